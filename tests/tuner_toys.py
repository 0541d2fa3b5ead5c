"""Toy knobs, objectives and a toy kernel op for the tuner tests (fast: no model, no sleeping).

Run as a script it tunes the toy objective into a given storage, for the multi-process tests:

    PYTHONPATH=.:tests python -m tuner_toys STORAGE_URL STUDY TRIALS [RESULTS_DIR]
"""
from __future__ import annotations

import random
import sys

import torch

from engine.knobs import AtMost, Divides, Knob, ProductAtMost
from tuner.search import Metric, TrialFailure, WrongAnswer

TOY_CATALOGUE = {k.name: k for k in (
    Knob("block_k", int, 64, "kernels/toy", "outer block", low=8, high=256, pow2=True),
    Knob("block_m", int, 16, "kernels/toy", "inner block, divides block_k", low=1, high=256, pow2=True,
         constraints=(Divides("block_k"),)),
    Knob("tp", int, 1, "engine/parallel", "tensor parallel degree", low=1, high=8),
    Knob("ep", int, 1, "engine/parallel", "expert parallel degree, TP × EP ≤ ranks", low=1, high=8,
         constraints=(ProductAtMost("tp", "ranks"),)),
    Knob("threads", int, 2, "engine", "threads ≤ cores", low=1, high=64, constraints=(AtMost("cores"),)),
    Knob("method", str, "lut", "kernels/toy", "conversion method", choices=("lut", "vector", "broken")),
    Knob("fast_path", bool, False, "engine", "a toggle"),
    Knob("capacity", int, 1024, "engine", "a setting, not tuned", low=64, high=4096, tune=False),
)}
TOY_LIMITS = {"cores": 4, "ranks": 8}


class ToyObjective:
    """time = a smooth bowl in the knobs + small noise; "broken" looks fastest but fails, block_m=1
    looks fastest but gives a wrong answer: neither may ever be chosen."""
    name, model, format = "toy", "toy", "none"
    metrics = (Metric("time_s", "minimize", "s"),)
    workload = {"toy": 1}

    def __init__(self, noise: float = 0.01, interrupt_after: int | None = None, seed: int = 0):
        self.noise, self.calls, self.interrupt_after = noise, 0, interrupt_after
        self.rng = random.Random(seed)

    @staticmethod
    def true_time(k: dict) -> float:
        t = 1.0 + 0.3 * abs(k["block_k"].bit_length() - 7) + 0.2 * abs(k["threads"] - 3)
        t += 0.1 * abs(k["tp"] * k["ep"] - 4) + (0.0 if k["fast_path"] else 0.2)
        t += {"lut": 0.0, "vector": 0.3, "broken": -0.9}[k["method"]]
        return t + (-0.9 if k["block_m"] == 1 else 0.05 * abs(k["block_m"].bit_length() - 4))

    def prepare(self, knobs: dict):
        if knobs["method"] == "broken":
            raise TrialFailure("compile error: method 'broken' does not build here")
        if knobs["block_m"] == 1:
            raise WrongAnswer("wrong answer: block_m=1 drops the tail")

        def run() -> dict:
            self.calls += 1
            if self.interrupt_after is not None and self.calls > self.interrupt_after:
                raise KeyboardInterrupt
            return {"time_s": self.true_time(knobs) * (1 + self.noise * self.rng.uniform(-1, 1))}

        return run


class ToyPareto(ToyObjective):
    """Two objectives that pull against each other through tp."""
    metrics = (Metric("ttft_s", "minimize", "s"), Metric("tpot_s", "minimize", "s"))

    def prepare(self, knobs: dict):
        base = super().prepare(knobs)

        def run() -> dict:
            t = base()["time_s"]
            return {"ttft_s": t / knobs["tp"], "tpot_s": t * knobs["tp"] / 2}

        return run


def toy_space(names=None):
    from tuner.space import SearchSpace

    return SearchSpace.from_catalogue(names, catalogue=TOY_CATALOGUE, limits=TOY_LIMITS, exclude_components=())


# ------------------------------------------------------------------ toy kernel op

