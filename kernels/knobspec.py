"""What a knob is: name, type, range or choices, default, reader, help, constraints.

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
