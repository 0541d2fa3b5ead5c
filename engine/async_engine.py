"""The engine in its own thread, for the server: requests and cancellations go in through a queue,
tokens come out through each request's callback, and the caller's event loop never waits on a
forward pass.
"""
from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable

from engine.llm import LLM
from engine.metrics import Metrics
from engine.scheduler import Request, Scheduler

log = logging.getLogger("moetune")


@dataclass(frozen=True)
class TokenEvent:
    """A request's state after one step (a snapshot: the engine thread keeps changing the request)."""

    text: str  # the whole generated text so far (stop strings cut off)
    num_tokens: int  # generated tokens so far
    finish_reason: str | None  # "stop" | "length" | "cancelled" | "abort" | "error" | None while running
    error: str | None = None
    logprobs: list = ()  # the request's live out.logprobs: read only its first num_tokens entries
    cumulative_logprob: float = 0.0


class EngineThread:
    """Owns the LLM and its scheduler; `submit` and `cancel` may be called from any thread."""

    def __init__(self, llm: LLM, metrics: Metrics | None = None):
        self.llm = llm
        self.scheduler = Scheduler(llm)
        self.metrics = metrics or Metrics()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._callbacks: dict[int, Callable[[TokenEvent], None]] = {}
        self._last_token_t: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="moetune-engine", daemon=True)

    def start(self) -> EngineThread:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._inbox.put(("wake", None))
        self._thread.join(timeout=30)

    def submit(self, reqs: list[Request], on_event: Callable[[int, TokenEvent], None]) -> None:
        """Queue checked requests together (the forks of a request with it); on_event(i, event) is
        called in the engine thread after each token of reqs[i]."""
        self._inbox.put(("add", (reqs, on_event)))

    def cancel(self, req: Request) -> None:
        """Drop the request before the next step; its blocks are freed then."""
        self._inbox.put(("cancel", req))

    def abort_all(self) -> None:
        """Fail every request before the next step (shutdown): finish reason "abort", with an error."""
        self._inbox.put(("abort", None))

    # ------------------------------------------------------------ engine thread

    def _loop(self) -> None:
        self.metrics.set_state(self.scheduler)
        while not self._stop.is_set():
            self._drain(block=not self.scheduler.has_work())
            if self.scheduler.has_work():
                self._step()
            self.metrics.set_state(self.scheduler)

    def _drain(self, block: bool) -> None:
        try:
            kind, item = self._inbox.get(timeout=1.0) if block else self._inbox.get_nowait()
            while True:
                self._handle(kind, item)
                kind, item = self._inbox.get_nowait()
        except queue.Empty:
            pass

    def _handle(self, kind: str, item) -> None:
        if kind == "add":
            reqs, on_event = item
            for i, req in enumerate(reqs):
                self._callbacks[req.id] = functools.partial(on_event, i)
                # a sequence each; a fork starts from its parent's prefill (its prompt counted once)
                self.metrics.on_arrival(0 if req.parent else len(req.out.prompt_token_ids))
                if req.parent is None:
                    self.scheduler.add(req)
        elif kind == "cancel" and item.id in self._callbacks:
            self.scheduler.cancel(item)
            self._emit(item)
        elif kind == "abort":
            reqs = list(self.scheduler.running) + list(self.scheduler.waiting)
            for req in reqs + [f for r in reqs for f in r.forks]:
                self.scheduler.cancel(req, "abort")
                self._emit(req, error="the server is shutting down")

    def _step(self) -> None:
        try:
            updated = self.scheduler.step()
        except Exception as e:  # a bug, not a user error: fail what is in flight, keep serving
            log.exception("engine step failed")
            for req in list(self.scheduler.running) + list(self.scheduler.waiting):
                self.scheduler.cancel(req, "error")
                self._emit(req, error=f"engine error: {e}")
            return
        for req in updated:
            self._emit(req)

    def _emit(self, req: Request, error: str | None = None) -> None:
        out = req.out
        now = time.perf_counter()
        if out.finish_reason not in ("cancelled", "error"):
            last = self._last_token_t.get(req.id)
            self.metrics.on_token(ttft=now - req.arrival if last is None else None,
                                  itl=None if last is None else now - last)
            self._last_token_t[req.id] = now
        callback = self._callbacks.get(req.id)
        if out.finish_reason is not None:
            self._callbacks.pop(req.id, None)
            self._last_token_t.pop(req.id, None)
            self.metrics.on_finish(out.finish_reason, now - req.arrival)
        if callback is not None:
            callback(TokenEvent(out.text, len(out.token_ids), out.finish_reason, error, out.logprobs,
                                out.cumulative_logprob))
