"""GPU check of the Triton kernels: right on the GPU (bf16 and fp8), then timed against torch and the card.

    python3 -m suites.gpu_check --out DIR [--budget-s 420] [--commit SHA] [--quick]
    python3 -m suites.gpu_check --smoke --out DIR     # CPU, Triton interpreter, tiny shapes (CI)

One call, well under 8 minutes on an H200 (a deadline, --budget-s, skips what does not fit and says
so). Stages, in order, each row written as soon as its stage ends:
 1. ceilings: device-to-device copy bandwidth (bytes read + written) and the bf16 matmul rate
    (8192³, random data): every kernel is expressed against these two measured numbers;
 2. checks on the GPU against kernels.reference / kernels.fp8_act (float32 inside), relative
    Frobenius error ‖out − ref‖/‖ref‖: FP8 activation quantizer (bits), FP8 block GEMM, fused MoE
    (bf16 and fp8 experts; contiguous and masked layouts; experts with no tokens), MLA decode (bf16,
    shuffled block tables with holes), and the masked MoE captured in a CUDA graph and replayed;
 3. timings at the catalogue's default tiles, DeepSeek-V3 shapes (D 7168, I 2048, 256 experts, top-8;
    MLA R 512 + P 64, 8K context): each kernel against torch's own implementation of the same math
    (bf16 matmul / torch._scaled_mm, a per-expert torch loop, a gather + einsum attention) and against
    the ceilings (GB/s over the bytes that must move, TFLOP/s over the FLOPs);
 4. small tile sweeps (if time is left): the best tiles next to the defaults, for the knob catalogue.

Output in DIR: gpu_check.md (the table, also printed last) and parts/*.parquet (rows of suite
"gpu_check" in the results store's schema; knobs under their catalogue names; CSV if pyarrow is
missing). Timing: CUDA events around `inner` back-to-back calls (≥ ~1 ms per sample), median of
the samples after warm-up; decode-sized ops also through a CUDA graph replay.

Through this workplace's device tool (nothing to carry: the image has torch, Triton, pyarrow):
    run(command="PYTHONUNBUFFERED=1 python3 -m suites.gpu_check --out $OUT --commit <sha>", timeout_s=540)
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

if "--smoke" in sys.argv:  # must precede every triton.jit (read when the kernel modules load)
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

SUITE = "gpu_check"


# ---------------------------------------------------------------- shapes


@dataclass(frozen=True)
class Shapes:
    """Problem sizes: full DeepSeek-V3 on a GPU, or tiny ones for the interpreter smoke run."""

    moe_d: int = 7168
    moe_i: int = 2048
    moe_e: int = 256
    moe_k: int = 8
    decode_tokens: tuple = (1, 8, 64)
    prefill_tokens: tuple = (2048,)
    gemm: tuple = ((2048, 7168, 7168), (4096, 7168, 7168), (2048, 24576, 1536), (4096, 7168, 16384),
                   (64, 7168, 2048))
    mla_r: int = 512
    mla_p: int = 64
    mla_context: int = 8192
    mla_block: int = 64
    mla_batches: tuple = (1, 16, 64)
    mla_heads: tuple = (16, 128)
    copy_bytes: int = 4 << 30
    matmul_n: int = 8192
    check_gemm: tuple = ((1, 576, 7168), (37, 1536, 7168), (2048, 7168, 2048))
    check_moe_tokens: tuple = (1, 8, 200)
    check_mla_lens: tuple = (1, 1000, 8192)


SMOKE = Shapes(moe_d=256, moe_i=128, moe_e=8, moe_k=2, decode_tokens=(2,), prefill_tokens=(24,),
               gemm=((32, 128, 256),), mla_r=64, mla_p=16, mla_context=40, mla_block=4, mla_batches=(2,),
               mla_heads=(16,), copy_bytes=1 << 20, matmul_n=128, check_gemm=((3, 128, 256),),
               check_moe_tokens=(1, 12), check_mla_lens=(1, 9, 40))


# ---------------------------------------------------------------- rows and the table


@dataclass
class Result:
    kernel: str  # e.g. "fused_moe"
    variant: str  # "ours", "ours-graph", "torch-bf16", "ceiling", "check", ...
    dtype: str
    shape: dict
    metric: str = "time_s"
    samples: list = field(default_factory=list)
    value: float | None = None  # for metrics that are not times (rel_err, GB/s)
    knobs: dict = field(default_factory=dict)
    status: str = "ok"
    error: str | None = None
    extra: dict = field(default_factory=dict)

    @property
    def median(self) -> float:
        return self.value if self.value is not None else (statistics.median(self.samples) if self.samples else math.nan)

    def row(self) -> dict:
        unit = {"time_s": "s", "rel_err": "", "copy_gbs": "GB/s", "bf16_tflops": "TFLOP/s"}.get(self.metric, "")
        direction = "maximize" if self.metric in ("copy_gbs", "bf16_tflops") else "minimize"
        row = {"suite": SUITE, "model": "deepseek-v3-shapes", "format": self.dtype, "metric": self.metric,
               "unit": unit, "direction": direction, "status": self.status, "error": self.error,
               "workload": {"op": self.kernel, "variant": self.variant, **self.shape},
               "knobs": self.knobs, "extra": self.extra, "samples": self.samples}
        if self.value is not None:
            row.update(median=self.value, p10=self.value, p90=self.value, p99=self.value, min=self.value,
                       max=self.value, repeats=1)
        return row


class Report:
    """Collects results, writes each stage's rows to DIR/parts, renders the markdown table."""

    def __init__(self, out: Path, run_meta: dict):
        self.out, self.meta, self.results, self._flushed = out, run_meta, [], 0
        self.ceilings: dict[str, float] = {}
        out.mkdir(parents=True, exist_ok=True)

    def add(self, r: Result) -> Result:
        self.results.append(r)
        msg = f"{r.kernel:>12s} {r.variant:<14s} {r.dtype:<5s} {_shape_str(r.shape):<34s} "
        msg += f"{r.metric}={r.median:.4g} {r.status}" + (f" ({r.error})" if r.error else "")
        print(msg, flush=True)
        return r

    def flush(self) -> None:
        rows = [r.row() for r in self.results[self._flushed:]]
        self._flushed = len(self.results)
        if not rows:
            return
        for row in rows:
            row["extra"] = {**row["extra"], **self.meta}
        try:
            from results.store import append_rows

            defaults = {"commit": self.meta.get("commit")} if self.meta.get("commit") else {}
            append_rows([{**r, **defaults} for r in rows], SUITE, run_id=self.meta["run_id"], directory=self.out)
        except ImportError:  # no pyarrow: CSV beside
            _append_csv(self.out / "gpu_check.csv", rows)

    def table(self) -> str:
        lines = [f"# GPU check — {self.meta.get('device', '?')}", "",
                 f"torch {self.meta.get('torch')}, triton {self.meta.get('triton')}, commit "
                 f"{self.meta.get('commit', '?')}; ceilings: copy {self.ceilings.get('copy_gbs', math.nan):.0f} GB/s, "
                 f"bf16 matmul {self.ceilings.get('bf16_tflops', math.nan):.0f} TFLOP/s", "",
                 "| kernel | variant | dtype | shape | median µs | vs torch | GB/s | % copy | TFLOP/s | % mm "
                 "| check |",
                 "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in self.results:
            if r.metric not in ("copy_gbs", "bf16_tflops"):  # in the header; their timing rows follow
                lines.append(_table_line(r))
        return "\n".join(lines + self._best_tiles()) + "\n"

    def _best_tiles(self) -> list[str]:
        """Per kernel × dtype × shape timed with several tile sets: the fastest, for the catalogue."""
        groups: dict[tuple, list[Result]] = {}
        for r in self.results:
            if r.metric == "time_s" and r.status == "ok" and r.knobs:
                graph = r.variant.endswith("-graph")
                groups.setdefault((r.kernel, r.dtype, _shape_str(r.shape), graph), []).append(r)
        lines = []
        for (kernel, dtype, shape, graph), rows in groups.items():
            if len(rows) > 1:
                best = min(rows, key=lambda r: r.median)
                default = next((r for r in rows if not r.variant.startswith("ours-sweep")), None)
                gain = f", {default.median / best.median:.2f}× the defaults" if default else ""
                knobs = " ".join(f"{k}={v}" for k, v in best.knobs.items())
                lines.append(f"- {kernel} {dtype} {shape}{' (graph)' if graph else ''}: "
                             f"{best.median * 1e6:.1f} µs{gain} with {knobs}")
        return ["", "## Fastest tiles found", ""] + lines if lines else []


def _shape_str(shape: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in shape.items())


def _fmt(v, spec: str) -> str:
    return "" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def _table_line(r: Result) -> str:
    e = r.extra
    if r.metric == "time_s":
        t = _fmt(r.median * 1e6, ".1f") if r.status == "ok" else r.status
        cells = [t, _fmt(e.get("speedup_vs_torch"), ".2f") + ("×" if e.get("speedup_vs_torch") else ""),
                 _fmt(e.get("gbs"), ".0f"), _fmt(e.get("pct_copy"), ".0f"), _fmt(e.get("tflops"), ".1f"),
                 _fmt(e.get("pct_mm"), ".0f"), ""]
    elif r.metric == "rel_err":
        cells = ["", "", "", "", "", "", f"{r.status} (rel {r.median:.2e}, tol {e.get('tol', '?')})"]
    else:
        cells = ["", "", _fmt(r.median, ".0f") if r.metric == "copy_gbs" else "", "",
                 _fmt(r.median, ".1f") if r.metric == "bf16_tflops" else "", "", ""]
    return "| " + " | ".join([r.kernel, r.variant, r.dtype, _shape_str(r.shape)] + cells) + " |"


def _append_csv(path: Path, rows: list[dict]) -> None:
    import csv

    new = not path.exists()
    cols = ["suite", "format", "metric", "status", "error", "median", "workload", "knobs", "extra", "samples"]
    with open(path, "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore")
        if new:
            w.writeheader()
        for row in rows:
            med = row.get("median", statistics.median(row["samples"]) if row["samples"] else math.nan)
            w.writerow({**{k: json.dumps(row[k], default=str) if k in ("workload", "knobs", "extra", "samples")
                           else row.get(k) for k in cols}, "median": med})


# ---------------------------------------------------------------- timing


class Clock:
    """Times a callable: CUDA events on a GPU, perf_counter on the CPU (smoke runs)."""

    def __init__(self, device: torch.device, reps: int, warmup: int):
        self.device, self.reps, self.warmup = device, reps, warmup

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def _once(self, fn: Callable, inner: int) -> float:
        if self.device.type != "cuda":
            t = time.perf_counter()
            for _ in range(inner):
                fn()
            return (time.perf_counter() - t) / inner
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / inner

    def samples(self, fn: Callable) -> list[float]:
        """Per-call seconds: warm-up, then `reps` samples of `inner` calls (≥ ~1 ms per sample)."""
        for _ in range(self.warmup):
            fn()
        self.sync()
        first = self._once(fn, 1)
        inner = max(1, min(200, int(1e-3 / max(first, 1e-7)))) if self.device.type == "cuda" else 1
        return [self._once(fn, inner) for _ in range(self.reps)]

    def graph_samples(self, fn: Callable) -> list[float]:
        """The same, replaying `fn` captured in a CUDA graph (launch gaps gone, as decode runs)."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return self.samples(graph.replay)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    o, r = out.double(), ref.double()
    if not torch.isfinite(o).all():
        return math.inf
    return ((o - r).norm() / r.norm().clamp_min(1e-30)).item()


# ---------------------------------------------------------------- the run


class Run:
    """State shared by the stages: device, clock, report, tiles, deadline, shapes."""

    def __init__(self, args, device: torch.device, shapes: Shapes, report: Report):
        from engine.knobs import CATALOGUE
        from kernels.cuda.tiles import CudaTiles

        self.args, self.device, self.shapes, self.report = args, device, shapes, report
        self.clock = Clock(device, reps=1 if args.smoke else (5 if args.quick else 10), warmup=0 if args.smoke else 3)
        self.knobs = {n: k.default for n, k in CATALOGUE.items() if k.component == "kernels/cuda"}
        self.tiles = CudaTiles.from_knobs(self.knobs)
        self.deadline = time.monotonic() + args.budget_s
        self.gen = torch.Generator(device=device).manual_seed(0)

    def time_left(self) -> float:
        return self.deadline - time.monotonic()

    def randn(self, *shape, dtype=torch.bfloat16, scale: float = 1.0) -> torch.Tensor:
        """Normal values × scale, drawn in `dtype` itself (no float32 copy of a 15 GB weight)."""
        return torch.randn(*shape, generator=self.gen, device=self.device, dtype=dtype).mul_(scale)

    def guarded(self, kernel: str, variant: str, dtype: str, shape: dict, fn: Callable[[], Result]) -> Result | None:
        """Run one measurement; a failure (compile error, out of resources, OOM) becomes a row."""
        if self.time_left() < 0:
            return self.report.add(Result(kernel, variant, dtype, shape, status="timeout",
                                          error="skipped: over the time budget"))
        try:
            return self.report.add(fn())
        except Exception as e:  # noqa: BLE001 - recorded, never a crash
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            return self.report.add(Result(kernel, variant, dtype, shape, status="failed",
                                          error=_one_line(e)))

    def timed(self, kernel: str, variant: str, dtype: str, shape: dict, fn: Callable, *, nbytes: int = 0,
              flops: int = 0, knobs: dict | None = None, graph: bool = False, torch_s: float | None = None) -> Result:
        """A timing row with GB/s and TFLOP/s against the measured ceilings."""
        samples = self.clock.graph_samples(fn) if graph else self.clock.samples(fn)
        med = statistics.median(samples)
        extra = {}
        c = self.report.ceilings
        if nbytes:
            extra["bytes"] = nbytes
            extra["gbs"] = nbytes / med / 1e9
            if c.get("copy_gbs"):
                extra["pct_copy"] = 100 * extra["gbs"] / c["copy_gbs"]
        if flops:
            extra["flops"] = flops
            extra["tflops"] = flops / med / 1e12
            if c.get("bf16_tflops"):
                extra["pct_mm"] = 100 * extra["tflops"] / c["bf16_tflops"]
        if torch_s and not math.isnan(torch_s):
            extra["speedup_vs_torch"] = torch_s / med
        return Result(kernel, variant, dtype, shape, samples=samples, knobs=knobs or {}, extra=extra)

    def check(self, kernel: str, dtype: str, shape: dict, out: torch.Tensor, ref: torch.Tensor, tol: float,
              variant: str = "check") -> Result:
        err = rel_err(out, ref)
        return Result(kernel, variant, dtype, shape, metric="rel_err", value=err,
                      status="ok" if err <= tol else "wrong", extra={"tol": tol})


def _one_line(e: Exception) -> str:
    text = str(e).splitlines()[0][:200] if str(e) else ""
    return f"{type(e).__name__}: {text}"


def _meta(args, device: torch.device) -> dict:
    import uuid

    meta = {"run_id": time.strftime("%Y%m%dT%H%M%S") + "-" + uuid.uuid4().hex[:6], "torch": torch.__version__}
    try:
        import triton

        meta["triton"] = triton.__version__
    except ImportError:
        meta["triton"] = "missing"
    meta["device"] = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (Triton interpreter)"
    if args.commit:
        meta["commit"] = args.commit
    else:
        from engine.fingerprint import _commit

        if _commit() != "unknown":
            meta["commit"] = _commit()
    return meta


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m suites.gpu_check", description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or "gpu_check_out", help="output folder (default $OUT)")
    ap.add_argument("--budget-s", type=float, default=420.0, help="stop starting new measurements after this")
    ap.add_argument("--commit", default=None, help="the commit measured (the device copy has no .git)")
    ap.add_argument("--quick", action="store_true", help="fewer repeats, no sweeps")
    ap.add_argument("--smoke", action="store_true", help="CPU + Triton interpreter, tiny shapes (tests the script)")
    args = ap.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        print("gpu_check: no CUDA device (use --smoke to exercise the script on a CPU)", file=sys.stderr)
        return 2
    device = torch.device("cpu" if args.smoke else "cuda")
    report = Report(Path(args.out), _meta(args, device))
    run = Run(args, device, SMOKE if args.smoke else Shapes(), report)
    from suites import gpu_check_stages as stages

    t0 = time.monotonic()
    for stage in (stages.ceilings, stages.checks, stages.timings, stages.sweeps):
        if stage is stages.sweeps and (args.quick or args.smoke):
            continue
        print(f"== {stage.__name__} (t={time.monotonic() - t0:.0f}s)", flush=True)
        stage(run)
        report.flush()
    text = report.table()
    (Path(args.out) / "gpu_check.md").write_text(text)
    print(text)
    bad = [r for r in report.results if r.metric == "rel_err" and r.status != "ok"]
    print(f"gpu_check: {len(report.results)} rows, {len(bad)} failed checks, {time.monotonic() - t0:.0f}s")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
