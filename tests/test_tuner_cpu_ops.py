"""The kernel tier's adapters for the cpu backend: the default configuration passes the verify step,
and together the ops search every cpu_* knob, each attention knob in one op only."""
import pytest

from tuner.cpu_ops import register_cpu_ops
from tuner.kernel_tier import KernelObjective, _OPS

SMALL_BUCKETS = {"linear": {"tokens": 3}, "fused_moe": {"tokens": 3}, "cpu_mla_decode": {"batch": 3, "context": 100},
                 "cpu_extend_attention": {"tokens": 70}}


@pytest.fixture(scope="module")
def registered():
    if not register_cpu_ops():
        pytest.skip("the cpu backend does not run here or its knobs are not in the catalogue yet")


@pytest.mark.parametrize("name", sorted(SMALL_BUCKETS))
def test_cpu_ops_verify_their_defaults(registered, name):
    from engine.knobs import resolve_knobs

    knobs = resolve_knobs()
    op = _OPS[name]
    for fmt in op.formats:
        obj = KernelObjective(op, fmt, SMALL_BUCKETS[name])
        timer = obj.prepare({k: knobs[k] for k in op.knobs})  # raises WrongAnswer on a mismatch
        assert timer()["time_s"] > 0
        assert obj.extra["bytes"] > 0 and obj.extra["flops"] > 0


def test_cpu_ops_search_every_per_call_cpu_knob(registered):
    import kernels.cpu as cpu

    ops = [_OPS[n] for n in SMALL_BUCKETS]
    searched = set().union(*(op.knobs for op in ops))
    assert searched == set(cpu.KNOB_DEFAULTS) - set(cpu.LOAD_KNOBS)  # load-time knobs: read by prepare()
    assert not searched & set(cpu.LOAD_KNOBS)
    attn = [k for op in ops for k in op.knobs if k.startswith("cpu_attn_")]
    assert sorted(attn) == sorted(cpu.ATTN_KNOBS)
