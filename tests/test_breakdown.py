"""The breakdown suite (suites/breakdown.py) on the tiny preset, 1-2 repeats: its command lines,
the rows it stores (schema, parts adding up to the step per repeat, the bandwidth fraction against
the probe's figure), the weight bytes it counts against the model's own weights, and that the model
is left as it was. No timing is asserted.
"""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from engine import LLM
from suites import breakdown, e2e

PHASES = ("prefill", "decode")
FIGURES = {"weight_bytes_per_token", "kv_bytes_per_token", "weight_gb_s", "fixed_cost_per_layer", "read_bw_fraction"}
PAIRED = {"paired_read_gb_s", "paired_read_fraction"}  # decode only


@pytest.fixture
def store(tmp_path, monkeypatch):
    """Rows go to a private store; the probe answers 10 GB/s without measuring."""
    import tuner.probe

    import suites.kernels

    monkeypatch.setenv("MOETUNE_RESULTS", str(tmp_path / "results"))
    monkeypatch.setattr(tuner.probe, "probe", lambda refresh=False: {"read_gbps": 10.0})
    monkeypatch.setattr(suites.kernels, "PAIRED_READ_BYTES", 64 << 20)  # the decode's paired read: a small buffer
    return tmp_path / "results"


def test_cli_stores_rows_whose_parts_add_up(store, capsys):
    from results.store import read_results

    assert breakdown.main(["--model", "tiny", "--prompt-len", "12", "--decode", "3", "--repeats", "2",
                           "--knob", "threads=1"]) == 0
    text = capsys.readouterr().out
    for words in ("prefill of 1 × 12 tokens", "decode step (1 sequence)", "weight bytes read per token",
                  "% of the probe's read bandwidth (10.0 GB/s)", "µs per layer", "fused_moe", "rest.model"):
        assert words in text, words
    df = read_results(store, suite="breakdown")
    assert df["fingerprint_hash"].notna().all() and df["hardware_key"].notna().all()
    assert df["run_id"].nunique() == 1 and set(df["model"]) == {"tiny"} and set(df["format"]) == {"bf16"}
    assert (df["repeats"] == 2).all() and (df["status"] == "ok").all()
    work = df["workload"].map(json.loads)
    assert set(work.map(lambda w: w["phase"])) == set(PHASES)
    assert all(w["prompt_len"] == 12 and w["batch"] == 1 and w["decode_steps"] == 3 for w in work)
    assert set(df["metric"]) == {"part_seconds"} | FIGURES | PAIRED
    assert json.loads(df["knobs"].iloc[0])["threads"] == 1
    for phase in PHASES:
        rows = df[(df["metric"] == "part_seconds") & work.map(lambda w: w["phase"] == phase)]
        parts = {json.loads(w)["part"]: list(s) for w, s in zip(rows["workload"], rows["samples"])}
        assert set(parts) == set(breakdown.PARTS + breakdown.REST + ("total",))
        for i in range(2):  # per repeat, the parts add up to the step's wall time
            assert math.isclose(sum(v[i] for p, v in parts.items() if p != "total"), parts["total"][i],
                                rel_tol=1e-9, abs_tol=1e-12)
        assert all(parts[p][0] > 0 for p in ("linear.attn", "attention", "norms", "fused_moe", "lm_head", "total"))
        fig = {m: list(s) for m, s, w in zip(df["metric"], df["samples"], work)
               if w["phase"] == phase and m != "part_seconds"}
        assert set(fig) == FIGURES | (PAIRED if phase == "decode" else set())
        for gbs, frac in zip(fig["weight_gb_s"], fig["read_bw_fraction"]):
            assert math.isclose(frac, gbs / 10.0)
        gb_row = df[(df["metric"] == "weight_gb_s") & work.map(lambda w: w["phase"] == phase)]
        extra = json.loads(gb_row["extra"].iloc[0])
        assert extra["read_gbps"] == 10.0 and extra["layers"] == 2
        assert set(extra["bytes_by_group"]) == set(breakdown.BYTE_GROUPS)


