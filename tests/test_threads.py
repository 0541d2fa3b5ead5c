"""Knobs threads_prefill / threads_decode: each step runs its ops with the phase's thread count
(observed inside the ops), a mixed step with the prefill count, "auto" follows `threads`, the count
is set only when it changes, and the answer does not change.
"""
from __future__ import annotations

import threading

import pytest
import torch

from engine import LLM, SamplingParams
from engine.errors import MoetuneError
from engine.knobs import resolve_knobs
from engine.llm import RequestOutput
from engine.scheduler import Request, Scheduler

VOCAB = 512


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(2, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class ThreadsSeen:
    """Wraps a backend: records torch.get_num_threads() at every op call."""

    def __init__(self, ops):
        self._ops, self.seen = ops, []

    def __getattr__(self, name):
        fn = getattr(self._ops, name)
        if not callable(fn):
            return fn

        def call(*a, **k):
            self.seen.append(torch.get_num_threads())
            return fn(*a, **k)
        return call

    def take(self) -> set[int]:
        out, self.seen = set(self.seen), []
        return out


def observed(llm: LLM) -> ThreadsSeen:
    spy = ThreadsSeen(llm.model.ops)
    llm.model.ops = spy
    runner = llm.model.runner  # graph_mode=cpp: a decode step is one call of the C++ runner
    if runner is not None:
        real = vars(runner).get("_real_logits", runner.step_logits)
        runner._real_logits = real

        def logits(*a, **k):
            spy.seen.append(torch.get_num_threads())
            return real(*a, **k)
        runner.step_logits = logits
    return spy


@pytest.fixture(scope="module")
def split() -> LLM:
    return LLM("tiny", dtype="float32", knobs={"threads_prefill": 1, "threads_decode": 2}, progress=False)


def test_auto_follows_threads():
    k = resolve_knobs({"threads": 3})
    assert k["threads_prefill"] == 3 and k["threads_decode"] == 3
    k = resolve_knobs({"threads": 3, "threads_decode": 1})
    assert k["threads_prefill"] == 3 and k["threads_decode"] == 1
    with pytest.raises(MoetuneError, match="threads_prefill"):
        resolve_knobs({"threads_prefill": 0})


def test_each_phase_runs_with_its_thread_count(split):
    spy = observed(split)
    torch.set_num_threads(4)  # whatever the caller left
    sched = Scheduler(split)
    a = Request(RequestOutput(ids(20, 1)), SamplingParams(max_tokens=4, ignore_eos=True))
    sched.add(a)
    sched.step()  # prefill
    assert spy.take() == {1}
    sched.step()  # decode only
    assert spy.take() == {2}
    b = Request(RequestOutput(ids(9, 2)), SamplingParams(max_tokens=2, ignore_eos=True))
    sched.add(b)
    plan = sched.schedule()
    assert sorted(n for _, n in plan) == [1, 9]  # a decode beside b's prompt: a mixed step
    sched.run(plan)
    assert spy.take() == {1}
    while sched.has_work():
        sched.step()
    assert spy.take() == {2}
    split.logits(ids(5, 3))
    assert spy.take() == {1}


def test_the_engine_thread_gets_the_count_too(split):
    """The count is per thread: a step run in another thread (the server's engine thread) must
    set it there."""
    spy = observed(split)
    seen = {}

    def run():
        torch.set_num_threads(3)
        split.generate(ids(6, 4), SamplingParams(max_tokens=3, ignore_eos=True))
        seen["ops"] = spy.take()

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert seen["ops"] == {1, 2}


def test_set_only_when_it_changes(split, monkeypatch):
    calls = []
    real = torch.set_num_threads
    monkeypatch.setattr(torch, "set_num_threads", lambda n: (calls.append(n), real(n)))
    real(1)
    split.generate(ids(6, 5), SamplingParams(max_tokens=5, ignore_eos=True))
    assert calls == [2]  # prefill already at 1; one change for the decode steps, then none


def test_answer_unchanged(split):
    ref = LLM("tiny", dtype="float32", knobs={"threads": 2}, progress=False)
    prompts = [ids(30, 6), ids(7, 7)]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    assert ([o.token_ids for o in split.generate(prompts, params)]
            == [o.token_ids for o in ref.generate(prompts, params)])
    torch.testing.assert_close(split.logits(prompts[0]), ref.logits(prompts[0]), rtol=1e-5, atol=1e-5)
