"""`moetune autotune`: tune this machine's knobs for a model and write its profile.

    moetune autotune [--model small] [--objective tpot|ttft|throughput|pareto] [--mix 128/16,4x128/16]
                     [--trials N | --time-budget 10m] [--storage URL] [--tier both|system|kernels]

With no arguments: the `small` preset, both tiers in ten minutes. First the kernel tier on the
model's own call sites (every distinct linear shape, the fused MoE with its experts and top-k, MLA
decode and extend attention with its heads; token buckets 1–512, attention by batch × context),
whose per-bucket winners become the profile's [kernel_tables]; then the system tier, TPOT over the
model's default mix (tuner/objectives.py DEFAULT_MIX: `prompt 128/16`, `prompt 1024/16`,
`batch 4 × 128/16`) on top of those tables. The budget split is printed (--kernel-share). The
studies are stored (SQLite in the results folder, or --storage, e.g. postgresql://user@host/db) and
resumed by name (the system study's name records the objective, model, machine and mix): Ctrl-C
stops cleanly, and the next run goes on where it stopped.

The system tier searches only the knobs its mix can observe (the others are listed with why) and
writes only those into the profile, and only where they differ from the defaults; serving limits
are never lowered below their defaults unless the objective measures concurrency (throughput).
"""
from __future__ import annotations

import argparse
import dataclasses
import re
import time
from datetime import datetime, timezone
from pathlib import Path

from engine.errors import MoetuneError


def parse_duration(text: str) -> float:
    """'10m', '90s', '1h30m', '45' (seconds) → seconds."""
    parts = re.fullmatch(r"\s*(?:(\d+(?:\.\d+)?)h)?\s*(?:(\d+(?:\.\d+)?)m)?\s*(?:(\d+(?:\.\d+)?)s?)?\s*", text)
    if not parts or not any(parts.groups()):
        raise argparse.ArgumentTypeError(f"expected a duration like 10m, 90s or 1h, got {text!r}")
    h, m, s = (float(g or 0) for g in parts.groups())
    return h * 3600 + m * 60 + s


def add_parser(sub) -> None:
    a = sub.add_parser("autotune", help="find this machine's best knobs for a model; write its profile")
    a.add_argument("--model", default="small", help="preset name or checkpoint directory")
    a.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    a.add_argument("--objective", default="tpot", choices=["tpot", "ttft", "throughput", "pareto"])
    a.add_argument("--tier", default="both", choices=["both", "system", "kernels"],
                   help="both (default): the kernel tier on the model's shapes, then the system tier on its tables")
    a.add_argument("--kernel-share", type=float, default=0.4,
                   help="tier both: the kernel tier's share of the time budget (default 0.4)")
    budget = a.add_mutually_exclusive_group()
    budget.add_argument("--trials", type=int, help="trials in the study in all (a rerun does the rest)")
    budget.add_argument("--time-budget", type=parse_duration, help="wall time of this run (default 10m)")
    a.add_argument("--storage", help="Optuna storage URL (default: SQLite in the results folder)")
    a.add_argument("--study", help="study name (default: from objective, model and machine)")
    a.add_argument("--mix", help="workload points, e.g. 128/16,1024/16,4x128/16 (BxPROMPT/OUTPUT; "
                                 "default: the model's mix, see tuner/objectives.py)")
    a.add_argument("--prompt-len", type=int, help="one point instead of the mix: prompt tokens per request")
    a.add_argument("--decode", type=int, help="one point instead of the mix: output tokens per request")
    a.add_argument("--batch", type=int, default=4, help="requests together (throughput)")
    a.add_argument("--defaults-every", type=int, default=5,
                   help="re-measure the defaults after this many trials (drift)")
    a.add_argument("--latency-limit", type=float, default=10.0, help="most s/token (throughput)")
    a.add_argument("--op", action="append", help="kernel tier: only this op (repeatable)")
    a.add_argument("--format", action="append", help="kernel tier: only this weight format (repeatable)")
    a.add_argument("--kernel-trials", type=int, default=8,
                   help="kernel tier without a time budget (--trials): trials per op × shape × bucket study")
    a.add_argument("--token-buckets", type=lambda t: [int(x) for x in t.split(",")], default=[1, 4, 16, 64, 512],
                   help="kernel tier: token buckets of linear and fused MoE (default 1,4,16,64,512)")
    a.add_argument("--table-rounds", type=int, default=3,
                   help="kernel tier: alternating rounds of the end-to-end check of its tables against the "
                        "defaults on the mix (0: no check)")
    a.add_argument("--repeats", type=int, default=3)
    a.add_argument("--seed", type=int)
    a.set_defaults(func=run_autotune)


