"""Compile (once) and load the C++ CPU kernels (kernels/cpu/csrc) as a torch extension.

A module beside the kernels.cpu package, so checking whether they can run never imports the
backend itself.

The sources in kernels/cpu/csrc are compiled with ninja through torch.utils.cpp_extension into
$MOETUNE_BUILD_DIR, else <moetune cache>/build, under a folder named by the hash of the sources
and flags, so a changed source rebuilds and an unchanged one loads in milliseconds. The first build
takes about a minute on two cores and shows a spinner on stderr.

The kernels need AVX-512 F/BW/VL/DQ; `load()` refuses (ImportError, with the reason) on a CPU
without them, before compiling anything. The global flags name only those: the variants on newer
instructions (AVX512-VNNI, AVX512-BF16, AMX) are compiled with function-level target attributes
(csrc/dot.h, micro_dot.inc, amx.cpp) and chosen at run time by cpuid (csrc/isa.cpp), so an
extension built on one machine runs on any AVX-512 CPU. Never add -mavx512vnni / -mavx512bf16 /
-mamx-* to CFLAGS. Nothing here imports the engine.
"""
from __future__ import annotations

import hashlib
import itertools
import os
import sys
import threading
import time
from functools import lru_cache
from pathlib import Path

CSRC = Path(__file__).resolve().parent / "cpu" / "csrc"
SOURCES = ("micro_f32.cpp", "micro_bf16.cpp", "micro_int8.cpp", "micro_fp8.cpp", "micro_int4.cpp",
           "matmul.cpp", "moe.cpp", "attention.cpp", "small_ops.cpp", "probe.cpp", "amx.cpp", "isa.cpp", "runner.cpp",
           "bindings.cpp")
HEADERS = ("common.h", "micro.h", "ops.h", "dot.h", "micro_dot.inc", "micro_dot_both.inc", "attn_dot.inc")
REQUIRED_ISA = ("avx512f", "avx512bw", "avx512vl", "avx512dq")
CFLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mavx2", "-fopenmp",
          "-ffp-contract=off", "-Wno-unused-variable"]
LDFLAGS = ["-fopenmp"]


def cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def missing_isa() -> list[str]:
    """The required ISA extensions this CPU lacks (empty: the kernels can run here)."""
    flags = cpu_flags()
    return [f for f in REQUIRED_ISA if f not in flags]


def build_root() -> Path:
    if os.environ.get("MOETUNE_BUILD_DIR"):
        return Path(os.environ["MOETUNE_BUILD_DIR"])
    cache = os.environ.get("MOETUNE_CACHE") or Path.home() / ".cache" / "moetune"
    return Path(cache) / "build"


def source_hash() -> str:
    h = hashlib.sha1()
    for name in SOURCES + HEADERS:
        h.update(name.encode())
        h.update((CSRC / name).read_bytes())
    h.update(" ".join(CFLAGS + LDFLAGS).encode())
    import torch

    h.update(torch.__version__.encode())
    return h.hexdigest()[:16]


class _Spinner:
    """A one-line progress indicator on stderr while a slow step runs."""

    def __init__(self, message: str):
        self.message, self._stop = message, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        t0 = time.monotonic()
        if not sys.stderr.isatty():  # a log, not a terminal: one line now, one at the end
            sys.stderr.write(f"{self.message}...\n")
            self._stop.wait()
            sys.stderr.write(f"{self.message}: done in {time.monotonic() - t0:.0f} s\n")
            return
        for ch in itertools.cycle("|/-\\"):
            if self._stop.wait(0.25):
                break
            sys.stderr.write(f"\r{self.message} {ch} {time.monotonic() - t0:4.0f} s")
            sys.stderr.flush()
        sys.stderr.write(f"\r{self.message} done in {time.monotonic() - t0:.0f} s\n")

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


@lru_cache(maxsize=1)
def load():
    """The compiled extension module (building it first if needed); ImportError if impossible."""
    missing = missing_isa()
    if missing:
        raise ImportError(f"this CPU lacks {', '.join(missing)} (the moetune CPU kernels need AVX-512)")
    from torch.utils import cpp_extension

    name = f"moetune_cpu_{source_hash()}"
    build_dir = build_root() / name
    build_dir.mkdir(parents=True, exist_ok=True)
    fresh = not (build_dir / f"{name}.so").exists()
    kwargs = dict(name=name, sources=[str(CSRC / s) for s in SOURCES], extra_cflags=CFLAGS,
                  extra_ldflags=LDFLAGS, build_directory=str(build_dir), verbose=False)
    try:
        if fresh:
            with _Spinner("moetune: compiling the CPU kernels (first use only)"):
                return _load_retrying(cpp_extension, kwargs)
        return _load_retrying(cpp_extension, kwargs)
    except Exception as e:  # compiler missing, build error: the caller falls back
        raise ImportError(f"building the moetune CPU kernels failed: {str(e).strip().splitlines()[-1]}") from e


def _load_retrying(cpp_extension, kwargs: dict, attempts: int = 3):
    """cpp_extension.load, again when a concurrent build we waited for died before linking."""
    for attempt in range(attempts):
        try:
            return cpp_extension.load(**kwargs)
        except ImportError as e:
            if "cannot open shared object" not in str(e) or attempt == attempts - 1:
                raise


def availability() -> tuple[bool, str]:
    """(True, "") when the extension loads here, else (False, why)."""
    try:
        load()
        return True, ""
    except ImportError as e:
        return False, str(e)
