"""The quality suite (suites/quality.py): its windows and measures by hand, BF16 against itself, INT8,
an INT4 ≥ INT8 ordering that must hold, the rows in the store and the report's page, bad input."""
import json
import math
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from moetune_cli import main as cli
from suites.quality import Run, compare, evaluate, scored, summarize, window_logits, windows

CTX, CHUNKS = 64, 4  # 4 windows of 64 tokens: 124 scored tokens on the tiny preset


def test_windows_and_the_scored_half():
    assert windows(list(range(10)), 4, None, bos=99) == [[99, 1, 2, 3], [99, 5, 6, 7]]
    assert windows(list(range(10)), 4, 1, bos=None) == [[0, 1, 2, 3]]
    assert scored(8) == slice(4, 7)  # logits rows 4..6 predict tokens 5..7

    class Oracle:  # puts all its mass on the true next token: NLL 0 only if rows and targets line up
        def logits(self, ids):
            out = torch.full((len(ids), 16), -1e4)
            out[torch.arange(len(ids) - 1), torch.tensor(ids[1:])] = 0.0
            return out

    logits, targets = window_logits(Oracle(), [3, 1, 4, 1, 5, 9, 2, 6])
    assert targets.tolist() == [9, 2, 6] and logits.shape == (3, 16)
    assert summarize([compare(logits, logits, targets)])["ppl"] == pytest.approx(1.0)


def test_measures_by_hand():
    p = torch.tensor([[0.5, 0.5], [0.9, 0.1]]).log() + 3.0  # logits: any offset per row
    q = torch.tensor([[0.25, 0.75], [0.6, 0.4]]).log() - 1.0
    c = compare(p, q, torch.tensor([1, 0]))
    kl0 = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)
    kl1 = 0.9 * math.log(0.9 / 0.6) + 0.1 * math.log(0.1 / 0.4)
    assert c["kl"] == pytest.approx([kl0, kl1], rel=1e-6)
    assert c["agree"].tolist() == [False, True]  # argmax of [.5, .5] is 0, of [.25, .75] is 1
    assert c["nll"] == pytest.approx([-math.log(0.75), -math.log(0.6)], rel=1e-6)
    s = summarize([c])
    assert s["kl_mean"] == pytest.approx((kl0 + kl1) / 2, rel=1e-6) and s["kl_max"] == pytest.approx(kl1, rel=1e-6)
    assert s["top1_agreement"] == 0.5 and s["tokens"] == 2
    assert s["ppl"] == pytest.approx(math.exp((-math.log(0.75) - math.log(0.6)) / 2), rel=1e-6)
    assert s["ppl_reference"] == pytest.approx(math.exp((-math.log(0.5) - math.log(0.9)) / 2), rel=1e-6)


