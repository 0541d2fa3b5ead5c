"""logprobs, echo, n > 1 and best_of on a real `moetune serve` process (float32, batch-invariant),
through the official `openai` client and raw HTTP: logprobs equal a log-softmax of LLM.logits on
the same ids (1e-5), streamed or not; echo gives the teacher-forced prompt logprobs (the
lm-evaluation-harness request, max_tokens 0 or 1); greedy samples are equal, seeded ones
reproducible; best_of keeps the likeliest; a client killed mid n = 4 stream frees every block.
"""
from __future__ import annotations

import textwrap

import openai
import pytest
import torch

from engine import LLM, SamplingParams
from server_util import kill_client, post_json
from test_server import client, offline, server  # noqa: F401 - the fixtures: a server of its own

PROMPT = "The router of the mixture of experts picks"


def reference(offline: LLM, ids: list[int]) -> torch.Tensor:
    return torch.log_softmax(offline.logits(ids).float(), dim=-1)


def check_top(offline, top: dict, token_text: str, logprob: float, row: torch.Tensor, k: int) -> None:
    """A completions top_logprobs dict: the texts of the top k of `row` (a text that two tokens share
    keeps the likelier), then the token itself if it is not among them, with their logprobs."""
    want = {}
    for v, i in zip(*row.topk(k)):
        want.setdefault(offline.tokenizer.decode([i.item()]), v.item())
    want.setdefault(token_text, logprob)
    assert list(top) == list(want) and list(top.values()) == pytest.approx(list(want.values()), abs=1e-5)


# ---------------------------------------------------------------- completions logprobs


def test_completion_logprobs_equal_a_log_softmax_of_llm_logits(client, offline):
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3,
                                    extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    prompt = offline.tokenizer.encode(PROMPT)
    generated = offline.generate(prompt, SamplingParams(max_tokens=8, ignore_eos=True))[0].token_ids
    ref = reference(offline, prompt + generated)[len(prompt) - 1:-1]
    assert lp.tokens == [offline.tokenizer.decode([t]) for t in generated]
    assert len(lp.token_logprobs) == 8 and "".join(lp.tokens) == out.choices[0].text
    for row, token, text, value, top in zip(ref, generated, lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert token == row.argmax().item() and abs(value - row[token].item()) <= 1e-5
        check_top(offline, top, text, value, row, 3)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(8)]


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_scoring_like_lm_eval_harness(server, offline, max_tokens):
    ids = offline.tokenizer.encode(PROMPT)
    status, body = post_json(server, "/v1/completions", {"model": "tiny", "prompt": [ids], "max_tokens": max_tokens,
                                                         "temperature": 0, "logprobs": 1, "echo": True, "seed": 1234})
    assert status == 200, body
    choice, usage = body["choices"][0], body["usage"]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) + max_tokens and usage["completion_tokens"] == max_tokens
    assert choice["text"].startswith(offline.tokenizer.decode(ids))
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    ref = reference(offline, ids)
    for t in range(1, len(ids)):  # teacher-forced: token t under the prompt before it
        assert abs(lp["token_logprobs"][t] - ref[t - 1, ids[t]].item()) <= 1e-5
        check_top(offline, lp["top_logprobs"][t], lp["tokens"][t], lp["token_logprobs"][t], ref[t - 1], 1)
    if max_tokens:  # the generated token: greedy, under the whole prompt
        assert abs(lp["token_logprobs"][-1] - ref[-1].max().item()) <= 1e-5


def test_streamed_logprobs_and_echo_equal_non_streamed(client):
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2, echo=True,
              extra_body={"ignore_eos": True})
    full = client.completions.create(**kw).choices[0]
    text, tokens, values, tops, offsets = "", [], [], [], []
    for chunk in client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            text += c.text
            tokens += c.logprobs.tokens
            values += c.logprobs.token_logprobs
            tops += c.logprobs.top_logprobs
            offsets += c.logprobs.text_offset
    assert text == full.text and tokens == full.logprobs.tokens and values == full.logprobs.token_logprobs
    assert tops == full.logprobs.top_logprobs and offsets == full.logprobs.text_offset


# ---------------------------------------------------------------- chat logprobs


def chat_ids(offline, messages):
    return offline.tokenizer.encode(offline.tokenizer.apply_chat_template(messages), add_bos=False)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_and_top_logprobs(client, offline, stream):
    messages = [{"role": "user", "content": "Name a fast kernel."}]
    kw = dict(model="tiny", messages=messages, max_tokens=6, temperature=0, logprobs=True, top_logprobs=4,
              extra_body={"ignore_eos": True})
    if stream:
        content = [e for chunk in client.chat.completions.create(stream=True, **kw) for c in chunk.choices
                   if c.logprobs for e in c.logprobs.content]
    else:
        content = client.chat.completions.create(**kw).choices[0].logprobs.content
    ref_ids = chat_ids(offline, messages)
    for e in content:  # greedy: each token is its position's top one
        row = reference(offline, ref_ids)[-1]
        top = row.topk(4)
        assert [t.logprob for t in e.top_logprobs] == pytest.approx(top.values.tolist(), abs=1e-5)
        assert [t.token for t in e.top_logprobs] == [offline.tokenizer.decode([i]) for i in top.indices.tolist()]
        assert e.token == e.top_logprobs[0].token and abs(e.logprob - top.values[0].item()) <= 1e-5
        assert e.bytes == list(e.token.encode())
        ref_ids.append(top.indices[0].item())
    assert len(content) == 6


