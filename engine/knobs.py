"""The knob catalogue: every performance setting, declared once (type, range, default, help).

Each component declares its knobs beside its reader: the engine's here, the CPU kernels' in
kernels/cpu_knobs.py, the Triton tiles' in kernels/cuda_knobs.py (below the engine, so the kernels
never import it). CATALOGUE collects them. The engine reads its settings only through
`resolve_knobs`; the tuner builds its search space from CATALOGUE. A value of "auto" is resolved
once at start-up from the hardware.
"""
from __future__ import annotations

import logging
import os
from functools import lru_cache
from typing import Any

from engine.errors import MoetuneError
from kernels.cpu_knobs import CPU_KNOBS
from kernels.cuda_knobs import CUDA_KNOBS
from kernels.knobspec import (AtMost, CappedBy, Divides, Knob, ProductAtMost, Provides,  # noqa: F401 - re-exported
                              SpansContexts)

ENGINE_KNOBS: tuple[Knob, ...] = (
    Knob("threads", int, "auto", "engine", "intra-op threads (auto: the usable cores)",
         low=1, high=1024, auto=True, constraints=(AtMost("cores"),)),
    Knob("threads_prefill", int, "auto", "engine",
         "intra-op threads of a step that feeds a prompt chunk (a mixed step too; auto: `threads`)",
         low=1, high=1024, auto=True, constraints=(AtMost("cores"),)),
    Knob("threads_decode", int, "auto", "engine",
         "intra-op threads of a decode-only step (auto: `threads`)",
         low=1, high=1024, auto=True, constraints=(AtMost("cores"),)),
    Knob("kernel_backend", str, "auto", "engine",
         "kernel backend running every op (auto: the C++ \"cpu\" kernels where they build and run, "
         "else the torch reference)", choices=("auto", "cpu", "reference"), tune=False),
    Knob("kv_block_size", int, 64, "engine/cache", "tokens per paged KV-cache block",
         low=1, high=1024, log=True, pow2=True),
    Knob("max_total_tokens", int, 16384, "engine/scheduler",
         "KV-cache capacity in tokens, all sequences together", low=64, high=1 << 22, log=True,
         tune=False, observed_by=(CappedBy("kv_tokens"),), serving_limit=True),
    Knob("mla_absorb", str, "decode", "engine/models",
         "where MLA uses the weight-absorbed form (else the naive form that expands the latent)",
         choices=("decode", "always", "never"), observed_by=(SpansContexts(512, 2048),)),
    Knob("chunked_prefill_size", int, 512, "engine/scheduler",
         "most prompt tokens prefilled in one step (a longer prompt is split across steps)",
         low=16, high=1 << 16, log=True, observed_by=(CappedBy("prompt_tokens"),)),
    Knob("decode_batch_cap", int, 256, "engine/scheduler",
         "most sequences decoded together in one step", low=1, high=4096, log=True,
         observed_by=(CappedBy("concurrency"),), serving_limit=True),
    Knob("max_running_requests", int, 256, "engine/scheduler",
         "most requests holding KV cache at once (the rest wait)", low=1, high=4096, log=True,
         observed_by=(CappedBy("concurrency"),), serving_limit=True),
    Knob("batch_invariant", bool, False, "engine",
         "compute every matmul one token row at a time and MLA in one (absorbed) form, so a "
         "sequence's result never depends on what it is batched with (slow; for reproducibility)",
         choices=(False, True), tune=False),
    Knob("graph_mode", str, "cpp", "engine",
         "how a decode-only step on the cpu kernels runs its decoder layers: one Python call per op "
         "(eager), or every layer in one call of the C++ decode runner (cpp; kernels/cpu/csrc/runner.cpp). "
         "Steps with prompt tokens, batch_invariant, mla_absorb=never and other backends always run eager",
         choices=("eager", "cpp")),
)

CATALOGUE: dict[str, Knob] = {k.name: k for k in ENGINE_KNOBS + CPU_KNOBS + CUDA_KNOBS}


def resolve_knobs(overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """Defaults overlaid with `overrides` (validated), "auto" resolved for this machine."""
    values = {name: knob.default for name, knob in CATALOGUE.items()}
    for name, value in (overrides or {}).items():
        if name not in CATALOGUE:
            raise MoetuneError(f"unknown knob {name!r} (known: {', '.join(sorted(CATALOGUE))})")
        values[name] = CATALOGUE[name].validate(value)
    if values["threads"] == "auto":
        values["threads"] = len(os.sched_getaffinity(0))
    for name in ("threads_prefill", "threads_decode"):
        if values[name] == "auto":
            values[name] = values["threads"]
    if values["kernel_backend"] == "auto":
        values["kernel_backend"] = auto_kernel_backend()
    check_constraints(values)
    return values


@lru_cache(maxsize=1)
def auto_kernel_backend() -> str:
    """"cpu" when the C++ kernels build and run on this machine (compiled once, cached), else
    "reference", saying why once."""
    from kernels.cpu_build import availability

    ok, why = availability()
    if not ok:
        logging.getLogger("moetune").warning("kernel_backend auto: using the reference kernels (%s)", why)
    return "cpu" if ok else "reference"


def check_constraints(values: dict[str, Any], limits: dict | None = None,
                      catalogue: dict[str, Knob] | None = None) -> None:
    """Raise MoetuneError for a constraint between knobs that `values` break.

    Constraints on machine limits ("cores", "ranks") are checked only when `limits` names them:
    the tuner never leaves them, a user may (oversubscribing cores, say)."""
    limits = limits or {}
    for knob in (catalogue or CATALOGUE).values():
        for con in knob.constraints:
            needed = [d for d in con.depends() if not isinstance(values.get(d), int)]
            machine = getattr(con, "limit", None)
            if needed or (machine and machine not in values and machine not in limits):
                continue
            if isinstance(values.get(knob.name), int) and not con.allows(values[knob.name], values, limits):
                raise MoetuneError(f"knob {knob.name}={values[knob.name]} breaks {con} "
                                   f"(values: { {d: values.get(d) for d in con.depends()} })")
