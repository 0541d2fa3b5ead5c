"""The OpenAI-compatible server, as a real `moetune serve` process on a 127.0.0.1 port, driven by
the official `openai` client and by raw HTTP: completions and chat (streamed and not), usage,
32 concurrent streams under KV-cache pressure (float32, batch-invariant: equal to each prompt
alone, every block free afterwards), every bad input (OpenAI error object, 4xx, still serving),
a killed client (its blocks freed), metrics, and the tuned profile shown on /v1/models.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from engine import LLM, SamplingParams
from server_util import get, kill_client, openai_client, post_json, start_tiny, wait_idle
from suites.live_server import ServerProcess

# 64 blocks of 16 tokens: 32 clients of ≈ 60 tokens each need twice that, so requests wait for
# admission and get preempted while the others decode.
KNOBS = {"batch_invariant": "true", "max_total_tokens": "1024", "kv_block_size": "16"}
PROMPTS = [f"The {w} of the mixture of experts is number {i}" for i, w in
           enumerate(["weight", "speed", "cache", "router", "kernel", "shape", "token", "layer"] * 4)]


@pytest.fixture(scope="module")
def server():
    srv = start_tiny(knobs=KNOBS)  # no tuned profile: "auto" finds none
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai_client(server)


@pytest.fixture(scope="module")
def offline() -> LLM:
    return LLM("tiny", dtype="float32", knobs=KNOBS, progress=False)


def complete(client, prompt, n=12, **kw):
    return client.completions.create(model="tiny", prompt=prompt, max_tokens=n, temperature=0, **kw)


def stream_text(client, prompt, n=12, **kw) -> tuple[str, list, object]:
    """Concatenated streamed text, the finish reasons seen, and the usage chunk's usage."""
    text, reasons, usage = "", [], None
    for chunk in client.completions.create(model="tiny", prompt=prompt, max_tokens=n, temperature=0, stream=True,
                                           stream_options={"include_usage": True}, **kw):
        usage = chunk.usage or usage
        for c in chunk.choices:
            text += c.text
            reasons += [c.finish_reason] if c.finish_reason else []
    return text, reasons, usage


def chat_stream(client, messages, n=12) -> tuple[str, list, object]:
    text, reasons, usage = "", [], None
    for chunk in client.chat.completions.create(model="tiny", messages=messages, max_tokens=n, temperature=0,
                                                stream=True, stream_options={"include_usage": True}):
        usage = chunk.usage or usage
        for c in chunk.choices:
            text += c.delta.content or ""
            reasons += [c.finish_reason] if c.finish_reason else []
    return text, reasons, usage


# ---------------------------------------------------------------- completions and chat


def test_completion_equals_offline_generate(client, offline):
    out = complete(client, PROMPTS[0], 12, extra_body={"ignore_eos": True})
    want = offline.generate(PROMPTS[0], SamplingParams(max_tokens=12, ignore_eos=True))[0]
    assert out.object == "text_completion" and out.model == "tiny"
    assert out.choices[0].text == want.text and out.choices[0].finish_reason == "length"
    n_prompt = len(offline.tokenizer.encode(PROMPTS[0]))
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (n_prompt, 12, n_prompt + 12)


def test_completion_from_token_ids(client, offline):
    ids = offline.tokenizer.encode(PROMPTS[1])
    assert complete(client, ids).choices[0].text == complete(client, PROMPTS[1]).choices[0].text


def test_streamed_completion_equals_non_streamed(client):
    for prompt in PROMPTS[:3]:
        full = complete(client, prompt, 16)
        text, reasons, usage = stream_text(client, prompt, 16)
        assert text == full.choices[0].text and reasons == [full.choices[0].finish_reason]
        assert usage.model_dump() == full.usage.model_dump()


def test_chat_equals_offline_and_stream(client, offline):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a fast kernel."}]
    out = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0)
    prompt_ids = offline.tokenizer.encode(offline.tokenizer.apply_chat_template(messages), add_bos=False)
    want = offline.generate(prompt_ids, SamplingParams(max_tokens=10))[0]
    assert out.object == "chat.completion" and out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == want.text
    assert out.choices[0].finish_reason == want.finish_reason
    assert out.usage.prompt_tokens == len(prompt_ids) and out.usage.completion_tokens == len(want.token_ids)
    text, reasons, usage = chat_stream(client, messages, 10)
    assert text == out.choices[0].message.content and reasons == [out.choices[0].finish_reason]
    assert usage.model_dump() == out.usage.model_dump()


def test_stop_string_streamed_and_not(client):
    full = complete(client, PROMPTS[2], 24).choices[0].text
    word = re.search(r"[A-Za-z]{2,}", full[1:])
    assert word, f"nothing to stop on in {full!r}"
    stop = word.group()
    out = complete(client, PROMPTS[2], 24, stop=[stop])
    assert out.choices[0].finish_reason == "stop" and out.choices[0].text == full[: full.index(stop)]
    text, reasons, _ = stream_text(client, PROMPTS[2], 24, stop=[stop])
    assert text == out.choices[0].text and reasons == ["stop"]


