"""Machine fingerprint: what a measured figure depends on (CPU, ISA, memory, libraries, commit)."""
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
        "isa": ",".join(f for f in ISA_FLAGS if f in flags),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "memory_gib": round(_mem_bytes() / 2**30, 1),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "commit": _commit(),
    }
    coarse = {k: fp[k] for k in ("cpu_model", "cores_usable", "isa")}
    fp["hardware_key"] = hashlib.sha1(json.dumps(coarse, sort_keys=True).encode()).hexdigest()[:12]
    fp["hash"] = hashlib.sha1(json.dumps(fp, sort_keys=True).encode()).hexdigest()[:12]
    return fp
