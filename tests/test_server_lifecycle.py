"""Limits and shutdown on a real `moetune serve` process: an over-limit body gets 413 (with or
without a Content-Length), too many prompts or tokens 400, an expired request 408 (streamed: an
error event and [DONE]), each with an OpenAI error object, and the server keeps serving with every
block free; SIGTERM (or SIGINT) during streams ends each with a final event or a clean close, and
the process exits 0 within the grace period.
"""
from __future__ import annotations

import http.client
import json
import signal
import threading
import time

import pytest

from server_util import post_json, request, start_tiny, wait_idle

LONG = {"model": "tiny", "prompt": "a long story", "max_tokens": 2000, "ignore_eos": True, "temperature": 0}
SLOW = {"batch_invariant": "true"}  # every op row by row: LONG takes many seconds, a 2-token request milliseconds


@pytest.fixture(scope="module")
def server():
    srv = start_tiny("--max-body-bytes", "4000", "--max-prompts", "3", "--max-request-tokens", "6000",
                     "--request-timeout", "1", knobs=SLOW)
    yield srv
    srv.stop()


def assert_error(status, body, want_status, code=None):
    assert status == want_status, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if code:
        assert err["code"] == code


def still_serving(server):
    # ignore_eos: a sampled end of text as the second token (the random `tiny` model) would make it 1
    status, body = post_json(server, "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2, "ignore_eos": True})
    assert status == 200 and body["usage"]["completion_tokens"] == 2
    assert wait_idle(server)["kv_blocks_used"] == 0


def test_body_over_the_limit_gets_413(server):
    big = json.dumps({"model": "tiny", "prompt": "word " * 1000}).encode()
    assert len(big) > 4000
    assert_error(*post_json(server, "/v1/completions", big), 413, "request_too_large")
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)  # no Content-Length: chunked
    try:
        conn.request("POST", "/v1/completions", body=iter([big[:3000], big[3000:]]), encode_chunked=True,
                     headers={"Content-Type": "application/json", "Transfer-Encoding": "chunked"})
        resp = conn.getresponse()
        assert_error(resp.status, json.loads(resp.read()), 413, "request_too_large")
    finally:
        conn.close()
    still_serving(server)


def test_too_many_prompts_or_tokens(server):
    status, body = post_json(server, "/v1/completions", {"model": "tiny", "prompt": ["a", "b", "c", "d"]})
    assert_error(status, body, 400)
    assert body["error"]["param"] == "prompt" and "--max-prompts" in body["error"]["message"]
    status, body = post_json(server, "/v1/completions", {"model": "tiny", "prompt": "a", "max_tokens": 1600, "n": 4})
    assert_error(status, body, 400)
    assert body["error"]["param"] == "max_tokens" and "--max-request-tokens" in body["error"]["message"]
    assert post_json(server, "/v1/completions", {"model": "tiny", "prompt": ["a", "b", "c"], "max_tokens": 2})[0] == 200
    still_serving(server)


def test_expired_request_gets_408_and_the_server_keeps_serving(server):
    assert_error(*post_json(server, "/v1/completions", LONG), 408, "timeout")
    still_serving(server)
    status, text = post_json(server, "/v1/completions", {**LONG, "stream": True})
    assert status == 200
    events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "timeout"
    still_serving(server)


# ---------------------------------------------------------------- shutdown


def read_stream(port: int, started: threading.Event, ends: list, i: int) -> None:
    """One streamed completion: records how it ended ("final event" then "[DONE]", or "closed")."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    last = None
    try:
        conn.request("POST", "/v1/completions", json.dumps({**LONG, "stream": True}),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        for line in resp:
            if not line.startswith(b"data: "):
                continue
            started.set()
            data = line[6:].strip()
            if data == b"[DONE]":
                ends[i] = ("done", last)
                return
            last = json.loads(data)
        ends[i] = ("closed", last)
    except (http.client.HTTPException, OSError) as e:
        ends[i] = ("error", repr(e))
    finally:
        conn.close()


def final(event: dict | None) -> bool:
    """A stream's last event before [DONE]: a finish reason, or an error object."""
    return event is not None and ("error" in event or any(c["finish_reason"] for c in event["choices"]))


@pytest.mark.parametrize("sig,streams", [(signal.SIGTERM, 8), (signal.SIGINT, 2)])
def test_signal_ends_every_stream_and_exits_0_within_the_grace_period(sig, streams):
    grace = 10.0  # requests cancelled at 7 s: 3 s to close and exit on a loaded machine
    srv = start_tiny("--shutdown-grace", str(grace), knobs=SLOW)
    try:
        ends: list = [None] * streams
        started = [threading.Event() for _ in range(streams)]
        threads = [threading.Thread(target=read_stream, args=(srv.port, started[i], ends, i)) for i in range(streams)]
        for t in threads:
            t.start()
        assert all(e.wait(120) for e in started)
        t0 = time.monotonic()
        srv.proc.send_signal(sig)
        code = srv.proc.wait(timeout=grace + 60)
        elapsed = time.monotonic() - t0
        for t in threads:
            t.join(30)
        assert code == 0, srv.log()
        assert elapsed <= grace, f"exited after {elapsed:.1f} s"
        for how, last in ends:
            assert how == "done" and final(last) or how == "closed", (how, last)
        assert "shutting down" in srv.log() and "stopped" in srv.log()
    finally:
        if srv.proc.poll() is None:
            srv.stop()


def test_new_requests_are_refused_while_draining():
    srv = start_tiny("--shutdown-grace", "4", knobs=SLOW)
    try:
        ended: list = [None]
        started = threading.Event()
        reader = threading.Thread(target=read_stream, args=(srv.port, started, ended, 0))
        reader.start()
        assert started.wait(120)
        srv.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        try:
            status, body = request(srv, "GET", "/v1/models")
            assert status == 503 and body["error"]["message"] == "the server is shutting down"
        except (ConnectionError, http.client.HTTPException):
            pass  # the listening socket is closed: refused
        assert srv.proc.wait(timeout=60) == 0
        reader.join(30)
        assert ended[0][0] in ("done", "closed")
    finally:
        if srv.proc.poll() is None:
            srv.stop()
