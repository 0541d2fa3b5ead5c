"""The search: failures never chosen, pruning, confirmation against the defaults, resume."""
import optuna
import pytest

from results.store import read_results
from tuner.kernel_tier import lookup, tune_op
from tuner.search import Tuner, TuneConfig
from tuner_toys import ToyObjective, ToyPareto, toy_kernel_op, toy_space


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