def run_autotune(args) -> int:
    t0 = time.monotonic()
    budget = args.time_budget if args.time_budget is not None else (None if args.trials else 600.0)
    from tuner.search import TuneConfig

    cfg = TuneConfig(trials=args.trials, repeats=args.repeats, seed=args.seed,
                     time_budget_s=None if budget is None else budget)
    if not 0 < args.kernel_share < 1:
        raise MoetuneError(f"--kernel-share must be between 0 and 1, got {args.kernel_share}")
    if args.tier == "kernels":
        return _kernels(args, cfg if budget is not None else dataclasses.replace(cfg, trials=args.kernel_trials), t0)
    if args.tier == "system":
        return _system(args, cfg, t0)
    total = cfg.time_budget_s
    if total is not None:
        print(f"budget {total:.0f} s: kernel tier {args.kernel_share * total:.0f} s, "
              f"system tier {(1 - args.kernel_share) * total:.0f} s")
    kcfg = dataclasses.replace(cfg, time_budget_s=None if total is None else args.kernel_share * total,
                               trials=args.kernel_trials if total is None else None)
    rc = _kernels(args, kcfg, t0)
    if rc:
        return rc
    return _system(args, cfg, t0)


def _model_key(args) -> str:
    from engine.config import ModelConfig
    from engine.llm import checkpoint_model_key
    from engine.weights.presets import resolve_model

    path = resolve_model(args.model, True)
    return checkpoint_model_key(path, ModelConfig.from_file(path), args.dtype)


def objective_from_args(args, fmt: str = ""):
    """The system objective the command line asks for (its mix: --mix, one --prompt-len/--decode
    point, or the model's default)."""
    from tuner.objectives import Point, SystemObjective, parse_mix

    if args.mix and (args.prompt_len or args.decode):
        raise MoetuneError("give either --mix or --prompt-len/--decode, not both")
    mix = parse_mix(args.mix) if args.mix else None
    if args.prompt_len or args.decode:
        mix = (Point(args.prompt_len or 128, args.decode or 16, args.batch if args.objective == "throughput" else 1),)
    if args.objective == "throughput" and mix is None:
        mix = (Point(128, 16, args.batch),)
    return SystemObjective(args.objective, args.model, args.dtype, mix, batch=args.batch,
                           latency_limit_s=args.latency_limit, format=fmt)


def study_name(obj, mkey: str, hw: str) -> str:
    """Objective, model, machine and the mix, e.g. system-tpot-<model>-<hw>-p128d16+p1024d16+b4p128d16."""
    from tuner.objectives import mix_slug

    return f"{obj.name}-{mkey}-{hw}-{mix_slug(obj.mix)}"


def _system(args, cfg, t0: float) -> int:
    from tuner.fingerprint import fingerprint
    from tuner.objectives import shared_weights
    from tuner.profile import find_profile
    from tuner.search import Tuner
    from tuner.space import SearchSpace

    mkey = _model_key(args)
    obj = objective_from_args(args, mkey.rsplit("-", 1)[1])
    cfg.defaults_every = args.defaults_every
    prior = find_profile(mkey)
    if prior and prior.kernel_tables:  # every trial runs on top of the kernel tier's tables
        obj.kernel_tables = dict(prior.kernel_tables)
        print(f"system tier on top of the kernel tables of {prior.path} "
              f"({sum(len(r) for r in prior.kernel_tables.values())} rows)")
    space = SearchSpace.from_catalogue(workload=obj.provides)
    hw = fingerprint()["hardware_key"]
    name = args.study or study_name(obj, mkey, hw)
    with shared_weights():
        tuner = Tuner(space, obj, cfg, args.storage, name, prior=prior.knobs if prior else None)
        if cfg.time_budget_s is not None:
            cfg.time_budget_s = max(0.0, cfg.time_budget_s - (time.monotonic() - t0))
        print(f"tuning {', '.join(space.names)} for {mkey} ({obj.kind} over {', '.join(obj.points)}; "
              f"study {name})")
        for knob, why in space.skipped.items():
            print(f"  not tuned: {knob} ({why})")
        with _Progress(tuner, cfg) as bar:
            result = tuner.run(on_trial=bar.update)
    if result.interrupted:
        print(f"stopped after {result.trials_done} trials; rerun the same command to resume study {name}")
        return 130
    print(gain_table(result, tuner))
    out = write_profile(result, tuner, mkey, prior)
    print(f"profile: {out}" + ("" if result.kept else " (no knob set beat the defaults beyond the spread: defaults kept)"))
    print(f"{result.trials_done} trials in the study; {time.monotonic() - t0:.0f} s this run")
    return 0


