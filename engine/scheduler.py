"""Continuous batching over the paged KV cache: requests wait, run (holding blocks), finish.

Every step mixes the decode token of each running sequence (at most `decode_batch_cap` of them)
with prompt chunks (at most `chunked_prefill_size` prompt tokens in all): first the prompts already
being prefilled, then newly admitted ones. A waiting request is admitted, oldest first, while fewer
than `max_running_requests` run and the free blocks hold the rest of its prompt. When a step needs
more blocks than are free, the newest running request is preempted: its blocks are freed and it
waits again, to be recomputed (prompt + the tokens it already generated) when there is room.
Cancelling a request frees its blocks at once.

Several samples of one prompt (n > 1) share its prefill: the first sample is scheduled alone and
holds the others in `forks`; when its prompt is in the cache they fork its blocks (engine/cache.py:
shared, copied on write) and each samples its first token from the same logits. A request with
params.prompt_logprobs gets the logits of every prompt position from the steps that feed them.

Offline `LLM.generate` and the server both drive this class (`step()` until `has_work()` is false).
"""
from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

import torch

from engine.cache import SeqCache
from engine.sampling import Sampler, token_logprobs

if TYPE_CHECKING:
    from engine.llm import LLM, RequestOutput, SamplingParams
    from engine.tokenizer import IncrementalDecoder

_ids = itertools.count()


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """One prompt being generated. Its tokens are prompt + out.token_ids; seq holds how many of
    them are in the cache; the rest (`num_pending`) are fed at the next steps."""

    out: RequestOutput
    params: SamplingParams
    sampler: Sampler | None = None
    seq: SeqCache = field(default_factory=SeqCache)
    status: Status = Status.WAITING
    arrival: float = field(default_factory=time.perf_counter)
    t_first: float = 0.0  # when the first token was sampled
    num_preemptions: int = 0
    detok: IncrementalDecoder | None = None  # out.text kept up to date token by token (LLM._accept)
    forks: list[Request] = field(default_factory=list)  # samples of the same prompt that fork this one's prefill
    parent: Request | None = None  # the request whose prefill this one waits to fork
    id: int = field(default_factory=lambda: next(_ids))

    def __post_init__(self):
        if self.sampler is None:
            self.sampler = Sampler(self.params)

    @property
    def num_tokens(self) -> int:
        return len(self.out.prompt_token_ids) + len(self.out.token_ids)

    @property
    def num_pending(self) -> int:
        return self.num_tokens - self.seq.num_tokens

    @property
    def is_decoding(self) -> bool:
        return bool(self.out.token_ids) and self.num_pending == 1

    def pending_tokens(self, n: int) -> list[int]:
        """The next n tokens not yet in the cache."""
        start, prompt = self.seq.num_tokens, self.out.prompt_token_ids
        if start + n <= len(prompt):
            return prompt[start:start + n]
        # not prompt + token_ids: that copies the whole sequence at every decode step
        return prompt[start:start + n] + self.out.token_ids[max(0, start - len(prompt)):start + n - len(prompt)]


Plan = list[tuple[Request, int]]  # (request, new tokens fed this step)


