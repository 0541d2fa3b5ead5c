"""The machine's limits, measured once per hardware key and cached: the roofline the kernel suite
and the tuner express their figures against.

- read bandwidth: a 512 MiB float32 buffer read by every thread, each its own slice, in several
  ways (C++, in the cpu kernels' extension: kernels/cpu/csrc/probe.cpp): sequential; as 1-8
  interleaved streams per thread (the kernels read several weight rows at once), each reading 1 or 4
  consecutive cache lines per step (more loads in flight), with and without software prefetch 1 KiB
  ahead, with ordinary or non-temporal (vmovntdqa) loads. Every method's best is recorded
  (`read_methods`) and the best of all is the limit (`read_gbps`), so that no kernel reads faster
  than the figure its "% of read bandwidth" is taken of; the median is of the best method's repeats;
- peak arithmetic per instruction (chains of independent operations in registers, every thread):
  FP32 FMA and int16 vpmaddwd (AVX-512, or in the kernels' AVX2 build the same chains on its model:
  two 256-bit instructions per 512-bit one, so the AVX2 peaks), and where the CPU has them (under the kernels'
  feature mask) VNNI vpdpbusd (int8), AVX512-BF16 vdpbf16ps, AMX TDPBSSD / TDPBF16PS; None where absent;
- the kernels' ISA variants: which run natively here and which only on their C++ models (tests).

    python -m tuner.probe [--refresh | --reset] [--json]

Cached in <moetune cache>/probe/<hardware_key>.json (a result of an older probe version is measured again).
A refresh measures everything again but keeps the fastest read measured on this machine as the limit
(`read_gbps_this_run` beside it, the refreshes in `read_history`): on a shared VM the memory's rate moves
by 2x between minutes, and a refresh in a slow minute must not lower the limit. --reset forgets them.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from engine.fingerprint import fingerprint
from engine.weights.presets import cache_root

BUFFER_BYTES = 512 << 20  # at least; twice the last-level cache where that is larger (read_buffer_bytes)
VERSION = 5  # 2: several read methods (best kept), the dot-product peaks, the ISA variants; 3: 2 × LLC at least;
# 4: the AVX2 build's FMA and madd peaks on 256-bit registers (its 512-bit loops spilled: half the peak), and
# the madd peak as 8 chains of vpmaddwd (it timed one vpmaddwd and 8 vpaddd a round); 5: the 512-bit madd,
# VNNI and BF16-dot peaks on 16 chains (8 were latency-bound on Intel's two 512-bit ports: INT8 GEMMs ran 117 %)
# (streams per thread, cache lines per step, prefetch bytes ahead, non-temporal loads)
READ_METHODS = [m for m in itertools.product((1, 2, 4, 8), (1, 4), (0, 1024), (False, True))]


def _path() -> Path:
    return cache_root() / "probe" / f"{fingerprint()['hardware_key']}.json"


def _method_name(streams: int, lines: int, ahead: int, nt: bool) -> str:
    return f"{streams} streams x {lines} lines" + (f", prefetch {ahead} B" if ahead else "") + (", non-temporal" if nt else "")


def read_methods(ext, buf: torch.Tensor, repeats: int) -> dict[str, list[float]]:
    """GB/s samples of every read method (the sequential reader, the kernels' 4 streams + prefetch
    pattern, READ_METHODS), each `repeats` times."""
    nbytes = buf.numel() * 4
    out = {"sequential": [nbytes / ext.read_seconds(buf) / 1e9 for _ in range(repeats)],
           "4 streams, prefetch 1024 B (kernels' pattern)":
               [nbytes / ext.read_seconds_streams(buf, 4, 1024) / 1e9 for _ in range(repeats)]}
    for m in READ_METHODS:
        out[_method_name(*m)] = [nbytes / ext.read_seconds_method(buf, *m) / 1e9 for _ in range(repeats)]
    return out


def _peak(fn, *args):
    return max(fn(*args) for _ in range(3))


def read_buffer_bytes(caches: str | None = None) -> int:
    """The probe's read buffer: BUFFER_BYTES, or twice the largest cache where that is larger (a 480 MiB L3
    was seen on an AMX VM: a 512 MiB buffer would be read partly from it), at most a quarter of the memory.
    `caches` as the fingerprint's ("L1d:48K,...,L3:491520K")."""
    caches = fingerprint()["caches"] if caches is None else caches
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    largest = max((int(size[:-1]) * units[size[-1]] for size in (c.split(":")[1] for c in caches.split(",") if ":" in c)
                   if size[:-1].isdigit() and size[-1] in units), default=0)
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(min(max(BUFFER_BYTES, 2 * largest), max(BUFFER_BYTES, mem // 4)))


def measure(repeats: int = 7, buffer_bytes: int | None = None, iters: int = 20_000_000) -> dict:
    """Run the probe now (≈10 s; `buffer_bytes` and `iters` smaller only in tests). Raises
    ImportError where the cpu kernels cannot run."""
    import kernels.cpu as cpu

    ext = cpu.extension()
    buffer_bytes = read_buffer_bytes() if buffer_bytes is None else buffer_bytes
    buf = torch.ones(buffer_bytes // 4, dtype=torch.float32)  # touched: pages are really there
    ext.read_seconds(buf)  # warm-up
    screened = read_methods(ext, buf, 3)
    best = max(screened, key=lambda n: max(screened[n]))
    samples = _best_samples(ext, buf, best, repeats)
    del buf
    have = cpu.features()
    result = {
        "version": VERSION,
        "read_gbps": max(max(samples), max(screened[best])), "read_gbps_median": statistics.median(samples),
        "read_method": best, "read_methods": {n: max(v) for n, v in screened.items()},
        "read_gbps_sequential": max(screened["sequential"]),
        "read_gbps_4_streams_prefetch": max(screened["4 streams, prefetch 1024 B (kernels' pattern)"]),
        "fp32_fma_gflops": _peak(ext.fma_gflops, iters),
        "int16_madd_gops": _peak(ext.int16_madd_gops, iters),
        "vnni_int8_gops": _peak(ext.vnni_int8_gops, iters) if "avx512_vnni" in have else None,
        "bf16_dot_gflops": _peak(ext.bf16_dot_gflops, iters) if "avx512_bf16" in have else None,
        "amx_int8_gops": _peak(ext.amx_peak_gops, max(1, iters // 10), True) if "amx" in have else None,
        "amx_bf16_gflops": _peak(ext.amx_peak_gops, max(1, iters // 10), False) if "amx" in have else None,
        "has_vnni": "avx512_vnni" in have, "has_bf16": "avx512_bf16" in have, "has_amx": "amx" in have,
        "isa_variants": cpu.isa_variants(),
        "threads": torch.get_num_threads(), "hardware_key": fingerprint()["hardware_key"],
        "method": f"C++ (kernels/cpu/csrc/probe.cpp): {buffer_bytes >> 20} MiB read with every thread in each of "
                  f"{len(screened)} ways (3 repeats each, the best way {repeats} more; the best figure is the limit); "
                  "FMA / vpmaddwd / vpdpbusd / vdpbf16ps / AMX tile chains in registers",
    }
    return result


def read_once(ext, buf: torch.Tensor, name: str) -> float:
    """Seconds to read `buf` (float32, contiguous) once with every thread by the read method called
    `name` (a key of `read_methods`, e.g. the probe's `read_method`)."""
    if name == "sequential":
        return ext.read_seconds(buf)
    if name.endswith("(kernels' pattern)"):
        return ext.read_seconds_streams(buf, 4, 1024)
    m = next((m for m in READ_METHODS if _method_name(*m) == name), None)
    if m is None:
        raise ValueError(f"no read method called {name!r}")
    return ext.read_seconds_method(buf, *m)


def _best_samples(ext, buf: torch.Tensor, name: str, repeats: int) -> list[float]:
    """`repeats` more samples of the read method called `name`."""
    nbytes = buf.numel() * 4
    return [nbytes / read_once(ext, buf, name) / 1e9 for _ in range(repeats)]


READ_KEYS = ("read_gbps", "read_gbps_median", "read_method")  # the best read's figures, kept together
HISTORY = 20  # the last refreshes' best reads kept in `read_history`


def keep_best_read(new: dict, old: dict | None) -> dict:
    """A refresh's result, keeping the fastest read measured on this machine (same probe version, hardware
    key and threads): the read limit is the fastest the memory has been seen to run, and a refresh while
    neighbours load a shared VM's memory (Zen 5, session 18: 77.0 GB/s, then 44.0 fourteen minutes later)
    must not lower it. `read_gbps_this_run` is the refresh's own figure; `read_history` the refreshes'
    (time, GB/s), the last HISTORY of them. The peaks are always the refresh's."""
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    same = bool(old) and all(old.get(k) == new.get(k) for k in ("version", "hardware_key", "threads"))
    history = (old.get("read_history") or [[None, old.get("read_gbps")]]) if same else []
    out = {**new, "read_gbps_this_run": new["read_gbps"], "read_history": (history + [[stamp, new["read_gbps"]]])[-HISTORY:]}
    if same and (old.get("read_gbps") or 0) > new["read_gbps"]:
        out.update({k: old[k] for k in READ_KEYS if k in old})
        out["read_methods"] = {n: max(g, old.get("read_methods", {}).get(n, 0)) for n, g in new["read_methods"].items()}
        for k in ("read_gbps_sequential", "read_gbps_4_streams_prefetch"):
            out[k] = max(new[k], old.get(k) or 0)
    return out


def probe(refresh: bool = False, reset: bool = False) -> dict:
    """This machine's limits, from the cache unless `refresh` (or none cached yet). A refresh keeps the
    fastest read measured before on this machine (keep_best_read) unless `reset`."""
    path = _path()
    cached = None
    if path.is_file():
        try:
            cached = json.loads(path.read_text())
        except ValueError:
            cached = None
    if cached and not refresh and not reset and cached.get("version") == VERSION:
        # the variants are the kernels' (they change with the code), not a measurement: read them now,
        # so a cache written before an update does not hide a variant added since
        from kernels import cpu

        return {**cached, "isa_variants": cpu.isa_variants()}
    result = keep_best_read(measure(), None if reset else cached)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=2))
    tmp.replace(path)
    return result


def variants_line(variants: dict) -> str:
    """The ISA knobs' variants as one line: "cpu_int8_isa avx512, vnni; ... (emulated only: ...)"."""
    native = "; ".join(f"{k} " + ", ".join(v for v, how in d.items() if how == "native") for k, d in variants.items())
    model = [f"{k}={v}" for k, d in variants.items() for v, how in d.items() if how != "native"]
    return native + (f" (C++ model only, tests: {', '.join(model)})" if model else "")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tuner.probe", description=__doc__.splitlines()[0])
    ap.add_argument("--refresh", action="store_true",
                    help="measure again even if cached (the read limit stays the fastest read measured here)")
    ap.add_argument("--reset", action="store_true",
                    help="measure again and forget the earlier reads (after a change of the memory or its settings)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    r = probe(args.refresh, args.reset)
    if args.json:
        print(json.dumps(r))
        return 0
    print(f"read bandwidth {r['read_gbps']:.1f} GB/s (median {r['read_gbps_median']:.1f}; {r['read_method']}), "
          f"{r['threads']} threads")
    if r.get("read_gbps_this_run") is not None and r["read_gbps_this_run"] < r["read_gbps"]:
        print(f"  (this run's best read {r['read_gbps_this_run']:.1f} GB/s; the limit kept is the fastest measured "
              f"here, of {len(r.get('read_history', []))} runs: --reset forgets them)")
    for name, gbps in sorted(r["read_methods"].items(), key=lambda kv: -kv[1]):
        print(f"  read {gbps:6.1f} GB/s  {name}")
    peaks = [("FP32 FMA", "fp32_fma_gflops"), ("int16 madd", "int16_madd_gops"), ("VNNI int8", "vnni_int8_gops"),
             ("AVX512-BF16 dot", "bf16_dot_gflops"), ("AMX int8", "amx_int8_gops"), ("AMX bf16", "amx_bf16_gflops")]
    print("peaks: " + ", ".join(f"{label} {r[key]:.0f} G/s" if r.get(key) else f"{label} absent" for label, key in peaks))
    print("variants: " + variants_line(r["isa_variants"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
