"""The search: failures never chosen, pruning, confirmation against the defaults, resume; drift
measured rather than learned; a mix's profile never slower at any point; the correctness gate;
profiles hold only what the workload observed."""
import dataclasses

import optuna
import pytest

from results.store import read_results
from tuner.kernel_tier import lookup, tune_op
from tuner.search import Tuner, TuneConfig
from tuner_toys import (TOY_MIX_CATALOGUE, DriftingToy, ToyObjective, ToyPareto, blocked_matmul, sleeping_tiny_objective,
                        toy_kernel_op, toy_space)


@pytest.fixture(autouse=True)
def results(tmp_path, monkeypatch):
    monkeypatch.setenv("MOETUNE_RESULTS", str(tmp_path / "results"))
    return tmp_path / "results"


def storage(tmp_path, persistent=False):
    return f"sqlite:///{tmp_path}/study.sqlite3" if persistent else ":memory:"


def test_failed_and_wrong_configurations_are_never_chosen(tmp_path):
    obj = ToyObjective(noise=0.0)
    cfg = TuneConfig(trials=40, repeats=2, warmup=0, seed=3, prune_factor=100)
    tuner = Tuner(toy_space(), obj, cfg, storage(tmp_path), "fail")
    result = tuner.run()
    df = read_results(suite="autotune", study="fail")
    wrong, failed = df[df["status"] == "wrong"], df[df["status"] == "failed"]
    assert len(wrong) and len(failed), "the toy space must have produced both kinds of failure"
    assert wrong["error"].str.contains("wrong answer").all()
    assert failed["error"].str.contains("compile error").all()
    states = {t.number: t.state for t in tuner.study.trials}
    assert {states[int(n)] for n in wrong["trial"]} == {optuna.trial.TrialState.FAIL}
    best = tuner.study.best_trial
    assert best.user_attrs["knobs"]["method"] != "broken" and best.user_attrs["knobs"]["block_m"] != 1
    assert result.kept and result.knobs["method"] != "broken" and result.knobs["block_m"] != 1
    for c in result.candidates:
        assert c.knobs["method"] != "broken" and c.knobs["block_m"] != 1
    ok = df[df["status"] == "ok"]
    assert (ok["repeats"] == 2).all() and ok["samples"].map(len).eq(2).all()


def test_defaults_and_last_profile_are_tried_first(tmp_path):
    prior = {"block_k": 128, "block_m": 16, "tp": 2, "ep": 2, "threads": 3, "method": "lut", "fast_path": True}
    tuner = Tuner(toy_space(), ToyObjective(), TuneConfig(trials=3, repeats=1, warmup=0), storage(tmp_path),
                  "seeds", prior=prior)
    tuner.run()
    first, second = tuner.study.trials[:2]
    assert first.user_attrs["seed"] == "defaults" and first.user_attrs["knobs"] == tuner.defaults
    assert second.user_attrs["seed"] == "last profile" and second.user_attrs["knobs"] == prior


def test_clearly_worse_trials_are_pruned(tmp_path):
    cfg = TuneConfig(trials=30, repeats=3, warmup=0, seed=5, prune_factor=1.3)
    tuner = Tuner(toy_space(), ToyObjective(), cfg, storage(tmp_path), "prune")
    tuner.run()
    pruned = [t for t in tuner.study.trials if t.state == optuna.trial.TrialState.PRUNED]
    assert pruned
    df = read_results(study="prune", status="pruned")
    assert len(df) == len(pruned) and (df["repeats"] == 2).all()  # stopped after two of three repeats
    best = min(t.value for t in tuner.study.trials if t.value is not None)
    assert all(ToyObjective.true_time(t.user_attrs["knobs"]) > best * 1.2 for t in pruned)


