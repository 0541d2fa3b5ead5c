"""The knob catalogue: every performance setting, declared once (type, range, default, help).

The engine reads its settings only through `resolve_knobs`; the tuner builds its search space from
CATALOGUE. A value of "auto" is resolved once at start-up from the hardware.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from engine.errors import MoetuneError


@dataclass(frozen=True)
class Knob:
    name: str
    type: type  # int | str | bool
    default: Any
    component: str  # who reads it
    help: str
    choices: tuple | None = None  # categorical values
    low: int | None = None  # integer range, inclusive
    high: int | None = None
    log: bool = False  # search the integer range on a log scale
    auto: bool = False  # "auto" is allowed and resolved from the hardware

    def validate(self, value: Any) -> Any:
        if self.auto and value == "auto":
            return value
        if self.type is int and isinstance(value, str) and value.strip().lstrip("-").isdigit():
            value = int(value)
        if self.type is bool and isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
            value = value.lower() in ("true", "1")
        if not isinstance(value, self.type) or (self.type is int and isinstance(value, bool)):
            raise MoetuneError(f"knob {self.name}: {value!r} is not a {self.type.__name__}")
        if self.choices is not None and value not in self.choices:
            raise MoetuneError(f"knob {self.name}: {value!r} is not one of {list(self.choices)}")
        if self.low is not None and not self.low <= value <= self.high:
            raise MoetuneError(f"knob {self.name}: {value} is outside [{self.low}, {self.high}]")
        return value


CATALOGUE: dict[str, Knob] = {k.name: k for k in (
    Knob("threads", int, "auto", "engine", "intra-op threads (auto: the usable cores)",
         low=1, high=1024, auto=True),
    Knob("kernel_backend", str, "reference", "engine", "kernel backend running every op",
         choices=("reference",)),
    Knob("kv_block_size", int, 64, "engine/cache", "tokens per paged KV-cache block",
         low=1, high=1024, log=True),
    Knob("max_total_tokens", int, 16384, "engine/scheduler",
         "KV-cache capacity in tokens, all sequences together", low=64, high=1 << 22, log=True),
    Knob("mla_absorb", str, "decode", "engine/models",
         "where MLA uses the weight-absorbed form (else the naive form that expands the latent)",
         choices=("decode", "always", "never")),
    Knob("chunked_prefill_size", int, 512, "engine/scheduler",
         "most prompt tokens prefilled in one step (a longer prompt is split across steps)",
         low=16, high=1 << 16, log=True),
    Knob("decode_batch_cap", int, 256, "engine/scheduler",
         "most sequences decoded together in one step", low=1, high=4096, log=True),
    Knob("max_running_requests", int, 256, "engine/scheduler",
         "most requests holding KV cache at once (the rest wait)", low=1, high=4096, log=True),
    Knob("batch_invariant", bool, False, "engine",
         "compute every matmul one token row at a time and MLA in one (absorbed) form, so a "
         "sequence's result never depends on what it is batched with (slow; for reproducibility)",
         choices=(False, True)),
)}


def resolve_knobs(overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """Defaults overlaid with `overrides` (validated), "auto" resolved for this machine."""
    values = {name: knob.default for name, knob in CATALOGUE.items()}
    for name, value in (overrides or {}).items():
        if name not in CATALOGUE:
            raise MoetuneError(f"unknown knob {name!r} (known: {', '.join(sorted(CATALOGUE))})")
        values[name] = CATALOGUE[name].validate(value)
    if values["threads"] == "auto":
        values["threads"] = len(os.sched_getaffinity(0))
    return values
