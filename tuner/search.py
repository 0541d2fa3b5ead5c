"""The Optuna search: trials over a SearchSpace against an Objective, then a confirmation round.

    tuner = Tuner(space, objective, TuneConfig(trials=30), storage=None)   # SQLite in the results folder
    result = tuner.run()          # → TuneResult: best knobs, confirmation (gain over defaults ± spread)

One trial: knobs sampled (TPE, multivariate) → objective.prepare(knobs) (load / build / verify
against the reference: a wrong answer raises WrongAnswer) → warm-up calls → repeats, each giving
one sample per metric; the value is the median, every sample is kept (Parquet store, suite
"autotune"). A trial whose best of its first two repeats is clearly worse than the best so far
(factor `prune_factor`) is pruned. Failures (exceptions, wrong answers, timeouts, out of memory) are told to
Optuna as FAIL and stored with their reason: they can never be chosen.

The first trials are the defaults and the last profile's knobs (enqueue_trial). The study lives in
an Optuna storage (SQLite by default, PostgreSQL via a URL: several processes tune one study) and is
resumed by name; `trials` is the study's total, so a rerun after Ctrl-C does the rest.

Before anything is written, `confirm` re-measures the best few and the defaults alternately, round
by round (at least three rounds, a time budget notwithstanding); a candidate is kept only if its gain
over the defaults, paired round by round, stays above zero across the spread (p10 of the paired
gains > 0).

Workload mixes. An objective may measure several points (`points`: labels such as `prompt 128/16`,
`batch 4 × 128/16`); its runner then returns one sample per (metric, point) under
`sample_key(metric, point)`. The confirmation keeps a candidate only if, besides winning overall,
it is not slower than the defaults beyond the spread at ANY point (`slower_at`: the upper quartile
of the paired gains at a point below zero rejects it).

Drift is measured, not learned (relative scoring: on when `defaults_every` is set or the objective
has several points). The defaults are measured at the start of each run and again after every
`defaults_every` trials, interleaved with the trials; each trial's value is, per metric, the
geometric mean over the points of its median divided by the defaults' median in the latest such
measurement (1.0: as fast as the defaults; lower is better for minimize, higher for maximize).
Stored for the report:
    study user attr  "defaults:<unix time>:<pid>" = {"after_trials": trials finished at that time,
                     "time": unix seconds, "medians": {sample key: median}, "run_id"}
    trial user attrs "raw" {sample key: median}, "baseline" (the defaults measurement's attr key),
                     "ratios" {sample key: median / the defaults' median}
    result store     suite "autotune-defaults": one row per (metric, point) per defaults
                     measurement (trial empty, extra.after_trials, extra.baseline);
                     suite "autotune": per trial one row per metric named "<metric>/defaults"
                     (unit "ratio", one sample per repeat: the geometric mean over the points of
                     that repeat's ratios; what the search saw, drift taken out);
                     suite "autotune-points": per trial one row per (metric, point), raw
                     (workload: the point; extra.point, extra.baseline);
                     suite "autotune-confirm": per candidate one row per (metric, point).
    Without relative scoring (one point, no `defaults_every`) the "autotune" rows are the raw
    metrics, as before.
"""
from __future__ import annotations

import logging
import math
import os
import statistics
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import optuna

from results.store import append_rows, new_run_id, results_dir, stats
from tuner.space import SearchSpace

log = logging.getLogger("moetune")


class TrialFailure(Exception):
    """A configuration that did not produce a valid measurement; `status` goes to the store."""
    status = "failed"


class WrongAnswer(TrialFailure):
    status = "wrong"


class TrialTimeout(TrialFailure):
    status = "timeout"


