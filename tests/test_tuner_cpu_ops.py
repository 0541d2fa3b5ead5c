"""The kernel tier's adapters for the cpu backend: the default configuration passes the verify step."""
import pytest

from tuner.cpu_ops import register_cpu_ops
from tuner.kernel_tier import KernelObjective, _OPS


def test_cpu_ops_verify_their_defaults():
    if not register_cpu_ops():
        pytest.skip("the cpu backend does not run here or its knobs are not in the catalogue yet")
    from engine.knobs import resolve_knobs

    knobs = resolve_knobs()
    for name in ("linear", "fused_moe"):
        op = _OPS[name]
        for fmt in op.formats:
            obj = KernelObjective(op, fmt, {"tokens": 3})
            timer = obj.prepare({k: knobs[k] for k in op.knobs})  # raises WrongAnswer on a mismatch
            assert timer()["time_s"] > 0
            assert obj.extra["bytes"] > 0 and obj.extra["flops"] > 0
