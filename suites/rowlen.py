"""Row-length sweep: the same bytes of weight read as rows of different lengths (linear, T=1).

    python -m suites.rowlen [--mib 384] [--format int8 --format int4] [--k 1024 --k 2048 ...] [--repeats 10]

Each microkernel row is its own memory stream, and short streams are slow to prefetch (the hardware
prefetchers stop at each 4 KiB page). This sweep measures by how much: one weight per row length,
all of the same size (`--mib`, from DRAM), timed in alternation within one process. It prints the
median and p10–p90 in ms and GB/s per case, with the machine fingerprint. Nothing is stored; this is
a diagnostic for docs/cpu_kernels.md.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch


def sweep(fmts: list[str], ks: list[int], mib: int, repeats: int, out=sys.stdout) -> list[dict]:
    import kernels.cpu as cpu
    from suites.kernels import random_weight
    from engine.fingerprint import fingerprint

    print(f"machine: {fingerprint().get('hardware_key', '?')}  weights {mib} MiB per case", file=out)
    g = torch.Generator().manual_seed(0)
    rows = []
    for fmt in fmts:
        per_byte = 0.5 if fmt == "int4" else 2 if fmt == "bf16" else 1
        weights = {k: cpu.prepare(random_weight((int((mib << 20) / (k * per_byte)), k), fmt, g)) for k in ks}
        xs = {k: torch.randn(1, k, generator=g) for k in ks}
        times = {k: [] for k in ks}
        for r in range(repeats + 2):
            for k in ks:
                t0 = time.perf_counter()
                cpu.linear(xs[k], weights[k])
                if r >= 2:
                    times[k].append(time.perf_counter() - t0)
        for k in ks:
            med = statistics.median(times[k])
            q = statistics.quantiles(times[k], n=10) if len(times[k]) > 1 else [med] * 9
            nbytes = weights[k].nbytes
            row = {"format": fmt, "k": k, "row_bytes": int(k * per_byte), "median_s": med, "p10_s": q[0],
                   "p90_s": q[-1], "gbps": nbytes / med / 1e9}
            rows.append(row)
            print(f"{fmt:5s} K={k:6d} row {row['row_bytes']:6d} B  {med * 1e3:8.2f} ms "
                  f"[{q[0] * 1e3:.2f}–{q[-1] * 1e3:.2f}]  {row['gbps']:6.2f} GB/s", file=out, flush=True)
        del weights
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m suites.rowlen", description=__doc__.split("\n\n")[0])
    ap.add_argument("--format", action="append", choices=("bf16", "int8", "fp8", "int4"))
    ap.add_argument("--k", action="append", type=int, help="row length in elements (repeatable)")
    ap.add_argument("--mib", type=int, default=384)
    ap.add_argument("--repeats", type=int, default=10)
    a = ap.parse_args(argv)
    ks = a.k or [1024, 2048, 8192, 16384]
    if a.mib < 1 or a.repeats < 1 or any(k < 1 for k in ks):
        print("error: --mib, --repeats and --k must be ≥ 1", file=sys.stderr)
        return 2
    sweep(a.format or ["int8", "int4"], ks, a.mib, a.repeats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