MIN_CONFIRM_ROUNDS = 3  # the confirmation's rounds, whatever the time budget (see Tuner.confirm)
# A candidate's confirmed gain over the defaults may exceed the gain the study measured for the same two
# configurations by at most this factor (as ratios of their times): beyond it, one side ran under load the
# other did not (session 35: a clean-clone `make run` beside a pytest confirmed +205 % for a fused MoE table
# that the end-to-end check then measured at -10.8 %). Uniform drift slows both sides and passes.
MAX_GAIN_INFLATION = 1.5


def sample_key(metric: str, point: str = "") -> str:
    """The runner's key for one metric at one workload point ("tpot_s @ prompt 128/16")."""
    return f"{metric} @ {point}" if point else metric


def _points(obj) -> tuple[str, ...]:
    return tuple(getattr(obj, "points", None) or ("",))


def _geomean(xs) -> float:
    xs = list(xs)
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs and all(x > 0 for x in xs) else math.nan


@dataclass(frozen=True)
class Metric:
    name: str  # e.g. "tpot_s"
    direction: str  # "minimize" | "maximize"
    unit: str = ""

    def better(self, a: float, b: float) -> bool:
        return a < b if self.direction == "minimize" else a > b

    def gain(self, tuned: float, default: float) -> float:
        """Relative gain of `tuned` over `default` (0.25: 25 % better, whichever the direction)."""
        return default / tuned - 1.0 if self.direction == "minimize" else tuned / default - 1.0


class Objective(Protocol):
    """What a tier measures. prepare(knobs) builds a runner (may raise TrialFailure); each call of
    the runner is one repeat and returns one sample per metric (per metric and point, keyed by
    sample_key, when the objective has `points`; `workload_of(point)` then names each point)."""
    name: str
    metrics: tuple[Metric, ...]
    model: str
    format: str
    workload: dict

    def prepare(self, knobs: dict[str, Any]) -> Callable[[], dict[str, float]]: ...


@dataclass
class TuneConfig:
    trials: int | None = None  # total finished trials of the study (resume: the rest)
    time_budget_s: float | None = None  # wall time of this run, confirmation included
    warmup: int = 1
    repeats: int = 3
    prune_factor: float = 1.5  # a trial whose first two repeats are this much worse is pruned
    trial_timeout_s: float | None = None
    finalists: int = 3  # candidates re-measured against the defaults
    confirm_rounds: int = 3
    defaults_every: int | None = None  # re-measure the defaults after this many trials (relative scoring)
    seed: int | None = None
    progress: bool = True


class ClearlyWorsePruner(optuna.pruners.BasePruner):
    """Prunes a trial whose reported value is `factor` times worse than the best completed value."""

    def __init__(self, factor: float):
        self.factor = factor

    def prune(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> bool:
        step = trial.last_step
        done = [t.value for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))]
        if step is None or not done:
            return False
        value = trial.intermediate_values[step]
        if study.direction == optuna.study.StudyDirection.MINIMIZE:
            return value > min(done) * self.factor
        return value < max(done) / self.factor


def default_storage() -> str:
    path = results_dir() / "optuna.sqlite3"
    path.parent.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{path}"


