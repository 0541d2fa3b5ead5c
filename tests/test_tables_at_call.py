"""End to end: a profile's kernel tables reach the kernel calls, bucket by bucket, observed at the
call through the backend's own record (kernels.cpu.recording), and `moetune autotune` writes them."""
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

cpu = pytest.importorskip("kernels.cpu", reason="the cpu kernels do not run here")

from engine import LLM, SamplingParams  # noqa: E402
from engine.errors import MoetuneError  # noqa: E402
from engine.knobs import CATALOGUE  # noqa: E402
from tuner.profile import Profile, model_key, save_profile  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
# distinct non-default values per bucket: what a call used tells which row it took
LINEAR_ROWS = {1: {"cpu_linear_block_n": 16, "cpu_micro_rows": 8},
               4: {"cpu_linear_block_n": 32, "cpu_micro_tokens": 2},
               64: {"cpu_linear_block_n": 128, "cpu_gemm_min_tokens": 8}}
MOE_ROWS = {1: {"cpu_moe_block_n": 8}, 4: {"cpu_moe_block_n": 16}, 64: {"cpu_moe_block_n": 64}}


def _tables(llm) -> dict:
    tables = {"linear": [], "fused_moe": []}
    for site in llm.kernel_plan:
        if site.op == "linear":
            tables["linear"] += [{"format": site.format, **site.shape, "tokens": t, **v} for t, v in LINEAR_ROWS.items()]
        elif site.op == "fused_moe":
            tables["fused_moe"] += [{"format": site.format, **site.shape, "tokens": t, **v} for t, v in MOE_ROWS.items()]
    tables["cpu_mla_decode"] = [
        {"format": "f32", "heads": 4, "rank": 32, "rope": 8, "batch": 1, "context": 16, "cpu_attn_kv_splits": 2},
        {"format": "f32", "heads": 4, "rank": 32, "rope": 8, "batch": 1, "context": 1024, "cpu_attn_kv_splits": 16}]
    return tables


def _expected(rows: dict, tokens: int) -> dict:
    import math

    best = min(rows, key=lambda t: abs(math.log2(t) - math.log2(tokens)))
    return rows[best]


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    """The tiny preset with a profile whose tables set other values per bucket."""
    base = LLM("tiny", dtype="float32", progress=False)
    from tuner.fingerprint import fingerprint

    path = tmp_path_factory.mktemp("profiles") / "tuned.toml"
    save_profile(Profile({"hardware_key": fingerprint()["hardware_key"], "model_key": base.model_key},
                         {}, _tables(base)), path)
    return base, LLM("tiny", dtype="float32", profile=str(path), progress=False), path


@pytest.mark.parametrize("tokens", [1, 3, 4, 40, 64, 100])
def test_each_bucket_reaches_the_call(tuned, tokens):
    base, llm, _ = tuned
    ids = torch.randint(2, 500, (tokens,), generator=torch.Generator().manual_seed(tokens)).tolist()
    with cpu.recording() as rec:
        got = llm.logits(ids)
    linear = [r for r in rec if r["op"] == "linear" and r["tokens"] == tokens]
    moe = [r for r in rec if r["op"] == "fused_moe"]
    assert linear and moe
    for r in linear:
        for k, v in _expected(LINEAR_ROWS, tokens).items():
            assert r["knobs"][k] == v, (k, r)
    for r in moe:
        assert r["knobs"]["cpu_moe_block_n"] == _expected(MOE_ROWS, tokens)["cpu_moe_block_n"]
    torch.testing.assert_close(got, base.logits(ids), atol=1e-4, rtol=1e-4)  # tiles never change the answer


def test_decode_attention_takes_its_context_bucket(tuned):
    _, llm, _ = tuned
    with cpu.recording() as rec:
        llm.generate([list(range(2, 12))], SamplingParams(max_tokens=3, ignore_eos=True))
    decode = [r for r in rec if r["op"] == "mla_decode"]
    assert decode and all(r["knobs"]["cpu_attn_kv_splits"] == 2 for r in decode)  # context ≈ 11–13: the 16 row
    with cpu.recording() as rec:
        llm.generate([[2 + i % 500 for i in range(600)]], SamplingParams(max_tokens=2, ignore_eos=True))
    decode = [r for r in rec if r["op"] == "mla_decode"]
    assert decode and all(r["knobs"]["cpu_attn_kv_splits"] == 16 for r in decode)


def test_explain_names_the_sources(tuned):
    _, llm, _ = tuned
    rows = [r for r in llm.explain() if r["op"] == "linear" and r["bucket"] == {"tokens": 4}]
    assert rows and all(r["sources"]["cpu_micro_tokens"] == "table" and r["knobs"]["cpu_micro_tokens"] == 2
                        for r in rows)
    assert all(r["sources"]["cpu_task_chunk"] == "default" for r in rows)


def test_command_line_beats_the_table(tuned):
    _, _, path = tuned
    llm = LLM("tiny", dtype="float32", profile=str(path), knobs={"cpu_linear_block_n": 64}, progress=False)
    with cpu.recording() as rec:
        llm.logits([5, 6, 7, 8])
    linear = [r for r in rec if r["op"] == "linear"]
    assert linear and all(r["knobs"]["cpu_linear_block_n"] == 64 and r["knobs"]["cpu_micro_tokens"] == 2
                          for r in linear)