def test_no_gain_beyond_the_spread_keeps_the_defaults(tmp_path):
    """When every configuration is as fast as the defaults (pure noise), nothing is kept."""
    class Flat(ToyObjective):
        @staticmethod
        def true_time(k):
            return 1.0

    tuner = Tuner(toy_space(["threads", "tp"]), Flat(noise=0.2, seed=1),
                  TuneConfig(trials=8, repeats=2, warmup=0, confirm_rounds=5, seed=0), storage(tmp_path), "flat")
    result = tuner.run()
    assert not result.kept and result.knobs == {}
    df = read_results(suite="autotune-confirm", study="flat")
    assert len(df) == len(result.candidates) and (df["repeats"] == 5).all()


def test_resume_after_interruption(tmp_path):
    """Ctrl-C mid-study stops cleanly (the trial is recorded as interrupted); the rerun completes the total."""
    cfg = TuneConfig(trials=12, repeats=1, warmup=0, seed=7)
    first = Tuner(toy_space(), ToyObjective(interrupt_after=5), cfg, storage(tmp_path, True), "resume")
    result = first.run()
    assert result.interrupted and result.trials_done < 12
    interrupted = [t for t in first.study.trials if t.user_attrs.get("error") == "interrupted"]
    assert len(interrupted) == 1 and interrupted[0].state == optuna.trial.TrialState.FAIL
    done_before = result.trials_done
    second = Tuner(toy_space(), ToyObjective(), cfg, storage(tmp_path, True), "resume")
    result2 = second.run()
    assert not result2.interrupted and result2.trials_done == 12
    assert len(second.study.trials) == 12  # the old trials were kept and counted, not redone
    assert sum(t.user_attrs.get("seed") == "defaults" for t in second.study.trials) == 1
    assert done_before == len([t for t in second.study.trials if t.number < done_before])


def test_a_changed_catalogue_starts_its_own_study(tmp_path):
    """A knob's choices differ from the stored study's (a kernel variant added or removed since): the
    rerun opens a study of its own (the name plus the space's signature) instead of failing on Optuna's
    "dynamic value space"; the unchanged space resumes its old study under its own name."""
    from tuner.space import SearchSpace
    from tuner_toys import TOY_CATALOGUE, TOY_LIMITS

    cfg = TuneConfig(trials=6, repeats=1, warmup=0, seed=7)
    first = Tuner(toy_space(), ToyObjective(), cfg, storage(tmp_path, True), "changed")
    assert first.run().trials_done == 6
    cat = {**TOY_CATALOGUE, "method": dataclasses.replace(TOY_CATALOGUE["method"], choices=("lut", "vector"))}
    space = SearchSpace.from_catalogue(None, catalogue=cat, limits=TOY_LIMITS, exclude_components=())
    assert space.signature() != toy_space().signature() and toy_space().signature() == toy_space().signature()
    second = Tuner(space, ToyObjective(), cfg, storage(tmp_path, True), "changed")
    assert first.study.study_name == "changed" and second.study.study_name == f"changed-{space.signature()}"
    assert len(second.study.trials) == 0
    assert second.run().trials_done == 6
    third = Tuner(toy_space(), ToyObjective(), cfg, storage(tmp_path, True), "changed")
    assert third.study.study_name == first.study.study_name and len(third.study.trials) == 6


def test_pareto_objective_keeps_two_metrics(tmp_path):
    tuner = Tuner(toy_space(), ToyPareto(), TuneConfig(trials=15, repeats=1, warmup=0, seed=2),
                  storage(tmp_path), "pareto")
    result = tuner.run()
    assert len(tuner.study.directions) == 2 and tuner.study.best_trials
    df = read_results(study="pareto", suite="autotune", status="ok")
    assert set(df["metric"]) == {"ttft_s", "tpot_s"}
    assert all(set(c.samples) == {"ttft_s", "tpot_s"} for c in result.candidates)


def test_time_budget_stops_in_time(tmp_path):
    import time

    t = time.monotonic()
    tuner = Tuner(toy_space(), ToyObjective(), TuneConfig(time_budget_s=2.0, repeats=1, warmup=0),
                  storage(tmp_path), "budget")
    result = tuner.run()
    assert time.monotonic() - t < 10 and result.trials_done >= 2


