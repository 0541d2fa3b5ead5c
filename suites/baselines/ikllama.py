"""The ik_llama.cpp baseline: the same GGUF as the llama.cpp one, run by the fork in a worker process.

    python -m suites.baselines.ikllama --setup      build it once (the set-up step; ≈5-15 min on 2 cores)
    python -m suites.baselines.ikllama --model small --type bf16 --prompt-len 128 --decode 32

ik_llama.cpp (a llama.cpp fork: FlashMLA on CPU, fused MoE, run-time repacking, its own GEMM
kernels) comes from the sdist of ik-llama-cpp-python on PyPI: its vendored sources are compiled
here with the machine's native flags (-march=native turns on the fork's "fancy SIMD" AVX-512/VNNI
paths; PyPI's wheel is built for generic AVX2), only the `llama` and `ggml` libraries (no tools,
examples or tests). The sdist's own ctypes bindings (its `ik_llama_cpp` package, which needs only
numpy) are installed beside the library in a versioned folder of the moetune cache, stamped when
complete; the worker (suites/baselines/ikllama_worker.py) runs in our interpreter with that folder
first on its path, so nothing of it enters our virtualenv.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from suites.baselines.client import BaselineError, Worker
from suites.baselines.llamacpp import GgufEngine

IK_VERSION = "0.1.5"  # ik-llama-cpp-python, whose sdist vendors the fork's sources
SDIST_SHA256 = "33c67eb99e4dcab5e611050433243815709b8b3067753f9ce18375013cf002ad"
# Native build; the IQK flash-attention kernels for the F16/BF16/Q8_0 KV cache only (ALL_QUANTS adds
# q4_0/q4_1/iq4_nl caches, which the comparison does not use, at a long extra compile).
CMAKE_ARGS = ("-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=ON", "-DGGML_NATIVE=ON",
              "-DGGML_IQK_FA_ALL_QUANTS=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
              "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_CURL=OFF", "-DCMAKE_BUILD_RPATH=$ORIGIN")
WORKER = Path(__file__).resolve().parent / "ikllama_worker.py"
# Its best configuration for DeepSeek-class models on a CPU (the fork's docs/parameters.md): MLA mode
# 3 (MLA with the K cache, "the best of both worlds"), flash attention (its FlashMLA CPU kernels),
# fused MoE up/gate (these three are its defaults), and run-time repacking of the weights into its
# row-interleaved layouts (-rtr, off by default: "may improve performance"; it did for prefill in the
# issue's llama-bench runs, Q8_0 and BF16 on a Zen 4; on a CPU without AVX512-BF16 it repacks Q8_0 only).
BEST = {"mla": 3, "flash_attn": True, "fused_moe": True, "rtr": True}


def ik_dir() -> Path:
    """Where the build lives: $MOETUNE_IK_DIR, else a versioned folder of the moetune cache."""
    if os.environ.get("MOETUNE_IK_DIR"):
        return Path(os.environ["MOETUNE_IK_DIR"])
    from engine.weights.presets import cache_root

    return cache_root() / f"ik_llama-{IK_VERSION}"


def _stamp() -> Path:
    return ik_dir() / ".complete"


def build_record() -> dict | None:
    """The stamp of a complete build made with today's flags (version, flags, build seconds), or None."""
    try:
        rec = json.loads(_stamp().read_text())
    except (OSError, ValueError):
        return None
    lib = ik_dir() / "ik_llama_cpp" / "lib" / "libllama.so"
    if rec.get("version") != IK_VERSION or rec.get("cmake_args") != list(CMAKE_ARGS) or not lib.is_file():
        return None
    return rec


def have_ik_llama() -> bool:
    return build_record() is not None


def require_ik_llama() -> dict:
    rec = build_record()
    if rec is None:
        raise BaselineError(f"ik_llama.cpp baseline is not built (no complete build in {ik_dir()}): run "
                            "`python -m suites.baselines.ikllama --setup` (or `make test`'s set-up step; "
                            "compiles the fork, ≈5-15 min on 2 cores)")
    return rec


def _run(cmd: list[str], what: str, cwd: Path | None = None) -> None:
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd)
    if r.returncode:
        tail = " | ".join((r.stderr or r.stdout).strip().splitlines()[-3:])
        raise BaselineError(f"ik_llama.cpp set-up failed ({what}): {tail}")