# ---------------------------------------------------------------- n and best_of


def texts(out) -> list[str]:
    return [c.text for c in sorted(out.choices, key=lambda c: c.index)]


def test_greedy_samples_are_equal(client):
    one = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=10, temperature=0,
                                    extra_body={"ignore_eos": True})
    four = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=10, temperature=0, n=4,
                                     extra_body={"ignore_eos": True})
    assert texts(four) == [one.choices[0].text] * 4 and [c.index for c in four.choices] == [0, 1, 2, 3]
    assert four.usage.completion_tokens == 40 and four.usage.prompt_tokens == one.usage.prompt_tokens
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], n=3,
                                          max_tokens=5, temperature=0)
    assert len({c.message.content for c in chat.choices}) == 1 and len(chat.choices) == 3


def test_seeded_samples_are_reproducible(client):
    def sample(n, seed):
        return texts(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=1.0, n=n,
                                               seed=seed, extra_body={"ignore_eos": True}))
    a = sample(4, 11)
    assert a == sample(4, 11) and len(set(a)) > 1
    assert a[0] == sample(1, 11)[0]  # sample 0 keeps the request's seed
    streamed = [""] * 4
    for chunk in client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=1.0, n=4,
                                           seed=11, stream=True, extra_body={"ignore_eos": True}):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == a


def test_best_of_keeps_the_likeliest(client):
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=8, temperature=1.0, seed=5, logprobs=0,
              extra_body={"ignore_eos": True})
    every = client.completions.create(n=4, **kw).choices
    best = client.completions.create(n=2, best_of=4, **kw)
    ranked = sorted(every, key=lambda c: -sum(c.logprobs.token_logprobs))
    assert texts(best) == [c.text for c in ranked[:2]]
    assert best.usage.completion_tokens == 32  # all four were generated
    plain = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=1.0, seed=5, n=1,
                                      best_of=4, extra_body={"ignore_eos": True})
    assert plain.choices[0].text == ranked[0].text and plain.choices[0].logprobs is None


def test_several_prompts_and_samples(client):
    prompts = [PROMPT, "Another prompt about kernels"]
    out = client.completions.create(model="tiny", prompt=prompts, max_tokens=6, temperature=0, n=2)
    alone = [client.completions.create(model="tiny", prompt=p, max_tokens=6, temperature=0).choices[0].text
             for p in prompts]
    assert texts(out) == [alone[0], alone[0], alone[1], alone[1]]


BAD = {
    "n 0": ({"n": 0}, "n"),
    "logprobs 21": ({"logprobs": 21}, "logprobs"),
    "logprobs a bool": ({"logprobs": True}, "logprobs"),
    "best_of below n": ({"n": 3, "best_of": 2}, "best_of"),
    "best_of streamed": ({"n": 1, "best_of": 2, "stream": True}, "best_of"),
    "max_tokens 0 without logprobs": ({"max_tokens": 0, "echo": True}, "max_tokens"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_sampling_request(server, case):
    extra, param = BAD[case]
    status, body = post_json(server, "/v1/completions", {"model": "tiny", "prompt": "x", **extra})
    assert status == 400 and param in (body["error"]["param"] or body["error"]["message"]), body
    status, body = post_json(server, "/v1/chat/completions", {"model": "tiny", "top_logprobs": 2,
                                                              "messages": [{"role": "user", "content": "x"}]})
    assert status == 400 and body["error"]["param"] == "top_logprobs"


KILLED_N4 = textwrap.dedent("""
    import http.client, json, sys
    conn = http.client.HTTPConnection("127.0.0.1", int(sys.argv[1]))
    body = {"model": "tiny", "prompt": "a long story", "max_tokens": 1000, "ignore_eos": True, "n": 4,
            "temperature": 1.0, "stream": True, "logprobs": 2}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    seen = set()
    while len(seen) < 4:  # a token of every sample
        line = resp.readline()
        if line.startswith(b"data: {"):
            seen.update(c["index"] for c in json.loads(line[6:])["choices"])
    print("started", flush=True)
    sys.stdin.read()
""")


def test_killed_client_mid_n4_stream_frees_every_block(server, client):
    busy, idle = kill_client(server, KILLED_N4)
    assert busy["kv_blocks_used"] > 0 and busy["requests_running"] == 4
    assert idle["kv_blocks_used"] == 0 and idle["requests_running"] == 0
    # the server still serves; ignore_eos: an unseeded sample of the random tiny model may stop early
    after = client.completions.create(model="tiny", prompt="after", max_tokens=3, n=2, extra_body={"ignore_eos": True})
    assert after.usage.completion_tokens == 6