def test_e2e_breakdown_json_without_probe_or_store(store, capsys):
    assert e2e.main(["--breakdown", "--model", "tiny", "--prompt-len", "6", "--decode", "2", "--repeats", "1",
                     "--batch", "2", "--no-probe", "--no-store", "--json", "--knob", "threads=1"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["read_gbps"] is None and r["batch"] == 2 and r["repeats"] == 1
    assert r["phases"]["decode"]["tokens"] == 2 and r["phases"]["prefill"]["tokens"] == 12
    assert r["phases"]["decode"]["read_bw_fraction"] is None
    assert not store.exists()  # --no-store


def test_weight_bytes_are_the_weights_a_decode_token_reads():
    """Batch 1: attention projections (kv_b_proj replaced by its absorbed halves W_UK, W_UV), dense
    FFN, K of the routed experts per MoE layer, shared experts, router, LM head, one embedding row."""
    llm = LLM("tiny", dtype="bfloat16", knobs={"threads": 1}, progress=False)
    ops = llm.model.ops
    r = breakdown.measure(llm, prompt_len=5, decode=2, batch=1, repeats=1, progress=False)
    assert llm.model.ops is ops and "_step" not in vars(llm)  # the model is left as it was
    c, w = llm.config, llm.model.w
    nb = breakdown._nbytes

    def total(pred):
        return sum(nb(v) for k, v in w.items() if pred(k))

    attn = total(lambda k: k.endswith(("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj", "o_proj")))
    attn += sum(nb(t) for t in llm.model.w_uk.values()) + sum(nb(t) for t in llm.model.w_uv.values())
    experts = sum((nb(w[f"layers.{i}.experts.w13"]) + nb(w[f"layers.{i}.experts.w2"])) * c.num_experts_per_tok
                  // c.n_routed_experts for i in range(c.num_hidden_layers) if c.is_moe_layer(i))
    want = {"attention": attn, "dense": total(lambda k: ".mlp." in k), "routed_experts": experts,
            "shared_experts": total(lambda k: ".shared." in k),
            "router": sum(nb(x) for x in llm.model.routers.values()),
            "lm_head": nb(w["lm_head"]), "embed": w["embed"].shape[1] * w["embed"].element_size()}
    dec = r["phases"]["decode"]
    assert dec["bytes_by_group"] == want
    assert dec["weight_bytes_per_token"]["median"] == sum(want.values())
    assert dec["kv_bytes_per_token"]["median"] > 0
    assert dec["parts"]["head_linear"]["calls"] == 2 * c.num_hidden_layers  # absorbed decode: W_UK and W_UV


def test_paired_read_times_one_steps_bytes_after_each_repeat(monkeypatch):
    """With paired_read the decode phase carries the probe's best reader over one step's weight bytes,
    timed after each repeat, and the step's GB/s as a fraction of it; prefill (compute-bound) does not."""
    import suites.kernels as ks
    import tuner.probe

    monkeypatch.setattr(tuner.probe, "probe", lambda: {"read_method": "sequential"})
    monkeypatch.setattr(ks, "PAIRED_READ_BYTES", 64 << 20)
    llm = LLM("tiny", dtype="bfloat16", knobs={"threads": 1}, progress=False)
    r = breakdown.measure(llm, prompt_len=5, decode=2, batch=1, repeats=2, progress=False, paired_read=True)
    dec = r["phases"]["decode"]
    assert len(dec["paired_read_gb_s"]["samples"]) == 2 and min(dec["paired_read_gb_s"]["samples"]) > 0
    assert dec["paired_read_fraction"]["samples"] == pytest.approx(
        [g / p for g, p in zip(dec["weight_gb_s"]["samples"], dec["paired_read_gb_s"]["samples"])])
    assert "paired_read_fraction" not in r["phases"]["prefill"]
    breakdown.add_bandwidth(r, 10.0)
    assert "of a paired read of the same bytes" in breakdown.table(r, "t")
    metrics = {row["metric"] for row in breakdown.rows(r, "tiny", "bf16", {}, {})}
    assert {"paired_read_gb_s", "paired_read_fraction"} <= metrics


def test_gqa_runner_steps_count_the_same_bytes_as_eager():
    """A GQA family (Qwen2-MoE: q/k/v biases, the shared expert's gate) under the C++ runner: its
    calls are attributed to the same parts and weight bytes as the eager path's."""
    runs = {m: breakdown.measure(LLM("tiny-qwen2moe", dtype="bfloat16", knobs={"threads": 1, "graph_mode": m},
                                     progress=False), prompt_len=5, decode=2, batch=1, repeats=1, progress=False)
            for m in ("eager", "cpp")}
    assert runs["cpp"]["graph_mode"] == "cpp" and runs["eager"]["graph_mode"] == "eager"
    dec = {m: r["phases"]["decode"] for m, r in runs.items()}
    assert dec["cpp"]["bytes_by_group"] == dec["eager"]["bytes_by_group"]
    llm = LLM("tiny-qwen2moe", dtype="bfloat16", progress=False)
    w, nb = llm.model.w, breakdown._nbytes
    attn = sum(nb(v) for k, v in w.items() if k.endswith(("q_proj", "k_proj", "v_proj", "o_proj")))
    assert dec["cpp"]["bytes_by_group"]["attention"] == attn
    assert dec["cpp"]["bytes_by_group"]["shared_experts"] == (
        sum(nb(v) for k, v in w.items() if ".shared." in k) + sum(nb(g) for g in llm.model.shared_gates.values()))
    for part in ("linear.attn", "attention", "fused_moe", "linear.shared", "lm_head"):
        assert dec["cpp"]["parts"][part]["calls"] == dec["eager"]["parts"][part]["calls"], part
    assert dec["cpp"]["parts"]["head_linear"]["calls"] == 0


def test_a_tuned_profile_is_run_and_named(store, capsys, tmp_path):
    """--profile PATH: the model runs with the profile's knobs, the title names it, and every stored row's
    extra says which (the default, none, says None)."""
    from engine.fingerprint import fingerprint
    from engine.llm import LLM
    from engine.profile import Profile, save_profile
    from results.store import read_results

    mkey = LLM("tiny", progress=False).model_key
    path = save_profile(Profile({"hardware_key": fingerprint()["hardware_key"], "model_key": mkey, "fingerprint": {},
                                 "commit": "test"}, {"threads_decode": 1}), tmp_path / "tuned.toml")
    common = ["--model", "tiny", "--prompt-len", "6", "--decode", "2", "--repeats", "1", "--no-probe"]
    assert breakdown.main([*common, "--profile", str(path)]) == 0
    assert f"profile {path}" in capsys.readouterr().out
    assert breakdown.main(common) == 0
    assert "defaults" in capsys.readouterr().out
    df = read_results(store, suite="breakdown")
    runs = {run: (set(d["extra"].map(lambda e: json.loads(e)["profile"])), json.loads(d["knobs"].iloc[0])["threads_decode"])
            for run, d in df.groupby("run_id")}
    assert sorted(runs.values(), key=str) == sorted([({str(path)}, 1), ({None}, LLM("tiny", progress=False).knobs["threads_decode"])], key=str)


@pytest.mark.parametrize("args, word", [(["--repeats", "0"], "--repeats"), (["--knob", "threads"], "NAME=VALUE"),
                                        (["--knob", "nope=1"], "unknown knob"),
                                        (["--profile", "/nonexistent/tuned.toml"], "does not exist")])
def test_bad_input_is_one_line(args, word):
    p = subprocess.run([sys.executable, "-m", "suites.breakdown", "--model", "tiny", "--no-store", *args],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 2, p.stderr
    assert word in p.stderr and "Traceback" not in p.stderr