def _kernels(args, cfg, t0: float) -> int:
    """The kernel tier on the model's own call sites; the winners go to the profile's [kernel_tables]."""
    from engine.llm import LLM
    from tuner.cpu_ops import model_ops
    from tuner.fingerprint import fingerprint
    from tuner.kernel_tier import tune_op
    from tuner.profile import profile_path

    llm = LLM(args.model, dtype=args.dtype, profile=None, progress=True)
    if llm.knobs["kernel_backend"] != "cpu":
        raise MoetuneError(f"the kernel tier tunes the cpu backend's ops; this machine runs the "
                           f"{llm.knobs['kernel_backend']} backend")
    mkey = llm.model_key
    ops = model_ops(llm.kernel_plan, token_buckets=tuple(args.token_buckets), ops=args.op, formats=args.format)
    del llm
    if not ops:
        raise MoetuneError(f"no kernel op to tune for {mkey} (ops: linear, fused_moe, cpu_mla_decode, "
                           f"cpu_extend_attention, cpu_paged_decode, cpu_paged_extend; formats: those of the model's weights)")
    from tuner.kernel_tier import study_budgets

    studies = sum(len(op.formats) * len(op.buckets) for op in ops)
    budget, budgets = cfg.time_budget_s, None
    if budget is not None:
        budget = max(0.0, budget - (time.monotonic() - t0))
        budgets = study_budgets(ops, budget)
    print(f"kernel tier: {studies} studies ({', '.join(sorted({op.name for op in ops}))}) on {mkey}"
          + (f", {budget:.0f} s split by each call's estimated time ({min(budgets.values()):.1f}–"
             f"{max(budgets.values()):.1f} s a study)" if budgets else ""))
    gains: list[tuple[str, str, dict, float]] = []

    def show(fmt, bucket, result, tuner):
        win = result.winner
        gain = win.gain("time_s")["median"] if (win and result.kept) else 0.0
        gains.append((tuner.study_name, fmt, bucket, gain))

    tables: dict[str, list] = {}
    from tqdm import tqdm

    with tqdm(total=studies, desc="kernel tier", unit="study", dynamic_ncols=True) as bar:
        def step(fmt, bucket, result, tuner):
            show(fmt, bucket, result, tuner)
            bar.update(1)
            bar.set_postfix_str(f"{tuner.study_name.removeprefix('kernel-')}: {gains[-1][3]:+.1%}", refresh=False)

        for op in ops:
            quiet = dataclasses.replace(cfg, progress=False)
            try:
                rows = tune_op(op, quiet, args.storage, None, step, budgets)
            except KeyboardInterrupt:
                bar.close()
                print("kernel tier stopped; rerun the same command to resume (finished studies are kept)")
                return 130
            defaults = {k: v for k, v in _op_defaults(op).items()}
            tables.setdefault(op.name, []).extend(
                {k: v for k, v in row.items() if k not in defaults or defaults[k] != v} for row in rows)
    from tuner.cpu_ops import release_copies

    release_copies()  # up to 2 × the last-level cache of weight copies, not needed by what follows
    print(kernel_gain_table(gains))
    if args.table_rounds:
        tables = confirm_tables(args, tables, args.table_rounds)
    path = profile_path(fingerprint()["hardware_key"], mkey)
    saved = store_tables(path, mkey, {op.name for op in ops}, tables)
    print(f"kernel tables for {', '.join(tables) or 'no op'}: {saved}")
    return 0


def store_tables(path: Path, mkey: str, tuned: set[str], tables: dict) -> Path:
    """This run's tables into the profile at `path`: for every op tuned now (`tuned`), its rows replace the
    profile's earlier ones, or remove them where the end-to-end check dropped them (an earlier run's rows
    were measured on other code and not checked against this one); other ops' tables and the system
    tier's knobs stay."""
    from tuner.profile import Profile, load_profile, save_profile

    prof = load_profile(path) if path.is_file() else Profile(_meta(mkey, "kernel tier", None, {}, {}))
    for op in tuned:
        prof.kernel_tables.pop(op, None)
    prof.kernel_tables.update(tables)
    return save_profile(prof, path)


