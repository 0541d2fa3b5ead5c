"""The moetune side of the JSON-lines protocol (suites/baselines/jsonl.py): a worker process.

`Worker(cmd).call(op, **args)` returns the result dict or raises `BaselineError` with one line:
the worker's own error, its death (exit code and the last lines of its stderr), a reply that is not
JSON, or no reply within the timeout (the worker is then killed).
"""
from __future__ import annotations

import json
import os
import selectors
import subprocess
import tempfile
import time

from engine.errors import MoetuneError


class BaselineError(MoetuneError):
    """A baseline could not run (missing package, worker error, crash, timeout)."""


class WorkerOwner:
    """A driver that owns a `self.worker` process: closing (or leaving a `with` block) stops it."""

    worker: "Worker"

    def close(self) -> None:
        self.worker.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Worker:
    """One worker process; use as a context manager (it is asked to quit, then killed if needed)."""

    def __init__(self, cmd: list[str], name: str, env: dict | None = None, timeout_s: float = 600.0):
        self.name, self.timeout_s = name, timeout_s
        self._err = tempfile.TemporaryFile(mode="w+b")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err,
                                     env={**os.environ, **(env or {})}, bufsize=0)

    def stderr_tail(self, lines: int = 5) -> str:
        self._err.flush()
        self._err.seek(0)
        text = self._err.read().decode("utf-8", "replace").strip().splitlines()
        return " | ".join(t.strip() for t in text[-lines:])

    def _readline(self, timeout_s: float) -> bytes:
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        deadline, buf = time.monotonic() + timeout_s, b""
        while not buf.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or not sel.select(left):
                self.proc.kill()
                self.proc.wait()
                raise BaselineError(f"{self.name} worker gave no reply within {timeout_s:.0f} s (killed)")
            chunk = os.read(self.proc.stdout.fileno(), 1 << 16)
            if not chunk:
                code = self.proc.wait()
                raise BaselineError(f"{self.name} worker exited (code {code}) without a reply: "
                                    f"{self.stderr_tail() or 'no stderr'}")
            buf += chunk
        return buf

    def call(self, op: str, timeout_s: float | None = None, **args) -> dict:
        if self.proc.poll() is not None:
            raise BaselineError(f"{self.name} worker is not running (exit code {self.proc.returncode}): "
                                f"{self.stderr_tail() or 'no stderr'}")
        try:
            self.proc.stdin.write((json.dumps({"op": op, "args": args}) + "\n").encode())
            self.proc.stdin.flush()
        except BrokenPipeError:
            code = self.proc.wait()
            raise BaselineError(f"{self.name} worker exited (code {code}): {self.stderr_tail() or 'no stderr'}") from None
        line = self._readline(timeout_s or self.timeout_s)
        try:
            reply = json.loads(line)
        except json.JSONDecodeError:
            raise BaselineError(f"{self.name} worker sent a line that is not JSON: {line[:200]!r}") from None
        if not isinstance(reply, dict) or "ok" not in reply:
            raise BaselineError(f"{self.name} worker sent a malformed reply: {str(reply)[:200]}")
        if not reply["ok"]:
            raise BaselineError(f"{self.name} {op}: {reply.get('error', 'unknown error')}")
        return reply.get("result") or {}

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call("quit", timeout_s=10)
            except BaselineError:
                pass
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait()
        self._err.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