def test_seeded_sampling(client):
    def sample(seed):
        return client.completions.create(model="tiny", prompt=PROMPTS[3], max_tokens=12, temperature=1.0,
                                         top_p=0.9, seed=seed, extra_body={"top_k": 50}).choices[0].text
    assert sample(7) == sample(7)
    assert sample(7) != sample(8)


def test_models_health_and_info(client, server):
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny"] and models[0].model_extra["profile"] is None
    assert get(server, "/health") == (200, {"status": "ok"})
    info = get(server, "/info")[1]
    assert info["knobs"]["batch_invariant"] is True and info["kv_blocks_total"] == 64
    assert "no tuned profile" in server.log() and "default knobs" in server.log()


# ---------------------------------------------------------------- under load


def test_32_concurrent_streams_equal_alone_and_free_every_block(client, server):
    prompts = PROMPTS  # 32
    alone = [complete(client, p, 24, extra_body={"ignore_eos": True}).choices[0].text for p in prompts]
    with ThreadPoolExecutor(32) as pool:
        streamed = list(pool.map(lambda p: stream_text(client, p, 24, extra_body={"ignore_eos": True}), prompts))
    assert [s[0] for s in streamed] == alone
    assert all(s[1] == ["length"] and s[2].completion_tokens == 24 for s in streamed)
    info = wait_idle(server)
    assert info["kv_blocks_used"] == 0 and info["requests_running"] == 0 and info["requests_waiting"] == 0


def test_metrics(server, client):
    complete(client, PROMPTS[4], 4)
    status, text = get(server, "/metrics")
    assert status == 200
    values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line and line[0] != "#"}
    assert values["moetune_requests_total"] >= 1 and values["moetune_generation_tokens_total"] >= 4
    assert values["moetune_kv_blocks_total"] == 64 and values["moetune_kv_blocks_used"] == 0
    assert values["moetune_requests_waiting"] == 0
    assert values["moetune_time_to_first_token_seconds_count"] >= 1
    assert values['moetune_time_to_first_token_seconds_bucket{le="+Inf"}'] == values["moetune_time_to_first_token_seconds_count"]
    assert values["moetune_inter_token_latency_seconds_count"] >= 3


# ---------------------------------------------------------------- bad input


