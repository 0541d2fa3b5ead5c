"""The kernel regression suite (suites/regression) stays runnable and checks before it times.

Its cases on toy shapes run once each (`--benchmark-disable`), so each kernel is checked against
the reference exactly as a regression run does; and a case whose output is wrong fails before
anything is timed.
"""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels.cpu_build import missing_isa

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(bool(missing_isa()), reason=f"this CPU lacks {missing_isa()}")
def test_regression_suite_runs_its_checks_on_toy_shapes():
    r = subprocess.run([sys.executable, "-m", "pytest", "suites/regression", "--regression-shapes", "tiny",
                        "--benchmark-disable", "-q", "-p", "no:cacheprovider"],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "26 passed" in r.stdout, r.stdout[-2000:]


@pytest.mark.skipif(bool(missing_isa()), reason=f"this CPU lacks {missing_isa()}")
def test_a_wrong_output_fails_before_it_is_timed():
    from suites.regression.test_cpu_kernels import rel, run

    class Bench:
        extra_info: dict = {}
        timed = False

        def pedantic(self, *a, **k):
            Bench.timed = True

    ref = torch.ones(4, 8)

    def check(out):
        assert rel(out, ref) <= 1e-2

    with pytest.raises(AssertionError):
        run(Bench(), lambda: torch.zeros(4, 8), "tiny", check)
    assert not Bench.timed
    run(Bench(), lambda: torch.ones(4, 8), "tiny", check)
    assert Bench.timed
