"""`moetune autotune` end to end on the tiny preset: Ctrl-C stops cleanly, the rerun resumes and
writes a profile with its gain table; `moetune results` and `moetune report` read what it stored."""
import os
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import optuna
import pytest

ROOT = Path(__file__).resolve().parent.parent


def moetune(*args, env, **kw):
    return subprocess.Popen([sys.executable, "-m", "moetune_cli", *args], cwd=ROOT, env=env, text=True,
                            **{"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, **kw})


def finished(url: str, name: str) -> int:
    try:
        study = optuna.load_study(study_name=name, storage=url)
    except KeyError:
        return 0
    return sum(t.state.is_finished() for t in study.get_trials(deepcopy=False))


@pytest.mark.timeout(1500)  # its own waits add up to 18 minutes on a slow machine
def test_interrupt_resume_profile_report(tmp_path):
    env = {**os.environ, "MOETUNE_RESULTS": str(tmp_path / "results"),
           "MOETUNE_PROFILES": str(tmp_path / "profiles"), "PYTHONPATH": str(ROOT)}
    url = f"sqlite:///{tmp_path}/study.sqlite3"
    common = ["autotune", "--model", "tiny", "--tier", "system", "--repeats", "1", "--storage", url, "--study", "cli",
              "--seed", "0"]
    # A trial count no run reaches: the Ctrl-C below always lands in the middle of the search, however
    # fast the trials go (a run of 200 once finished between two polls of a busy machine's SQLite file).
    total = 1_000_000
    # Its output goes to files, not pipes: nothing reads them while it runs, and a full pipe would stop it
    # mid-trial. It is killed whatever happens below: a run of a million trials must not outlive the test.
    log_out, log_err = tmp_path / "run1.out", tmp_path / "run1.err"
    with open(log_out, "w") as fo, open(log_err, "w") as fe:
        p = moetune(*common, "--trials", str(total), env=env, stdout=fo, stderr=fe)
    try:
        deadline = time.monotonic() + 420
        while finished(url, "cli") < 3 and time.monotonic() < deadline and p.poll() is None:
            time.sleep(0.5)
        assert p.poll() is None, f"autotune stopped before the Ctrl-C: {log_err.read_text()[-2000:]}"
        assert finished(url, "cli") >= 3, "no 3 trials finished in 420 s"
        p.send_signal(signal.SIGINT)  # Ctrl-C
        p.wait(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    out, err = log_out.read_text(), log_err.read_text()
    assert p.returncode == 130, err[-2000:]
    assert "rerun the same command to resume" in out
    done = finished(url, "cli")
    assert 3 <= done < total
    assert not list((tmp_path / "profiles").glob("*.toml"))  # nothing written on an interrupted run

    p = moetune(*common, "--trials", str(done + 3), env=env)
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0, err[-2000:]
    assert finished(url, "cli") >= done + 3
    assert "defaults" in out and "gain" in out and "profile: " in out
    assert "batch 4 × 128/16" in out and "prompt 2032/16" in out  # the gain table names the mix's points
    assert "not tuned: max_running_requests (a serving limit" in out
    profile = next((tmp_path / "profiles").glob("*.toml"))
    meta = tomllib.loads(profile.read_text())["meta"]
    assert meta["study"] == "cli" and set(meta["gain"]) == {"tpot_s"} and len(meta["gain_spread"]["tpot_s"]) == 2
    assert meta["workload"]["mix"] == ["prompt 128/16", "prompt 2032/16", "batch 4 × 128/16"]
    assert {"max_running_requests", "decode_batch_cap"} <= set(meta["not_tuned"])
    from engine.knobs import CATALOGUE, resolve_knobs

    knobs, defaults = tomllib.loads(profile.read_text())["knobs"], resolve_knobs()
    assert set(knobs) <= set(CATALOGUE) and all(defaults[k] != v for k, v in knobs.items())
    # only what the tiny mix observes (the system tier's knobs, as its "tuning ..." line lists them); never a
    # serving limit (a latency objective)
    assert set(knobs) <= {"threads", "threads_prefill", "threads_decode", "kv_block_size", "chunked_prefill_size",
                          "graph_mode", "mla_absorb"}
    assert bool(knobs) == meta["kept"]
    if meta["kept"]:
        assert set(meta["gain_by_point"]["tpot_s"]) == set(meta["workload"]["mix"])
    study = optuna.load_study(study_name="cli", storage=url)
    assert any(k.startswith("defaults:") for k in study.user_attrs)  # the defaults, re-measured

    p = moetune("results", "--suite", "autotune-confirm", env=env)
    out, _ = p.communicate(timeout=120)
    assert p.returncode == 0 and "autotune-confirm" in out
    p = moetune("report", "--out", str(tmp_path / "report"), env=env)
    out, _ = p.communicate(timeout=120)
    assert p.returncode == 0 and (tmp_path / "report" / "study-cli.html").is_file()


def test_study_name_records_the_mix():
    from types import SimpleNamespace

    from tuner.autotune import objective_from_args, study_name

    args = SimpleNamespace(objective="tpot", model="small", dtype="bfloat16", mix=None, prompt_len=None,
                           decode=None, batch=4, latency_limit=10.0)
    obj = objective_from_args(args)
    assert obj.points == ("prompt 128/16", "prompt 1024/16", "batch 4 × 128/16")
    assert study_name(obj, "m", "hw") == "system-tpot-m-hw-p128d16+p1024d16+b4p128d16"
    args.mix = "2x64/8"
    assert study_name(objective_from_args(args), "m", "hw").endswith("-b2p64d8")
    args.mix, args.objective, args.prompt_len = None, "throughput", 256
    assert objective_from_args(args).points == ("batch 4 × 256/16",)


def test_user_mistakes_are_one_line(tmp_path):
    env = {**os.environ, "MOETUNE_RESULTS": str(tmp_path), "PYTHONPATH": str(ROOT)}
    p = moetune("autotune", "--time-budget", "ten minutes", env=env)
    _, err = p.communicate(timeout=300)  # a generous bound: a loaded 2-core machine takes long to import
    assert p.returncode == 2 and "duration" in err


def test_a_dropped_kernel_table_removes_the_earlier_runs_rows(tmp_path):
    """The kernel tier's tables replace, per op it tuned, what an earlier run left in the profile: where
    this run's end-to-end check dropped an op's rows, the earlier rows (measured on other code, never
    checked against this one) go too; ops not tuned now and the system tier's knobs stay."""
    from tuner.autotune import store_tables
    from tuner.profile import load_profile

    path = tmp_path / "p.toml"
    linear = [{"format": "bf16", "n": 768, "k": 2048, "tokens": 16, "cpu_micro_rows": 8}]
    mla = [{"format": "bf16", "heads": 16, "rank": 512, "rope": 64, "batch": 1, "context": 128,
            "cpu_attn_kv_splits": 2}]
    store_tables(path, "m", {"linear", "cpu_mla_decode"}, {"linear": linear, "cpu_mla_decode": mla})
    prof = load_profile(path)
    prof.knobs["threads"] = 2
    from tuner.profile import save_profile
    save_profile(prof, path)
    store_tables(path, "m", {"linear"}, {})  # linear re-tuned, its rows dropped by the check
    after = load_profile(path)
    assert "linear" not in after.kernel_tables
    assert after.kernel_tables["cpu_mla_decode"] == mla and after.knobs == {"threads": 2}
    newer = [{**linear[0], "cpu_micro_rows": 4}]
    store_tables(path, "m", {"linear"}, {"linear": newer})  # kept: this run's rows, not appended to old ones
    assert load_profile(path).kernel_tables["linear"] == newer