def test_kernel_tier_verifies_before_timing(tmp_path):
    """The toy op's mm_block=4 drops a column block: recorded as a wrong answer, never in the table."""
    op = toy_kernel_op()
    rows = tune_op(op, TuneConfig(trials=10, repeats=2, warmup=1, seed=0), storage(tmp_path))
    assert len(rows) == 2 and all(r["mm_block"] != 4 for r in rows)
    df = read_results(suite="kernels-autotune")
    wrong = df[df["status"] == "wrong"]
    assert len(wrong) and (wrong["knob.mm_block"] == 4).all()
    assert wrong["error"].str.contains("reference").all()


def test_kernel_tier_seeds_each_bucket_with_the_one_before(tmp_path, monkeypatch):
    """Each study's seed after the defaults is the knob set the previous (smaller) bucket kept, none after a
    bucket that kept the defaults, and a new format starts without one; the seed runs as a trial labelled
    'previous bucket'."""
    import tuner.kernel_tier as kt
    from tuner.search import TuneResult

    import dataclasses

    op = dataclasses.replace(toy_kernel_op(), buckets=({"tokens": 1}, {"tokens": 4}, {"tokens": 16}))
    kept = iter([{"mm_block": 16, "mm_split": 2}, {}, {"mm_block": 32, "mm_split": 1}])
    seen = []

    class Recorder:
        def __init__(self, space, obj, cfg, storage, suite, study_name, prior=None, prior_label=""):
            seen.append((study_name, prior, prior_label))
            self.defaults = {"mm_block": 8, "mm_split": 1}

        def run(self):
            return TuneResult("s", None, next(kept), True, [], (), 1)

    monkeypatch.setattr(kt, "Tuner", Recorder)
    rows = kt.tune_op(op, TuneConfig(trials=1), storage(tmp_path))
    assert [p for _, p, _ in seen] == [None, {"mm_block": 16, "mm_split": 2}, None]
    assert {label for _, _, label in seen} == {"previous bucket"}
    assert [r["mm_block"] for r in rows] == [16, 8, 32]
    monkeypatch.undo()
    tuner = Tuner(toy_space(), ToyObjective(), TuneConfig(trials=3, repeats=1, warmup=0), storage(tmp_path), "seeded",
                  prior={"block_k": 128, "method": "vector"}, prior_label="previous bucket")
    tuner.run()
    seeds = [t.user_attrs.get("seed") for t in tuner.study.trials]
    assert seeds[:2] == ["defaults", "previous bucket"]


def test_kernel_table_lookup_picks_the_nearest_bucket():
    table = [{"format": "int8", "tokens": 1, "blk": 32}, {"format": "int8", "tokens": 64, "blk": 128},
             {"format": "fp8", "tokens": 1, "blk": 16}]
    assert lookup(table, "int8", ["blk"], tokens=2) == {"blk": 32}
    assert lookup(table, "int8", ["blk"], tokens=40) == {"blk": 128}
    assert lookup(table, "fp8", ["blk"], tokens=512) == {"blk": 16}
    assert lookup(table, "bf16", ["blk"], tokens=1) == {}


def test_one_slow_sample_does_not_prune(tmp_path):
    """A burst of load from elsewhere slows one sample 3×: the trial is not pruned for it."""
    class Bursty(ToyObjective):
        def prepare(self, knobs):
            run, calls = super().prepare(knobs), []

            def bursty():
                calls.append(1)
                t = run()["time_s"]
                return {"time_s": t * 3 if len(calls) == 1 else t}

            return bursty

    tuner = Tuner(toy_space(["threads"]), Bursty(noise=0.0), TuneConfig(trials=6, repeats=3, warmup=0, seed=0),
                  storage(tmp_path), "bursty")
    tuner.run()
    states = [t.state for t in tuner.study.trials]
    assert optuna.trial.TrialState.PRUNED not in states and len(states) == 6