def decode_rows(tables: dict) -> dict:
    """The tables with the knob values of their decode buckets only (linear / fused MoE at ≤ 4 tokens,
    MLA and paged decode): every other row keeps its bucket but no knob value, i.e. the defaults there. (Dropping
    those rows would not do: a prefill call would take the nearest remaining row, a decode one;
    measured 40-50 % slower TTFT on `small`.)"""
    from engine.knobs import CATALOGUE

    def decode(op: str, row: dict) -> bool:
        return op in ("cpu_mla_decode", "cpu_paged_decode") or (op in ("linear", "fused_moe") and row.get("tokens", 0) <= 4)

    return {op: [r if decode(op, r) else {k: v for k, v in r.items() if k not in CATALOGUE} for r in rows]
            for op, rows in tables.items()}


def confirm_tables(args, tables: dict, rounds: int) -> dict:
    """The kernel tables end to end: the model with them against without, alternating on the system
    tier's mix (suites/profile_ab.py), `rounds` paired rounds per point. A point where the tables
    lose in every round is a loss: if only TTFT lost, the decode rows alone are tried; what still
    loses is dropped, so a profile's tables are never slower than the defaults on the mix."""
    from engine.llm import LLM
    from suites.profile_ab import measure, table
    from tuner.objectives import shared_weights

    obj = objective_from_args(args)
    print(f"checking the kernel tables end to end: {rounds} alternating rounds on {', '.join(obj.points)}")
    with shared_weights():
        base = LLM(args.model, dtype=args.dtype, profile=None, progress=False)

        def losses(candidate: dict) -> list[dict]:
            llm = LLM(args.model, dtype=args.dtype, profile=None, progress=False, kernel_tables=candidate)
            rows = measure(llm, base, obj.mix, rounds, progress=False)
            print(table(rows))
            return [r for r in rows if max(r["gains"]) < 0]

        lost = losses(tables)
        if not lost:
            print("kernel tables kept: no point of the mix is slower with them")
            return tables
        print("slower with the tables: " + ", ".join(f"{r['metric']} @ {r['point']}" for r in lost))
        if all(r["metric"] == "ttft_s" for r in lost) and decode_rows(tables):
            decode = decode_rows(tables)
            if not losses(decode):
                print("kernel tables: the decode rows kept, the prefill rows dropped")
                return decode
        print("kernel tables dropped: the defaults are not slower anywhere")
        return {}


def _op_defaults(op) -> dict:
    from engine.knobs import CATALOGUE

    return {k: CATALOGUE[k].default for k in op.knobs}


def kernel_gain_table(gains) -> str:
    """Per op, format, shape and bucket: the kept configuration's gain over the defaults (0: defaults kept)."""
    lines = ["", f"{'study':60s} {'gain':>8s}"]
    for name, fmt, bucket, gain in gains:
        lines.append(f"{name.removeprefix('kernel-'):60s} {gain:+8.1%}")
    return "\n".join(lines)


