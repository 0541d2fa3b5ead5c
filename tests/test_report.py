"""The report as a person reads it (no browser): workloads named as people say them, one unit per
axis, and a first page with the machine, the profile in use, its gain and the baselines."""
import json
import re

import pytest

from dashboards.report import baseline_figures, build_report, paired_gains
from engine.fingerprint import describe, fingerprint
from engine.profile import Profile, profile_path, save_profile
from results.labels import metric_axis, metric_title, number, workload_label
from results.store import append_rows, read_results

OBJECTIVE = {"prompt_len": 128, "decode": 32, "dtype": "bfloat16"}
STUDY = "system-tpot-small"
OTHER_KEY = "0000deadbeef"


@pytest.mark.parametrize("workload, label", [
    ({"kind": "batch", "batch": 4, "prompt": 128, "decode": 16}, "batch 4 × 128/16"),
    ({"kind": "ttft", "prompt": 512, "decode": 2}, "prompt 512"),
    ({"kind": "io", "prompt": 128, "decode": 32}, "io 128/32"),
    ({"kind": "moe", "tokens": 1}, "MoE layer, 1 token"),
    (OBJECTIVE, "io 128/32"),
    ({"prompt_len": 8, "decode": 4, "dtype": "bfloat16", "batch": 4, "latency_limit_s": 10.0},
     "batch 4 × 8/4, ≤ 10 s/token"),
    ({"op": "fused_moe", "format": "int8", "tokens": 16}, "fused_moe int8, 16 tokens"),
    ({"op": "mla_decode", "format": "bf16", "batch": 4, "context": 2048}, "mla_decode bf16, batch 4, context 2048"),
    ({"op": "linear", "shape": "small.q_proj 2048x3072", "tokens": 1}, "linear small.q_proj 2048x3072, 1 token"),
    ({"input_len": 128, "output_len": 16, "num_prompts": 32, "concurrency": 4, "request_rate": None, "seed": 0},
     "serving 128/16, 32 prompts, concurrency 4"),
    ('{"kind": "io", "prompt": 64, "decode": 8}', "io 64/8"),  # the store's JSON text
    ([{"kind": "ttft", "prompt": 128, "decode": 2}, {"kind": "ttft", "prompt": 2048, "decode": 2}],
     "prompt 128 + prompt 2048"),
    ({"contexts": [128, 2048, 8192], "batches": [1, 4], "dtype": "bfloat16"}, "contexts 128, 2048, 8192; batches 1, 4"),
    (None, ""),
    (float("nan"), ""),
])
def test_workload_labels(workload, label):
    assert workload_label(workload) == label
    assert "{" not in workload_label(workload) and '"' not in workload_label(workload)


def test_metric_units():
    assert metric_axis("tpot_s", "s") == ("time per output token", "ms", 1e3)
    assert metric_axis("decode_tok_s", "tok/s") == ("decode", "tokens/s", 1.0)
    assert metric_title("throughput_tok_s", "tokens/s") == "throughput (tokens/s)"
    assert metric_title("made_up", None) == "made_up"
    assert [number(x) for x in (9213.4, 105.04, 0.012341, float("nan"))] == ["9213", "105", "0.01234", "—"]


def test_paired_gains():
    assert paired_gains([0.5, 1.0], [1.0, 1.0, 7.0], "minimize") == [1.0, 0.0]  # defaults / tuned − 1
    assert paired_gains([30.0], [20.0], "maximize") == [0.5]


def _confirm(directory):
    """A confirmation round: defaults and two finalists, three alternating samples each."""
    samples = {"defaults": [0.10, 0.11, 0.10], "trial 7": [0.08, 0.085, 0.08], "trial 9": [0.09, 0.095, 0.09]}
    append_rows([{"study": STUDY, "metric": "tpot_s", "unit": "s", "direction": "minimize", "model": "small",
                  "workload": OBJECTIVE, "samples": s, "extra": {"label": label}} for label, s in samples.items()],
                "autotune-confirm", run_id="r1", directory=directory)


