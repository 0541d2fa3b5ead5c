"""suites/profile_ab.py: a tuned profile against the defaults, alternating, per point of a mix."""
import pytest

from engine.fingerprint import fingerprint
from engine.profile import Profile, save_profile
from suites import profile_ab


def test_profile_against_defaults_rows_and_table(tmp_path, monkeypatch):
    monkeypatch.setenv("MOETUNE_RESULTS", str(tmp_path / "res"))
    from engine.llm import LLM
    from results.store import read_results

    base = LLM("tiny", dtype="float32", profile=None, progress=False)
    path = tmp_path / "p.toml"
    save_profile(Profile({"hardware_key": fingerprint()["hardware_key"], "model_key": base.model_key},
                         {"kv_block_size": 16}, {"linear": [{"format": "f32", "tokens": 1, "cpu_micro_rows": 8}]}), path)
    assert profile_ab.main(["--model", "tiny", "--dtype", "float32", "--profile", str(path), "--mix", "8/4,2x8/4",
                            "--repeats", "2"]) == 0
    rows = read_results(tmp_path / "res")
    rows = rows[rows["suite"] == "profile-ab"]
    assert len(rows) == 2 * 2 * 2  # points × metrics × (tuned, defaults)
    assert all(len(s) == 2 for s in rows["samples"])
    tuned = LLM("tiny", dtype="float32", profile=str(path), progress=False)
    from tuner.objectives import parse_mix

    got = profile_ab.measure(tuned, base, parse_mix("8/4"), 1, progress=False)
    assert {r["metric"] for r in got} == {"ttft_s", "tpot_s"} and all(len(r["gains"]) == 1 for r in got)
    assert "| prompt 8/4 | tpot_s |" in profile_ab.table(got)


def test_no_profile_is_one_clear_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MOETUNE_PROFILES", str(tmp_path))
    assert profile_ab.main(["--model", "tiny", "--mix", "8/4", "--repeats", "1"]) == 2
    assert "no tuned profile" in capsys.readouterr().err
