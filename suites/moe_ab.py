"""Fused-MoE variants timed in alternation within one process: formats and knob settings side by side.

    python -m suites.moe_ab --shape small|v3 [--tokens 1] [--repeats 20] [--no-flush] VARIANT [VARIANT ...]
    python -m suites.moe_ab --linear N,K [--tokens 1] [--repeats 20] VARIANT [VARIANT ...]

A VARIANT is FORMAT or FORMAT:KNOB=VALUE[,KNOB=VALUE...], e.g. `int8 fp8:cpu_fp8_method=vector int4`.
Round r calls every variant once, in order, each call on a routing of its own (the suite's routings ×
variants, in turn: no call routes to the experts of the call before it, which the last-level cache would
still hold, as the variants of one format share their weights; and, untimed before each call, a read of twice
the last-level cache from a buffer of its own (`--no-flush` leaves it out): a 480 MiB L3 (the AMX VM) holds
most of an INT4 `small` stack (311 MB) across the rounds, and without the read INT4 ran ×1.87 INT8's speed
where the kernel suite, which reads 1 GiB between calls, measured ×1.64 (session 43); a variant setting a load-time knob,
`cpu_huge_pages`, gets weights of its own prepared under it); after 2 warm-up rounds the
median and p10–p90 of each variant are printed with its GB/s (weight bytes of the experts touched)
and its speed relative to the first variant. On a shared machine the figures drift between runs,
but the variants of one run share the drift. That makes this the tool for ratios, such as FP8 vs
INT8 or one knob value vs another (docs/cpu_kernels.md). Nothing is stored.

--linear N,K times a linear of an [N, K] weight the same way instead: each variant's calls go round copies
of its weight, enough of them to be 4x the last-level cache, so no call finds its rows still cached.
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time

import torch

SHAPES = {"small": (2048, 1408, 64, 6), "v3": (7168, 2048, 64, 8)}  # D, I, experts allocated, top-k


def parse_variant(text: str) -> tuple[str, dict]:
    fmt, _, rest = text.partition(":")
    if fmt not in ("bf16", "int8", "fp8", "int4"):
        raise ValueError(f"variant {text!r}: format must be bf16, int8, fp8 or int4")
    knobs = {}
    for kv in filter(None, rest.split(",")):
        name, sep, value = kv.partition("=")
        if not sep:
            raise ValueError(f"variant {text!r}: expected KNOB=VALUE, got {kv!r}")
        knobs[name] = (int(value) if value.lstrip("-").isdigit()
                       else {"true": True, "false": False}.get(value.lower(), value))
    return fmt, knobs


def weight_key(fmt: str, knobs: dict) -> tuple:
    """Variants share one set of weights per format and load-time knob values (`cpu_huge_pages`: those
    act when `prepare()` copies a weight, so a variant setting one gets weights prepared under it)."""
    from kernels.cpu_knobs import LOAD_KNOBS

    return fmt, tuple(sorted((k, v) for k, v in knobs.items() if k in LOAD_KNOBS))


@contextlib.contextmanager
def load_knobs(cpu, values: dict):
    """`values` as the kernels' defaults while weights are prepared, the previous ones after."""
    before = {k: cpu._knobs[k] for k in values}
    cpu.configure(values)
    try:
        yield
    finally:
        cpu.configure(before)


def call_knobs(cpu, parsed: list[tuple[str, dict]]) -> list:
    """Each variant's per-call knobs as the C++ struct, built once (make_knobs leaves out the load-time ones, which
    acted at prepare()): a dict would be converted at every call (≈ 20 µs here), a constant that pulls every ratio
    towards 1."""
    return [cpu.make_knobs(knobs) for _, knobs in parsed]


def call_routing(r: int, j: int, variants: int) -> int:
    """The routing of round r's call of variant j, among ROUTINGS × variants: each call's own in turn, so
    consecutive calls never route to the same experts."""
    from suites.kernels import ROUTINGS

    return (r * variants + j) % (ROUTINGS * variants)