def _meta(mkey: str, objective: str, study: str | None, gain: dict, spread: dict, **more) -> dict:
    from tuner.fingerprint import fingerprint

    fp = fingerprint()
    return {"hardware_key": fp["hardware_key"], "fingerprint": dict(fp), "model_key": mkey,
            "commit": fp["commit"], "dirty": fp["dirty"], "objective": objective,
            "study": study or "", "gain": gain, "gain_spread": spread,
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"), **more}


def write_profile(result, tuner, mkey: str, prior):
    """The profile for (this machine, model): the kept knobs that differ from the defaults, gains
    with spreads; the kernel tables of an earlier profile are kept."""
    from tuner.profile import Profile, profile_path, save_profile
    from tuner.search import sample_key

    win = result.winner
    gain = {m.name: (win.gain(m.name)["median"] if win else 0.0) for m in result.metrics}
    spread = {m.name: ([win.gain(m.name)["low"], win.gain(m.name)["high"]] if win else [0.0, 0.0])
              for m in result.metrics}
    points = getattr(tuner.obj, "points", ())
    by_point = {m.name: {p: [win.gain(sample_key(m.name, p))[x] for x in ("median", "low", "high")]
                         for p in points} for m in result.metrics} if win and points else {}
    meta = _meta(mkey, tuner.obj.kind, result.study, gain, spread, trial=result.best_trial if result.kept else -1,
                 kept=result.kept, workload=tuner.obj.workload, gain_by_point=by_point,
                 not_tuned=dict(tuner.space.skipped))
    prof = Profile(meta, profile_knobs(result.knobs, tuner), dict(prior.kernel_tables) if prior else {})
    hw = meta["hardware_key"]
    return save_profile(prof, profile_path(hw, mkey))


def profile_knobs(knobs: dict, tuner) -> dict:
    """What a profile may hold of a kept knob set: only knobs the space searched (those its
    workload observes) that differ from the defaults (the rest follow the engine's defaults, so a
    later default is not pinned back by an old profile), and no serving limit below its default
    unless the objective measures concurrency."""
    from engine.knobs import CATALOGUE

    provides = getattr(tuner.obj, "provides", None)
    concurrency = bool(provides and provides.measures_concurrency)
    out = {}
    for k, v in knobs.items():
        knob = CATALOGUE.get(k)
        if k not in tuner.space.names or tuner.defaults.get(k) == v:
            continue
        if knob is not None and knob.serving_limit and not concurrency and isinstance(v, int) \
                and isinstance(knob.default, int) and v < knob.default:
            continue
        out[k] = v
    return out


def gain_table(result, tuner) -> str:
    """Defaults and each finalist, re-measured alternately: median [p10–p90] and gain over the defaults."""
    from tuner.search import sample_key

    points = [p for p in getattr(tuner.obj, "points", ()) if p]
    w = max([len(p) for p in points] + [8])
    lines = ["", f"{'candidate':12s} {'workload':{w}s} {'metric':16s} {'median':>10s} {'p10–p90':>21s} "
                 f"{'gain':>8s} {'gain p10–p90':>17s}  changed knobs"]
    for c in result.candidates:
        changed = {k: v for k, v in c.knobs.items() if tuner.defaults.get(k) != v}
        mark = " ←kept" if result.kept and c is result.winner else (f" ({c.note})" if c.note else "")
        for m in result.metrics:
            for p in points or [""]:
                s = _stats(c.samples.get(sample_key(m.name, p), []))
                g = c.gain(sample_key(m.name, p))
                lines.append(f"{c.label:12s} {p or '-':{w}s} {m.name:16s} {s['median']:10.4g} "
                             f"{s['p10']:10.4g}–{s['p90']:<10.4g} {g['median']:+8.1%} {g['low']:+8.1%}–{g['high']:<+8.1%}")
            if len(points) > 1:
                g = c.gain(m.name)
                lines.append(f"{c.label:12s} {'all (geomean)':{w}s} {m.name:16s} {'':10s} {'':21s} "
                             f"{g['median']:+8.1%} {g['low']:+8.1%}–{g['high']:<+8.1%}")
        lines[-1] += f"  {changed if c.label != 'defaults' else ''}{mark}"
    return "\n".join(lines)


def _stats(samples):
    from results.store import stats

    return stats(samples)


class _Progress:
    """tqdm bar: trials (or seconds of the budget), best so far, gain over the defaults' trial."""

    def __init__(self, tuner, cfg):
        from tqdm import tqdm

        self.tuner, self.t0 = tuner, time.monotonic()
        self.by_time = cfg.trials is None
        total = cfg.time_budget_s if self.by_time else cfg.trials
        fmt = "{desc}: {percentage:3.0f}%|{bar}| {n}/{total} s [{elapsed}<{remaining}{postfix}]" \
            if self.by_time else None
        self.bar = tqdm(total=round(total or 0), unit="s" if self.by_time else "trial", bar_format=fmt,
                        desc="autotune", dynamic_ncols=True, initial=0 if self.by_time else tuner.finished())

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.bar.close()

    def update(self, tuner, frozen) -> None:
        if self.by_time:
            self.bar.n = min(self.bar.total, round(time.monotonic() - self.t0))
        else:
            self.bar.n = tuner.finished()
        self.bar.set_postfix_str(_postfix(tuner, frozen), refresh=False)
        self.bar.refresh()


def _postfix(tuner, frozen) -> str:
    import optuna

    metrics = tuner.obj.metrics
    done = tuner.study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    text = f"trial {frozen.number} {frozen.user_attrs.get('status', frozen.state.name.lower())}"
    if len(metrics) > 1 or not done:
        return text + f", {len(done)} complete"
    m = metrics[0]
    best = min(done, key=lambda t: t.value) if m.direction == "minimize" else max(done, key=lambda t: t.value)
    if tuner.relative:  # values are ratios to the latest measurement of the defaults
        return text + f", best {best.value:.3f}× the defaults' {m.name} (trial {best.number})"
    base = next((t for t in done if t.user_attrs.get("seed") == "defaults"), None)
    gain = f", gain {m.gain(best.value, base.value):+.1%}" if base else ""
    return text + f", best {m.name}={best.value:.4g} (trial {best.number}){gain}"
