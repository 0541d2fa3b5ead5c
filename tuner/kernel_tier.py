"""The kernel tier: per op × format × shape bucket, a search over that op's tile knobs.

An op joins by registering a `KernelOp` adapter (suites/kernels.py or a backend does it at import):

    register_kernel_op(KernelOp(
        name="fused_moe", knobs=("moe_block_m", "moe_block_n"), formats=("int8", "fp8"),
        buckets=({"tokens": 1}, {"tokens": 16}, {"tokens": 512}),
        make_inputs=lambda bucket, fmt: (...),          # the op's arguments for that bucket
        run=lambda args, **knobs: backend.fused_moe(*args, **knobs),
        reference=lambda args: kernels.reference.fused_moe(*args),
        atol=1e-2, rtol=1e-2))

Every configuration is run once and compared with the reference *before* it is timed: a wrong
answer is a failed trial (status "wrong"), never a winner. A timing sample is the fastest of a few
back-to-back calls (`KernelObjective.SAMPLE_S`), so a burst of load from elsewhere cannot pass for a
gain, and the calls cycle through copies of the op's weights (`KernelOp.rotate`), so each finds them in
DRAM as a model's step does, not in a cache that held them since the call before. The winners form
a table per op, stored in the profile's [kernel_tables] and looked up at run time by the nearest
bucket (`lookup`: distance in log2 of each numeric bucket field).
"""
from __future__ import annotations

import gc
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from engine.knobs import Knob
from tuner.search import Metric, Tuner, TuneConfig, WrongAnswer
from tuner.space import SearchSpace

TIME = Metric("time_s", "minimize", "s")


@dataclass(frozen=True)
class KernelOp:
    name: str
    knobs: tuple[str, ...]  # the op's tile knobs (catalogue names)
    formats: tuple[str, ...]
    buckets: tuple[dict, ...]  # shape buckets, e.g. {"tokens": 1}
    make_inputs: Callable[[dict, str], tuple]  # (bucket, format) → arguments
    run: Callable[..., Any]  # run(args, **knobs) → output
    reference: Callable[[tuple], Any]  # reference(args) → output
    atol: float = 1e-3
    rtol: float = 1e-3
    catalogue: dict[str, Knob] | None = None  # None: engine.knobs.CATALOGUE
    work: Callable[[dict, str], dict] | None = None  # bucket, format → {"bytes", "flops"}
    # args → the argument tuples the timed calls cycle through (copies of the weights or caches, other
    # routings): each call then finds its weights in DRAM, as a model's step does after streaming every
    # other layer's since; None: the same arguments every call (the verify step always uses make_inputs')
    rotate: Callable[[tuple], list[tuple]] | None = None


_OPS: dict[str, KernelOp] = {}


def register_kernel_op(op: KernelOp) -> None:
    _OPS[op.name] = op


def kernel_ops() -> dict[str, KernelOp]:
    """The registered ops: the cpu backend's (tuner.cpu_ops) and the cuda backend's
    (tuner.cuda_ops) where they run, and any that suites.kernels registers."""
    from tuner.cpu_ops import register_cpu_ops
    from tuner.cuda_ops import register_cuda_ops

    register_cpu_ops()
    register_cuda_ops()
    try:
        import suites.kernels  # noqa: F401 - may register adapters of its own
    except ImportError:
        pass
    return dict(_OPS)


def bucket_key(bucket: dict) -> str:
    return "-".join(f"{k}{v}" for k, v in sorted(bucket.items()))


def check_close(out, ref, atol: float, rtol: float) -> None:
    """Raise WrongAnswer with the worst element when `out` is not within atol + rtol·|ref|."""
    out, ref = torch.as_tensor(out).float(), torch.as_tensor(ref).float()
    if out.shape != ref.shape:
        raise WrongAnswer(f"wrong answer: shape {tuple(out.shape)} ≠ reference {tuple(ref.shape)}")
    err = (out - ref).abs() - (atol + rtol * ref.abs())
    if not torch.isfinite(out).all() or (err > 0).any():
        i = int(torch.nan_to_num(err, nan=math.inf).flatten().argmax())
        raise WrongAnswer(f"wrong answer: element {i} is {out.flatten()[i]:.6g}, reference "
                          f"{ref.flatten()[i]:.6g} (atol {atol}, rtol {rtol})")