def _compare(directory, engine="llama.cpp"):
    rows = []
    for e, scale in (("moetune", 1.0), (engine, 2.0)):
        for wl in ({"kind": "io", "prompt": 128, "decode": 32}, {"kind": "batch", "batch": 4, "prompt": 128, "decode": 16}):
            rows += [{"metric": "tpot_s", "unit": "s", "direction": "minimize", "samples": [0.05 * scale, 0.06 * scale],
                      "workload": wl, "model": "small", "extra": {"engine": e, "settings": {"threads": 2}}},
                     {"metric": "decode_tok_s", "unit": "tok/s", "direction": "maximize", "model": "small",
                      "samples": [20 / scale, 21 / scale], "workload": wl, "extra": {"engine": e, "settings": {}}}]
    append_rows(rows, "compare", run_id="c1", directory=directory)


def _profiles(directory):
    here = fingerprint()
    meta = {"hardware_key": here["hardware_key"], "fingerprint": dict(here), "model_key": "deepseek_v3-small-bf16",
            "commit": "abc1234", "objective": "tpot", "study": STUDY, "trial": 9, "kept": True,
            "gain": {"tpot_s": 0.111}, "gain_spread": {"tpot_s": [0.104, 0.158]}, "workload": OBJECTIVE}
    save_profile(Profile(meta, {"mla_absorb": "always"}, {"fused_moe": [{"format": "int8", "tokens": 1, "block_m": 32}]}),
                 profile_path(here["hardware_key"], "deepseek_v3-small-bf16", directory))
    other = {**meta, "hardware_key": OTHER_KEY, "fingerprint": {"cpu_model": "AMD EPYC 9654", "cores_usable": 2,
                                                                 "isa": "avx512f,avx512_bf16", "gpu_count": 0}}
    save_profile(Profile(other, {}), profile_path(OTHER_KEY, "deepseek_v3-small-bf16", directory))


def _text(page: str) -> str:
    """The page without its figures (their plotly JSON)."""
    return re.sub(r'<div class="fig">.*?</script>\s*</div>\s*</div>', "", page, flags=re.S)


def test_first_page(tmp_path):
    res, prof = tmp_path / "res", tmp_path / "profiles"
    _confirm(res)
    _compare(res)
    append_rows([{"metric": "tpot_s", "unit": "s", "samples": [0.1], "hardware_key": OTHER_KEY}], "e2e", directory=res)
    _profiles(prof)
    page = (build_report(tmp_path / "rep", res, prof) / "index.html").read_text()
    text = _text(page)
    here = fingerprint()
    # the machine: this one, and the other whose rows are in the store (described by its profile)
    assert describe(here) in text and here["hardware_key"] in text
    assert "AMD EPYC 9654" in text and OTHER_KEY in text
    # the profile in use: this machine's, with its knobs, tables and gain with its spread
    assert "deepseek_v3-small-bf16" in text and "mla_absorb = always" in text and "fused_moe (1 rows)" in text
    assert "+11.1% [+10.4%, +15.8%] (beyond the spread)" in text
    assert "1 profile(s) in the folder were tuned on other machines" in text
    # the gain over the defaults: the kept finalist (trial 9), not the fastest one (trial 7)
    gains = text.split("<h2>Gain over the defaults</h2>")[1].split("<h2>")[0]
    gain_row = next(r for r in gains.split("<tr>") if STUDY in r)
    assert "trial 9 (in the profile)" in gain_row and "io 128/32" in gain_row
    assert "100 [100–108] ms" in gain_row and "+11.1% [+11.1%, +14.9%]" in gain_row
    # the baselines: llama.cpp's ratios by workload (its column); no ik_llama.cpp or KTransformers run yet
    assert "<th>llama.cpp median [p10–p90] (ratio)</th>" in text
    assert "<td>batch 4 × 128/16</td><td>time per output token</td><td>55 [51–59] ms</td><td>" in text
    assert "<b>2.00×</b>" in text
    assert re.search(r"ik_llama.cpp</h3><p>No comparison run yet", text)
    assert re.search(r"KTransformers \(kt-kernel\)</h3><p>No comparison run yet", text)
    # no workload appears as a raw dict anywhere on the page, figures included
    for raw in ('"kind"', '\\"kind\\"', '"prompt_len"', '\\"prompt_len\\"', "{&quot;", "{'"):
        assert raw not in page, raw
    for i in ("tuned-vs-defaults", "baselines-ms", "baselines-tokens-s"):
        assert f'id="{i}"' in page


