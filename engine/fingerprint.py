"""Machine fingerprint: what a measured figure depends on (CPU, ISA, memory, libraries, commit).

In the engine, below its readers: profile lookup (engine.profile), the result store's provenance
and the tuner (tuner.fingerprint re-exports it).
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
from functools import lru_cache
from pathlib import Path

ISA_FLAGS = ("avx2", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx512_bf16",
             "amx_tile", "amx_bf16", "amx_int8", "avx_vnni")


def _cpuinfo() -> dict[str, str]:
    info: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if ":" in line:
                k, v = (s.strip() for s in line.split(":", 1))
                info.setdefault(k, v)
    except OSError:
        pass
    return info


def _mem_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 0


def _sysfs_int_dirs(pattern: str) -> int:
    return len(list(Path("/sys/devices/system").glob(pattern)))


def _topology() -> dict:
    """Sockets, physical cores, SMT threads per core and NUMA nodes (from /proc and /sys)."""
    sockets, cores = set(), set()
    phys = core = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("physical id"):
                phys = line.split(":")[1].strip()
            elif line.startswith("core id"):
                core = line.split(":")[1].strip()
            elif not line.strip() and phys is not None:
                sockets.add(phys)
                cores.add((phys, core))
                phys = core = None
    except OSError:
        pass
    logical = os.cpu_count() or 1
    return {"sockets": max(1, len(sockets)), "physical_cores": max(1, len(cores)),
            "smt": max(1, logical // max(1, len(cores))), "numa_nodes": max(1, _sysfs_int_dirs("node/node[0-9]*"))}


def _caches() -> str:
    """Per-level cache sizes of CPU 0, e.g. "L1d:32K,L1i:32K,L2:1024K,L3:33792K"."""
    out = []
    for d in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            level, kind, size = ((d / f).read_text().strip() for f in ("level", "type", "size"))
        except OSError:
            continue
        out.append(f"L{level}{ {'Data': 'd', 'Instruction': 'i'}.get(kind, '')}:{size}")
    return ",".join(out)


def _kernel_variants(flags: set[str]) -> dict:
    """The cpu kernels' ISA variants by the CPU's flags (no build): those that run natively, and those
    that run here only on the C++ model of their instructions (tests), e.g.
    "cpu_int8_isa=avx512,vnni;cpu_bf16_isa=avx512" and "cpu_bf16_isa=avx512bf16"."""
    from kernels.cpu_build import selected_build
    from kernels.cpu_knobs import variants_for

    build = selected_build()
    v = variants_for(flags, build)
    pick = lambda how: ";".join(f"{k}=" + ",".join(n for n, h in d.items() if h == how)  # noqa: E731
                                for k, d in v.items() if how in d.values())
    return {"cpu_kernel_build": build or "none", "cpu_kernel_variants": pick("native"),
            "cpu_kernel_variants_model_only": pick("model")}


def _gpus() -> dict:
    """CUDA devices when present: name, compute capability, memory (GiB), count."""
    try:
        import torch

        if not torch.cuda.is_available():
            return {"gpu_count": 0}
        p = torch.cuda.get_device_properties(0)
        return {"gpu_count": torch.cuda.device_count(), "gpu_name": p.name,
                "gpu_capability": f"{p.major}.{p.minor}", "gpu_memory_gib": round(p.total_memory / 2**30, 1)}
    except Exception:  # a broken driver must not stop a CPU run
        return {"gpu_count": 0}


def _versions() -> str:
    """Versions of the libraries a figure depends on (those installed)."""
    from importlib import metadata

    found = []
    for name in ("numpy", "triton", "optuna", "transformers"):
        try:
            found.append(f"{name}={metadata.version(name)}")
        except metadata.PackageNotFoundError:
            pass
    return ",".join(found)


def _dirty() -> bool:
    """True when the work tree has uncommitted changes to tracked files."""
    try:
        root = Path(__file__).resolve().parent.parent
        out = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                             capture_output=True, text=True, timeout=5)
        return bool(out.stdout.strip())
    except (OSError, subprocess.SubprocessError):
        return False


def _commit() -> str:
    try:
        root = Path(__file__).resolve().parent.parent
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=5)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


@lru_cache(maxsize=1)
def fingerprint() -> dict:
    """A flat dict of facts; `hardware_key` is coarse (for profile lookup), `hash` is the full one."""
    import torch

    cpu = _cpuinfo()
    flags = set(cpu.get("flags", "").split())
    fp = {
        "cpu_model": cpu.get("model name", platform.processor()),
        "cpu_family_model_stepping": f"{cpu.get('cpu family', '?')}/{cpu.get('model', '?')}/{cpu.get('stepping', '?')}",
        "cores_usable": len(os.sched_getaffinity(0)),
        **_topology(),
        "caches": _caches(),
        "isa": ",".join(f for f in ISA_FLAGS if f in flags),
        **_kernel_variants(flags),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "memory_gib": round(_mem_bytes() / 2**30, 1),
        **_gpus(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "libraries": _versions(),
        "commit": _commit(),
        "dirty": _dirty(),
    }
    coarse = {k: fp[k] for k in ("cpu_model", "cores_usable", "isa")}
    if fp["gpu_count"]:
        coarse.update({k: fp[k] for k in ("gpu_name", "gpu_count")})
    fp["hardware_key"] = hashlib.sha1(json.dumps(coarse, sort_keys=True).encode()).hexdigest()[:12]
    fp["hash"] = hashlib.sha1(json.dumps(fp, sort_keys=True).encode()).hexdigest()[:12]
    return fp


def describe(fp: dict) -> str:
    """One line a person reads: CPU, cores, ISA, memory, GPUs, torch (a stored fingerprint may
    lack fields: those are left out)."""
    parts = [fp.get("cpu_model") or "unknown CPU"]
    if fp.get("cores_usable"):
        topo = [f"{fp[k]} {name}" for k, name in (("sockets", "socket"), ("physical_cores", "physical cores"),
                                                   ("numa_nodes", "NUMA node")) if fp.get(k)]
        parts.append(f"{fp['cores_usable']} cores usable" + (f" ({', '.join(topo)})" if topo else ""))
    if fp.get("isa"):
        parts.append(fp["isa"].replace(",", " "))
    if fp.get("memory_gib"):
        parts.append(f"{fp['memory_gib']} GiB")
    if fp.get("gpu_count"):
        parts.append(f"{fp['gpu_count']}× {fp.get('gpu_name', 'GPU')} ({fp.get('gpu_memory_gib', '?')} GiB)")
    elif "gpu_count" in fp:
        parts.append("no GPU")
    if fp.get("torch"):
        parts.append(f"torch {fp['torch']}")
    return " · ".join(str(p) for p in parts)
