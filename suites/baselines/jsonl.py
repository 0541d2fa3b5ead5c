"""The JSON-lines protocol between moetune and a baseline worker process (standard library only).

A worker runs in its own process (llama.cpp in ours, kt-kernel in its own numpy-only virtualenv, so
this file imports nothing from moetune). One request per line on its stdin, one reply per line on
its stdout:

    request  {"op": "load", "args": {...}}
    reply    {"ok": true, "result": {...}}          or     {"ok": false, "error": "one line"}

Anything a library prints goes to stderr (stdout is redirected there while an op runs), so the
reply channel only ever carries replies. `{"op": "quit"}` ends the loop.
"""
from __future__ import annotations

import json
import os
import sys
import traceback


def _one_line(err: BaseException) -> str:
    text = f"{type(err).__name__}: {err}".strip()
    return " ".join(text.split())[:500]


def serve(handlers: dict, stdin=None, stdout=None) -> int:
    """Answer requests until EOF or `quit`; a handler takes the args as keywords and returns a dict."""
    stdin = stdin or sys.stdin
    reply_fd = os.dup(1)  # the real stdout, kept for replies
    os.dup2(2, 1)  # libraries' prints (C and Python) go to stderr
    sys.stdout = sys.stderr
    out = stdout or os.fdopen(reply_fd, "w", buffering=1)
    for line in stdin:
        if not line.strip():
            continue
        try:
            req = json.loads(line)
            if not isinstance(req, dict) or not isinstance(req.get("op"), str):
                raise ValueError("a request is an object with a string 'op'")
            op, args = req["op"], req.get("args") or {}
            if not isinstance(args, dict):
                raise ValueError("'args' must be an object")
            if op == "quit":
                out.write(json.dumps({"ok": True, "result": {}}) + "\n")
                break
            if op not in handlers:
                raise ValueError(f"unknown op {op!r} (known: {', '.join(sorted(handlers))}, quit)")
            reply = {"ok": True, "result": handlers[op](**args)}
        except Exception as err:  # noqa: BLE001 — every failure becomes a reply, the loop goes on
            traceback.print_exc(file=sys.stderr)
            reply = {"ok": False, "error": _one_line(err)}
        out.write(json.dumps(reply) + "\n")
        out.flush()
    return 0
