"""The kernel tier's adapters for the cpu backend: the default configuration passes the verify step,
together the ops search every cpu_* knob, each attention knob in one op only, and the timed calls
cycle through cold copies of the weights and caches."""
import dataclasses

import pytest
import torch

from tuner.cpu_ops import register_cpu_ops
from tuner.kernel_tier import KernelObjective, _OPS

SMALL_BUCKETS = {"linear": {"tokens": 3}, "fused_moe": {"tokens": 3}, "cpu_mla_decode": {"batch": 3, "context": 100},
                 "cpu_extend_attention": {"tokens": 70}}


@pytest.fixture(autouse=True)
def small_cache(monkeypatch):
    """An 8 MiB last-level cache (and pool): the rotations stay tens of MB here, whatever this CPU's L3."""
    import suites.kernels as sk

    monkeypatch.setattr(sk, "last_level_cache_bytes", lambda: 8 << 20)
    monkeypatch.setattr(sk, "POOL_BYTES", 8 << 20)


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


def _tensors(x):
    import kernels.cpu as cpu

    return [t for t in (x.args if isinstance(x, cpu.Packed) else (x,)) if isinstance(t, torch.Tensor) and t.numel()]


@pytest.mark.parametrize("name,fmt", [("linear", "int8"), ("linear", "bf16"), ("fused_moe", "int8"),
                                      ("cpu_mla_decode", "bf16")])
def test_the_timed_calls_stream_cold_copies(registered, name, fmt):
    """The cycle holds the verified arguments first, then copies equal in value in storage of their own
    (weights, caches) or other routings (fused MoE), ≥ 2 × the (patched) last-level cache in all; the
    timer walks it, a call never on the copy the call before it read."""
    op = _OPS[name]
    obj = KernelObjective(op, fmt, SMALL_BUCKETS[name])
    cycle = obj._cycle
    assert cycle[0] is obj._args and len(cycle) >= 2
    pos = {"linear": (1,), "fused_moe": (1, 2), "cpu_mla_decode": (2,)}[name]
    for args in cycle[1:]:
        for i in pos:
            for mine, theirs in zip(_tensors(args[i]), _tensors(obj._args[i])):
                assert torch.equal(mine, theirs)
    if name == "fused_moe":
        ids = [args[4] for args in cycle]
        assert len({tuple(i.flatten().tolist()) for i in ids}) == len(ids)  # another routing every call
        e, k = obj._args[1].shape[0], obj._args[4].shape[1]
        assert all(i.shape == obj._args[4].shape and (i.sort(-1).values.diff(dim=-1) > 0).all() and int(i.max()) < e
                   for i in ids) and k > 1
        stacks = {args[1].args[1].data_ptr() for args in cycle}
        assert len(stacks) * obj._args[1].nbytes >= 16 << 20 or len(stacks) == 8
    else:
        ptrs = {_tensors(args[pos[0]])[0].data_ptr() for args in cycle}
        assert len(ptrs) == len(cycle)
        assert len(cycle) * _tensors(obj._args[pos[0]])[0].nbytes >= 16 << 20
    seen = []
    run = op.run

    def spy(args, **knobs):
        seen.append(id(args))
        return run(args, **knobs)

    obj.op = dataclasses.replace(op, run=spy)
    from engine.knobs import resolve_knobs

    knobs = resolve_knobs()
    timer = obj.prepare({k: knobs[k] for k in op.knobs})
    first = len(seen)  # the verify call: the verified arguments
    for _ in range(3):
        timer()
    walk = seen[first:]
    assert seen[0] == id(obj._args) and len(walk) >= 6
    assert all(a != b for a, b in zip(walk, walk[1:]))
    assert set(walk) <= {id(a) for a in cycle}


def test_a_linear_study_reuses_the_copies_of_the_study_before(registered):
    """The next token bucket of the same weight layout cycles through the same copies (made once), another
    layout gets its own, and release_copies frees them when the kernel tier is done."""
    import tuner.cpu_ops as co

    op = _OPS["linear"]
    a = KernelObjective(op, "int8", {"tokens": 1})._cycle
    b = KernelObjective(op, "int8", {"tokens": 16})._cycle
    c = KernelObjective(op, "bf16", {"tokens": 1})._cycle
    assert [id(x[1]) for x in a[1:]] == [id(x[1]) for x in b[1:]] and len(a) >= 2
    assert not {id(x[1]) for x in c[1:]} & {id(x[1]) for x in a[1:]}
    co.release_copies()
    assert co._last_copies == [None, []]