def open_study(name: str, metrics: tuple[Metric, ...], storage, cfg: TuneConfig) -> optuna.Study:
    """Create or resume the study `name` (TPE multivariate, clearly-worse pruner) in `storage`:
    a URL (sqlite:///..., postgresql://...), ":memory:", an Optuna storage, or None (SQLite in
    the results folder)."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    if isinstance(storage, optuna.storages.BaseStorage):
        store = storage
    elif storage == ":memory:":  # for tests and throw-away runs
        store = optuna.storages.InMemoryStorage()
    else:
        store = _rdb_storage(storage or default_storage())
    sampler = optuna.samplers.TPESampler(multivariate=True, seed=cfg.seed, n_startup_trials=5)
    dirs = [m.direction for m in metrics]
    return optuna.create_study(storage=store, study_name=name, sampler=sampler, load_if_exists=True,
                               pruner=ClearlyWorsePruner(cfg.prune_factor) if len(dirs) == 1 else None,
                               directions=dirs)


def _rdb_storage(url: str, attempts: int = 5) -> optuna.storages.RDBStorage:
    """Open (and on first use create) an RDB storage; processes racing to create its tables retry."""
    for i in range(attempts):
        try:
            return optuna.storages.RDBStorage(url)
        except Exception:  # noqa: BLE001 - sqlalchemy's IntegrityError/ProgrammingError from the race
            if i == attempts - 1:
                raise
            time.sleep(0.5 * (i + 1))
    raise AssertionError("unreachable")


@dataclass
class Candidate:
    label: str  # "defaults" or "trial N"
    knobs: dict
    samples: dict[str, list[float]] = field(default_factory=dict)  # per sample key
    gains: dict[str, list[float]] = field(default_factory=dict)  # paired with the defaults, per round:
    # per sample key, and per metric name (the geometric mean over the points of each round's ratios)
    note: str = ""  # why the confirmation did not keep it
    study: dict[str, float] = field(default_factory=dict)  # per sample key, its median in the study (if measured)
    study_defaults: dict[str, float] = field(default_factory=dict)  # ... and the defaults' in the study, then

    def gain(self, metric: str) -> dict:
        g = self.gains.get(metric, [])
        s = stats(g)
        return {"median": s["median"], "low": s["p10"], "high": s["p90"]}


@dataclass
class TuneResult:
    study: str
    best_trial: int | None
    knobs: dict  # the kept knob set ({} when nothing beat the defaults)
    kept: bool
    candidates: list[Candidate]
    metrics: tuple[Metric, ...]
    trials_done: int
    interrupted: bool = False

    @property
    def winner(self) -> Candidate | None:
        return next((c for c in self.candidates if c.knobs == self.knobs and c.label != "defaults"), None) \
            if self.kept else None


def _choices_changed(study, space: SearchSpace) -> bool:
    """Whether a stored trial of `study` sampled a categorical knob of `space` from other choices than
    the space's today (Optuna refuses to resume such a study: "dynamic value space")."""
    now = {k.name: tuple(k.choices) if k.choices is not None else (False, True)
           for k in space.knobs if k.choices is not None or k.type is bool}
    for t in study.get_trials(deepcopy=False):
        for name, dist in t.distributions.items():
            if name in now and isinstance(dist, optuna.distributions.CategoricalDistribution) \
                    and tuple(dist.choices) != now[name]:
                return True
    return False


