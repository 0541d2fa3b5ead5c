"""A real `moetune serve` process on a free 127.0.0.1 port, and small raw-HTTP helpers."""
from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, args: list[str], env: dict | None = None, log_path: Path | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path or Path(os.environ["MOETUNE_CACHE"]) / f"server-{self.port}.log"
        cmd = [sys.executable, "-m", "engine.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port), *args]
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **(env or {})},
                                     stdout=self._log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 180) -> ServerProcess:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if get(self, "/health")[0] == 200:
                    return self
            except OSError:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"server not ready after {timeout} s:\n{self.log()}")

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text()

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


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
