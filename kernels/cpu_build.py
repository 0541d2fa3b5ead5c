"""Compile (once) and load the C++ CPU kernels (kernels/cpu/csrc) as a torch extension.

A module beside the kernels.cpu package, so checking whether they can run never imports the
backend itself.

The sources in kernels/cpu/csrc are compiled with ninja through torch.utils.cpp_extension into
$MOETUNE_BUILD_DIR, else <moetune cache>/build, under a folder named by the hash of the sources
and flags, so a changed source rebuilds and an unchanged one loads in milliseconds. The first build
takes about a minute on two cores and shows a spinner on stderr.

Two builds of the same sources, chosen at load by /proc/cpuinfo (never by the build machine):
- "avx512" needs AVX-512 F/BW/VL/DQ. The global flags name only those: the variants on newer
  instructions (AVX512-VNNI, AVX512-BF16, AMX) are compiled with function-level target attributes
  (csrc/dot.h, micro_dot.inc, amx.cpp) and chosen at run time by cpuid (csrc/isa.cpp), so an
  extension built on one machine runs on any AVX-512 CPU. Never add -mavx512vnni / -mavx512bf16 /
  -mamx-* to its flags.
- "avx2" needs AVX2, FMA and F16C (AMD Zen 1-3, Intel Haswell and later client cores): the same
  kernel source compiled against csrc/avx512_model.h, a C++ model of every AVX-512 instruction it
  uses on pairs of 256-bit registers, force-included first. VNNI, BF16 and AMX run there on their
  C++ models only (tests); isa.cpp reports none of them.
`MOETUNE_CPU_BUILD` = auto (default: avx512 where the CPU has it, else avx2) | avx512 | avx2 picks
one by hand: the tests run the AVX2 build on AVX-512 machines that way, so the model is checked
against the native instructions. `load()` refuses (ImportError, with the reason) where the chosen
build cannot run, before compiling anything. Nothing here imports the engine.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import itertools
import os
import sys
import threading
import time
from functools import lru_cache
from pathlib import Path

CSRC = Path(__file__).resolve().parent / "cpu" / "csrc"
SOURCES = ("micro_f32.cpp", "micro_bf16.cpp", "micro_r16.cpp", "micro_int8.cpp", "micro_fp8.cpp", "micro_int4.cpp",
           "matmul.cpp", "moe.cpp", "attention.cpp", "small_ops.cpp", "probe.cpp", "amx.cpp", "isa.cpp", "runner.cpp",
           "bindings.cpp")
HEADERS = ("common.h", "micro.h", "ops.h", "dot.h", "amx_tiles.h", "micro_dot.inc", "micro_dot_both.inc", "attn_dot.inc",
           "avx512_model.h")
_COMMON = ("-O3", "-fopenmp", "-ffp-contract=off", "-Wno-unused-variable")
# build → (the cpuinfo flags it needs, its compiler flags). Tuples: torch's cpp_extension.load appends its
# own -L / -l flags to the extra_ldflags list it is given, in place, so a list here changed after the first
# load, and with it every later source_hash (the venv's path included): a process that had loaded one build
# looked for the other under another name and compiled it again (seen: each test run compiled the AVX2
# build twice and the AVX-512 one twice). The calls get fresh lists (_flags).
BUILDS = {
    "avx512": (("avx512f", "avx512bw", "avx512vl", "avx512dq"),
               ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mavx2") + _COMMON),
    "avx2": (("avx2", "fma", "f16c"),
             ("-mavx2", "-mfma", "-mf16c", "-DMOETUNE_AVX2_BUILD", "-include", "avx512_model.h", "-Wno-psabi") + _COMMON),
}
BUILD_ENV = "MOETUNE_CPU_BUILD"
REQUIRED_ISA = BUILDS["avx512"][0]
CFLAGS = BUILDS["avx512"][1]
LDFLAGS = ("-fopenmp",)


def _flags(build: str) -> tuple[list[str], list[str]]:
    """Fresh lists of a build's compiler and linker flags, for torch to extend as it likes."""
    return list(BUILDS[build][1]), list(LDFLAGS)


def cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def requested_build() -> str:
    """MOETUNE_CPU_BUILD: auto, avx512 or avx2 (ValueError on anything else)."""
    want = os.environ.get(BUILD_ENV, "auto").strip().lower() or "auto"
    if want != "auto" and want not in BUILDS:
        raise ValueError(f"{BUILD_ENV}={want!r}: expected auto, {' or '.join(BUILDS)}")
    return want


def missing_for(build: str) -> list[str]:
    """The ISA extensions this CPU lacks for one build (empty: it runs here)."""
    flags = cpu_flags()
    return [f for f in BUILDS[build][0] if f not in flags]