@dataclass
class KernelObjective:
    op: KernelOp
    format: str
    bucket: dict
    model: str = "kernel"
    metrics: tuple = (TIME,)
    workload: dict = field(default_factory=dict)

    def __post_init__(self):
        self.name = f"kernel-{self.op.name}"
        self.workload = {"op": self.op.name, "format": self.format, **self.bucket}
        self.extra = self.op.work(self.bucket, self.format) if self.op.work else {}
        self._args = self.op.make_inputs(self.bucket, self.format)
        self._ref = self.op.reference(self._args)
        self._cycle = self.op.rotate(self._args) if self.op.rotate else [self._args]
        self._turn = 0  # the next call's place in the cycle, shared by every configuration's timer

    # A sample is the fastest of back-to-back calls: at least MIN_CALLS, and more until SAMPLE_S has passed
    # (at most MAX_CALLS), with Python's garbage collector off meanwhile (timeit's rules). Load from elsewhere
    # only ever slows a call, so the fastest is the configuration's own time. One call a sample let a burst
    # decide a study: a clean-clone `make run` on the Emerald Rapids VM (session 34) timed one 1.1 ms linear
    # configuration at 1.1 / 17 / 45 ms in three consecutive calls, and kept gains of +300 % to +1682 % that
    # no configuration has (its end-to-end check then dropped every table).
    MIN_CALLS = 2
    MAX_CALLS = 16
    SAMPLE_S = 0.01

    def prepare(self, knobs: dict) -> Callable[[], dict[str, float]]:
        """Verify the configuration against the reference, then return a timer of one sample."""
        check_close(self.op.run(self._args, **knobs), self._ref, self.op.atol, self.op.rtol)
        run, cycle, least, most, span = self.op.run, self._cycle, self.MIN_CALLS, self.MAX_CALLS, self.SAMPLE_S

        def timed() -> dict[str, float]:
            collecting = gc.isenabled()
            gc.disable()
            try:
                best, n, t0 = math.inf, 0, time.perf_counter()
                while n < least or (n < most and time.perf_counter() - t0 < span):
                    args = cycle[self._turn % len(cycle)]
                    self._turn += 1
                    t = time.perf_counter()
                    run(args, **knobs)
                    best, n = min(best, time.perf_counter() - t), n + 1
            finally:
                if collecting:
                    gc.enable()
            return {"time_s": best}

        return timed


def estimated_seconds(op: KernelOp, fmt: str, bucket: dict, read_bw: float = 20e9, peak: float = 200e9) -> float:
    """A rough time of one call from the op's work (bytes at `read_bw`, flops at `peak`): what the
    kernel tier weighs its studies' budgets by."""
    work = op.work(bucket, fmt) if op.work else {}
    return work.get("bytes", 0) / read_bw + work.get("flops", 0) / peak


def study_budgets(ops: list[KernelOp], total_s: float, floor_s: float = 1.0) -> dict[tuple, float]:
    """Split `total_s` over every (op, format, bucket) study in proportion to the square root of its
    estimated call time (a slow call needs more time per trial and matters more to a step), each
    at least `floor_s` when the total allows."""
    keys = [(op.name, f, bucket_key(b), estimated_seconds(op, f, b)) for op in ops for f in op.formats
            for b in op.buckets]
    if not keys:
        return {}
    floor = min(floor_s, total_s / len(keys))
    weights = [math.sqrt(max(est, 1e-6)) for *_, est in keys]
    rest = total_s - floor * len(keys)
    return {k[:3]: floor + rest * w / sum(weights) for k, w in zip(keys, weights)}


def tune_op(op: KernelOp, cfg: TuneConfig, storage: str | None = None, formats=None,
            on_result: Callable | None = None, budgets: dict | None = None) -> list[dict]:
    """Tune every format (or those of `formats`) × bucket of `op`; returns its table rows
    {format, bucket..., knobs...}; `on_result(fmt, bucket, result, tuner)` sees each study's end.
    budgets: (op name, format, bucket key) → seconds for that study (else cfg's budget each)."""
    import dataclasses

    rows = []
    for fmt in [f for f in op.formats if not formats or f in formats]:
        # each study's second seed (after the defaults) is the knob set kept by the bucket before it (the next
        # smaller token count): what a machine prefers, a prefetch hint say, often holds across buckets, and
        # a study of a few trials rarely finds it again by chance (Zen 5, session 18: the 64-token MoE bucket)
        before: dict | None = None
        for bucket in op.buckets:
            obj = KernelObjective(op, fmt, bucket)
            if budgets is not None:
                cfg = dataclasses.replace(cfg, time_budget_s=budgets[(op.name, fmt, bucket_key(bucket))])
            space = SearchSpace.from_catalogue(list(op.knobs), catalogue=op.catalogue, exclude_components=())
            tuner = Tuner(space, obj, cfg, storage, suite="kernels-autotune",
                          study_name=f"kernel-{op.name}-{fmt}-{bucket_key(bucket)}", prior=before,
                          prior_label="previous bucket")
            result = tuner.run()
            if result.interrupted:
                raise KeyboardInterrupt
            if on_result:
                on_result(fmt, bucket, result, tuner)
            rows.append({"format": fmt, **bucket, **(result.knobs or tuner.defaults)})
            before = result.knobs or None
    return rows


def lookup(table: list[dict], fmt: str, knob_names, **bucket) -> dict:
    """The knobs of the row with `fmt` nearest to `bucket` ({} when the table has no such format)."""
    rows = [r for r in table if r.get("format") == fmt]
    if not rows:
        return {}

    def distance(r: dict) -> float:
        return sum(abs(math.log2(max(1, r.get(k, v))) - math.log2(max(1, v))) for k, v in bucket.items())

    best = min(rows, key=distance)
    return {k: best[k] for k in knob_names if k in best}
