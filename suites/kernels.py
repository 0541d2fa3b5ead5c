"""Kernel suite: each op × weight format of the "cpu" backend on real layer shapes, side by side
with torch on the same math, as fractions of the machine's measured limits (tuner.probe).

    moetune bench kernels [--op fused_moe|linear] [--format bf16|int8|fp8|int4] [--tokens N ...]
                          [--shapes small|v3|all] [--repeats 10] [--experts-v3 32] [--json]

Shapes: the `small` preset's (D=2048, I=1408, E=64, top-6; dense gate_up [11264, 2048], LM head
[32000, 2048]) and DeepSeek-V3's (D=7168, I=2048, top-8, --experts-v3 of its 256 experts;
o_proj [7168, 16384]). Weights are random values made directly in each format (no quantizer run).
For fused MoE every repeat routes to other experts (a cycle of 8 routings), so weights come from
DRAM as in decode, and the bytes counted are those of the experts each call touches.

Each case: 2 warm-ups, then `repeats` rounds alternating ours and torch's (F.linear per expert on
weights dequantized to bfloat16 beforehand, bf16 activations); median and p10/p90 of each.
gbps = weight bytes touched / median; fraction_of_read_bw = gbps / the probe's read bandwidth;
for T ≥ 64 also GFLOP/s and fraction_of_peak (FP32 FMA peak). Rows go to the Parquet store
(results.store, suite "kernels").
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels import formats

FORMATS = ("bf16", "int8", "fp8", "int4")
TOKENS = (1, 2, 4, 8, 16, 64, 512)
ROUTINGS = 8
INT4_GROUP = 128


@dataclass(frozen=True)
class MoeShape:
    name: str
    d: int
    i: int
    e: int
    k: int


@dataclass(frozen=True)
class LinearShape:
    name: str
    n: int
    k: int


def moe_shapes(which: str, experts_v3: int) -> list[MoeShape]:
    shapes = {"small": [MoeShape("small.moe", 2048, 1408, 64, 6)],
              "v3": [MoeShape("v3.moe", 7168, 2048, experts_v3, 8)]}
    return shapes["small"] + shapes["v3"] if which == "all" else shapes[which]


def linear_shapes(which: str) -> list[LinearShape]:
    shapes = {"small": [LinearShape("small.ffn_gate_up", 11264, 2048), LinearShape("small.lm_head", 32000, 2048)],
              "v3": [LinearShape("v3.o_proj", 7168, 16384)]}
    return shapes["small"] + shapes["v3"] if which == "all" else shapes[which]


# ---------------------------------------------------------------- random weights in each format


def random_weight(shape: tuple[int, ...], fmt: str, g: torch.Generator):
    """A weight of logical shape [..., N, K] with random values stored directly in `fmt`."""
    *lead, n, k = shape
    if fmt == "bf16":
        return formats.DenseWeight((torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16))
    if fmt == "int8":
        w = torch.randint(-127, 128, shape, generator=g, dtype=torch.int8)
        return formats.Int8ChannelWeight(w, torch.rand(*lead, n, generator=g) * 1e-3 + 1e-4)
    if fmt == "fp8":
        mag = torch.randint(0, 0x7F, shape, generator=g, dtype=torch.uint8)  # 0x7F would be NaN
        sign = torch.randint(0, 2, shape, generator=g, dtype=torch.uint8) << 7
        scale = torch.rand(*lead, -(-n // 128), -(-k // 128), generator=g) * 1e-3 + 1e-4
        return formats.Fp8BlockWeight((mag | sign).view(torch.float8_e4m3fn), scale, (128, 128))
    kp = -(-k // INT4_GROUP) * INT4_GROUP
    packed = torch.randint(0, 256, (*lead, n, kp // 2), generator=g, dtype=torch.uint8)
    scale = torch.rand(*lead, n, kp // INT4_GROUP, generator=g) * 1e-2
    return formats.Int4GroupWeight(packed, scale, torch.full_like(scale, 8.0), k, INT4_GROUP)


def expert_bytes(w13, w2) -> float:
    return (w13.nbytes + w2.nbytes) / w13.shape[0]


# ---------------------------------------------------------------- timing


def _time(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def alternate(ours, theirs, repeats: int) -> tuple[list[float], list[float]]:
    """2 warm-ups each, then `repeats` rounds of (ours, theirs); each call gets the round index."""
    for r in range(2):
        ours(r)
        theirs(r)
    a, b = [], []
    for r in range(repeats):
        a.append(_time(lambda: ours(r)))
        b.append(_time(lambda: theirs(r)))
    return a, b


def summary(samples: list[float]) -> dict:
    q = statistics.quantiles(samples, n=10) if len(samples) > 1 else [samples[0]] * 9
    return {"median_s": statistics.median(samples), "p10_s": q[0], "p90_s": q[-1]}


# ---------------------------------------------------------------- cases


def bench_moe(shape: MoeShape, fmt: str, t: int, repeats: int, g: torch.Generator) -> dict:
    import kernels.cpu as cpu

    w13 = random_weight((shape.e, 2 * shape.i, shape.d), fmt, g)
    w2 = random_weight((shape.e, shape.d, shape.i), fmt, g)
    p13, p2 = cpu.prepare(w13), cpu.prepare(w2)
    x = (torch.randn(t, shape.d, generator=g)).to(torch.bfloat16)
    routes = [(torch.softmax(torch.randn(t, shape.k, generator=g), -1),
               torch.stack([torch.randperm(shape.e, generator=g)[:shape.k] for _ in range(t)]))
              for _ in range(ROUTINGS)]
    touched = statistics.mean(len(ids.unique()) for _, ids in routes)
    deq: dict[int, tuple] = {}

    def torch_moe(r: int) -> torch.Tensor:
        tw, ids = routes[r % ROUTINGS]
        out = torch.zeros(t, shape.d, dtype=torch.float32)
        for e in ids.unique().tolist():
            if e not in deq:
                deq[e] = (w13[e].dequantize(torch.bfloat16), w2[e].dequantize(torch.bfloat16))
            tok, slot = (ids == e).nonzero(as_tuple=True)
            gu = F.linear(x[tok], deq[e][0])
            h = F.silu(gu[:, :shape.i]) * gu[:, shape.i:]
            out.index_add_(0, tok, F.linear(h, deq[e][1]).float() * tw[tok, slot, None])
        return out.to(torch.bfloat16)

    for e in range(shape.e):  # dequantize outside the timed region
        deq[e] = (w13[e].dequantize(torch.bfloat16), w2[e].dequantize(torch.bfloat16))
    ours, theirs = alternate(lambda r: cpu.fused_moe(x, p13, p2, *routes[r % ROUTINGS]), torch_moe, repeats)
    flops = 2 * t * shape.k * 3 * shape.i * shape.d
    return _row("fused_moe", fmt, t, f"{shape.name} D={shape.d} I={shape.i} E={shape.e} top-{shape.k}",
                ours, theirs, touched * expert_bytes(w13, w2), flops)


def bench_linear(shape: LinearShape, fmt: str, t: int, repeats: int, g: torch.Generator) -> dict:
    import kernels.cpu as cpu

    w = random_weight((shape.n, shape.k), fmt, g)
    p = cpu.prepare(w)
    wd = w.dequantize(torch.bfloat16)
    x = torch.randn(t, shape.k, generator=g).to(torch.bfloat16)
    ours, theirs = alternate(lambda r: cpu.linear(x, p), lambda r: F.linear(x, wd), repeats)
    return _row("linear", fmt, t, f"{shape.name} [{shape.n}, {shape.k}]", ours, theirs, w.nbytes,
                2 * t * shape.n * shape.k)


def _row(op, fmt, t, shape, ours, theirs, nbytes, flops) -> dict:
    from tuner.probe import probe

    limits = probe()
    s = summary(ours)
    gbps = nbytes / s["median_s"] / 1e9
    row = {"op": op, "format": fmt, "tokens": t, "shape": shape, **s, "gbps": gbps,
           "fraction_of_read_bw": gbps / limits["read_gbps"], "torch_median_s": statistics.median(theirs),
           "speedup_vs_torch": statistics.median(theirs) / s["median_s"],
           "gflops": flops / s["median_s"] / 1e9, "weight_bytes": nbytes, "samples": ours, "torch_samples": theirs}
    row["fraction_of_peak_flops"] = row["gflops"] / limits["fp32_fma_gflops"]
    return row


# ---------------------------------------------------------------- the run


def cases(ops, fmts, tokens, which: str, experts_v3: int):
    for op in ops:
        shapes = moe_shapes(which, experts_v3) if op == "fused_moe" else linear_shapes(which)
        for shape in shapes:
            for fmt in fmts:
                for t in tokens:
                    yield op, shape, fmt, t


def run(ops, fmts, tokens, which="small", experts_v3=32, repeats=10, store=True, out=sys.stdout, as_json=False):
    import kernels.cpu as cpu
    from tqdm import tqdm

    todo = list(cases(ops, fmts, tokens, which, experts_v3))
    rows = []
    g = torch.Generator().manual_seed(0)
    for op, shape, fmt, t in tqdm(todo, desc="kernel suite", leave=False, disable=as_json):
        bench = bench_moe if op == "fused_moe" else bench_linear
        row = bench(shape, fmt, t, repeats, g)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if not k.endswith("samples")}) if as_json else _line(row),
              file=out, flush=True)
    if store:
        _store(rows, dict(cpu._knobs))
    return rows


def _line(r: dict) -> str:
    return (f"{r['op']:9s} {r['format']:5s} T={r['tokens']:<4d} {r['shape']:42s} {r['median_s'] * 1e3:9.3f} ms "
            f"[{r['p10_s'] * 1e3:.3f}–{r['p90_s'] * 1e3:.3f}] {r['gbps']:6.2f} GB/s "
            f"{r['fraction_of_read_bw'] * 100:5.1f}% bw {r['gflops']:7.1f} GFLOP/s  torch {r['torch_median_s'] * 1e3:9.3f} ms "
            f"(×{r['speedup_vs_torch']:.2f})")


def _store(rows: list[dict], knobs: dict) -> None:
    from results.store import append_rows

    append_rows([{"model": r["shape"].split(" ")[0].split(".")[0], "format": r["format"],
                  "workload": {"op": r["op"], "shape": r["shape"], "tokens": r["tokens"]},
                  "knobs": knobs, "metric": "kernel_seconds", "unit": "s", "direction": "minimize",
                  "samples": r["samples"],
                  "extra": {k: r[k] for k in ("gbps", "fraction_of_read_bw", "torch_median_s", "speedup_vs_torch",
                                              "gflops", "fraction_of_peak_flops", "weight_bytes")}}
                 for r in rows], suite="kernels")


# ---------------------------------------------------------------- CLI


def add_parser(sub) -> None:
    """`moetune bench kernels ...` (engine/cli.py calls this)."""
    b = sub.add_parser("bench", help="benchmark suites")
    bs = b.add_subparsers(dest="suite", required=True)
    k = bs.add_parser("kernels", help="the cpu kernels vs torch, as fractions of this machine's limits")
    k.add_argument("--op", action="append", choices=["fused_moe", "linear"], help="(repeatable; default both)")
    k.add_argument("--format", action="append", choices=list(FORMATS), help="(repeatable; default all)")
    k.add_argument("--tokens", action="append", type=int, help=f"(repeatable; default {list(TOKENS)})")
    k.add_argument("--shapes", default="small", choices=["small", "v3", "all"])
    k.add_argument("--experts-v3", type=int, default=32, help="DeepSeek-V3 experts allocated (of 256)")
    k.add_argument("--repeats", type=int, default=10)
    k.add_argument("--knob", action="append", metavar="NAME=VALUE", help="override a cpu_* knob")
    k.add_argument("--no-store", action="store_true", help="do not append the rows to the result store")
    k.add_argument("--json", action="store_true", help="one JSON object per line")
    k.set_defaults(func=run_cli)


def run_cli(args) -> int:
    from engine.errors import MoetuneError
    from engine.knobs import resolve_knobs

    if args.repeats < 1 or any(t < 1 for t in args.tokens or []):
        raise MoetuneError("--repeats and --tokens must be ≥ 1")
    overrides = dict(kv.split("=", 1) for kv in args.knob or [])
    knobs = resolve_knobs(overrides)
    if knobs["kernel_backend"] != "cpu" and "kernel_backend" not in overrides:
        raise MoetuneError("the cpu kernels cannot run on this machine (see the warning above)")
    import kernels.cpu as cpu

    cpu.configure(knobs)
    torch.set_num_threads(knobs["threads"])
    run(args.op or ["fused_moe", "linear"], args.format or list(FORMATS), args.tokens or list(TOKENS),
        args.shapes, args.experts_v3, args.repeats, store=not args.no_store, as_json=args.json)
    return 0
