"""Attention decode variants timed in alternation within one process: knob settings side by side.

    python -m suites.attn_ab --heads H,HKV [--dim 128] [--context 2048] [--batch 1] [--block-size 64]
                             [--repeats 9] [--calls 24] [--warm] [--threads N] VARIANT [VARIANT ...]
    python -m suites.attn_ab --mla H [--context 2048] ... VARIANT [VARIANT ...]

A VARIANT is `defaults` or KNOB=VALUE[,KNOB=VALUE...] of the cpu_attn_* knobs, e.g.
`cpu_attn_f32_form=transpose,cpu_attn_prefetch=none cpu_attn_f32_form=packed`.
--heads: GQA/MHA decode (kernels.cpu.paged_decode) of H query heads over HKV KV heads of --dim dims (bf16
K and V caches [blocks, block size, HKV, dim]); --mla: MLA decode (kernels.cpu.mla_decode) of H heads over
DeepSeek's latent cache (R = 512, P = 64). Each of --batch sequences has --context keys.

Round r calls every variant `--calls` times back to back, in order, and keeps each variant's fastest
call; the median and min–max over --repeats rounds are printed with GB/s (cache bytes read) and each
variant's speed relative to the first. The calls go round copies of the cache, 4x the last-level cache in
all (the cache from DRAM, as a model's step reads it: one cache per layer, the weights streamed
between), or one copy with --warm. Every variant's output is checked against kernels.reference first
(its relative error printed). On a shared machine the figures drift between runs, but the variants of
one run share the drift: this is the tool for ratios (docs/cpu_kernels.md). Nothing is stored.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

R, P = 512, 64  # MLA's latent and rope dims


def parse_variant(text: str) -> dict:
    if text == "defaults":
        return {}
    knobs = {}
    for kv in filter(None, text.split(",")):
        name, sep, value = kv.partition("=")
        if not sep or not name.startswith("cpu_attn_"):
            raise ValueError(f"variant {text!r}: expected cpu_attn_KNOB=VALUE, got {kv!r}")
        knobs[name] = int(value) if value.lstrip("-").isdigit() else value
    return knobs


def make_case(args, g: torch.Generator):
    """(the op's call on copy c, the reference's answer on copy 0, cache bytes one call reads, copies)."""
    import kernels.cpu as cpu
    from kernels import reference
    from suites.kernels import last_level_cache_bytes

    b, ctx, bs = args.batch, args.context, args.block_size
    per_seq = -(-ctx // bs)
    tables = torch.randperm(b * per_seq, generator=g).to(torch.int32).view(b, per_seq)  # blocks out of order
    lens = torch.full((b,), ctx, dtype=torch.int32)
    if args.mla:
        h, row = args.mla, (R + P) * 2
        nbytes = b * ctx * row
    else:
        h, hkv = args.heads
        row = hkv * 2 * args.dim * 2
        nbytes = b * ctx * row
    copies = 1 if args.warm else max(2, -(-4 * last_level_cache_bytes() // (b * per_seq * bs * row)))
    if args.mla:
        caches = [torch.empty(b * per_seq, bs, R + P, dtype=torch.bfloat16).normal_(generator=g) for _ in range(copies)]
        q_lat = torch.empty(b, h, R, dtype=torch.bfloat16).normal_(generator=g)
        q_pe = torch.empty(b, h, P, dtype=torch.bfloat16).normal_(generator=g)
        scale = (R + P) ** -0.5

        def call(c: int, knobs):
            return cpu.mla_decode(q_lat, q_pe, caches[c], tables, lens, scale, knobs=knobs)

        want = reference.mla_decode(q_lat, q_pe, caches[0], tables, lens, scale)
    else:
        kv = [tuple(torch.empty(b * per_seq, bs, hkv, args.dim, dtype=torch.bfloat16).normal_(generator=g)
                    for _ in range(2)) for _ in range(copies)]
        q = torch.empty(b, h, args.dim, dtype=torch.bfloat16).normal_(generator=g)
        scale = args.dim ** -0.5

        def call(c: int, knobs):
            return cpu.paged_decode(q, kv[c][0], kv[c][1], tables, lens, scale, knobs=knobs)

        want = reference.paged_decode(q, kv[0][0], kv[0][1], tables, lens, scale)
    return call, want, nbytes, copies


def run(args, out=sys.stdout) -> list[dict]:
    import kernels.cpu as cpu

    variants = [(text, cpu.make_knobs(parse_variant(text))) for text in args.variants]
    g = torch.Generator().manual_seed(0)
    call, want, nbytes, copies = make_case(args, g)
    what = f"MLA {args.mla} heads" if args.mla else f"GQA {args.heads[0]} / {args.heads[1]} heads × {args.dim}"
    print(f"{what}, {args.batch} × {args.context} keys, block size {args.block_size}, "
          f"{'one warm copy' if args.warm else f'{copies} copies of the cache (from DRAM)'}, "
          f"{torch.get_num_threads()} threads", file=out)
    rows = []
    for text, kn in variants:
        got = call(0, kn).float()
        rows.append({"variant": text, "knobs": kn, "times": [],
                     "rel_err": float((got - want.float()).norm() / want.float().norm())})
    for _ in range(2):  # warm-up rounds
        for row in rows:
            call(0, row["knobs"])
    n = 0
    for _ in range(args.repeats):
        for row in rows:
            best = float("inf")
            for _ in range(args.calls):
                c, n = n % copies, n + 1
                t0 = time.perf_counter()
                call(c, row["knobs"])
                best = min(best, time.perf_counter() - t0)
            row["times"].append(best)
    base = statistics.median(rows[0]["times"])
    for row in rows:
        med = statistics.median(row["times"])
        row.update(median_s=med, gbps=nbytes / med / 1e9, vs_first=base / med)
        print(f"  {row['variant']:64s} {med * 1e6:9.1f} us [{min(row['times']) * 1e6:.0f}–{max(row['times']) * 1e6:.0f}]"
              f" {row['gbps']:6.2f} GB/s  x{row['vs_first']:.2f}  rel. err {row['rel_err']:.1e}", file=out)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m suites.attn_ab", description=__doc__.split("\n")[0])
    what = ap.add_mutually_exclusive_group(required=True)
    what.add_argument("--heads", help="GQA/MHA decode: query heads,KV heads (e.g. 32,4)")
    what.add_argument("--mla", type=int, help="MLA decode: heads")
    ap.add_argument("--dim", type=int, default=128, help="GQA/MHA head dim")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--calls", type=int, default=24, help="calls per variant per round (the fastest kept)")
    ap.add_argument("--warm", action="store_true", help="one copy of the cache (cache-resident)")
    ap.add_argument("--threads", type=int, help="torch / OpenMP threads (default: torch's)")
    ap.add_argument("variants", nargs="+", metavar="VARIANT")
    args = ap.parse_args(argv)
    try:
        for text in args.variants:
            parse_variant(text)
        if args.heads is not None:
            h, hkv = (int(x) for x in args.heads.split(","))
            if hkv < 1 or h % hkv:
                raise ValueError("--heads: the query heads must be a multiple of the KV heads")
            args.heads = (h, hkv)
        if min(args.dim, args.context, args.batch, args.block_size, args.repeats, args.calls, args.mla or 1) < 1:
            raise ValueError("--dim, --context, --batch, --block-size, --repeats, --calls and --mla must be ≥ 1")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
