"""Tuned profiles: round trip, refusal on another machine, lookup, and the engine reading one."""
import pytest

from engine.errors import MoetuneError
from engine.fingerprint import fingerprint
from engine.profile import Profile, find_profile, load_profile, profile_path, save_profile


def make(hw=None, knobs=None):
    fp = fingerprint()
    meta = {"hardware_key": hw or fp["hardware_key"], "model_key": "m-key", "fingerprint": dict(fp),
            "commit": fp["commit"], "study": "s", "trial": 3, "objective": "tpot",
            "gain": {"tpot_s": 0.25}, "gain_spread": {"tpot_s": [0.1, 0.4]}}
    tables = {"fused_moe": [{"format": "int8", "tokens": 1, "cpu_moe_block_n": 16}]}
    return Profile(meta, knobs or {"kv_block_size": 16, "mla_absorb": "always"}, tables)


def test_round_trip(tmp_path):
    p = save_profile(make(), tmp_path / "a.toml")
    got = load_profile(p)
    assert got.knobs == {"kv_block_size": 16, "mla_absorb": "always"}
    assert got.kernel_tables == {"fused_moe": [{"format": "int8", "tokens": 1, "cpu_moe_block_n": 16}]}
    assert got.meta["gain_spread"] == {"tpot_s": [0.1, 0.4]} and got.meta["schema_version"] == 1
    assert got.meta["fingerprint"]["hash"] == fingerprint()["hash"]
    assert not list(tmp_path.glob("*.tmp-*"))  # the temp file was renamed


def test_other_machine_is_refused_unless_forced(tmp_path):
    p = save_profile(make(hw="0000deadbeef"), tmp_path / "b.toml")
    with pytest.raises(MoetuneError, match="another machine"):
        load_profile(p)
    assert load_profile(p, force=True).hardware_key == "0000deadbeef"


def test_broken_files_are_refused(tmp_path):
    (tmp_path / "bad.toml").write_text("meta = [")
    with pytest.raises(MoetuneError, match="not valid TOML"):
        load_profile(tmp_path / "bad.toml")
    (tmp_path / "old.toml").write_text("[meta]\nschema_version = 99\n")
    with pytest.raises(MoetuneError, match="schema version"):
        load_profile(tmp_path / "old.toml")
    with pytest.raises(MoetuneError, match="does not exist"):
        load_profile(tmp_path / "none.toml")


def test_lookup_by_fingerprint_and_engine_use(tmp_path, monkeypatch):
    from engine.llm import LLM

    monkeypatch.setenv("MOETUNE_PROFILES", str(tmp_path))
    llm = LLM("tiny", dtype="float32", progress=False)
    assert find_profile(llm.model_key) is None
    save_profile(make(knobs={"kv_block_size": 8}), profile_path(fingerprint()["hardware_key"], llm.model_key))
    tuned = LLM("tiny", dtype="float32", profile="auto", progress=False)
    assert tuned.knobs["kv_block_size"] == 8 and tuned.profile is not None
    assert LLM("tiny", dtype="float32", profile="auto", knobs={"kv_block_size": 32},
               progress=False).knobs["kv_block_size"] == 32  # explicit knobs win over the profile
