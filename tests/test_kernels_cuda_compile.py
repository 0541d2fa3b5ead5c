"""Every Triton kernel, launched as the cuda backend launches it at the catalogue's default tiles,
compiles for Hopper (sm_90) on this CPU machine (Triton's ahead-of-time compiler and the ptxas /
cuobjdump of its wheel): no spills to local memory, shared memory within the H100/H200 limit, loads
pipelined through cp.async, and the GEMMs on tensor-core instructions. What the interpreter cannot
see (types, layouts, register pressure) fails here before a GPU is ever lent.

Run in a subprocess: Triton imported without TRITON_INTERPRET in this process would stop the
interpreter tests (its own @jit library functions are compiled or interpreted from first import)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

SHARED_LIMIT = 227 * 1024  # opt-in dynamic shared memory per block on sm_90
EXPECTED = {"act_quant_kernel", "fp8_gemm_kernel", "mla_split_kernel", "mla_merge_kernel",
            *(f"moe_{f}_{l}_{p}" for f in ("fp8", "dense") for l in ("masked", "contiguous")
              for p in ("gate_up", "down"))}


@pytest.fixture(scope="module")
def reports() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"TRITON_DEFAULT_FP_FUSION": "1"}
    proc = subprocess.run([sys.executable, "-m", "suites.hopper_compile", "--json"], capture_output=True,
                          text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {r["launch"]: r for r in json.loads(proc.stdout.strip().splitlines()[-1])}


def test_every_kernel_compiles_for_hopper(reports):
    assert set(reports) == EXPECTED


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_no_spills_and_the_right_instructions(reports, name):
    r = reports[name]
    assert r["stack"] == 0 and r["LDL"] == 0 and r["STL"] == 0, r
    assert r["shared"] <= SHARED_LIMIT, r
    if name.startswith(("fp8_gemm", "moe_", "mla_split")):
        assert r["QGMMA"] + r["HGMMA"] + r["HMMA"] > 0, r  # tensor cores
        assert r["LDGSTS"] + r["UTMALDG"] > 0, r  # software-pipelined loads
    if name == "fp8_gemm_kernel":
        assert r["QGMMA"] > 0, r  # Hopper's FP8 wgmma, not an upcast
