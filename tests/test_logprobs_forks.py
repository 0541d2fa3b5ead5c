"""Engine side of logprobs and n > 1 (the server's are in test_server_sampling.py): generated and
prompt logprobs equal a float32 log-softmax of LLM.logits on the same ids (1e-5), whatever the
prefill chunking, with a preemption in the way too; samples of one prompt fork its prefill's
blocks (shared, copied on write), greedy forks equal the unforked request, and every block is
back after they finish or are cancelled.
"""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.cache import BlockAllocator, HeadKVCache, LatentKVCache, SeqCache
from engine.llm import RequestOutput
from engine.sampling import token_logprobs
from engine.scheduler import Request, Scheduler

KNOBS = {"batch_invariant": "true", "max_total_tokens": "1024", "kv_block_size": "16"}
PROMPT = [5, 17, 99, 3, 250, 41, 8, 8, 77, 120, 33, 64, 2, 19, 200, 7, 150, 11, 90, 45, 6, 31]  # 22 tokens


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("tiny", dtype="float32", knobs=KNOBS, progress=False)


def run(llm: LLM, reqs: list[Request], chunk: int | None = None) -> Scheduler:
    sched = Scheduler(llm)
    if chunk:
        sched.chunk = chunk
    for r in reqs:
        if r.parent is None:
            sched.add(r)
    while sched.has_work():
        sched.step()
    return sched


def reference(llm: LLM, ids: list[int]) -> torch.Tensor:
    """log-softmax of LLM.logits: row t is the distribution of token t + 1."""
    return torch.log_softmax(llm.logits(ids).float(), dim=-1)


def check_entries(ref: torch.Tensor, tokens: list[int], entries, k: int) -> None:
    assert len(entries) == len(tokens)
    for row, token, e in zip(ref, tokens, entries):
        assert e.token == token and abs(e.logprob - row[token].item()) <= 1e-5
        want = row.topk(k)
        assert [t for t, _ in e.top] == want.indices.tolist()
        assert torch.allclose(torch.tensor([v for _, v in e.top]), want.values, atol=1e-5, rtol=0)
        values = [v for _, v in e.top]
        assert values == sorted(values, reverse=True)


def test_token_logprobs_is_a_log_softmax():
    logits = torch.randn(3, 50) * 4
    out = token_logprobs(logits, [1, 7, 49], 5)
    ref = torch.log_softmax(logits, dim=-1)
    check_entries(ref, [1, 7, 49], out, 5)
    assert token_logprobs(logits, [0, 0, 0], 0)[0].top == ()


@pytest.mark.parametrize("chunk", [None, 5, 16])
def test_prompt_and_generated_logprobs_equal_teacher_forced(llm, chunk):
    req = Request(RequestOutput(list(PROMPT)), SamplingParams(max_tokens=6, ignore_eos=True, logprobs=3,
                                                              prompt_logprobs=4))
    run(llm, [req], chunk)
    out = req.out
    ref = reference(llm, PROMPT + out.token_ids)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(PROMPT)
    check_entries(ref[: len(PROMPT) - 1], PROMPT[1:], out.prompt_logprobs[1:], 4)
    check_entries(ref[len(PROMPT) - 1: -1], out.token_ids, out.logprobs, 3)
    assert abs(out.cumulative_logprob - sum(e.logprob for e in out.logprobs)) < 1e-9


def test_scoring_only_max_tokens_0(llm):
    req = Request(RequestOutput(list(PROMPT)), SamplingParams(max_tokens=0, prompt_logprobs=1))
    sched = run(llm, [req], 8)
    assert req.out.token_ids == [] and req.out.finish_reason == "length"
    check_entries(reference(llm, PROMPT)[:-1], PROMPT[1:], req.out.prompt_logprobs[1:], 1)
    assert sched.kv_blocks_used() == 0


def test_prompt_logprobs_survive_a_preemption(llm):
    req = Request(RequestOutput(list(PROMPT)), SamplingParams(max_tokens=4, ignore_eos=True, prompt_logprobs=2))
    sched = Scheduler(llm)
    sched.chunk = 8
    sched.add(req)
    sched.step()  # 8 of 22 prompt tokens in
    sched._preempt(req)  # recomputed from the start: nothing recorded twice
    while sched.has_work():
        sched.step()
    check_entries(reference(llm, PROMPT)[:-1], PROMPT[1:], req.out.prompt_logprobs[1:], 2)


def group(params: SamplingParams, n: int, ids=PROMPT) -> list[Request]:
    first = Request(RequestOutput(list(ids)), params)
    first.forks = [Request(RequestOutput(list(ids)), params, parent=first) for _ in range(n - 1)]
    return [first, *first.forks]


