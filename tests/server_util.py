"""Raw-HTTP helpers for the server tests (the server process itself: suites.live_server)."""
from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import tempfile
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


def wait_busy(server: ServerProcess, timeout: float = 20) -> dict:
    """/info once some KV block is in use."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = get(server, "/info")[1]
        if info["kv_blocks_used"]:
            return info
        time.sleep(0.05)
    return info


def kill_client(server: ServerProcess, script: str, *args: str) -> tuple[dict, dict]:
    """Run `python -c script PORT ARGS` until it prints "started", then SIGKILL it: /info while its
    request was running, and once the engine is idle again."""
    proc = subprocess.Popen([sys.executable, "-c", script, str(server.port), *args],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "started"
        busy = wait_busy(server)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    return busy, wait_idle(server)


def wait_idle(server: ServerProcess, timeout: float = 20) -> dict:
    """/info once no request runs or waits (the engine thread updates it after each step)."""
    deadline = time.monotonic() + timeout
    while True:
        info = get(server, "/info")[1]
        idle = info["requests_running"] == 0 and info["requests_waiting"] == 0
        if (idle and info["kv_blocks_used"] == 0) or time.monotonic() > deadline:
            return info
        time.sleep(0.1)


def start_tiny(*extra: str, knobs: dict | None = None, env: dict | None = None) -> ServerProcess:
    """A ready `moetune serve --model tiny --dtype float32 [--knob K=V ...] EXTRA` that finds no
    tuned profile (an empty profile directory)."""
    profiles = tempfile.mkdtemp(prefix="moetune-profiles-")
    args = ["--model", "tiny", "--dtype", "float32"]
    for k, v in (knobs or {}).items():
        args += ["--knob", f"{k}={v}"]
    return ServerProcess([*args, *extra], env={"MOETUNE_PROFILES": profiles, **(env or {})}).wait_ready()


def openai_client(server: ServerProcess, key: str = "unused"):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=120)