def test_bad_table_value_is_one_clear_error(tuned, tmp_path):
    base, _, _ = tuned
    from tuner.fingerprint import fingerprint

    path = tmp_path / "bad.toml"
    save_profile(Profile({"hardware_key": fingerprint()["hardware_key"], "model_key": base.model_key}, {},
                         {"linear": [{"format": "f32", "tokens": 1, "cpu_linear_block_n": 3}]}), path)
    with pytest.raises(MoetuneError, match=r"row 0: knob cpu_linear_block_n"):
        LLM("tiny", dtype="float32", profile=str(path), progress=False)
    other = tmp_path / "other.toml"
    save_profile(Profile({"hardware_key": "another-machine", "model_key": base.model_key}, {}, _tables(base)), other)
    with pytest.raises(MoetuneError, match="tuned on another machine"):
        LLM("tiny", dtype="float32", profile=str(other), progress=False)
    forced = LLM("tiny", dtype="float32", profile=str(other), force_profile=True, progress=False)
    assert any(r["sources"].get("cpu_linear_block_n") == "table" for r in forced.explain())


def test_autotune_both_tiers_writes_tables_that_the_calls_use(tmp_path):
    """A short `moetune autotune` on tiny: the kernel tier on the model's call sites, then the system tier."""
    env = {**os.environ, "MOETUNE_RESULTS": str(tmp_path / "results"), "MOETUNE_PROFILES": str(tmp_path / "profiles"),
           "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-m", "moetune_cli", "autotune", "--model", "tiny", "--dtype", "float32",
                        "--trials", "3", "--kernel-trials", "2", "--token-buckets", "1,16", "--repeats", "1", "--table-rounds", "0",
                        "--seed", "0"], cwd=ROOT, env=env, text=True, capture_output=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "kernel tier:" in p.stdout and "profile: " in p.stdout
    doc = tomllib.loads(next((tmp_path / "profiles").glob("*.toml")).read_text())
    tables = doc["kernel_tables"]
    assert set(tables) == {"linear", "fused_moe", "cpu_mla_decode", "cpu_extend_attention"}
    llm = LLM("tiny", dtype="float32", progress=False)
    shapes = {(s.op, tuple(sorted(s.shape.items()))) for s in llm.kernel_plan}
    tuned = {("linear", tuple(sorted((k, r[k]) for k in ("n", "k")))) for r in tables["linear"]}
    assert {s for s in shapes if s[0] == "linear"} == tuned  # every distinct linear shape was tuned
    assert {r["tokens"] for r in tables["fused_moe"]} == {1, 16}
    for op, rows in tables.items():
        for r in rows:  # only knobs of the catalogue, within range
            for k, v in r.items():
                if k in CATALOGUE:
                    CATALOGUE[k].validate(v)
    from engine.kernel_tables import check_tables

    check_tables(tables)
    assert doc["meta"]["model_key"] == model_key(llm.config, "fp32")


@pytest.mark.parametrize("lose, expect", [
    ({}, "all"),                                      # no point slower: every row kept
    ({"ttft_s"}, "decode"),                           # only prefill slower: the decode rows kept
    ({"tpot_s"}, "none"),                             # decode slower: nothing kept
])
def test_kernel_tables_are_confirmed_end_to_end(monkeypatch, lose, expect):
    """autotune's check of the kernel tables against the defaults on the mix (measure planted: the
    first candidate loses the planted metrics in every round, the decode rows alone lose nothing)."""
    import argparse

    import suites.profile_ab as ab
    from tuner.autotune import confirm_tables, decode_rows

    tables = {"linear": [{"format": "f32", "tokens": 1, "cpu_micro_rows": 8}, {"format": "f32", "tokens": 64}],
              "cpu_mla_decode": [{"format": "f32", "batch": 1, "context": 128}],
              "cpu_extend_attention": [{"format": "f32", "tokens": 128}]}
    seen = []

    def planted(llm, base, mix, rounds, progress=True):
        seen.append(llm)
        first = len(seen) == 1
        return [{"point": p.label, "metric": m, "tuned": [1.0], "defaults": [1.0],
                 "gains": [-0.1] * rounds if (first and m in lose) else [0.05] * rounds}
                for p in mix for m in ("ttft_s", "tpot_s")]

    monkeypatch.setattr(ab, "measure", planted)
    args = argparse.Namespace(model="tiny", dtype="float32", mix="8/4", prompt_len=None, decode=None, batch=4,
                              objective="tpot", latency_limit=10.0)
    got = confirm_tables(args, tables, 2)
    assert got == {"all": tables, "decode": decode_rows(tables), "none": {}}[expect]
    assert decode_rows(tables) == {"linear": [tables["linear"][0], {"format": "f32", "tokens": 64}],
                                   "cpu_mla_decode": tables["cpu_mla_decode"],
                                   "cpu_extend_attention": [{"format": "f32", "tokens": 128}]}
    full = {"linear": [{"format": "f32", "tokens": 512, "cpu_micro_rows": 8}]}
    assert decode_rows(full) == {"linear": [{"format": "f32", "tokens": 512}]}  # the bucket stays, at the defaults