def flusher():
    """An untimed read of twice the last-level cache (at most 2 GiB), so that the next call finds none of its
    weights cached."""
    from suites.kernels import last_level_cache_bytes

    buf = torch.ones(min(2 * last_level_cache_bytes(), 2 << 30) // 4)
    return lambda: buf.sum()


def run(shape: str, tokens: int, repeats: int, variants: list[str], out=None, flush: bool = True) -> list[dict]:
    out = out or sys.stdout
    import kernels.cpu as cpu
    from suites.kernels import ROUTINGS, expert_bytes, random_routes, random_weight
    from engine.fingerprint import fingerprint

    d, i, e, k = SHAPES[shape]
    parsed = [parse_variant(v) for v in variants]
    g = torch.Generator().manual_seed(0)
    keys = [weight_key(fmt, knobs) for fmt, knobs in parsed]  # each variant's weights
    weights = {}
    for (fmt, _), key in zip(parsed, keys):
        if key not in weights:
            w13_src, w2_src = random_weight((e, 2 * i, d), fmt, g), random_weight((e, d, i), fmt, g)
            with load_knobs(cpu, dict(key[1])):
                w13, w2 = cpu.prepare(w13_src), cpu.prepare(w2_src)
            weights[key] = (w13, w2, expert_bytes(w13, w2))
    x = torch.randn(tokens, d, generator=g).to(torch.bfloat16)
    # ROUTINGS routings per variant, and no call on the routing of the call before it: variants of one
    # format share their weights, so a variant run right after another on the same experts would find
    # them in the last-level cache
    routes = random_routes(tokens, e, k, g, n=ROUTINGS * len(parsed))
    touched = statistics.mean(len(ids.unique()) for _, ids in routes)
    structs = call_knobs(cpu, parsed)

    def call(r: int, j: int) -> None:
        w13, w2, _ = weights[keys[j]]
        cpu.fused_moe(x, w13, w2, *routes[call_routing(r, j, len(parsed))], knobs=structs[j])

    times = alternate(call, len(parsed), repeats, before=flusher() if flush else None)
    print(f"machine {fingerprint().get('hardware_key', '?')}  {shape} D={d} I={i} E={e} top-{k}  T={tokens}"
          f"{'' if flush else '  (no flush: the last-level cache may hold experts)'}", file=out)
    return _report(variants, [touched * weights[key][2] for key in keys], times, out)


def run_linear(n: int, k: int, tokens: int, repeats: int, variants: list[str], out=None) -> list[dict]:
    out = out or sys.stdout
    import kernels.cpu as cpu
    from suites.kernels import last_level_cache_bytes, random_weight
    from engine.fingerprint import fingerprint

    parsed = [parse_variant(v) for v in variants]
    g = torch.Generator().manual_seed(0)
    keys = [weight_key(fmt, knobs) for fmt, knobs in parsed]
    copies: dict[tuple, list] = {}  # each variant's weight copies
    nbytes = {}
    for (fmt, _), key in zip(parsed, keys):
        if key not in copies:
            src = random_weight((n, k), fmt, g)
            nbytes[key] = src.nbytes
            count = max(2, -(-4 * last_level_cache_bytes() // max(1, src.nbytes)))
            with load_knobs(cpu, dict(key[1])):
                copies[key] = [cpu.prepare(src) for _ in range(count)]
    x = torch.randn(tokens, k, generator=g).to(torch.bfloat16)

    # each weight list's next copy per call, counted per list: variants that share one (the same format and
    # load knobs) never call the copy the call before them read (a 23 MB INT8 weight stays in a 32 MB L3)
    turn = dict.fromkeys(copies, 0)
    structs = call_knobs(cpu, parsed)

    def call(r: int, j: int) -> None:
        ws = copies[keys[j]]
        turn[keys[j]] += 1
        cpu.linear(x, ws[turn[keys[j]] % len(ws)], knobs=structs[j])

    times = alternate(call, len(parsed), repeats)
    print(f"machine {fingerprint().get('hardware_key', '?')}  linear [{n}, {k}]  T={tokens}", file=out)
    return _report(variants, [nbytes[key] for key in keys], times, out)


def alternate(call, variants: int, repeats: int, before=None) -> list[list[float]]:
    """Round r calls call(r, j) for every variant j in turn (`before()` untimed ahead of each); each call's
    seconds after 2 warm-up rounds."""
    times: list[list[float]] = [[] for _ in range(variants)]
    for r in range(repeats + 2):
        for j in range(variants):
            if before is not None:
                before()
            t0 = time.perf_counter()
            call(r, j)
            if r >= 2:
                times[j].append(time.perf_counter() - t0)
    return times


def _report(variants: list[str], nbytes: list[float], times: list[list[float]], out) -> list[dict]:
    base = statistics.median(times[0])
    rows = []
    for text, b, t in zip(variants, nbytes, times):
        med = statistics.median(t)
        q = statistics.quantiles(t, n=10) if len(t) > 1 else [med] * 9
        gbps = b / med / 1e9
        rows.append({"variant": text, "median_s": med, "p10_s": q[0], "p90_s": q[-1], "gbps": gbps,
                     "speed_vs_first": base / med})
        print(f"{text:44s} {med * 1e3:8.2f} ms [{q[0] * 1e3:.2f}–{q[-1] * 1e3:.2f}]  {gbps:6.2f} GB/s  "
              f"×{base / med:.2f} vs {variants[0]}", file=out, flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m suites.moe_ab", description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="small")
    ap.add_argument("--linear", metavar="N,K", help="time a linear of an [N, K] weight instead of fused MoE")
    ap.add_argument("--tokens", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--no-flush", action="store_true",
                    help="fused MoE: no read of twice the last-level cache before each call")
    ap.add_argument("variants", nargs="+")
    a = ap.parse_args(argv)
    if a.tokens < 1 or a.repeats < 1:
        print("error: --tokens and --repeats must be ≥ 1", file=sys.stderr)
        return 2
    try:
        if a.linear:
            try:
                n, k = (int(v) for v in a.linear.split(","))
            except ValueError:
                raise ValueError(f"--linear {a.linear!r}: expected N,K (two integers)") from None
            run_linear(n, k, a.tokens, a.repeats, a.variants)
        else:
            run(a.shape, a.tokens, a.repeats, a.variants, flush=not a.no_flush)
    except (ValueError, KeyError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
