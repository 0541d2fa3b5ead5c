"""The Parquet store: one schema, stats from samples, filters, compaction, and a writer killed mid-write."""
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from results.store import COLUMNS, append_rows, compact, read_results, stats

ROOT = Path(__file__).resolve().parent.parent


def rows(n, suite_tag="x", knobs=None):
    return [{"metric": "tpot_s", "unit": "s", "direction": "minimize", "samples": [3.0, 1.0, 2.0, 4.0],
             "knobs": knobs or {"threads": i + 1, "mla_absorb": "decode"}, "model": "tiny",
             "workload": {"prompt_len": 8, "tag": suite_tag}, "trial": i} for i in range(n)]


def test_append_and_read_one_schema(tmp_path):
    append_rows(rows(3), "autotune", directory=tmp_path)
    append_rows([{"metric": "time_s", "samples": [1e-3], "status": "wrong", "error": "wrong answer: x",
                  "knobs": {"block_m": 32}, "workload": {"op": "fused_moe", "tokens": 1}}],
                "kernels", directory=tmp_path)
    df = read_results(tmp_path)
    assert len(df) == 4 and set(COLUMNS) <= set(df.columns)
    a = df[df["suite"] == "autotune"].iloc[0]
    assert (a["median"], a["min"], a["max"], a["repeats"]) == (2.5, 1.0, 4.0, 4)
    assert a["p10"] == pytest.approx(1.3) and a["p90"] == pytest.approx(3.7)
    assert list(a["samples"]) == [3.0, 1.0, 2.0, 4.0]
    assert json.loads(a["workload"]) == {"prompt_len": 8, "tag": "x"}
    assert a["hardware_key"] and a["commit"] and a["status"] == "ok" and isinstance(a["ts"], pd.Timestamp)
    assert df["knob.threads"].dropna().tolist() == [1, 2, 3]  # numbers back as numbers
    assert read_results(tmp_path, suite="kernels", status="wrong")["knob.block_m"].tolist() == [32]
    assert len(read_results(tmp_path, suite="nope")) == 0


def test_bad_status_is_refused(tmp_path):
    with pytest.raises(ValueError, match="status"):
        append_rows([{"metric": "m", "samples": [1.0], "status": "great"}], "x", directory=tmp_path)


def test_stats_of_no_samples():
    s = stats([])
    assert s["repeats"] == 0 and s["median"] != s["median"]  # NaN


def test_compaction_keeps_every_row_once(tmp_path):
    for i in range(4):
        append_rows(rows(2, f"b{i}"), "autotune", directory=tmp_path)
    before = read_results(tmp_path)
    out = compact(tmp_path)
    assert out is not None and not list((tmp_path / "parts").glob("*.parquet"))
    after = read_results(tmp_path)
    assert sorted(after["row_id"]) == sorted(before["row_id"]) and len(after) == 8
    # A crash after writing the compacted file but before deleting the parts double-counts nothing.
    append_rows(rows(1), "autotune", directory=tmp_path)
    part = next((tmp_path / "parts").glob("*.parquet"))
    compact(tmp_path, min_parts=1)
    (tmp_path / "parts" / part.name).write_bytes(next(tmp_path.glob("compacted-*.parquet")).read_bytes())
    assert len(read_results(tmp_path)) == 9


WRITER = """
import os, signal, sys
import pyarrow.parquet as pq
from results.store import append_rows
real = pq.write_table
def half_then_die(table, where, **kw):
    real(table, where, **kw)
    data = open(where, "rb").read()
    open(where, "wb").write(data[: len(data) // 2])   # the disk has half the file...
    os.kill(os.getpid(), signal.SIGKILL)              # ...when the writer dies
directory = sys.argv[1]
for i in range(3):
    append_rows([{"metric": "m", "samples": [float(i)], "trial": i}], "crash", directory=directory)
pq.write_table = half_then_die
append_rows([{"metric": "m", "samples": [9.0], "trial": 3}], "crash", directory=directory)
print("not reached")
"""


def test_writer_killed_mid_write_loses_only_its_batch(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-c", WRITER, str(tmp_path)], env=env, capture_output=True, text=True)
    assert p.returncode == -signal.SIGKILL, p.stderr
    assert "not reached" not in p.stdout
    assert len(list((tmp_path / "parts").glob("*.tmp"))) == 1  # the half-written file is there...
    df = read_results(tmp_path)  # ...and readers never see it
    assert sorted(df["trial"]) == [0, 1, 2]
    append_rows([{"metric": "m", "samples": [4.0], "trial": 4}], "crash", directory=tmp_path)
    compact(tmp_path)
    assert sorted(read_results(tmp_path)["trial"]) == [0, 1, 2, 4]


def test_concurrent_writers(tmp_path):
    """Two processes appending at once: every row of both lands, none is torn."""
    code = ("import sys\nfrom results.store import append_rows\n"
            "for i in range(8):\n"
            "    append_rows([{'metric': 'm', 'samples': [1.0], 'trial': i, 'study': sys.argv[2]}], 'c', directory=sys.argv[1])\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path), name], env=env) for name in "ab"]
    assert [p.wait() for p in procs] == [0, 0]
    df = read_results(tmp_path)
    assert sorted(df.groupby("study")["trial"].count().tolist()) == [8, 8]


def test_parallel_figure_with_a_knob_unset_in_older_trials():
    """`moetune report` on a study whose older trials predate a knob (value missing) draws the knob
    with an "unset" category instead of failing to sort NaN among strings."""
    from dashboards.report import parallel_figure

    rows = pd.DataFrame({"status": ["ok"] * 3, "median": [0.3, 0.2, 0.1], "metric": ["tpot_s"] * 3,
                         "knob.cpu_int4_method": [float("nan"), "int16", "float"],
                         "knob.threads": [1, 2, 2]})
    dims = {d["label"]: d for d in parallel_figure(rows).data[0].dimensions}
    method = dims["cpu_int4_method"]
    assert list(method.ticktext) == ["float", "int16", "unset"]
    assert list(method.values) == [2, 1, 0]
    assert list(dims["threads"].values) == [1, 2, 2]