def test_bf16_against_itself_int8_and_the_store_and_report(tmp_path, monkeypatch, capsys):
    """BF16 loaded twice gives KL 0; INT8 moves it (KL > 0); the rows land in the store and the report
    draws them on quality.html."""
    monkeypatch.setenv("MOETUNE_RESULTS", str(tmp_path / "results"))
    assert cli(["quality", "--model", "tiny", "--format", "bf16,int8", "--ctx", str(CTX), "--chunks", str(CHUNKS),
                "--knob", "cpu_int4_method=float", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    res = {r["label"]: r for r in out["results"]}
    assert out["workload"]["scored_tokens"] == CHUNKS * (CTX // 2 - 1)
    again = res["bf16 (again)"]
    assert again["kl_max"] <= 1e-6 and abs(again["kl_mean"]) <= 1e-6 and again["top1_agreement"] == 1.0
    assert again["ppl"] == pytest.approx(res["bf16"]["ppl"], rel=1e-9)
    int8 = res["int8"]
    assert int8["kl_mean"] > 1e-9 and int8["kl_max"] >= int8["kl_p99"] >= int8["kl_median"] >= 0
    assert int8["ppl"] != res["bf16"]["ppl"] and int8["ppl_reference"] == pytest.approx(res["bf16"]["ppl"])
    # a knob that INT8 / BF16 weights never read leaves them where they were
    assert res["int8 cpu_int4_method=float"]["kl_max"] <= 1e-6
    assert res["int8 cpu_int4_method=float"]["reference"] == "int8 (defaults)"

    from results.store import read_results

    rows = read_results(tmp_path / "results", suite="quality")
    assert set(rows["format"]) == {"bf16", "int8"} and rows["run_id"].nunique() == 1
    assert rows["hardware_key"].notna().all() and rows["fingerprint_hash"].notna().all()
    kl = rows[(rows["metric"] == "kl_mean") & (rows["format"] == "int8")]
    labels = [json.loads(e)["label"] for e in kl["extra"]]
    assert kl["median"].iloc[labels.index("int8")] == pytest.approx(int8["kl_mean"])
    assert rows[rows["metric"] == "kl_mean"]["unit"].eq("nats").all()

    from dashboards.report import FIGURE_IDS, build_report

    page = (build_report(tmp_path / "rep", tmp_path / "results", tmp_path / "none") / "quality.html").read_text()
    for i in FIGURE_IDS["quality"]:
        assert f'id="{i}"' in page
    assert f"corpus.txt, {CHUNKS} × {CTX} tokens" in page
    assert "<td>int8</td><td>bf16</td>" in page and "<td>bf16</td><td>(the reference)</td>" in page
    for raw in ('"ctx"', '\\"ctx\\"', "{&quot;"):  # the workload named, never a raw dict
        assert raw not in page, raw
    assert 'href="quality.html"' in (tmp_path / "rep" / "index.html").read_text()


HIDDEN_INPUT = ("q_a_proj.weight", "kv_a_proj_with_mqa.weight", "gate_proj.weight", "up_proj.weight")
TO_HIDDEN = ("o_proj.weight", "down_proj.weight")


def int4_kills_every_layer(dst):
    """The tiny preset changed so that INT4 must lose more than INT8.

    Hidden channel 0 is zero everywhere: the embedding's column 0 and every weight row that writes
    the residual stream's channel 0 (o_proj, down_proj) are zeroed, so no layer ever makes it
    non-zero, in any format. Every projection that reads the (normed) hidden state gets in that
    column, per row, an outlier 16 × the row's largest other |weight|: it multiplies a zero input, so
    the model's function is unchanged, but it sets the row's quantization scale. INT4 (amax / 7 per
    group; one group spans the 64 inputs) rounds every other weight to 0 (|w| < amax / 14), so in
    the INT4 model every layer adds exactly zero to the residual stream: its output depends only on
    the current token. INT8 (amax / 127) keeps every weight within amax / 254 = m / 16."""
    from engine.weights.presets import resolve_model

    src = resolve_model("tiny", progress=False)
    shutil.copytree(src, dst)
    for f in dst.glob("*.safetensors"):
        ts = load_file(f)
        for name, t in ts.items():
            w = t.float()
            if name == "model.embed_tokens.weight":
                w[:, 0] = 0
            elif name.endswith(TO_HIDDEN):
                w[0, :] = 0
            elif name.endswith(HIDDEN_INPUT):
                w[:, 0] = 16 * w[:, 1:].abs().amax(-1)
            else:
                continue
            ts[name] = w.to(t.dtype).contiguous()
        save_file(ts, f, metadata={"format": "pt"})
    return dst


def test_int4_kl_is_at_least_int8s_where_it_must_be(tmp_path, monkeypatch):
    """Why it must hold: in this checkpoint the INT4 model's next-token distribution Q depends on the
    current token only (int4_kills_every_layer). For any such Q, the mean KL(P_i‖Q(tok_i)) over the
    scored tokens is at least LB = the mean KL(P_i‖P̄(tok_i)), P̄(t) the average of the reference's
    P_i over the positions whose token is t (Gibbs: the average minimizes Σ_i KL(P_i‖Q)). INT8,
    which keeps every weight and ignores no context, stays far below LB (checked, not assumed)."""
    monkeypatch.setenv("MOETUNE_RESULTS", str(tmp_path / "results"))
    model = str(int4_kills_every_layer(tmp_path / "tiny-int4-worst"))
    run = Run(model, CTX, CHUNKS, "bfloat16", {}, "cpu", progress=False)
    ref = [window_logits(run.load("bf16", {}), w) for w in run.windows]
    p = torch.log_softmax(torch.cat([logits for logits, _ in ref]).double(), -1)
    tokens = torch.cat([torch.tensor(w[scored(CTX)]) for w in run.windows])
    lb = 0.0
    for t in tokens.unique():
        group = p[tokens == t]
        mix = group.exp().mean(0).log()
        lb += (group.exp() * (group - mix)).sum().item()
    lb /= len(tokens)
    # the construction does what it says: INT4's logits depend on the current token only
    int4 = run.load("int4", {})
    rows = torch.cat([int4.logits(w)[scored(CTX)] for w in run.windows])
    for t in tokens.unique():
        same = rows[tokens == t]
        assert (same - same[0]).abs().max() <= 1e-5 * same.abs().max()
    out = {r["label"]: r for r in evaluate(model, ["int8", "int4"], [], CTX, CHUNKS, progress=False)["results"]}
    assert out["int4"]["kl_mean"] >= lb - 1e-6  # the bound, and a check of the suite's KL
    assert out["int8"]["kl_mean"] < lb / 2, (out["int8"]["kl_mean"], lb)
    assert out["int4"]["kl_mean"] > out["int8"]["kl_mean"]
    assert out["int4"]["top1_agreement"] <= out["int8"]["top1_agreement"]


@pytest.mark.parametrize("args, message", [
    (["--model", "no-such-model"], "model 'no-such-model' is neither a preset"),
    (["--model", "tiny", "--format", "int3"], "unknown format 'int3' (choose bf16, fp8, int8, int4)"),
    (["--model", "tiny", "--knob", "no_such_knob=1"], "unknown knob 'no_such_knob'"),
    (["--model", "tiny", "--ctx", "7"], "--ctx must be an even number ≥ 4, got 7"),
])
def test_bad_input_is_one_clear_line(args, message, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MOETUNE_RESULTS", str(tmp_path / "results"))
    assert cli(["quality", *args, "--no-store"]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "results").exists()