def test_drift_is_measured_not_learned(tmp_path):
    """The machine slows steadily through the study and the knob does nothing: the defaults are
    re-measured between the trials, each trial is scored against the latest measurement, so the
    scores stay flat while the raw times climb; the series is stored for the report."""
    cfg = TuneConfig(trials=16, repeats=2, warmup=0, seed=0, defaults_every=3, prune_factor=100)
    tuner = Tuner(toy_space(["threads"]), DriftingToy(), cfg, storage(tmp_path), "drift")
    tuner.run()
    series = sorted((v for k, v in tuner.study.user_attrs.items() if k.startswith("defaults:")),
                    key=lambda v: v["time"])
    assert len(series) >= 16 // 3 and [v["after_trials"] for v in series] == sorted(v["after_trials"] for v in series)
    assert series[-1]["medians"]["time_s"] > series[0]["medians"]["time_s"] * 1.1  # the drift, measured
    done = [t for t in tuner.study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    raw = [t.user_attrs["raw"]["time_s"] for t in done]
    assert max(raw) > 1.1 * min(raw)
    assert all(0.95 < t.value < 1.05 for t in done)  # scored against the nearest defaults: no signal
    assert all(t.user_attrs["baseline"] in tuner.study.user_attrs for t in done)
    rows = read_results(suite="autotune-defaults", study="drift")
    assert len(rows) == len(series) and rows["extra"].str.contains("after_trials").all()
    scores = read_results(suite="autotune", study="drift")
    assert len(scores) == len(tuner.study.trials) and (scores["unit"] == "ratio").all()
    assert set(scores["metric"]) == {"time_s/defaults"}
    raw_rows = read_results(suite="autotune-points", study="drift", status="ok")
    assert sorted(raw_rows["median"]) == sorted(raw)


def test_a_knob_whose_effect_reverses_with_context_is_not_kept(tmp_path):
    """The default objective (tpot) on tiny over a short and a long point: `reverse` with `uniform`
    (planted: 0.04× the defaults' sleep short, 2× long, 0.28× overall) wins overall, but the
    confirmation finds it slower than the defaults at the long point and keeps `uniform` alone
    (0.4× everywhere). The planted effects are sleeps of 0.15 s a step, so the decisions asserted
    (a 2× loss, a 2.5× gain) stand above a loaded machine's noise."""
    from tuner.objectives import shared_weights
    from tuner.space import SearchSpace

    obj = sleeping_tiny_objective()
    space = SearchSpace.from_catalogue(catalogue=TOY_MIX_CATALOGUE, limits={}, exclude_components=(),
                                       workload=obj.provides)
    assert sorted(space.names) == ["reverse", "uniform"]  # the mix spans the contexts `reverse` needs
    cfg = TuneConfig(trials=5, repeats=2, warmup=1, seed=0, confirm_rounds=5, defaults_every=2, prune_factor=100)
    with shared_weights():
        tuner = Tuner(space, obj, cfg, storage(tmp_path), "reverse", prior={"uniform": True, "reverse": False})
        for knobs in ({"reverse": True, "uniform": True}, {"reverse": True, "uniform": False}):
            tuner.study.enqueue_trial(knobs)
        result = tuner.run()
    both = next(c for c in result.candidates if c.knobs == {"reverse": True, "uniform": True})
    assert both.gain("tpot_s")["median"] > 0  # overall (geometric mean over the mix) it is faster
    assert "slower than the defaults beyond the spread at tpot_s @ prompt 512/4" in both.note, both.gains
    assert result.kept and result.knobs == {"reverse": False, "uniform": True}
    for p in obj.points:  # never slower at any point of the mix
        assert result.winner.gain(f"tpot_s @ {p}")["median"] > 0 and not Tuner.slower_at(result.winner, f"tpot_s @ {p}")


def test_the_gate_fails_a_planted_wrong_configuration(tmp_path):
    """kv_block_size=8 shifts every logit of the tiny engine: recorded as a wrong trial, never a candidate."""
    from test_tuner_objectives import Planted

    from tuner.objectives import Point, shared_weights
    from tuner.space import SearchSpace

    obj = Planted("tpot", "tiny", "float32", mix=(Point(8, 3),))
    obj.shift = 1.0
    space = SearchSpace.from_catalogue(["kv_block_size"], limits={"cores": 2, "ranks": 1}, workload=obj.provides)
    cfg = TuneConfig(trials=4, repeats=1, warmup=0, seed=0, confirm_rounds=2)
    with shared_weights():
        tuner = Tuner(space, obj, cfg, storage(tmp_path), "gate", prior={"kv_block_size": 8})
        result = tuner.run()
    wrong = [t for t in tuner.study.trials if t.user_attrs.get("status") == "wrong"]
    assert [t.user_attrs["knobs"]["kv_block_size"] for t in wrong] == [8] * len(wrong) and wrong
    assert all(t.state == optuna.trial.TrialState.FAIL for t in wrong)
    assert "logits differ" in wrong[0].user_attrs["error"]
    assert all(c.knobs["kv_block_size"] != 8 for c in result.candidates)
    df = read_results(suite="autotune", study="gate", status="wrong")
    assert len(df) and (df["knob.kv_block_size"] == 8).all()


def test_profile_holds_only_observed_knobs_and_never_lowers_serving_limits(tmp_path):
    """Tuned on the old default workload (one request, 8-token prompt), the search samples only
    the knobs that workload observes; a kept set is written without any other knob, and a serving
    limit below its default is written only for an objective that measures concurrency."""
    from types import SimpleNamespace

    from engine.knobs import resolve_knobs
    from tuner.autotune import profile_knobs
    from tuner.search import _defaults
    from tuner.objectives import Point, SystemObjective, shared_weights
    from tuner.space import SearchSpace

    obj = SystemObjective("tpot", "tiny", "float32", mix=(Point(8, 4),))
    space = SearchSpace.from_catalogue(limits={"cores": 2, "ranks": 1}, workload=obj.provides)
    with shared_weights():
        tuner = Tuner(space, obj, TuneConfig(trials=4, repeats=1, warmup=0, seed=0, confirm_rounds=2),
                      storage(tmp_path), "observed", prior={"max_running_requests": 5, "chunked_prefill_size": 703})
        result = tuner.run()
    for t in tuner.study.trials:
        assert set(t.user_attrs["knobs"]) == {"threads", "threads_prefill", "threads_decode", "kv_block_size", "graph_mode"}
    planted = {**resolve_knobs(), "threads": 1, "kv_block_size": 16, "max_running_requests": 5,
               "decode_batch_cap": 365, "chunked_prefill_size": 703, "mla_absorb": "never"}
    written = profile_knobs({**result.knobs, **planted}, tuner)
    assert set(written) <= {"threads", "threads_prefill", "threads_decode", "kv_block_size", "graph_mode"}
    assert written.get("kv_block_size") == 16
    thr = SystemObjective("throughput", "tiny", "float32", batch=8)
    tspace = SearchSpace.from_catalogue(limits={"cores": 2, "ranks": 1}, workload=thr.provides)
    fake = SimpleNamespace(obj=thr, space=tspace, defaults=_defaults(tspace))  # the caps clipped at the batch, 8
    # a value at the cap behaves as the default (no cap reached): not written
    assert profile_knobs({"max_running_requests": 4, "decode_batch_cap": 8}, fake) == {"max_running_requests": 4}
    lat = SimpleNamespace(obj=SystemObjective("tpot", "tiny", "float32", mix=(Point(8, 4, 8),)), space=tspace,
                          defaults=fake.defaults)
    assert profile_knobs({"max_running_requests": 4}, lat) == {}  # a latency objective never lowers it


def test_one_outlying_round_does_not_hide_a_loss_at_a_point():
    """Per point, a candidate is slower beyond the spread when most of its paired gains are
    losses: a round where a burst of load slowed the defaults does not hide a steady 2× loss."""
    from tuner.search import Candidate

    c = Candidate("trial 1", {}, gains={"lossy": [-0.5, -0.5, -0.5, -0.5, 2.0], "noisy": [0.1, -0.05, 0.2, 0.0, 0.1],
                                        "even": [-0.1, 0.1, -0.1, 0.1, 0.0]})
    assert Tuner.slower_at(c, "lossy") and not Tuner.slower_at(c, "noisy") and not Tuner.slower_at(c, "even")


def test_a_burst_of_load_on_the_defaults_is_no_gain(tmp_path):
    """Every configuration of the toy op takes the same 1 ms, but every other call of the defaults comes
    20 ms late (load from elsewhere): a sample is the fastest of a few back-to-back calls, so no study
    claims a gain of that size (one call a sample kept "+1500 %")."""
    import time

    op, calls = toy_kernel_op(), []

    def run(args, mm_block, mm_split):  # every other call of the defaults (their own count) is late
        if (mm_block, mm_split) == (16, 1):
            calls.append(mm_block)
        late = (mm_block, mm_split) == (16, 1) and len(calls) % 2 == 0
        time.sleep(0.021 if late else 0.001)
        return blocked_matmul(*args, mm_block, mm_split)

    op = dataclasses.replace(op, run=run, buckets=({"tokens": 1},))
    seen = []
    tune_op(op, TuneConfig(trials=5, repeats=3, warmup=1, seed=0), storage(tmp_path),
            on_result=lambda fmt, bucket, result, tuner: seen.append(result))
    (result,) = seen
    assert len(result.candidates) >= 2
    for c in result.candidates[1:]:
        assert c.gain("time_s")["median"] < 0.5, (c.label, c.samples)


def test_the_confirmation_keeps_three_rounds_past_its_budget(tmp_path):
    """A time budget spent before the confirmation's rounds start still leaves them three (two rounds'
    median is their mean, which one disturbed round decides)."""
    import time

    class SlowToPrepareLater(ToyObjective):
        prepared = 0

        def prepare(self, knobs):
            self.prepared += 1
            if self.prepared > 3:  # the confirmation's: past the budget before its first round
                time.sleep(0.3)
            return super().prepare(knobs)

    tuner = Tuner(toy_space(), SlowToPrepareLater(),
                  TuneConfig(trials=3, time_budget_s=0.5, repeats=1, warmup=0, confirm_rounds=5, finalists=2, seed=0),
                  storage(tmp_path), "short")
    result = tuner.run()
    assert len(result.candidates) >= 2
    assert all(len(c.samples["time_s"]) == 3 for c in result.candidates)


def test_load_on_one_side_of_the_confirmation_keeps_nothing(tmp_path):
    """The study measures every configuration on a quiet machine; then, through the whole confirmation, load
    from elsewhere makes the defaults 3x slower and the candidates not (session 35: a `make run` beside a
    pytest confirmed +205 % that the end-to-end check measured at -10.8 %). The confirmed gains exceed the
    study's for the same pairs far beyond the drift both would share: nothing is kept, and the note says
    why. The same study without the load keeps its winner."""
    class LoadedDefaultsAtConfirmation(ToyObjective):
        prepared, trials, defaults = 0, 0, None

        def prepare(self, knobs):
            self.prepared += 1
            run = super().prepare(knobs)
            if self.prepared <= self.trials or knobs != self.defaults:
                return run
            return lambda: {"time_s": 3.0 * run()["time_s"]}

    results = {}
    for loaded in (False, True):
        obj = LoadedDefaultsAtConfirmation()
        cfg = TuneConfig(trials=12, repeats=3, warmup=0, confirm_rounds=3, finalists=2, seed=0)
        tuner = Tuner(toy_space(), obj, cfg, storage(tmp_path), f"loaded-{loaded}")
        obj.trials, obj.defaults = cfg.trials if loaded else 10 ** 9, dict(tuner.defaults)
        results[loaded] = tuner.run()
    quiet, loaded = results[False], results[True]
    assert quiet.kept and all(not c.note for c in quiet.candidates)
    assert not loaded.kept
    noted = [c for c in loaded.candidates[1:] if "under load" in c.note]
    assert noted and all(c.gain("time_s")["median"] > 1.0 for c in noted), [(c.label, c.note) for c in loaded.candidates]
