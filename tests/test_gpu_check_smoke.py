"""suites.gpu_check end to end in its --smoke mode (CPU, Triton interpreter, tiny shapes), in a
subprocess (it sets TRITON_INTERPRET for itself): every stage runs, every check passes, the table and
the Parquet rows are written. Keeps the GPU script from rotting on machines without a GPU."""
from __future__ import annotations

import json
import subprocess
import sys

from results.store import read_results


def test_gpu_check_smoke(tmp_path):
    out = tmp_path / "gpu"
    proc = subprocess.run([sys.executable, "-m", "suites.gpu_check", "--smoke", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    table = (out / "gpu_check.md").read_text()
    assert "| fused_moe | ours | fp8 |" in table and "| mla_decode | ours |" in table
    df = read_results(out)
    assert set(df["suite"]) == {"gpu_check"}
    checks = df[df["metric"] == "rel_err"]
    ops = {json.loads(w)["op"] for w in checks["workload"]}
    assert ops == {"act_quant", "fp8_gemm", "fused_moe", "mla_decode"}
    assert (checks["status"] == "ok").all(), checks[["workload", "median", "status"]]
    ours = df[(df["metric"] == "time_s") & df["workload"].str.contains('"variant": "ours"')]
    assert len(ours) >= 4 and (ours["median"] > 0).all()
    assert ours["knob.cuda_mla_head_block"].notna().any()  # knobs stored under catalogue names
