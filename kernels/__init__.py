"""Every op of the engine, behind one interface with interchangeable backends.

A backend is a module exposing the functions named in OPS with the signatures of
`kernels.reference` (the readable oracle). Backends are imported lazily, so a CPU-only machine
never imports Triton. Nothing here imports the engine.
"""
from __future__ import annotations

import importlib
from types import ModuleType

OPS = (
    "rms_norm", "add_rms_norm", "silu_and_mul", "rope", "linear", "head_linear",
    "grouped_topk", "fused_moe", "extend_attention", "mla_decode", "paged_decode", "paged_extend",
)

_BACKENDS: dict[str, str] = {
    "reference": "kernels.reference",
    "cpu": "kernels.cpu",  # AVX-512 C++ kernels, compiled on first use (kernels/cpu_build.py)
    "cuda": "kernels.cuda.backend",  # Triton; imported only when asked for (GPU machines)
}
_loaded: dict[str, ModuleType] = {}


def register_backend(name: str, module_path: str) -> None:
    """Declare a backend by the import path of its module (imported on first use)."""
    _BACKENDS[name] = module_path


def available_backends() -> list[str]:
    return sorted(_BACKENDS)


def get_backend(name: str = "reference") -> ModuleType:
    """The backend module; raises KeyError for an unknown name, ImportError if it lacks an op."""
    if name not in _loaded:
        if name not in _BACKENDS:
            raise KeyError(f"unknown kernel backend {name!r} (known: {', '.join(available_backends())})")
        module = importlib.import_module(_BACKENDS[name])
        missing = [op for op in OPS if not hasattr(module, op)]
        if missing:
            raise ImportError(f"kernel backend {name!r} lacks ops: {', '.join(missing)}")
        _loaded[name] = module
    return _loaded[name]