def test_no_comparison_and_no_profile(tmp_path):
    res = tmp_path / "res"
    _confirm(res)
    text = _text((build_report(tmp_path / "rep", res, tmp_path / "none") / "index.html").read_text())
    assert "No tuned profile for this machine" in text
    assert text.count("No comparison run yet") == 3  # llama.cpp, ik_llama.cpp, KTransformers
    assert "trial 7 (best finalist, not kept)" in text  # without a profile: the fastest finalist


def test_baseline_figures_one_unit_per_axis(tmp_path):
    _compare(tmp_path, engine="kt-kernel")
    df = read_results(tmp_path)
    figs = dict(baseline_figures(df))
    assert set(figs) == {"ms", "tokens/s"}  # milliseconds and tokens/s never share a figure
    for unit, fig in figs.items():
        titles = {fig.layout[k].title.text for k in fig.layout if k.startswith("yaxis")}
        assert titles == {unit}
        for trace in fig.data:
            assert set(trace.x) == {"io 128/32", "batch 4 × 128/16"}
    ms = [t for t in figs["ms"].data if t.name == "moetune"][0]
    assert list(ms.y) == pytest.approx([55.0, 55.0])  # seconds shown in milliseconds
    rates = [t for t in figs["tokens/s"].data if t.name == "kt-kernel"][0]
    assert list(rates.y) == pytest.approx([10.25, 10.25])


def test_study_and_compare_pages_name_workloads(tmp_path):
    res = tmp_path / "res"
    _confirm(res)
    _compare(res)
    append_rows([{"study": STUDY, "trial": t, "metric": "tpot_s", "unit": "s", "direction": "minimize",
                  "workload": OBJECTIVE, "samples": [0.1 + 0.01 * t], "knobs": {"threads": t + 1}}
                 for t in range(4)], "autotune", directory=res)
    out = build_report(tmp_path / "rep", res, tmp_path / "none")
    study = (out / f"study-{STUDY}.html").read_text()
    assert "<title>Study system-tpot-small: io 128/32</title>" in study
    assert "time per output token (ms)" in study
    compare = _text((out / "compare.html").read_text())
    assert "<td>io 128/32</td><td>decode</td>" in compare and "tokens/s" in compare
    assert json.dumps(OBJECTIVE) not in compare


def test_study_page_draws_the_defaults_drift(tmp_path):
    """The defaults re-measured through a study (suite autotune-defaults) are drawn on its page."""
    res = tmp_path / "res"
    append_rows([{"study": STUDY, "trial": t, "metric": "tpot_s", "unit": "s", "direction": "minimize",
                  "workload": OBJECTIVE, "samples": [0.1], "knobs": {"threads": 1}} for t in range(3)],
                "autotune", directory=res)
    point = {"prompt": 128, "decode": 16, "batch": 1}
    append_rows([{"study": STUDY, "metric": "tpot_s", "unit": "s", "direction": "minimize", "workload": point,
                  "samples": [0.02 * (1 + 0.1 * k)] * 3, "extra": {"after_trials": 5 * k}} for k in range(3)],
                "autotune-defaults", directory=res)
    out = build_report(tmp_path / "rep", res, tmp_path / "none")
    study = (out / f"study-{STUDY}.html").read_text()
    assert 'id="drift"' in study and "trials finished" in study
    from dashboards.report import drift_figure

    rows = read_results(res)
    fig = drift_figure(rows[rows["suite"] == "autotune-defaults"])
    assert list(fig.data[0].x) == [0, 5, 10] and [round(y, 3) for y in fig.data[0].y] == [20.0, 22.0, 24.0]
    assert "prompt 128" in fig.data[0].name
