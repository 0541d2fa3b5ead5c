"""The search space, read from the knob catalogue: one Optuna parameter per tunable knob.

    int range            suggest_int(name, low, high, log)       upper bound lowered by constraints
    int, pow2=True       suggest_int("log2_" + name, e_lo, e_hi)  value = 2**e; Divides ⇒ e ≤ log2(other)
    choices / bool       suggest_categorical(name, choices)

Constraints between knobs (engine.knobs: Divides, AtMost, ProductAtMost) become *dynamic upper
bounds*: a knob is sampled after the knobs it depends on, and its range is cut to what they allow,
so a sampled configuration never breaks one (nothing is rejected after sampling). Machine limits
("cores", "ranks") come from `limits`.

Given the objective's workload (`workload`: a knobspec.Provides), only the knobs it can observe
are searched (Knob.observed: serving limits only under an objective that measures concurrency,
CappedBy knobs only when the workload reaches above their low end, SpansContexts knobs only when
the mix spans the contexts); the others stay at their defaults and are listed in `skipped` with
the reason. A CappedBy knob is searched up to the workload's figure (`caps`): higher values all
behave like it, so its default is clipped there and a value at the cap is no change.
"""
from __future__ import annotations

import hashlib
import math
import os
from dataclasses import dataclass, field
from typing import Any

from engine.errors import MoetuneError
from engine.knobs import CATALOGUE, Knob, Provides, check_constraints, resolve_knobs


def machine_limits() -> dict[str, int]:
    """The limits constraints may name: usable cores, ranks (processes of a parallel run; 1 here)."""
    cores = len(os.sched_getaffinity(0))
    return {"cores": cores, "ranks": int(os.environ.get("WORLD_SIZE", "1"))}


def _order(knobs: list[Knob]) -> list[Knob]:
    """Knobs sorted so each comes after the searched knobs its constraints depend on."""
    by_name, done, out = {k.name: k for k in knobs}, set(), []

    def visit(k: Knob, stack: tuple = ()) -> None:
        if k.name in done:
            return
        if k.name in stack:
            raise MoetuneError(f"knob constraints form a cycle: {' → '.join(stack + (k.name,))}")
        for con in k.constraints:
            for dep in con.depends():
                if dep in by_name:
                    visit(by_name[dep], stack + (k.name,))
        done.add(k.name)
        out.append(k)

    for k in knobs:
        visit(k)
    return out


def param_name(knob: Knob) -> str:
    return f"log2_{knob.name}" if knob.pow2 else knob.name