def test_greedy_forks_equal_the_request_alone_and_share_blocks(llm):
    alone = Request(RequestOutput(list(PROMPT)), SamplingParams(max_tokens=8, ignore_eos=True))
    run(llm, [alone])
    reqs = group(SamplingParams(max_tokens=8, ignore_eos=True), 4)
    sched = Scheduler(llm)
    sched.add(reqs[0])
    sched.step()  # the prompt (22 tokens: one full block, one partial) and the first tokens
    assert all(len(r.out.token_ids) == 1 for r in reqs)
    tables = [r.seq.block_table for r in reqs]
    assert len({t[0] for t in tables}) == 1 and len({t[1] for t in tables}) == 1  # one prefill, shared
    assert sched.kv_blocks_used() == 2
    sched.step()  # each writes its first token into the shared partial block: copy on write
    assert len({t[0] for t in tables}) == 1 and len({t[1] for t in tables}) == 4
    assert sched.kv_blocks_used() == 5  # 1 shared full block + the partial block and 3 copies
    while sched.has_work():
        sched.step()
    assert all(r.out.token_ids == alone.out.token_ids for r in reqs)
    assert sched.kv_blocks_used() == 0 and llm.cache.allocator.refs == [0] * llm.cache.allocator.num_blocks


def test_cancelled_forks_free_every_block(llm):
    reqs = group(SamplingParams(max_tokens=50, ignore_eos=True), 4)
    sched = Scheduler(llm)
    sched.add(reqs[0])
    for _ in range(3):
        sched.step()
    assert sched.kv_blocks_used() > 0
    for r in reqs:
        sched.cancel(r)
    assert sched.kv_blocks_used() == 0 and all(r.out.finish_reason == "cancelled" for r in reqs)
    pending = group(SamplingParams(max_tokens=5), 3)  # cancelled before its prefill: forks too
    sched.add(pending[0])
    sched.cancel(pending[0])
    assert [r.out.finish_reason for r in pending] == ["cancelled"] * 3 and not sched.has_work()


def test_forks_under_preemption_still_equal(llm):
    """A tight cache: forks are preempted and recomputed alone, and still give the same tokens."""
    small = LLM("tiny", dtype="float32", knobs={**KNOBS, "max_total_tokens": "64"}, progress=False)
    alone = Request(RequestOutput(list(PROMPT)), SamplingParams(max_tokens=12, ignore_eos=True))
    run(small, [alone])
    reqs = group(SamplingParams(max_tokens=12, ignore_eos=True), 3)
    sched = run(small, reqs)
    assert sched.num_preemptions > 0
    assert all(r.out.token_ids == alone.out.token_ids for r in reqs)
    assert sched.kv_blocks_used() == 0


def test_allocator_refcounts():
    a = BlockAllocator(4)
    blocks = a.allocate(2)
    a.share(blocks)
    a.free(blocks)
    assert a.num_free == 2
    a.free(blocks)
    assert a.num_free == 4 and a.allocate(1) == [0]


def test_copy_on_write_keeps_the_shared_rows():
    cache = LatentKVCache(2, 64, 16, 4, torch.float32)
    a = SeqCache()
    slots = cache.append(a, 20)  # one full block, 4 rows in the second
    for layer in range(2):
        cache.write(layer, slots, torch.arange(80.0).reshape(20, 4) + layer)
    b = cache.fork(a)
    assert b.block_table == a.block_table and cache.blocks_needed(b, 1) == 1
    cache.reserve(b, 1)
    assert b.block_table[0] == a.block_table[0] and b.block_table[1] != a.block_table[1]
    for layer in range(2):
        assert torch.equal(cache.rows(layer, b)[:20], cache.rows(layer, a))
    assert cache.blocks_needed(a, 1) == 0  # the last holder of the partial block writes in place
    cache.release(a)
    cache.release(b)
    assert cache.allocator.num_free == 4


def test_copy_on_write_in_the_per_head_cache():
    """The GQA families' cache (K and V per KV head) copies a shared partial block on write too."""
    cache = HeadKVCache(2, 64, 16, 2, 3, 5, torch.float32)
    a = SeqCache()
    slots = cache.append(a, 20)
    for layer in range(2):
        cache.write(layer, slots, torch.arange(120.0).reshape(20, 2, 3) + layer, -torch.arange(200.0).reshape(20, 2, 5))
    b = cache.fork(a)
    cache.reserve(b, 1)
    old, new = a.block_table[1], b.block_table[1]
    assert new != old and b.block_table[0] == a.block_table[0]
    assert torch.equal(cache.k[:, new], cache.k[:, old]) and torch.equal(cache.v[:, new], cache.v[:, old])
    cache.release(a)
    cache.release(b)
    assert cache.allocator.num_free == 4


@pytest.mark.parametrize("preset", ["tiny-qwen3moe", "tiny-llama"])
def test_greedy_forks_of_a_gqa_family_equal_the_request_alone(preset):
    gqa = LLM(preset, dtype="float32", knobs=KNOBS, progress=False)
    alone = Request(RequestOutput(list(PROMPT)), SamplingParams(max_tokens=6, ignore_eos=True))
    run(gqa, [alone])
    reqs = group(SamplingParams(max_tokens=6, ignore_eos=True), 3)
    run(gqa, reqs)
    assert all(r.out.token_ids == alone.out.token_ids for r in reqs)
    assert gqa.cache.allocator.refs == [0] * gqa.cache.allocator.num_blocks