class Scheduler:
    def __init__(self, llm: LLM):
        self.llm, self.cache = llm, llm.cache
        self.chunk = llm.knobs["chunked_prefill_size"]
        self.decode_cap = llm.knobs["decode_batch_cap"]
        self.max_running = llm.knobs["max_running_requests"]
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order
        self.num_steps = 0
        self._next_decode = 0  # round-robin position under the decode cap
        self.num_preemptions = 0

    # ------------------------------------------------------------ queue

    def add(self, req: Request) -> None:
        req.status = Status.WAITING
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def cancel(self, req: Request, reason: str = "cancelled") -> None:
        """Drop the request wherever it is and free its blocks now (no-op once finished); a request
        still holding forks that never started cancels them too."""
        if req.status is Status.WAITING and req in self.waiting:
            self.waiting.remove(req)
        elif req.status is Status.RUNNING:
            self.running.remove(req)
            self.cache.release(req.seq)
        elif req.parent is not None and req in req.parent.forks:
            req.parent.forks.remove(req)
        else:
            return
        req.status = Status.FINISHED
        req.out.finish_reason = req.out.finish_reason or reason
        for fork in list(req.forks):
            self.cancel(fork, reason)

    def cancel_all(self, reason: str = "cancelled") -> None:
        for req in list(self.running) + list(self.waiting):
            self.cancel(req, reason)

    # ------------------------------------------------------------ one step

    def step(self) -> list[Request]:
        """Schedule, run one forward, sample where a sequence is complete. Returns the requests
        that got a new token (finished ones have out.finish_reason set and no blocks left)."""
        return self.run(self.schedule())

    def run(self, plan: Plan) -> list[Request]:
        """One forward over a plan from `schedule()`; see `step`."""
        if not plan:
            return []
        self.num_steps += 1
        reqs = [r for r, _ in plan]
        starts = [r.seq.num_tokens for r in reqs]
        every_row = frozenset(i for i, r in enumerate(reqs) if self._wants_prompt_logprobs(r))
        new_tokens = [r.pending_tokens(n) for r, n in plan]
        logits, rows = self.llm._forward(reqs, new_tokens, every_row) if every_row else (self.llm._step(reqs, new_tokens), {})
        for i, chunk in rows.items():
            self._record_prompt_logprobs(reqs[i], starts[i], chunk)
        return [u for r, row in zip(reqs, logits.unbind(0)) for u in self._after_forward(r, row)]

    @staticmethod
    def _wants_prompt_logprobs(req: Request) -> bool:
        return req.params.prompt_logprobs is not None and len(req.out.prompt_logprobs) < len(req.out.prompt_token_ids)

    def _record_prompt_logprobs(self, req: Request, start: int, logits: torch.Tensor) -> None:
        """logits [n, vocab] of positions start.. (row j predicts token start + j + 1): the logprobs
        of the prompt tokens they predict that are not recorded yet (a recompute repeats none)."""
        prompt, done = req.out.prompt_token_ids, req.out.prompt_logprobs
        if not done:
            done.append(None)  # the first prompt token has no context
        first, end = len(done), min(start + len(logits) + 1, len(prompt))
        if first < end:
            done += token_logprobs(logits[first - 1 - start:end - 1 - start], prompt[first:end],
                                   req.params.prompt_logprobs)

    def _after_forward(self, req: Request, logits: torch.Tensor) -> list[Request]:
        """The requests that got a token from this row: req, and the forks it starts."""
        if req.num_pending:  # a prompt chunk that is not the last: nothing to sample yet
            return []
        if not req.out.token_ids:
            req.t_first = time.perf_counter()
            req.out.ttft_s = req.t_first - req.arrival
        samples = [req, *self._fork(req)]
        for r in samples:
            if r.params.max_tokens == 0:  # scoring only: the prompt (and its logprobs) is all
                r.out.finish_reason = "length"
            else:
                self.llm._accept(r, logits)
            if r.out.finish_reason is not None:
                self._finish(r)
        return samples

    def _fork(self, req: Request) -> list[Request]:
        """req's waiting forks, running from now on with its blocks (shared) and its prompt logprobs."""
        forks, req.forks = req.forks, []
        for f in forks:
            f.seq, f.status, f.t_first, f.out.ttft_s = self.cache.fork(req.seq), Status.RUNNING, req.t_first, req.out.ttft_s
            f.out.prompt_logprobs = req.out.prompt_logprobs
            f.parent = None
            self.running.append(f)
        return forks

    def _finish(self, req: Request) -> None:
        self.running.remove(req)
        self.cache.release(req.seq)
        req.status = Status.FINISHED

    # ------------------------------------------------------------ scheduling

    def schedule(self) -> Plan:
        plan: Plan = [(r, 1) for r in self._decodes()]
        budget = self.chunk
        for r in self.running:
            if budget and not r.is_decoding:
                n = min(r.num_pending, budget)
                plan.append((r, n))
                budget -= n
        while budget and self.waiting and self._can_admit(self.waiting[0], plan):
            r = self.waiting.popleft()
            r.status = Status.RUNNING
            self.running.append(r)
            n = min(r.num_pending, budget)
            plan.append((r, n))
            budget -= n
        return self._fit(plan)

    def _decodes(self) -> list[Request]:
        """Decoding sequences, at most decode_batch_cap, taken round-robin when there are more."""
        ready = [r for r in self.running if r.is_decoding]
        if len(ready) > self.decode_cap:
            start = self._next_decode % len(ready)
            ready = (ready[start:] + ready[:start])[: self.decode_cap]
            self._next_decode = start + self.decode_cap
        return ready

    def _blocks(self, plan: Plan) -> int:
        return sum(self.cache.blocks_needed(r.seq, n) for r, n in plan)

    def _can_admit(self, req: Request, plan: Plan) -> bool:
        """Room for another request (and its forks), and free blocks for the rest of its prompt after
        this step. A group larger than max_running_requests is admitted alone."""
        if self.running and len(self.running) + 1 + len(req.forks) > self.max_running:
            return False
        need = self._blocks(plan) + self.cache.blocks_needed(req.seq, req.num_pending)
        return need <= self.cache.allocator.num_free

    def _fit(self, plan: Plan) -> Plan:
        """Preempt the newest running requests until the plan's new blocks are free."""
        while self._blocks(plan) > self.cache.allocator.num_free:
            victim = max(self.running, key=lambda r: r.arrival)
            self._preempt(victim)
            plan = [(r, n) for r, n in plan if r is not victim]
        return plan

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.cache.release(req.seq)
        req.status = Status.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    # ------------------------------------------------------------ stats

    def kv_blocks_used(self) -> int:
        a = self.cache.allocator
        return a.num_blocks - a.num_free