class Tuner:
    """Runs one study: search trials, then the confirmation that decides the kept knob set."""

    def __init__(self, space: SearchSpace, objective: Objective, cfg: TuneConfig,
                 storage: str | None = None, study_name: str | None = None,
                 prior: dict | None = None, suite: str = "autotune", prior_label: str = "last profile"):
        self.space, self.obj, self.cfg, self.suite = space, objective, cfg, suite
        self.study_name = study_name or f"{objective.name}-{objective.model}-{objective.format}"
        self.study = open_study(self.study_name, objective.metrics, storage, cfg)
        if _choices_changed(self.study, space):  # a kernel variant added or removed since: Optuna would fail
            self.study = open_study(f"{self.study_name}-{space.signature()}", objective.metrics, storage, cfg)
        self.prior, self.prior_label, self.run_id = prior, prior_label, new_run_id()
        self.defaults = _defaults(space)
        self._call_s: list[float] = []  # seconds per runner call, to size the confirmation
        self._prepare_s: list[float] = []
        self._deadline = math.inf
        self.points = _points(objective)
        self.keys = [(m, p, sample_key(m.name, p)) for m in objective.metrics for p in self.points]
        self.relative = cfg.defaults_every is not None or len(self.points) > 1
        self.baseline: dict[str, float] = {}  # the latest measurement of the defaults: sample key → median
        self.baseline_key = ""
        self._since_baseline = 0

    # ------------------------------------------------------------ search

    def run(self, on_trial: Callable[["Tuner", optuna.trial.FrozenTrial], None] | None = None) -> TuneResult:
        """Search until `trials` or the time budget, then confirm; Ctrl-C stops cleanly."""
        t0 = time.monotonic()
        self._deadline = t0 + self.cfg.time_budget_s if self.cfg.time_budget_s is not None else math.inf
        self._enqueue_seeds()
        interrupted = False
        try:
            while self._more(t0):
                if self.relative and (not self.baseline or (self.cfg.defaults_every is not None and
                                                            self._since_baseline >= self.cfg.defaults_every)):
                    self.measure_defaults()
                frozen = self._one_trial()
                self._since_baseline += 1
                if on_trial:
                    on_trial(self, frozen)
        except KeyboardInterrupt:
            interrupted = True
        if interrupted:
            return TuneResult(self.study_name, None, {}, False, [], self.obj.metrics, self.finished(), True)
        return self.confirm()

    def finished(self) -> int:
        states = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED, optuna.trial.TrialState.FAIL)
        return len(self.study.get_trials(deepcopy=False, states=states))

    def _more(self, t0: float) -> bool:
        if self.cfg.trials is not None and self.finished() >= self.cfg.trials:
            return False
        if self.cfg.time_budget_s is None:
            return self.cfg.trials is not None
        left = self.cfg.time_budget_s - (time.monotonic() - t0)
        return left > 1.5 * self.confirm_estimate_s() + self.trial_estimate_s()  # margin: noisy machines

    def trial_estimate_s(self) -> float:
        """One trial, with its share of the defaults' re-measurements."""
        call = statistics.median(self._call_s) if self._call_s else 0.0
        prep = statistics.median(self._prepare_s) if self._prepare_s else 0.0
        share = 1.0 + (1.0 / self.cfg.defaults_every if self.relative and self.cfg.defaults_every else 0.0)
        return share * (prep + call * (self.cfg.warmup + self.cfg.repeats))

    # ------------------------------------------------------------ drift: the defaults, re-measured

    def measure_defaults(self) -> dict[str, float]:
        """Measure the defaults now (warm-up, repeats); they become the baseline of the next trials."""
        from engine.errors import MoetuneError

        samples: dict[str, list[float]] = {}
        try:
            t = time.monotonic()
            runner = self.obj.prepare(dict(self.defaults))
            self._prepare_s.append(time.monotonic() - t)
            for _ in range(self.cfg.warmup):
                self._timed_call(runner, math.inf)
            for _ in range(self.cfg.repeats):
                for name, value in self._timed_call(runner, math.inf).items():
                    samples.setdefault(name, []).append(float(value))
        except TrialFailure as e:
            raise MoetuneError(f"the defaults cannot be measured: {e}") from None
        self.baseline = {key: statistics.median(samples[key]) for _, _, key in self.keys}
        self.baseline_key = f"defaults:{time.time():.3f}:{os.getpid()}"
        self._since_baseline = 0
        self.study.set_user_attr(self.baseline_key, {"after_trials": self.finished(), "time": time.time(),
                                                     "medians": self.baseline, "run_id": self.run_id})
        self._store(None, self.defaults, samples, "ok", "", suite="autotune-defaults", label="defaults",
                    extra={"after_trials": self.finished(), "baseline": self.baseline_key})
        return self.baseline

    def ratios(self, samples: dict[str, list[float]], i: int | None = None) -> dict[str, float]:
        """Each sample key's median (or its i-th sample) over the baseline's median."""
        return {key: (statistics.median(samples[key]) if i is None else samples[key][i]) / self.baseline[key]
                if self.baseline.get(key) else math.nan for _, _, key in self.keys}

    def score(self, samples: dict[str, list[float]], i: int | None = None) -> list[float]:
        """The trial's value per metric: relative, the geometric mean of its ratios over the points;
        else the median."""
        if not self.relative:
            keys = [sample_key(m.name, self.points[0]) for m in self.obj.metrics]  # one point
            return [statistics.median(samples[k]) if i is None else samples[k][i] for k in keys]
        r = self.ratios(samples, i)
        return [_geomean(r[sample_key(m.name, p)] for p in self.points) for m in self.obj.metrics]

    def confirm_estimate_s(self) -> float:
        call = statistics.median(self._call_s) if self._call_s else 0.0
        prep = statistics.median(self._prepare_s) if self._prepare_s else 0.0
        n = self.cfg.finalists + 1
        return n * (prep + call * (1 + self.cfg.confirm_rounds))

    def _enqueue_seeds(self) -> None:
        self.study.enqueue_trial(self.space.params_of(self.defaults), user_attrs={"seed": "defaults"},
                                 skip_if_exists=True)
        # the last profile's values of the searched knobs (a value above a workload cap behaves as the cap)
        prior = {k: (min(v, self.space.caps[k]) if k in self.space.caps and isinstance(v, int) else v)
                 for k, v in (self.prior or {}).items() if k in self.space.names}
        if prior and self.space.contains({**self.defaults, **prior}):
            self.study.enqueue_trial(self.space.params_of({**self.defaults, **prior}),
                                     user_attrs={"seed": self.prior_label}, skip_if_exists=True)

    def _one_trial(self) -> optuna.trial.FrozenTrial:
        trial = self.study.ask()
        trial.set_user_attr("worker", f"{os.uname().nodename}:{os.getpid()}")
        knobs = self.space.suggest(trial)
        trial.set_user_attr("knobs", knobs)
        samples: dict[str, list[float]] = {m.name: [] for m in self.obj.metrics}
        try:
            self._measure(trial, knobs, samples)
        except optuna.TrialPruned:
            return self._finish(trial, knobs, samples, optuna.trial.TrialState.PRUNED, "pruned", "")
        except TrialFailure as e:
            return self._finish(trial, knobs, samples, optuna.trial.TrialState.FAIL, e.status, str(e))
        except MemoryError as e:
            return self._finish(trial, knobs, samples, optuna.trial.TrialState.FAIL, "failed", f"out of memory: {e}")
        except KeyboardInterrupt:
            self._finish(trial, knobs, samples, optuna.trial.TrialState.FAIL, "failed", "interrupted")
            raise
        except Exception as e:  # noqa: BLE001 - any crash of a configuration is a failed trial
            return self._finish(trial, knobs, samples, optuna.trial.TrialState.FAIL, "failed",
                                f"{type(e).__name__}: {e}")
        return self._finish(trial, knobs, samples, optuna.trial.TrialState.COMPLETE, "ok", "")

    def _measure(self, trial, knobs: dict, samples: dict[str, list[float]]) -> None:
        t = time.monotonic()
        runner = self.obj.prepare(knobs)
        self._prepare_s.append(time.monotonic() - t)
        deadline = t + self.cfg.trial_timeout_s if self.cfg.trial_timeout_s else math.inf
        for _ in range(self.cfg.warmup):
            self._timed_call(runner, deadline)
        for i in range(self.cfg.repeats):
            for name, value in self._timed_call(runner, deadline).items():
                samples.setdefault(name, []).append(float(value))
            if i < 2 and len(self.obj.metrics) == 1 and i < self.cfg.repeats - 1:
                so_far = [self.score(samples, j)[0] for j in range(i + 1)]
                best = min(so_far) if self.obj.metrics[0].direction == "minimize" else max(so_far)
                trial.report(best, i)
                # Pruned only when the best of two samples is clearly worse: one sample taken
                # during a burst of load from elsewhere must not end a good configuration.
                if trial.should_prune() and (i == 1 or self.cfg.repeats == 2):
                    raise optuna.TrialPruned()

    def _timed_call(self, runner, deadline: float) -> dict[str, float]:
        t = time.monotonic()
        out = runner()
        self._call_s.append(time.monotonic() - t)
        if time.monotonic() > deadline:
            raise TrialTimeout(f"timeout: over {self.cfg.trial_timeout_s:.0f} s")
        missing = [key for _, _, key in self.keys if key not in out]
        if missing:
            raise TrialFailure(f"objective returned no {missing}")
        return out

    def _finish(self, trial, knobs, samples, state, status: str, error: str) -> optuna.trial.FrozenTrial:
        trial.set_user_attr("status", status)
        if error:
            trial.set_user_attr("error", error[:500])
        values = None
        if state == optuna.trial.TrialState.COMPLETE:
            values = self.score(samples)
            if not all(math.isfinite(v) for v in values):
                state, status, error, values = optuna.trial.TrialState.FAIL, "failed", \
                    f"no valid measurement: {values}", None
        if self.relative and all(samples.get(key) for _, _, key in self.keys):
            trial.set_user_attr("raw", {key: statistics.median(samples[key]) for _, _, key in self.keys})
            trial.set_user_attr("ratios", self.ratios(samples))
            trial.set_user_attr("baseline", self.baseline_key)
        self.study.tell(trial, values, state=state)
        self._store(trial.number, knobs, samples, status, error)
        return self.study.trials[trial.number]

    def _store(self, number: int | None, knobs: dict, samples: dict, status: str, error: str,
               suite: str | None = None, label: str = "", extra: dict | None = None) -> None:
        base = {"study": self.study_name, "trial": number, "knobs": knobs, "status": status,
                "error": error or None, "model": self.obj.model, "format": self.obj.format}
        more = {**getattr(self.obj, "extra", {}), "objective": self.obj.name, **({"label": label} if label else {}),
                **({"baseline": self.baseline_key} if self.relative and number is not None else {}),
                **(extra or {})}
        rows = []
        points_suite = None
        if self.relative and (suite or self.suite) == self.suite:  # the scores; the points beside them
            points_suite = f"{self.suite}-points"
            n = min((len(samples.get(key, [])) for _, _, key in self.keys), default=0)
            per_repeat = [self.score(samples, i) for i in range(n)] if self.baseline else []
            rows += [{**base, "metric": f"{m.name}/defaults", "unit": "ratio", "direction": m.direction,
                      "samples": [v[j] for v in per_repeat], "workload": self.obj.workload,
                      "extra": {**more, "points": list(self.points)}}
                     for j, m in enumerate(self.obj.metrics)]
        rows += [{**base, "metric": m.name, "unit": m.unit, "direction": m.direction,
                  "samples": samples.get(key, []), **({"suite": points_suite} if points_suite else {}),
                  "workload": getattr(self.obj, "workload_of", lambda _: self.obj.workload)(p) if p
                  else self.obj.workload,
                  "extra": {**more, **({"point": p} if p else {})}}
                 for m, p, key in self.keys]
        try:
            append_rows(rows, suite or self.suite, run_id=self.run_id)
        except OSError as e:  # a full disk must not lose the study
            log.warning("could not append results: %s", e)

    # ------------------------------------------------------------ confirmation

    def finalists(self) -> list[optuna.trial.FrozenTrial]:
        """The best few distinct completed trials (multi-objective: from the Pareto front)."""
        done = self.study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
        if len(self.obj.metrics) > 1:
            pool = self.study.best_trials
            ranked = sorted(pool, key=lambda t: -sum(_rank_gain(self.obj.metrics, t, done)))
        else:
            sign = 1 if self.obj.metrics[0].direction == "minimize" else -1
            ranked = sorted(done, key=lambda t: sign * t.value)
        out, seen = [], [self.defaults]
        for t in ranked:
            knobs = t.user_attrs.get("knobs") or self.space.knobs_of_params(t.params)
            if knobs not in seen:
                seen.append(knobs)
                out.append(t)
            if len(out) == self.cfg.finalists:
                break
        return out

    def confirm(self) -> TuneResult:
        """Re-measure the finalists and the defaults alternately; keep a set only if it wins beyond the spread."""
        trials = self.finalists()
        seed = next((t for t in self.study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
                     if t.user_attrs.get("seed") == "defaults"), None)
        seed_medians = self._study_medians(seed)
        cands = [Candidate("defaults", dict(self.defaults))] + [
            Candidate(f"trial {t.number}", t.user_attrs.get("knobs") or self.space.knobs_of_params(t.params),
                      study=self._study_medians(t), study_defaults=self._baseline_of(t) or seed_medians)
            for t in trials]
        runners = self._prepare_all(cands)
        cands = [c for c in cands if c.label in runners]
        if "defaults" not in runners:
            return TuneResult(self.study_name, None, {}, False, cands, self.obj.metrics, self.finished())
        # Never fewer than MIN_CONFIRM_ROUNDS (or confirm_rounds if smaller), whatever the budget says: the
        # median of two paired gains is their mean, so one round that a burst of load slowed for the
        # defaults decided it (session 34's clean-clone `make run`: 2-round confirmations kept "+410 %").
        least = min(MIN_CONFIRM_ROUNDS, self.cfg.confirm_rounds)
        for r in range(self.cfg.confirm_rounds):
            t = time.monotonic()
            order = cands[r % len(cands):] + cands[:r % len(cands)]  # rotate who goes first
            for c in order:
                for name, v in runners[c.label]().items():
                    c.samples.setdefault(name, []).append(float(v))
            if r + 1 >= least and r + 1 < self.cfg.confirm_rounds and \
                    time.monotonic() + (time.monotonic() - t) > self._deadline:
                log.info("confirmation cut to %d rounds by the time budget", r + 1)
                break
        self._pair_gains(cands)
        for c in cands[1:]:
            factor, key = self.inflation(c, cands[0])
            if factor > MAX_GAIN_INFLATION:
                c.note = (f"its confirmed gain over the defaults is {factor:.2f}x the study's at {key}: one side ran "
                          f"under load the other did not")
                log.warning("confirmation: %s not kept: %s", c.label, c.note)
        for c in cands:
            number = int(c.label.split()[1]) if c.label != "defaults" else None
            self._store(number, c.knobs, c.samples, "ok", "", suite="autotune-confirm", label=c.label)
        winner = self._pick(cands[1:])
        number = int(winner.label.split()[1]) if winner else None
        return TuneResult(self.study_name, number, winner.knobs if winner else {}, winner is not None,
                          cands, self.obj.metrics, self.finished())

    def _study_medians(self, t) -> dict[str, float]:
        """A completed trial's median per sample key as the study measured it (relative studies keep them
        as "raw"; a study of one point scores each metric by its median)."""
        if t is None:
            return {}
        if t.user_attrs.get("raw"):
            return dict(t.user_attrs["raw"])
        if not self.relative and t.values is not None:
            return {sample_key(m.name, self.points[0]): v for m, v in zip(self.obj.metrics, t.values)}
        return {}

    def _baseline_of(self, t) -> dict[str, float]:
        """A relative study's measurement of the defaults that scored trial t (the one nearest it in time)."""
        key = t.user_attrs.get("baseline")
        return dict((self.study.user_attrs.get(key) or {}).get("medians") or {}) if key else {}

    def inflation(self, c: Candidate, base: Candidate) -> tuple[float, str]:
        """The largest factor by which c's confirmed gain over the defaults exceeds the gain the study
        measured for the two (times as ratios: (defaults' confirmed / study) over (c's confirmed / study),
        inverted for a metric to maximize), and the sample key where it does; 1.0 where either lacks a
        study median."""
        worst, where = 1.0, ""
        for m, _, key in self.keys:
            cs, bs = c.study.get(key), c.study_defaults.get(key)
            if not (cs and bs and c.samples.get(key) and base.samples.get(key)):
                continue
            r = (statistics.median(base.samples[key]) / bs) / (statistics.median(c.samples[key]) / cs)
            r = r if m.direction == "minimize" else 1.0 / r
            if r > worst:
                worst, where = r, key
        return worst, where

    def _prepare_all(self, cands: list[Candidate]) -> dict[str, Callable]:
        runners = {}
        for c in cands:
            try:
                runners[c.label] = self.obj.prepare(c.knobs)
                runners[c.label]()  # warm-up
            except Exception as e:  # noqa: BLE001
                log.warning("confirmation: %s failed to prepare (%s); dropped", c.label, e)
        return runners

    def _pair_gains(self, cands: list[Candidate]) -> None:
        """Gains over the defaults paired round by round: per sample key, and per metric the gain
        of the geometric mean over the points of that round's ratios."""
        base = cands[0]
        for c in cands:
            for m in self.obj.metrics:
                ratios = []  # per point: this round's candidate / defaults
                for p in self.points:
                    key = sample_key(m.name, p)
                    pairs = list(zip(c.samples.get(key, []), base.samples.get(key, [])))
                    c.gains[key] = [m.gain(t, d) for t, d in pairs]
                    ratios.append([t / d if d else math.nan for t, d in pairs])
                rounds = min(len(r) for r in ratios)
                c.gains[m.name] = [m.gain(_geomean(r[i] for r in ratios), 1.0) for i in range(rounds)]

    @staticmethod
    def slower_at(c: Candidate, key: str) -> bool:
        """Slower than the defaults at this point beyond the spread: the upper quartile of the
        paired gains is below zero (slower in most rounds; stricter than p90 < 0, and unlike the
        p90 of a few rounds, one round that a burst of load slowed for the defaults cannot hide it)."""
        import numpy as np

        g = c.gains.get(key, [])
        return bool(g) and not float(np.percentile(g, 75)) >= 0

    def _pick(self, cands: list[Candidate]) -> Candidate | None:
        """The candidate with the largest median gain among those winning beyond the spread and
        slower than the defaults beyond the spread at no point of the mix."""
        ok = []
        for c in cands:
            if c.note:  # set by the confirmation (the gain inflation check)
                continue
            g = [c.gain(m.name) for m in self.obj.metrics]
            slower = [key for _, _, key in self.keys if self.slower_at(c, key)]
            if slower:
                c.note = f"slower than the defaults beyond the spread at {', '.join(slower)}"
                continue
            if not (any(x["low"] > 0 for x in g) and all(x["high"] >= 0 for x in g)
                    and all(x["median"] >= 0 for x in g)):
                c.note = "no gain beyond the spread"
                continue
            ok.append((sum(x["median"] for x in g), c))
        return max(ok, key=lambda p: p[0])[1] if ok else None


def _defaults(space: SearchSpace) -> dict:
    """The catalogue defaults of the searched knobs ("auto" resolved, clipped into the space)."""
    from engine.knobs import CATALOGUE, resolve_knobs

    base = resolve_knobs() if all(k.name in CATALOGUE and CATALOGUE[k.name] is k for k in space.knobs) \
        else {k.name: k.default for k in space.knobs}
    values = dict(space.fixed)
    for k in space.knobs:
        v = base[k.name]
        if isinstance(v, int) and not isinstance(v, bool) and k.choices is None:
            low, high = space.bounds(k, values)
            v = min(max(v, low), high)
        values[k.name] = v
    return {k.name: values[k.name] for k in space.knobs}


def _rank_gain(metrics, trial, done) -> list[float]:
    """For ordering a Pareto front: each value's gain over the median of all completed trials."""
    out = []
    for i, m in enumerate(metrics):
        ref = statistics.median(t.values[i] for t in done)
        out.append(m.gain(trial.values[i], ref) if ref and trial.values[i] else 0.0)
    return out