def _build_tools(root: Path, progress: bool) -> tuple[str, str | None]:
    """cmake (and ninja where there is one): the system's, else PyPI's into the build folder (as
    pip's own source builds of llama-cpp-python fetch them)."""
    cmake, ninja = shutil.which("cmake"), shutil.which("ninja")
    if cmake:
        return cmake, ninja
    tools = root / "tools"

    def elf(p: Path) -> bool:
        with open(p, "rb") as f:
            return f.read(4) == b"\x7fELF"

    def binary(name: str) -> str | None:  # the packages' executables, not their Python launchers
        return next((str(p) for p in sorted(tools.rglob(name)) if p.is_file() and elf(p)), None)

    if binary("cmake") is None:
        if progress:
            print("ik_llama.cpp: no cmake on the PATH, installing cmake and ninja from PyPI", file=sys.stderr)
        _run([sys.executable, "-m", "pip", "install", "-q", "--target", str(tools), "cmake", "ninja"], "pip install cmake")
    if binary("cmake") is None:
        raise BaselineError(f"ik_llama.cpp set-up: PyPI's cmake package installed no cmake executable in {tools}")
    return binary("cmake"), binary("ninja")


def _compile(cmake: str, build: Path, progress: bool) -> None:
    """cmake --build for the llama target, shown as a progress bar (ninja's [i/N], make's [ p%])."""
    from tqdm import tqdm

    jobs = str(len(os.sched_getaffinity(0)))
    proc = subprocess.Popen([cmake, "--build", str(build), "--target", "llama", "-j", jobs],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    tail: list[str] = []
    with tqdm(desc="ik_llama.cpp build", unit="file", disable=not progress) as bar:
        for line in proc.stdout:
            tail = (tail + [line.rstrip()])[-20:]
            m = re.match(r"\[(\d+)/(\d+)\]", line) or re.match(r"\[\s*(\d+)()%\]", line)
            if m:
                bar.total = int(m.group(2) or 100)
                bar.n = int(m.group(1))
                bar.refresh()
    if proc.wait():
        errors = [t for t in tail if "error" in t.lower()] or tail
        raise BaselineError(f"ik_llama.cpp build failed: {' | '.join(errors[-3:])}")


def ensure_ik_llama(progress: bool = True) -> dict:
    """The build's stamp; the build is made first if missing: the sdist fetched by pip and checked
    against its SHA-256, the fork's libraries compiled natively, installed beside the sdist's bindings."""
    rec = build_record()
    if rec is not None:
        return rec
    root = ik_dir()
    root.mkdir(parents=True, exist_ok=True)
    cmake, ninja = _build_tools(root, progress)
    _stamp().unlink(missing_ok=True)
    t0 = time.monotonic()
    tarball = root / f"ik_llama_cpp_python-{IK_VERSION}.tar.gz"
    if not tarball.is_file():
        if progress:
            print(f"ik_llama.cpp: fetching the ik-llama-cpp-python {IK_VERSION} sdist", file=sys.stderr)
        _run([sys.executable, "-m", "pip", "download", "-q", "--no-binary", ":all:", "--no-deps",
              f"ik-llama-cpp-python=={IK_VERSION}", "-d", str(root)], "pip download")
    digest = hashlib.sha256(tarball.read_bytes()).hexdigest()
    if digest != SDIST_SHA256:
        tarball.unlink()
        raise BaselineError(f"ik-llama-cpp-python {IK_VERSION} sdist has SHA-256 {digest}, expected {SDIST_SHA256}")
    src = root / "src"
    if not (src / "vendor" / "ik_llama.cpp" / "CMakeLists.txt").is_file():
        shutil.rmtree(src, ignore_errors=True)
        with tarfile.open(tarball) as tar:
            safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}  # Python ≥ 3.11.4
            tar.extractall(root / "unpack", **safe)
        (root / "unpack" / f"ik_llama_cpp_python-{IK_VERSION}").rename(src)
        shutil.rmtree(root / "unpack")
    build = root / "build"
    gen = ["-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}"] if ninja else []
    if progress:
        print(f"ik_llama.cpp: configuring ({' '.join(CMAKE_ARGS)})", file=sys.stderr)
    _run([cmake, "-S", str(src / "vendor" / "ik_llama.cpp"), "-B", str(build), *gen, *CMAKE_ARGS], "cmake configure")
    _compile(cmake, build, progress)
    pkg = root / "ik_llama_cpp"
    shutil.rmtree(pkg, ignore_errors=True)
    shutil.copytree(src / "ik_llama_cpp", pkg)
    (pkg / "lib").mkdir(exist_ok=True)
    for name in ("libllama.so", "libggml.so"):
        found = sorted(build.rglob(name))
        if not found:
            raise BaselineError(f"ik_llama.cpp build made no {name}")
        shutil.copy2(found[0], pkg / "lib" / name)
    rec = {"version": IK_VERSION, "sdist_sha256": SDIST_SHA256, "cmake_args": list(CMAKE_ARGS),
           "build_s": round(time.monotonic() - t0, 1)}
    with Worker(_worker_cmd(), "ik_llama.cpp", timeout_s=120) as w:  # it loads, and names its instructions
        rec["system_info"] = w.call("info")["system_info"]
    shutil.rmtree(build, ignore_errors=True)  # the libraries and bindings are all that is needed now
    shutil.rmtree(src, ignore_errors=True)
    tarball.unlink(missing_ok=True)
    _stamp().write_text(json.dumps(rec, indent=1) + "\n")
    return rec


