"""Raw-HTTP helpers for the server tests (the server process itself: suites.live_server)."""
from __future__ import annotations

import http.client
import json
import time

from suites.live_server import ServerProcess


def request(server: ServerProcess, method: str, path: str, body: bytes | None = None,
            headers: dict | None = None) -> tuple[int, object]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        data = resp.read()
        kind = resp.getheader("content-type", "")
        return resp.status, json.loads(data) if "json" in kind else data.decode()
    finally:
        conn.close()


def get(server: ServerProcess, path: str) -> tuple[int, object]:
    return request(server, "GET", path)


def post_json(server: ServerProcess, path: str, obj) -> tuple[int, object]:
    body = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
    return request(server, "POST", path, body, {"Content-Type": "application/json"})


def wait_idle(server: ServerProcess, timeout: float = 20) -> dict:
    """/info once no request runs or waits (the engine thread updates it after each step)."""
    deadline = time.monotonic() + timeout
    while True:
        info = get(server, "/info")[1]
        idle = info["requests_running"] == 0 and info["requests_waiting"] == 0
        if (idle and info["kv_blocks_used"] == 0) or time.monotonic() > deadline:
            return info
        time.sleep(0.1)