def selected_build() -> str | None:
    """The build `load()` takes here: the requested one, or under auto the widest that runs; None if none."""
    try:
        want = requested_build()
    except ValueError:
        return None
    if want != "auto":
        return want if not missing_for(want) else None
    return next((b for b in BUILDS if not missing_for(b)), None)


def missing_isa() -> list[str]:
    """The ISA extensions this CPU lacks for the kernels (empty: the selected build runs here)."""
    if selected_build():
        return []
    try:
        want = requested_build()
    except ValueError:
        want = "auto"
    return missing_for("avx2" if want == "auto" else want)


def build_root() -> Path:
    if os.environ.get("MOETUNE_BUILD_DIR"):
        return Path(os.environ["MOETUNE_BUILD_DIR"])
    cache = os.environ.get("MOETUNE_CACHE") or Path.home() / ".cache" / "moetune"
    return Path(cache) / "build"


def source_hash(build: str = "avx512") -> str:
    h = hashlib.sha1()
    for name in SOURCES + HEADERS:
        h.update(name.encode())
        h.update((CSRC / name).read_bytes())
    h.update(" ".join(BUILDS[build][1] + LDFLAGS).encode())
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


def choose_build() -> str:
    """The build to load here; ImportError (one line) for a bad MOETUNE_CPU_BUILD or a CPU that runs none."""
    try:
        want = requested_build()
    except ValueError as e:
        raise ImportError(str(e)) from None
    build = selected_build()
    if build is None:
        if want == "auto":
            raise ImportError(f"this CPU lacks {', '.join(missing_for('avx2'))} (the moetune CPU kernels need "
                              f"AVX-512, or AVX2 with FMA and F16C)")
        raise ImportError(f"{BUILD_ENV}={want}: this CPU lacks {', '.join(missing_for(want))}")
    return build


@contextlib.contextmanager
def _build_lock(build_dir: Path):
    """Held while this process compiles or loads `build_dir`: an flock on a file beside it, which the
    kernel releases when its holder dies. torch's own baton (`build_dir/lock`, created by the builder and
    removed when it finishes) stays forever when a build is killed, and every later load then waits on it
    without end (seen here: a pytest run stopped while compiling left one, and the next run hung in
    collection). Under the flock no other moetune builder is running, so a baton found then is stale and
    is removed."""
    with open(build_dir.parent / f"{build_dir.name}.flock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            (build_dir / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@lru_cache(maxsize=1)
def load():
    """The compiled extension module (building it first if needed); ImportError if impossible.
    Its `BUILD` attribute names the build (avx512 or avx2)."""
    build = choose_build()
    from torch.utils import cpp_extension

    name = f"moetune_cpu_{build}_{source_hash(build)}"
    build_dir = build_root() / name
    build_dir.mkdir(parents=True, exist_ok=True)
    cflags, ldflags = _flags(build)
    kwargs = dict(name=name, sources=[str(CSRC / s) for s in SOURCES], extra_cflags=cflags,
                  extra_ldflags=ldflags, extra_include_paths=[str(CSRC)], build_directory=str(build_dir),
                  verbose=False)
    try:
        with _build_lock(build_dir):
            fresh = not (build_dir / f"{name}.so").exists()  # another process may have built it meanwhile
            with (_Spinner(f"moetune: compiling the CPU kernels, {build} build (first use only)") if fresh
                  else contextlib.nullcontext()):
                mod = _load_retrying(cpp_extension, kwargs)
        mod.BUILD = build
        return mod
    except Exception as e:  # compiler missing, build error: the caller falls back
        raise ImportError(f"building the moetune CPU kernels ({build}) failed: {str(e).strip().splitlines()[-1]}") from e


def library(build: str) -> Path:
    """The shared library of one build, compiled if needed but not loaded: the codegen tests read the
    AVX-512 build's instructions (objdump) on every machine, including one that cannot run it."""
    if build == selected_build():
        return Path(load().__file__)
    from torch.utils import cpp_extension

    name = f"moetune_cpu_{build}_{source_hash(build)}"
    build_dir = build_root() / name
    so = build_dir / f"{name}.so"
    build_dir.mkdir(parents=True, exist_ok=True)
    with _build_lock(build_dir):
        if so.exists():
            return so
        with _Spinner(f"moetune: compiling the CPU kernels, {build} build (to inspect, not to run)"):
            # the private half of cpp_extension.load that builds without importing (torch 2.13)
            cflags, ldflags = _flags(build)
            cpp_extension._write_ninja_file_and_build_library(
                name, [str(CSRC / s) for s in SOURCES], cflags, None, None, ldflags, [str(CSRC)],
                str(build_dir), False, False, False)
    return so


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
