"""`LLM.generate` and `LLM.logits` on the "tiny" preset: greedy and batched decode through the paged
cache, seeded sampling, stop strings and lengths, and every user error (after which the engine
still works and the KV cache is empty again).
"""
import re

import pytest
import torch

from engine import LLM, SamplingParams
from engine.errors import MoetuneError

VOCAB = 512  # the tiny preset
MAX_POS = 2048


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(2, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# Different lengths; the longest crosses a 64-token block boundary while decoding.
PROMPTS = ["hello world", ids(23, 1), ids(60, 2)]
GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("tiny", dtype="float32", progress=False)


@pytest.fixture(scope="module")
def small_cache() -> LLM:
    """64 tokens of KV cache in 4 blocks of 16."""
    return LLM("tiny", dtype="float32", knobs={"max_total_tokens": 64, "kv_block_size": 16}, progress=False)


def greedy(llm: LLM, prompt, n: int = 10) -> list[int]:
    return llm.generate(prompt, SamplingParams(max_tokens=n, ignore_eos=True))[0].token_ids


def assert_cache_empty(llm: LLM) -> None:
    assert llm.cache.allocator.num_free == llm.cache.allocator.num_blocks


# ---------------------------------------------------------------- greedy and batched decode


def test_greedy_is_deterministic(llm):
    first = llm.generate(PROMPTS[1], GREEDY)[0]
    again = llm.generate(PROMPTS[1], GREEDY)[0]
    assert first.token_ids == again.token_ids and len(first.token_ids) == 10
    assert first.prompt_token_ids == PROMPTS[1]
    assert_cache_empty(llm)


def test_cached_decode_equals_recomputation(llm):
    """Each greedy token is the argmax of a fresh prefill over everything before it."""
    prompt = PROMPTS[1]
    out = greedy(llm, prompt, 8)
    for k, token in enumerate(out):
        assert int(llm.logits(prompt + out[:k])[-1].argmax()) == token, f"step {k}"


def test_batched_generate_equals_each_alone(llm):
    batch = llm.generate(PROMPTS, GREEDY)
    alone = [llm.generate(p, GREEDY)[0] for p in PROMPTS]
    assert len(batch) == 3
    assert [o.prompt_token_ids for o in batch] == [o.prompt_token_ids for o in alone]
    assert [o.token_ids for o in batch] == [o.token_ids for o in alone]
    assert [o.text for o in batch] == [o.text for o in alone]
    assert len({len(o.prompt_token_ids) for o in batch}) == 3
    assert_cache_empty(llm)


# ---------------------------------------------------------------- sampling


def sample(llm: LLM, **kw) -> list[int]:
    params = SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True, **kw)
    return llm.generate(PROMPTS[0], params)[0].token_ids


def test_seeded_sampling_reproduces(llm):
    assert sample(llm, seed=1) == sample(llm, seed=1)
    assert sample(llm, seed=1) != sample(llm, seed=2)
    assert sample(llm, seed=1) != greedy(llm, PROMPTS[0], 16)


@pytest.mark.parametrize("kw", [dict(top_k=1), dict(top_p=1e-6)], ids=["top_k=1", "top_p=1e-6"])
def test_narrowest_filter_is_greedy(llm, kw):
    assert sample(llm, seed=3, **kw) == greedy(llm, PROMPTS[0], 16)


# ---------------------------------------------------------------- stopping


def test_stop_string_truncates(llm):
    full = llm.generate(PROMPTS[0], SamplingParams(max_tokens=16, ignore_eos=True))[0]
    found = re.search(r"[A-Za-z]{3}", full.text[1:])
    assert found, f"no ASCII word in {full.text!r} to stop on"
    stop = found.group()
    out = llm.generate(PROMPTS[0], SamplingParams(max_tokens=16, ignore_eos=True, stop=["\x00never", stop]))[0]
    assert out.finish_reason == "stop"
    assert out.text == full.text[: full.text.index(stop)]
    assert stop not in out.text
    assert out.token_ids == full.token_ids[: len(out.token_ids)] and len(out.token_ids) < 16
    assert_cache_empty(llm)


@pytest.mark.parametrize("n", [1, 7])
def test_max_tokens_is_exact(llm, n):
    out = llm.generate(PROMPTS[2], SamplingParams(max_tokens=n, ignore_eos=True))[0]
    assert out.finish_reason == "length"
    assert len(out.token_ids) == n


# ---------------------------------------------------------------- errors leave a working engine


