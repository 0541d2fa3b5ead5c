"""The KTransformers baseline: kt-kernel's CPU fused MoE against ours, same shapes, weights, inputs.

    python -m suites.baselines.ktkernel --shape v3 --experts 64 --format int8 --tokens 1,4 --repeats 5

kt-kernel 0.7.2 pins torch 2.9.1 (a CUDA build of several GB) but its compiled library links
neither torch nor CUDA, so it is installed with `--no-deps` into its own numpy-only virtualenv
under the moetune cache (`ensure_kt_venv`) and driven through suites/baselines/kt_worker.py.
Both sides build their weights and inputs with kt_worker.random_experts / random_inputs, so they
are bit-identical BF16; each quantizes to its own INT8 / INT4 layout (ours: kernels/formats.py).

Format pairs (ours ↔ kt-kernel class): bf16 ↔ AMXBF16_MOE, int8 ↔ AMXInt8_MOE, int4 ↔ AMXInt4_MOE.
The AMX-named classes fall back to AVX-512 code on CPUs without AMX. On a CPU without AVX-512 kt-kernel
loads its avx2 variant, which has other classes: bf16 ↔ AVX2BF16_MOE, and no INT8 or symmetric INT4
group MoE (a clear error names what it has).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from suites.baselines.client import BaselineError, Worker, WorkerOwner

KT_VERSION = "0.7.2"
WORKER = Path(__file__).resolve().parent / "kt_worker.py"
METHODS = {"bf16": "AMXBF16_MOE", "int8": "AMXInt8_MOE", "int4": "AMXInt4_MOE"}
METHODS_AVX2 = {"bf16": "AVX2BF16_MOE"}  # kt-kernel's avx2 variant (checked on 0.7.2 on AMD Zen 3)
SHAPES = {  # (hidden D, moe intermediate I, top-k)
    "v3": (7168, 2048, 8),  # DeepSeek-V3 / R1 routed experts
    "small": (2048, 1408, 6),  # the `small` preset
    "tiny": (256, 256, 2),  # tests
}


def kt_venv() -> Path:
    """kt-kernel's own virtualenv: $MOETUNE_KT_VENV, else in the moetune cache."""
    if os.environ.get("MOETUNE_KT_VENV"):
        return Path(os.environ["MOETUNE_KT_VENV"])
    from engine.weights.presets import cache_root

    return cache_root() / f"kt-venv-{KT_VERSION}"


def kt_python() -> Path:
    return kt_venv() / "bin" / "python"


def ensure_kt_venv(progress: bool = True) -> Path:
    """The worker's interpreter; the virtualenv is made first if missing (numpy + kt-kernel, no torch)."""
    py = kt_python()
    if py.is_file() and (kt_venv() / ".complete").is_file():
        return py
    venv = kt_venv()
    steps = [[sys.executable, "-m", "venv", "--clear", str(venv)],
             [str(py), "-m", "pip", "install", "-q", "numpy"],
             [str(py), "-m", "pip", "install", "-q", "--no-deps", f"kt-kernel=={KT_VERSION}"]]
    for cmd in steps:
        if progress:
            print(f"kt-kernel venv: {' '.join(cmd[-3:])}", file=sys.stderr)
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode:
            tail = " | ".join((r.stderr or r.stdout).strip().splitlines()[-3:])
            raise BaselineError(f"could not make the kt-kernel virtualenv ({' '.join(cmd[-2:])}): {tail}")
    (venv / ".complete").write_text(f"kt-kernel {KT_VERSION}\n")
    return py


