"""The machine's limits, measured once per hardware key and cached: the roofline the kernel suite
and the tuner express their figures against.

- read bandwidth: a streaming read of a 512 MiB float32 buffer by every thread, each its own
  contiguous slice, summed with four AVX-512 accumulators (C++, in the cpu kernels' extension:
  kernels/cpu/csrc/probe.cpp); best and median of the repeats;
- peak arithmetic per ISA path: FP32 FMA (12 independent zmm chains per thread) and the INT8 path
  this backend uses, int16 vpmaddwd + vpaddd (AVX-512BW); VNNI (vpdpbusd) and AMX are reported
  only where the CPU has them (not measured yet: no kernel uses them).

    python -m tuner.probe [--refresh] [--json]

Cached in <moetune cache>/probe/<hardware_key>.json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from engine.fingerprint import fingerprint
from engine.weights.presets import cache_root

BUFFER_BYTES = 512 << 20


def _path() -> Path:
    return cache_root() / "probe" / f"{fingerprint()['hardware_key']}.json"


def measure(repeats: int = 7) -> dict:
    """Run the probe now (≈5 s). Raises ImportError where the cpu kernels cannot run."""
    import kernels.cpu as cpu

    ext = cpu.extension()
    buf = torch.ones(BUFFER_BYTES // 4, dtype=torch.float32)  # touched: pages are really there
    ext.read_seconds(buf)  # warm-up
    plain = [BUFFER_BYTES / ext.read_seconds(buf) / 1e9 for _ in range(repeats)]
    # the kernels read several rows at once with software prefetch: the same pattern, measured too;
    # the limit is the best either way of reading reaches
    streamed = [BUFFER_BYTES / ext.read_seconds_streams(buf, 4, 1024) / 1e9 for _ in range(repeats)]
    gbps = streamed if max(streamed) > max(plain) else plain
    del buf
    fma = max(ext.fma_gflops(20_000_000) for _ in range(3))
    madd = max(ext.int16_madd_gops(20_000_000) for _ in range(3))
    isa = fingerprint()["isa"].split(",")
    return {
        "read_gbps": max(gbps), "read_gbps_median": statistics.median(gbps),
        "read_gbps_sequential": max(plain), "read_gbps_4_streams_prefetch": max(streamed),
        "fp32_fma_gflops": fma, "int16_madd_gops": madd,
        "vnni_int8_gops": None, "has_vnni": "avx512_vnni" in isa, "has_amx": "amx_tile" in isa,
        "threads": torch.get_num_threads(), "hardware_key": fingerprint()["hardware_key"],
        "method": "C++ (kernels/cpu/csrc/probe.cpp): 512 MiB read with every thread, sequential and as "
                  "4 interleaved streams per thread with prefetch 1 KiB ahead (the better counts); "
                  "FMA / vpmaddwd chains in registers",
    }


def probe(refresh: bool = False) -> dict:
    """This machine's limits, from the cache unless `refresh` (or none cached yet)."""
    path = _path()
    if path.is_file() and not refresh:
        return json.loads(path.read_text())
    result = measure()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=2))
    tmp.replace(path)
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tuner.probe", description=__doc__.splitlines()[0])
    ap.add_argument("--refresh", action="store_true", help="measure again even if cached")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    r = probe(args.refresh)
    if args.json:
        print(json.dumps(r))
        return 0
    print(f"read bandwidth {r['read_gbps']:.1f} GB/s (median {r['read_gbps_median']:.1f}), "
          f"FP32 FMA {r['fp32_fma_gflops']:.0f} GFLOP/s, int16 madd {r['int16_madd_gops']:.0f} GOP/s, "
          f"{r['threads']} threads; VNNI {'yes' if r['has_vnni'] else 'no'}, AMX {'yes' if r['has_amx'] else 'no'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