def _worker_cmd() -> list[str]:
    return [sys.executable, str(WORKER), str(ik_dir())]


def ik_refusal(gguf: Path) -> str | None:
    """Why the fork would refuse this GGUF, or None. Its deepseek2 loader takes llama.cpp's MLA layout
    (one KV head, attn_k_b / attn_v_b) only with DeepSeek's own attention sizes, K 576, V 512, RoPE
    64 and heads a multiple of 4 (it converts those tensors to its layout at load), and aborts
    otherwise ("incompatible DeepSeek model", src/llama-hparams.cpp)."""
    import gguf as gg

    r = gg.GGUFReader(gguf)
    kv = {f.name: f.contents() for f in r.fields.values() if not f.name.startswith("tokenizer.")}
    arch = kv.get("general.architecture")
    if arch != "deepseek2" or kv.get(f"{arch}.attention.head_count_kv") != 1:
        return None
    got = tuple(kv.get(f"{arch}.{k}") for k in ("attention.key_length", "attention.value_length",
                                                 "rope.dimension_count"))
    if got == (576, 512, 64) and kv.get(f"{arch}.attention.head_count", 0) % 4 == 0:
        return None
    return (f"ik_llama.cpp cannot run {gguf.name}: its deepseek2 loader takes llama.cpp's MLA layout only with "
            f"DeepSeek's attention sizes (K 576, V 512, RoPE 64, heads a multiple of 4); this model has "
            f"K {got[0]}, V {got[1]}, RoPE {got[2]}, {kv.get(f'{arch}.attention.head_count')} heads")


class IkLlamaCpp(GgufEngine):
    """A loaded GGUF in an ik_llama.cpp worker, with the fork's settings (default: its best, BEST)."""

    engine = "ik_llama.cpp"

    def __init__(self, gguf: Path, threads: int, n_ctx: int = 4096, n_batch: int = 512, **settings):
        rec = require_ik_llama()
        unknown = set(settings) - set(BEST)
        if unknown:
            raise BaselineError(f"unknown ik_llama.cpp setting(s) {', '.join(sorted(unknown))} (known: {', '.join(BEST)})")
        fork = {**BEST, **settings}
        refusal = ik_refusal(gguf)
        if refusal:
            raise BaselineError(refusal)
        super().__init__(_worker_cmd(), gguf, {"threads": threads, "n_ctx": n_ctx, "n_batch": n_batch, **fork},
                         timeout_s=1800)  # -rtr repacks every weight at load
        self.settings = {"engine": "ik_llama.cpp", "threads": threads, "n_ctx": n_ctx, "n_batch": n_batch,
                         **fork, "flash_attn_batches": False,  # B > 1 sequences: see ikllama_worker._context
                         "gguf": gguf.name, "version": f"ik-llama-cpp-python {IK_VERSION} (sdist)",
                         "system_info": self.info["system_info"], "build": " ".join(CMAKE_ARGS),
                         "build_s": rec.get("build_s"), "model_bytes": self.load["model_bytes"],
                         "rss_load_bytes": self.load["rss_after"] - self.load["rss_before"]}


def main(argv=None) -> int:
    import statistics

    import torch

    from suites.baselines.llamacpp import ensure_gguf

    ap = argparse.ArgumentParser(prog="python -m suites.baselines.ikllama", description=__doc__.splitlines()[0])
    ap.add_argument("--setup", action="store_true", help="only build ik_llama.cpp (the set-up step)")
    ap.add_argument("--model", default="small")
    ap.add_argument("--type", default="bf16", choices=("f32", "bf16", "q8_0", "q4_0"))
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rtr", type=int, choices=(0, 1), default=int(BEST["rtr"]), help="run-time repack")
    args = ap.parse_args(argv)
    try:
        if args.setup:
            rec = ensure_ik_llama()
            print(f"ik_llama.cpp {rec['version']}: {ik_dir()} (built in {rec['build_s']:.0f} s; {rec['system_info']})")
            return 0
        with IkLlamaCpp(ensure_gguf(args.model, args.type), args.threads, rtr=bool(args.rtr)) as ik:
            prompt = torch.randint(2, ik.load["n_vocab"], (args.prompt_len,),
                                   generator=torch.Generator().manual_seed(0)).tolist()
            ik.run_once(prompt, 2)
            runs = [ik.run_once(prompt, args.decode) for _ in range(args.repeats)]
            print(json.dumps({"settings": ik.settings,
                              "pp_tok_s": statistics.median(args.prompt_len / r["ttft_s"] for r in runs),
                              "tg_tok_s": statistics.median(r["decoded"] / r["decode_s"] for r in runs)}, indent=1))
    except BaselineError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