ERRORS = {
    "empty prompt": ([], {}, "empty"),
    "empty prompt in a batch": ([PROMPTS[1], []], {}, "empty"),
    "token id past the vocabulary": ([5, VOCAB], {}, str(VOCAB)),
    "negative token id": ([-1, 5], {}, "-1"),
    "prompt longer than max_position_embeddings": (ids(MAX_POS + 1, 3), {}, f"context of {MAX_POS}"),
    "prompt + max_tokens past max_position_embeddings": (ids(MAX_POS - 4, 3), dict(max_tokens=5),
                                                         f"context of {MAX_POS}"),
    "max_tokens 0": (PROMPTS[1], dict(max_tokens=0), "max_tokens"),
    "temperature < 0": (PROMPTS[1], dict(temperature=-0.5), "temperature"),
    "top_p 0": (PROMPTS[1], dict(top_p=0.0), "top_p"),
    "top_p > 1": (PROMPTS[1], dict(top_p=1.5), "top_p"),
    "top_k < 0": (PROMPTS[1], dict(top_k=-1), "top_k"),
}


@pytest.mark.parametrize("case", ERRORS)
def test_generate_errors(llm, case):
    prompt, kw, word = ERRORS[case]
    before = greedy(llm, PROMPTS[1])
    with pytest.raises(MoetuneError, match=re.escape(word)):
        llm.generate(prompt, SamplingParams(**kw))
    assert_cache_empty(llm)
    assert greedy(llm, PROMPTS[1]) == before


def test_prompt_plus_max_tokens_past_the_cache(small_cache):
    prompt = ids(60, 4)
    with pytest.raises(MoetuneError, match="context of 64"):
        small_cache.generate(prompt, SamplingParams(max_tokens=5))
    with pytest.raises(MoetuneError, match="context of 64"):
        small_cache.logits(ids(65, 4))
    assert_cache_empty(small_cache)
    assert len(greedy(small_cache, prompt, 4)) == 4  # 64 tokens exactly: fits


def test_cache_full_mid_batch_preempts_and_recomputes(small_cache):
    """Each request fits alone, together they overflow the cache while decoding: the scheduler
    preempts the newest (frees its blocks, recomputes it later) instead of failing; both finish
    with the tokens they get alone, and every block is back afterwards."""
    a, b = ids(30, 5), ids(30, 6)
    alone = [greedy(small_cache, p, 20) for p in (a, b)]
    outs = small_cache.generate([a, b], SamplingParams(max_tokens=20, ignore_eos=True))
    assert [o.token_ids for o in outs] == alone
    assert_cache_empty(small_cache)


# ---------------------------------------------------------------- logits


def test_logits_shape_dtype_and_cache(llm):
    prompt = PROMPTS[2]
    out = llm.logits(prompt)
    assert out.dtype == torch.float32 and out.shape == (len(prompt), VOCAB)
    assert torch.isfinite(out).all()
    assert_cache_empty(llm)
    assert int(out[-1].argmax()) == greedy(llm, prompt, 1)[0]
    assert torch.equal(llm.logits(prompt), out)


def test_logits_float32_from_bfloat16_model():
    llm = LLM("tiny", dtype="bfloat16", progress=False)
    out = llm.logits(PROMPTS[1])
    assert out.dtype == torch.float32 and out.shape == (len(PROMPTS[1]), VOCAB)
    assert_cache_empty(llm)


@pytest.mark.parametrize("prompt, word", [([], "empty"), ([3, VOCAB + 7], str(VOCAB + 7)),
                                          (ids(MAX_POS + 1, 8), f"context of {MAX_POS}")])
def test_logits_errors(llm, prompt, word):
    with pytest.raises(MoetuneError, match=re.escape(word)):
        llm.logits(prompt)
    assert_cache_empty(llm)


@pytest.mark.parametrize("row", [
    [1.0, 3.0, 3.0, 2.0],                            # a tie: the first largest
    [1.0, 3.0, float("nan"), 3.0, float("nan")],     # a NaN counts as largest: the first NaN
    [float("-inf")] * 5,                             # nothing finite: index 0
    [float("inf"), 1.0, float("inf")],
    [-2.0],
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_greedy_picks_as_torch_argmax(row, dtype):
    from engine.sampling import greedy

    x = torch.tensor(row, dtype=dtype)
    assert greedy(x) == int(x.argmax())
    big = torch.randn(129280, generator=torch.Generator().manual_seed(len(row))).to(dtype)
    big[7], big[90000] = 50.0, 50.0  # the largest twice: the first wins
    assert greedy(big) == int(big.argmax()) == 7
    assert greedy(big[1:][::2]) == int(big[1:][::2].argmax())  # a strided view