def blocked_matmul(a: torch.Tensor, b: torch.Tensor, block: int, split: int) -> torch.Tensor:
    """a [M, K] @ b [K, N] in column blocks of `block`; block=4 "forgets" the last column block
    (a wrong-answer configuration for the verify step)."""
    n = b.shape[1]
    cols = range(0, n - block if block == 4 else n, block)
    out = torch.zeros(a.shape[0], n)
    for j in cols:
        out[:, j:j + block] = a @ b[:, j:j + block]
    return out


TOY_KERNEL_CATALOGUE = {k.name: k for k in (
    Knob("mm_block", int, 16, "kernels/toy_mm", "column block", low=4, high=64, pow2=True),
    Knob("mm_split", int, 1, "kernels/toy_mm", "unused split", low=1, high=2),
)}


def toy_kernel_op():
    from tuner.kernel_tier import KernelOp

    def make_inputs(bucket, fmt):
        g = torch.Generator().manual_seed(bucket["tokens"])
        return torch.randn(bucket["tokens"], 32, generator=g), torch.randn(32, 64, generator=g)

    return KernelOp(name="toy_mm", knobs=("mm_block", "mm_split"), formats=("fp32",),
                    buckets=({"tokens": 1}, {"tokens": 16}), make_inputs=make_inputs,
                    run=lambda args, mm_block, mm_split: blocked_matmul(*args, mm_block, mm_split),
                    reference=lambda args: args[0] @ args[1], atol=1e-4, rtol=1e-4,
                    catalogue=TOY_KERNEL_CATALOGUE)


def main(argv: list[str]) -> int:
    import os

    from tuner.search import Tuner, TuneConfig

    storage, study, trials = argv[0], argv[1], int(argv[2])
    if len(argv) > 3:
        os.environ["MOETUNE_RESULTS"] = argv[3]
    tuner = Tuner(toy_space(), ToyObjective(seed=os.getpid()), TuneConfig(trials=trials, repeats=2, warmup=0),
                  storage=storage, study_name=study)
    result = tuner.run()
    print(f"done {result.trials_done} kept={result.kept}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))


# ------------------------------------------------------------------ drift and workload mixes

class DriftingToy(ToyObjective):
    """The machine slows down steadily (0.4 % a call, as a machine drifts by 15 % within minutes);
    the knob `threads` does nothing. Relative scoring must see no signal in it."""
    metrics = (Metric("time_s", "minimize", "s"),)

    def prepare(self, knobs: dict):
        def run() -> dict:
            self.calls += 1
            return {"time_s": 1.0 + 0.004 * self.calls}

        return run


def sleeping_tiny_objective(base_s: float = 0.15):
    """The default (tpot) objective on `tiny` with a short and a long point, and two planted toy
    knobs (TOY_MIX_CATALOGUE) acting through a sleep of `base_s` in every engine step (a tiny step
    takes 5-60 ms on a loaded 2-core machine, with bursts of +60 ms): `reverse` makes short
    contexts' sleep 10× shorter and long ones' 5× longer (its best value depends on the context);
    `uniform` makes every sleep 0.4× as long. The engine's answers are untouched."""
    import time

    from tuner.objectives import Point, SystemObjective

    class Sleeping(SystemObjective):
        def build(self, knobs):
            toy = {k: knobs.get(k, TOY_MIX_CATALOGUE[k].default) for k in TOY_MIX_CATALOGUE}
            llm = super().build({k: v for k, v in knobs.items() if k not in TOY_MIX_CATALOGUE})
            step = llm._step

            def slowed(reqs, new_tokens):
                out = step(reqs, new_tokens)
                long = max(r.seq.num_tokens for r in reqs) > 256
                f = (5.0 if long else 0.1) if toy["reverse"] else 1.0
                time.sleep(base_s * f * (0.4 if toy["uniform"] else 1.0))
                return out

            llm._step = slowed
            return llm

    return Sleeping("tpot", "tiny", "float32", mix=(Point(16, 4), Point(512, 4)))


def toy_mix_catalogue():
    from engine.knobs import SpansContexts

    return {k.name: k for k in (
        Knob("reverse", bool, False, "engine/toy", "faster at short contexts, slower at long ones",
             observed_by=(SpansContexts(256, 512),)),
        Knob("uniform", bool, False, "engine/toy", "faster everywhere"),
    )}


TOY_MIX_CATALOGUE = toy_mix_catalogue()