@dataclass
class SearchSpace:
    """The tunable knobs of `catalogue` selected by `names` (default: every knob with tune=True)."""
    knobs: list[Knob]
    limits: dict[str, int]
    fixed: dict[str, Any]  # knobs held at their (resolved) value: the rest of the catalogue
    caps: dict[str, int] = field(default_factory=dict)  # CappedBy knobs: highest value the workload tells apart
    skipped: dict[str, str] = field(default_factory=dict)  # knob → why the workload cannot observe it

    @classmethod
    def from_catalogue(cls, names=None, catalogue: dict[str, Knob] | None = None,
                       limits: dict | None = None, exclude_components=("kernels",),
                       workload: Provides | None = None) -> "SearchSpace":
        cat = catalogue if catalogue is not None else CATALOGUE
        if names is None:
            names = [k.name for k in cat.values()
                     if k.tune and not k.component.startswith(tuple(exclude_components))]
        unknown = [n for n in names if n not in cat]
        if unknown:
            raise MoetuneError(f"unknown knobs {unknown} (known: {', '.join(sorted(cat))})")
        skipped, caps = {}, {}
        if workload is not None:
            for n in names:
                ok, why = cat[n].observed(workload)
                if not ok:
                    skipped[n] = why
                elif cat[n].cap(workload) is not None and cat[n].choices is None and cat[n].type is int:
                    caps[n] = min(cat[n].high, cat[n].cap(workload))
            names = [n for n in names if n not in skipped]
        searched = _order([cat[n] for n in names])
        for k in searched:
            _check_searchable(k, cat)
        defaults = resolve_knobs() if cat is CATALOGUE else {k.name: k.default for k in cat.values()}
        fixed = {n: v for n, v in defaults.items() if n not in names}
        return cls(searched, limits if limits is not None else machine_limits(), fixed, caps, skipped)

    @property
    def names(self) -> list[str]:
        return [k.name for k in self.knobs]

    def signature(self) -> str:
        """A short hash of what Optuna fixes per study: each searched knob's name and kind, and the
        choices of a categorical one. Where a stored study sampled other choices than today's (a kernel
        variant added since), the tuner resumes `<name>-<signature>` instead (tuner.search.Tuner)."""
        parts = [f"{k.name}:{k.type.__name__}:{list(k.choices) if k.choices is not None else ('pow2' if k.pow2 else k.log)}"
                 for k in self.knobs]
        return hashlib.sha1("|".join(parts).encode()).hexdigest()[:8]

    def suggest(self, trial) -> dict[str, Any]:
        """Sample one configuration (searched knobs only) through an Optuna trial."""
        values = dict(self.fixed)
        for k in self.knobs:
            values[k.name] = self._suggest_one(trial, k, values)
        return {n: values[n] for n in self.names}

    def _suggest_one(self, trial, k: Knob, values: dict) -> Any:
        if k.choices is not None:
            return trial.suggest_categorical(k.name, list(k.choices))
        if k.type is bool:
            return trial.suggest_categorical(k.name, [False, True])
        low, high = self.bounds(k, values)
        if k.pow2:
            return 2 ** trial.suggest_int(param_name(k), _log2_ceil(low), _log2_floor(high))
        return trial.suggest_int(k.name, low, high, log=k.log)

    def bounds(self, k: Knob, values: dict) -> tuple[int, int]:
        """The integer range of `k` given the knobs sampled before it."""
        high = min(k.high, self.caps.get(k.name, k.high))
        for con in k.constraints:
            high = min(high, con.upper(values, self.limits))
        if high < k.low:
            raise MoetuneError(f"knob {k.name}: constraints leave no value (≤ {high} < low {k.low})")
        return k.low, high

    def params_of(self, knobs: dict[str, Any]) -> dict[str, Any]:
        """The Optuna parameters that produce `knobs` (for enqueue_trial); knobs outside the space are dropped."""
        params = {}
        for k in self.knobs:
            if k.name not in knobs:
                continue
            v = knobs[k.name]
            params[param_name(k)] = int(math.log2(v)) if k.pow2 else v
        return params

    def contains(self, knobs: dict[str, Any]) -> bool:
        """True when `knobs` (searched knobs) could have been sampled: in range, constraints kept."""
        values = {**self.fixed, **knobs}
        for k in self.knobs:
            v = values.get(k.name)
            if k.choices is not None or k.type is bool:
                if v not in (k.choices or (False, True)):
                    return False
                continue
            low, high = self.bounds(k, values)
            if not isinstance(v, int) or not low <= v <= high or (k.pow2 and v & (v - 1)):
                return False
        try:
            check_constraints(values, self.limits, {k.name: k for k in self.knobs})
        except MoetuneError:
            return False
        return True

    def knobs_of_params(self, params: dict[str, Any]) -> dict[str, Any]:
        """Inverse of params_of: a finished trial's parameters as knob values."""
        return {k.name: (2 ** params[param_name(k)] if k.pow2 else params[param_name(k)])
                for k in self.knobs if param_name(k) in params}


def _check_searchable(k: Knob, cat: dict[str, Knob]) -> None:
    if k.choices is None and k.type is int and (k.low is None or k.high is None):
        raise MoetuneError(f"knob {k.name}: an int knob needs low/high or choices to be searched")
    for con in k.constraints:
        if type(con).__name__ == "Divides" and not (k.pow2 and cat[con.other].pow2):
            raise MoetuneError(f"knob {k.name}: Divides({con.other}) needs both knobs pow2=True")


def _log2_ceil(x: int) -> int:
    return max(0, math.ceil(math.log2(x)))


def _log2_floor(x: int) -> int:
    return int(math.floor(math.log2(x)))
