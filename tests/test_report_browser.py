"""The report renders in headless Chromium: every figure drawn, no JavaScript error, no network."""
import pytest
from services import chromium_driver

from dashboards.report import FIGURE_IDS, build_report, importances, pareto_front
from results.store import append_rows
from tuner.search import Tuner, TuneConfig
from tuner_toys import ToyObjective, ToyPareto, toy_space


@pytest.fixture
def report(tmp_path, monkeypatch):
    """Results of every kind (two studies, confirmation, kernels + probe, a comparison, a quality run)
    and their report."""
    monkeypatch.setenv("MOETUNE_RESULTS", str(tmp_path / "results"))
    Tuner(toy_space(), ToyObjective(), TuneConfig(trials=10, repeats=2, warmup=0, seed=1), ":memory:", "single").run()
    Tuner(toy_space(), ToyPareto(), TuneConfig(trials=10, repeats=1, warmup=0, seed=1), ":memory:", "two").run()
    append_rows([{"metric": "time_s", "samples": [1e-3 * t, 1.1e-3 * t], "workload": {"op": "fused_moe", "tokens": t},
                  "extra": {"bytes": 3e7, "flops": 2e6 * t, "gbps": 3e7 / (1e-3 * t) / 1e9}} for t in (1, 16, 64)],
                "kernels")
    append_rows([{"metric": "read_bw_gbps", "samples": [12.0]}, {"metric": "peak_gflops_avx512_fp32", "samples": [150.0]}],
                "probe")
    append_rows([{"metric": m, "unit": u, "samples": [0.5, 0.6], "extra": {"engine": e},
                  "workload": {"kind": "io", "prompt": 8, "decode": 4}}
                 for e in ("moetune", "llama.cpp") for m, u in (("tpot_s", "s"), ("decode_tok_s", "tok/s"))], "compare")
    quality = {"text": "corpus.txt", "ctx": 64, "windows": 2, "scored_tokens": 62, "dtype": "bfloat16"}
    append_rows([{"metric": m, "unit": u, "samples": [v], "format": f, "model": "tiny", "workload": quality,
                  "extra": {"label": f, "reference": None if f == "bf16" else "bf16",
                            "role": "reference" if f == "bf16" else "format", "backend": "cpu", "device": "cpu"}}
                 for f, kl in (("bf16", None), ("int8", 1e-4), ("int4", 2e-3))
                 for m, u, v in (("kl_mean", "nats", kl), ("kl_p99", "nats", kl and 5 * kl),
                                 ("top1_agreement", "fraction", kl and 1 - 10 * kl), ("ppl", "", 500.0))
                 if v is not None], "quality")
    return build_report(tmp_path / "report", profiles=tmp_path / "profiles")


def test_every_figure_renders_without_js_errors(report):
    from selenium.webdriver.support.ui import WebDriverWait

    pages = {"index.html": FIGURE_IDS["index"],
             "study-single.html": FIGURE_IDS["study"],
             "study-two.html": FIGURE_IDS["study"] + FIGURE_IDS["study2"],
             "quality.html": FIGURE_IDS["quality"]}
    assert (report / "plotly.min.js").stat().st_size > 1_000_000  # offline: plotly.js beside the pages
    driver = chromium_driver()
    try:
        for page, ids in pages.items():
            driver.get((report / page).as_uri())
            WebDriverWait(driver, 30).until(lambda d: d.execute_script("return document.readyState") == "complete")
            drawn = lambda d: all(d.execute_script(  # noqa: E731
                f"const e = document.getElementById('{i}');"
                "return !!e && e.classList.contains('js-plotly-plot') && !!e.querySelector('.main-svg')") for i in ids)
            WebDriverWait(driver, 30).until(drawn, message=f"{page}: a figure was not drawn")
            assert driver.execute_script("return typeof Plotly") == "object"
            errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
            assert not errors, f"{page}: {errors}"
        driver.save_screenshot(str(report / "screenshot-study-two.png"))
    finally:
        driver.quit()


def test_report_helpers():
    from dashboards.report import _work

    assert _work({"bytes": 100, "flops": 50}, 2.0) == (100, 50)
    assert _work({"weight_bytes": 8e6, "gflops": 4.0}, 0.5) == (8e6, 2e9)  # the kernel suite's rows
    assert _work({"gbps": 2.0}, 0.25) == (5e8, 0)
    assert pareto_front([(1, 5), (2, 2), (3, 3), (5, 1), (2, 6)]) == [0, 1, 3]
    import pandas as pd

    rows = pd.DataFrame({"status": ["ok"] * 8, "median": [1.0, 1.1, 4.0, 4.2, 1.05, 1.0, 4.1, 4.0],
                         "knob.a": [1, 1, 2, 2, 1, 1, 2, 2], "knob.b": ["x", "y", "x", "y", "y", "x", "y", "x"],
                         "knob.c": [11, 15, 12, 16, 13, 17, 14, 18]})  # unique per trial, unrelated
    imp = importances(rows)
    assert imp["a"] > 0.9 and imp["b"] < 0.05 and imp["c"] < 0.1 and abs(sum(imp.values()) - 1) < 1e-9