class KtKernel(WorkerOwner):
    """A kt-kernel worker with one MoE layer loaded."""

    engine = "kt-kernel"

    def __init__(self, threads: int, python: Path | None = None, variant: str | None = None, timeout_s: float = 1800):
        self.worker = Worker([str(python or ensure_kt_venv()), str(WORKER)], "kt-kernel", timeout_s=timeout_s)
        try:
            self.info = self.worker.call("info")
            self.setup = self.worker.call("setup", threads=threads, variant=variant)
        except BaselineError:
            self.worker.close()
            raise

    def load(self, fmt: str, experts: int, shape: tuple[int, int, int], seed: int, max_len: int) -> dict:
        if fmt not in METHODS:
            raise BaselineError(f"kt-kernel has no counterpart for format {fmt!r} (known: {', '.join(METHODS)})")
        methods = METHODS_AVX2 if self.setup.get("loaded") == "avx2" else METHODS
        if fmt not in methods:
            raise BaselineError(f"kt-kernel's {self.setup.get('loaded')} build here has no {fmt} MoE class "
                                f"(it has {', '.join(self.setup.get('classes', []))})")
        D, I, K = shape
        max_len = -(-max(max_len, 1) // 64) * 64  # its INT8/INT4 buffers need a multiple of their M step
        return self.worker.call("load", method=methods[fmt], experts=experts, topk=K, hidden=D, inter=I,
                                seed=seed, max_len=max_len)

    def forward(self, tokens: int, seed: int, repeats: int, warmup: int = 1) -> dict:
        return self.worker.call("forward", tokens=tokens, seed=seed, repeats=repeats, warmup=warmup)



# ------------------------------------------------------------------ our side


def our_layer(fmt: str, experts: int, shape: tuple[int, int, int], seed: int, backend=None):
    """(w13, w2) in our formats from the same BF16 bits kt-kernel gets; quantized expert by expert
    (a float32 copy of a whole V3-sized stack would not fit beside kt-kernel's), then prepared for
    `backend` once, as the engine prepares its weights at load (the cpu backend's INT8 row sums:
    computed per call on an unprepared 2.8 GB stack, they made the layer take seconds)."""
    import dataclasses

    import torch

    from kernels.formats import DenseWeight, quantize_int4_group, quantize_int8_channel
    from suites.baselines.kt_worker import random_experts

    quant = {"bf16": DenseWeight, "int8": quantize_int8_channel, "int4": quantize_int4_group}.get(fmt)
    if quant is None:
        raise BaselineError(f"unknown format {fmt!r}")
    D, I, _ = shape
    gate, up, down = random_experts(experts, D, I, seed)
    as_bf16 = lambda a: torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)  # noqa: E731

    def stacked(parts):
        return type(parts[0])(**{f.name: torch.stack([getattr(p, f.name) for p in parts])
                                 if isinstance(getattr(parts[0], f.name), torch.Tensor) else getattr(parts[0], f.name)
                                 for f in dataclasses.fields(parts[0])})

    w13 = stacked([quant(torch.cat([as_bf16(gate[e]), as_bf16(up[e])]).clone()) for e in range(experts)])
    del gate, up
    w2 = stacked([quant(as_bf16(down[e]).clone()) for e in range(experts)])
    prepare = getattr(backend, "prepare", None)
    return (prepare(w13), prepare(w2)) if prepare else (w13, w2)


def our_inputs(experts: int, shape: tuple[int, int, int], tokens: int, seed: int):
    import torch

    from suites.baselines.kt_worker import random_inputs

    D, _, K = shape
    x, ids, wts = random_inputs(experts, K, D, tokens, seed)
    return (torch.from_numpy(x.view(np.int16)).view(torch.bfloat16), torch.from_numpy(wts), torch.from_numpy(ids))


def time_ours(backend, w13, w2, x, wts, ids, repeats: int, warmup: int = 1) -> tuple[list[float], "np.ndarray"]:
    times = []
    for i in range(warmup + repeats):
        t0 = time.perf_counter()
        y = backend.fused_moe(x, w13, w2, wts, ids)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times, y.float().numpy()


def relative_error(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def main(argv=None) -> int:
    import statistics

    import kernels

    ap = argparse.ArgumentParser(prog="python -m suites.baselines.ktkernel", description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="v3", choices=sorted(SHAPES))
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--format", default="int8", choices=sorted(METHODS))
    ap.add_argument("--tokens", default="1,4")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--variant", default=None, help="kt-kernel extension variant (default: its own detection)")
    ap.add_argument("--setup", action="store_true", help="only make kt-kernel's virtualenv (the set-up step)")
    args = ap.parse_args(argv)
    if args.setup:
        try:
            print(f"kt-kernel {KT_VERSION}: {ensure_kt_venv()}")
        except BaselineError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        return 0
    tokens = [int(t) for t in args.tokens.split(",")]
    shape = SHAPES[args.shape]
    backend = kernels.get_backend(args.backend)
    w13, w2 = our_layer(args.format, args.experts, shape, seed=0, backend=backend)
    with KtKernel(args.threads, variant=args.variant) as kt:
        load = kt.load(args.format, args.experts, shape, seed=0, max_len=max(tokens))
        print(json.dumps({"kt": kt.setup | load}), flush=True)
        for t in tokens:
            x, wts, ids = our_inputs(args.experts, shape, t, seed=t)
            ours, y = time_ours(backend, w13, w2, x, wts, ids, args.repeats)
            theirs = kt.forward(t, seed=t, repeats=args.repeats)
            err = relative_error(y, np.asarray(theirs["output"])) if theirs["output"] is not None else None
            print(json.dumps({"tokens": t, "ours_ms": statistics.median(ours) * 1e3,
                              "kt_ms": statistics.median(theirs["seconds"]) * 1e3, "rel_err_vs_kt": err}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