LONG = " ".join(["token"] * 2100)
BAD = {
    "malformed json": (b'{"model": "tiny", "prompt": ', 400, None),
    "body not an object": ([1, 2], 400, None),
    "missing prompt": ({"model": "tiny"}, 400, "prompt"),
    "unknown field": ({"model": "tiny", "prompt": "x", "bogus": 1}, 400, "bogus"),
    "max_tokens not an int": ({"model": "tiny", "prompt": "x", "max_tokens": "ten"}, 400, "max_tokens"),
    "temperature not a number": ({"model": "tiny", "prompt": "x", "temperature": "hot"}, 400, "temperature"),
    "prompt a number": ({"model": "tiny", "prompt": 5}, 400, "prompt"),
    "stream not a bool": ({"model": "tiny", "prompt": "x", "stream": "yes"}, 400, "stream"),
    "max_tokens 0": ({"model": "tiny", "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    "max_tokens negative": ({"model": "tiny", "prompt": "x", "max_tokens": -3}, 400, "max_tokens"),
    "max_tokens past the context": ({"model": "tiny", "prompt": "x", "max_tokens": 5000}, 400, "max_tokens"),
    "prompt longer than the context": ({"model": "tiny", "prompt": LONG, "max_tokens": 1}, 400, "prompt"),
    "empty prompt": ({"model": "tiny", "prompt": []}, 400, "prompt"),
    "token id past the vocabulary": ({"model": "tiny", "prompt": [3, 99999]}, 400, "prompt"),
    "one of two prompts empty": ({"model": "tiny", "prompt": [[5, 6], []]}, 400, "prompt"),
    "n 0": ({"model": "tiny", "prompt": "x", "n": 0}, 400, "n"),
    "suffix": ({"model": "tiny", "prompt": "x", "suffix": "y"}, 400, "suffix"),
    "temperature 3": ({"model": "tiny", "prompt": "x", "temperature": 3}, 400, "temperature"),
    "top_p 0": ({"model": "tiny", "prompt": "x", "top_p": 0}, 400, "top_p"),
    "empty stop string": ({"model": "tiny", "prompt": "x", "stop": [""]}, 400, "stop"),
    "unknown model": ({"model": "gpt-9", "prompt": "x"}, 404, "model"),
}
BAD_CHAT = {
    "no messages": ({"model": "tiny", "messages": []}, 400, "messages"),
    "messages not a list": ({"model": "tiny", "messages": "hi"}, 400, "messages"),
    "unknown role": ({"model": "tiny", "messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages"),
    "content a number": ({"model": "tiny", "messages": [{"role": "user", "content": 3}]}, 400, "messages"),
    "chat max_tokens 0": ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0},
                          400, "max_tokens"),
    "chat unknown model": ({"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]}, 404, "model"),
}


def check_error(server, path, body, status, param):
    got, payload = post_json(server, path, body)
    assert got == status, payload
    err = payload["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    if param is not None:
        assert param in (err["param"] or "") or param in err["message"], err


@pytest.mark.parametrize("case", BAD)
def test_bad_completion_request(server, client, case):
    check_error(server, "/v1/completions", *BAD[case])
    assert complete(client, "still serving", 2).choices[0].finish_reason in ("length", "stop")


@pytest.mark.parametrize("case", BAD_CHAT)
def test_bad_chat_request(server, case):
    check_error(server, "/v1/chat/completions", *BAD_CHAT[case])


def test_bad_input_through_the_official_client(client, server):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="x", max_tokens=0)
    assert e.value.status_code == 400 and "max_tokens" in str(e.value)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError):  # a bad streaming request fails before the stream starts
        next(iter(client.completions.create(model="tiny", prompt=LONG, max_tokens=1, stream=True)))
    assert get(server, "/nowhere")[0] == 404
    assert wait_idle(server)["kv_blocks_used"] == 0


# ---------------------------------------------------------------- disconnects


KILLED_CLIENT = textwrap.dedent("""
    import http.client, json, sys
    conn = http.client.HTTPConnection("127.0.0.1", int(sys.argv[1]))
    body = {"model": "tiny", "prompt": "a long story", "max_tokens": 1000, "ignore_eos": True,
            "temperature": 0, "stream": sys.argv[2] == "stream"}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    if sys.argv[2] == "stream":
        resp = conn.getresponse()
        resp.readline()
    print("started", flush=True)
    sys.stdin.read()
""")


@pytest.mark.parametrize("mode", ["stream", "plain"])
def test_killed_client_frees_its_blocks(server, client, mode):
    busy, idle = kill_client(server, KILLED_CLIENT, mode)
    assert busy["kv_blocks_used"] > 0 and busy["requests_running"] == 1
    assert idle["kv_blocks_used"] == 0 and idle["requests_running"] == 0
    status, metrics = get(server, "/metrics")
    assert re.search(r'moetune_requests_finished_total\{reason="cancelled"\} [1-9]', metrics)
    assert complete(client, "after the kill", 3).usage.completion_tokens == 3


# ---------------------------------------------------------------- tuned profiles


def write_profile(path, hardware_key: str, mkey: str, knobs: dict):
    from engine.profile import Profile, save_profile

    meta = {"hardware_key": hardware_key, "model_key": mkey, "fingerprint": {}, "commit": "test"}
    return save_profile(Profile(meta, knobs), path)


TINY_KEY = "deepseek_v3-d64-l2-e8k2-i32-h4-fp32"


def test_foreign_profile_is_refused_then_forced(tmp_path):
    path = write_profile(tmp_path / "other.toml", "another-machine", TINY_KEY, {"kv_block_size": 32})
    run = subprocess.run([sys.executable, "-m", "moetune_cli", "serve", "--model", "tiny", "--dtype", "float32",
                          "--profile", str(path), "--port", "1"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "another machine" in run.stderr and "Traceback" not in run.stderr
    srv = ServerProcess(["--model", "tiny", "--dtype", "float32", "--profile", str(path), "--force-profile"])
    try:
        srv.wait_ready()
        card = get(srv, "/v1/models")[1]["data"][0]
        assert card["profile"]["path"] == str(path) and card["profile"]["hardware_key"] == "another-machine"
        assert get(srv, "/info")[1]["knobs"]["kv_block_size"] == 32
        assert f"tuned profile {path}" in srv.log()
    finally:
        srv.stop()


def test_auto_profile_lookup(tmp_path, monkeypatch, caplog):
    from engine.fingerprint import fingerprint
    from engine.profile import profile_path

    monkeypatch.setenv("MOETUNE_PROFILES", str(tmp_path))
    path = write_profile(profile_path(fingerprint()["hardware_key"], TINY_KEY), fingerprint()["hardware_key"],
                         TINY_KEY, {"chunked_prefill_size": 32})
    with caplog.at_level("INFO", logger="moetune"):
        llm = LLM("tiny", dtype="float32", profile="auto", progress=False)
    assert llm.profile.path == path and llm.knobs["chunked_prefill_size"] == 32
    assert f"running with tuned profile {path}" in caplog.text
    assert json.dumps(llm.profile.knobs) == '{"chunked_prefill_size": 32}'


# ---------------------------------------------------------------- the load suite


def test_load_suite_against_the_server(server):
    from suites.serving import loopback_target, make_prompts, run_load, summarize

    prompts = make_prompts(4, 12, 512, seed=0)
    assert prompts == make_prompts(4, 12, 512, seed=0) and len(prompts[0]) == 12
    results, duration = run_load("127.0.0.1", server.port, "tiny", prompts, 6, concurrency=2, rate=50.0, seed=0)
    summary = summarize(results, duration, 12)
    assert summary["completed"] == 4 and summary["failed"] == 0
    assert all(r.output_tokens == 6 and len(r.chunk_times) == 6 for r in results)
    assert 0 < summary["ttft_s"]["median"] <= summary["e2e_s"]["p99"] and len(summary["itl_s"]["samples"]) == 20
    with pytest.raises(SystemExit, match="loopback"):
        loopback_target("http://example.com:8000")
