"""What a knob is: name, type, range or choices, default, reader, help, constraints, and what a
workload must provide to observe it (Provides, CappedBy, SpansContexts).

The bottom of the knob path. Each component declares its own knobs beside the code that reads them
(kernels/cpu_knobs.py, kernels/cuda_knobs.py, engine/knobs.py) with this class; engine.knobs
collects them into the one CATALOGUE that the tuner searches and the engine resolves. Nothing here
imports the engine, so the kernels read their defaults from their own declarations.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kernels.errors import MoetuneError


MACHINE_LIMITS = ("cores", "ranks")  # limits a constraint may name that are not knobs


@dataclass(frozen=True)
class Divides:
    """This knob's value divides knob `other`'s (both searched as powers of two)."""
    other: str

    def depends(self) -> tuple[str, ...]:
        return (self.other,)

    def upper(self, values: dict, limits: dict) -> int:
        return values[self.other]

    def allows(self, value: int, values: dict, limits: dict) -> bool:
        return values[self.other] % value == 0


@dataclass(frozen=True)
class AtMost:
    """This knob's value ≤ `limit`: another knob's value or a machine limit ("cores", "ranks")."""
    limit: str

    def depends(self) -> tuple[str, ...]:
        return (self.limit,) if self.limit not in MACHINE_LIMITS else ()

    def upper(self, values: dict, limits: dict) -> int:
        return values[self.limit] if self.limit in values else limits[self.limit]

    def allows(self, value: int, values: dict, limits: dict) -> bool:
        return value <= self.upper(values, limits)


@dataclass(frozen=True)
class ProductAtMost:
    """This knob × knob `other` ≤ `limit` (a knob or a machine limit), e.g. TP × EP ≤ ranks."""
    other: str
    limit: str

    def depends(self) -> tuple[str, ...]:
        return (self.other,) + ((self.limit,) if self.limit not in MACHINE_LIMITS else ())

    def upper(self, values: dict, limits: dict) -> int:
        cap = values[self.limit] if self.limit in values else limits[self.limit]
        return cap // values[self.other]

    def allows(self, value: int, values: dict, limits: dict) -> bool:
        return value <= self.upper(values, limits)


@dataclass(frozen=True)
class Provides:
    """What an objective's workload gives a knob to act on (tuner/objectives.py fills it from its
    mix of requests; tuner/space.py asks each knob's `observed_by` whether it can be seen)."""
    concurrency: int = 1  # requests in flight together
    prompt_tokens: int = 0  # most prompt tokens one scheduler step could take (a batch's prompts together)
    contexts: tuple[int, ...] = ()  # the context lengths measured (prompt + output tokens)
    kv_tokens: int = 0  # most tokens held in the KV cache at once
    measures_concurrency: bool = False  # the score depends on how requests share the engine (throughput)


@dataclass(frozen=True)
class CappedBy:
    """Values at or above the workload's `quantity` ("concurrency", "prompt_tokens", "kv_tokens")
    all behave alike (a cap the workload never reaches): the knob is observed when that figure is
    above its low end, and searched only up to it."""
    quantity: str

    def observed(self, knob: "Knob", w: Provides) -> bool:
        return getattr(w, self.quantity) > (knob.low or 0)

    def cap(self, w: Provides) -> int | None:
        return getattr(w, self.quantity)

    def __str__(self) -> str:
        return f"{self.quantity.replace('_', ' ')} above its low end"


@dataclass(frozen=True)
class SpansContexts:
    """The best value changes with the context (e.g. MLA's naive form at short contexts, the
    absorbed one at long): observed only by a mix that measures a context ≤ `short` and one
    ≥ `long`, so a value is never chosen once for all from one length."""
    short: int
    long: int

    def observed(self, knob: "Knob", w: Provides) -> bool:
        return bool(w.contexts) and min(w.contexts) <= self.short and max(w.contexts) >= self.long

    def cap(self, w: Provides) -> int | None:
        return None

    def __str__(self) -> str:
        return f"contexts from ≤ {self.short} to ≥ {self.long} tokens"


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
    pow2: bool = False  # the tuner searches powers of two only (block sizes)
    tune: bool = True  # False: a setting, not a speed knob; the tuner leaves it at its default
    constraints: tuple = ()  # Divides / AtMost / ProductAtMost: built into the tuner's space
    # What a workload must provide to observe this knob (CappedBy / SpansContexts; all must hold).
    # Empty: any run of the engine observes it. The system tier searches only observed knobs.
    observed_by: tuple = ()
    # A serving limit (a cap on what the server admits): a profile never lowers it below the
    # default unless an objective that measures concurrency chose it.
    serving_limit: bool = False

    def observed(self, w: Provides) -> tuple[bool, str]:
        """Whether a workload providing `w` can observe this knob, and if not, what it lacks."""
        if self.serving_limit and not w.measures_concurrency:
            return False, "a serving limit: only an objective that measures concurrency may set it"
        for need in self.observed_by:
            if not need.observed(self, w):
                return False, f"needs {need}"
        return True, ""

    def cap(self, w: Provides) -> int | None:
        """The highest value the workload tells apart from higher ones (None: no such cap)."""
        caps = [c for c in (need.cap(w) for need in self.observed_by) if c is not None]
        return min(caps) if caps else None

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
