"""API keys on a real `moetune serve` process: the official `openai` client with a right key
(from --api-key or MOETUNE_API_KEY) works; a wrong or missing key gets a 401 OpenAI error object on
every route but /health, streamed or not; /metrics opens with --metrics-public; no key reaches the
log; filesystem paths go only to an authenticated client (or, with no key, a loopback server).
"""
from __future__ import annotations

import json

import openai
import pytest

from engine.protocol import ServerOptions
from engine.server import _is_loopback
from server_util import openai_client, request, start_tiny
from suites.live_server import ServerProcess

KEYS = ("flag-key-7f3a9c", "second-flag-key-51e0")
ENV_KEY = "env-key-c0ffee42"
ROUTES = [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
          ("GET", "/info"), ("GET", "/metrics"), ("GET", "/nowhere")]


def start(*extra: str) -> ServerProcess:
    return start_tiny("--api-key", KEYS[0], "--api-key", KEYS[1], *extra, env={"MOETUNE_API_KEY": ENV_KEY})


@pytest.fixture(scope="module")
def server():
    srv = start()
    yield srv
    srv.stop()


def client(server, key: str) -> openai.OpenAI:
    return openai_client(server, key)


def call(server, method: str, path: str, key: str | None = None, scheme: str = "Bearer"):
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"{scheme} {key}"
    body = json.dumps({"model": "tiny", "max_tokens": 2, "prompt": "hi"} if path == "/v1/completions" else
                      {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
    return request(server, method, path, body.encode() if method == "POST" else None, headers)


@pytest.mark.parametrize("key", [*KEYS, ENV_KEY])
def test_right_key_works_with_the_official_client(server, key):
    c = client(server, key)
    out = c.completions.create(model="tiny", prompt="Hello", max_tokens=4, temperature=0)
    assert out.usage.completion_tokens >= 1
    text = "".join(ch.choices[0].text for ch in c.completions.create(
        model="tiny", prompt="Hello", max_tokens=4, temperature=0, stream=True) if ch.choices)
    assert text == out.choices[0].text
    assert [m.id for m in c.models.list().data] == ["tiny"]


@pytest.mark.parametrize("key", ["wrong-key", "", KEYS[0][:-1], KEYS[0] + "x"])
def test_wrong_key_is_refused_by_the_official_client(server, key):
    c = client(server, key or "unset")
    for make in (lambda: c.completions.create(model="tiny", prompt="Hello", max_tokens=2),
                 lambda: next(iter(c.completions.create(model="tiny", prompt="Hello", max_tokens=2, stream=True))),
                 lambda: c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}]),
                 lambda: next(iter(c.chat.completions.create(model="tiny", stream=True,
                                                             messages=[{"role": "user", "content": "hi"}]))),
                 lambda: c.models.list()):
        with pytest.raises(openai.AuthenticationError) as e:
            make()
        assert e.value.status_code == 401 and e.value.code == "invalid_api_key"


@pytest.mark.parametrize("method,path", ROUTES)
@pytest.mark.parametrize("how", ["missing", "wrong", "basic scheme"])
def test_every_route_but_health_needs_the_key(server, method, path, how):
    key, scheme = {"missing": (None, ""), "wrong": ("nope", "Bearer"), "basic scheme": (KEYS[0], "Basic")}[how]
    status, body = call(server, method, path, key, scheme)
    assert status == 401, body
    assert set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["code"] == "invalid_api_key"
    assert not any(k in json.dumps(body) for k in (*KEYS, ENV_KEY))


def test_health_is_open_and_the_right_key_opens_the_rest(server):
    assert request(server, "GET", "/health") == (200, {"status": "ok"})
    for method, path in ROUTES[:-1]:
        assert call(server, method, path, KEYS[1])[0] == 200, path
    assert call(server, "GET", "/nowhere", KEYS[1])[0] == 404
    assert call(server, "GET", "/info", "  ".join(["", ENV_KEY]).strip())[0] == 200


def test_paths_only_for_an_authenticated_client(server):
    info = call(server, "GET", "/info", KEYS[0])[1]
    assert info["path"] and "tiny" in info["path"]
    assert call(server, "GET", "/v1/models", KEYS[0])[1]["data"][0]["root"] == info["path"]


def test_the_log_names_no_key(server):
    log = server.log()
    assert "authentication: 3 API key(s)" in log
    assert not any(k in log for k in (*KEYS, ENV_KEY))


def test_metrics_public():
    srv = start("--metrics-public")
    try:
        status, text = call(srv, "GET", "/metrics")
        assert status == 200 and "moetune_requests_total" in text
        assert call(srv, "GET", "/info")[0] == 401 and call(srv, "POST", "/v1/completions")[0] == 401
    finally:
        srv.stop()


def test_paths_without_keys_only_on_loopback():
    assert ServerOptions(loopback=True).show_paths(authenticated=False)
    assert not ServerOptions(loopback=False).show_paths(authenticated=False)
    assert not ServerOptions(api_keys=["k"], loopback=True).show_paths(authenticated=False)
    assert ServerOptions(api_keys=["k"], loopback=False).show_paths(authenticated=True)
    assert [_is_loopback(h) for h in ("127.0.0.1", "127.8.0.1", "::1", "localhost", "0.0.0.0", "10.0.0.2", "::")] \
        == [True, True, True, True, False, False, False]
