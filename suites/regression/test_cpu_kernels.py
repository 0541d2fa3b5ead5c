"""The regression suite's cases (see suites/regression/__init__.py): each cpu kernel checked against the
reference, then timed by pytest-benchmark."""
from __future__ import annotations

import itertools
from functools import lru_cache

import pytest
import torch

from kernels import reference
from kernels.cpu_build import missing_isa

if missing_isa():
    pytest.skip(f"this CPU lacks {missing_isa()}: the cpu backend cannot run here", allow_module_level=True)

import kernels.cpu as cpu  # noqa: E402
from suites.kernels import (CACHE_BLOCK, MoeShape, bf16_randn, expert_bytes, paged_latent_cache,  # noqa: E402
                            random_routes, random_weight, weight_copies)

FORMATS = ("bf16", "int8", "fp8", "int4")
TOKENS = (1, 16, 128)
# shapes per --regression-shapes: fused MoE (D, I, experts, top-k), the linear [N, K], MLA (heads, R, P)
SHAPES = {"small": (MoeShape("small.moe", 2048, 1408, 64, 6), (2816, 2048), (16, 512, 64)),
          "tiny": (MoeShape("tiny.moe", 256, 128, 8, 2), (96, 256), (4, 64, 32))}
MLA_CASES = ((1, 512), (4, 4096))  # (sequences, keys each)
# The conformance tests' bounds on bf16 activations (tests/test_kernels_cpu.py), INT4's int8 activations
BOUND = {"linear": 1e-2, "fused_moe": 2e-2, "int4": 3e-2, "mla_decode": 1e-2}
ROUNDS = {"small": 20, "tiny": 3}


@pytest.fixture(scope="module")
def shapes(request):
    return request.config.getoption("--regression-shapes")


def rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()


def run(benchmark, fn, shapes: str, check, **info) -> None:
    """Check one call against the reference, then time `fn` (one call per round, warmed up); the ISA
    variant the kernels ran and the case's bytes / FLOPs go to extra_info."""
    with cpu.recording() as rec:
        out = fn()
    check(out)
    benchmark.extra_info.update(info, isa="+".join(sorted({r["isa"] for r in rec})) or "reference")
    benchmark.pedantic(fn, rounds=ROUNDS[shapes], warmup_rounds=2, iterations=1)


@lru_cache(maxsize=1)  # one format's expert stacks at a time (the cases run format by format)
def moe_weights(shapes: str, fmt: str):
    shape = SHAPES[shapes][0]
    g = torch.Generator().manual_seed(1)
    w13, w2 = random_weight((shape.e, 2 * shape.i, shape.d), fmt, g), random_weight((shape.e, shape.d, shape.i), fmt, g)
    return cpu.prepare(w13), cpu.prepare(w2)


@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("fmt", FORMATS)  # format-major order: one format's stacks cached at a time
def test_fused_moe(benchmark, shapes, fmt, t):
    shape = SHAPES[shapes][0]
    p13, p2 = moe_weights(shapes, fmt)
    g = torch.Generator().manual_seed(t)
    x = torch.randn(t, shape.d, generator=g).to(torch.bfloat16)
    routes = random_routes(t, shape.e, shape.k, g)
    turn = itertools.count()  # each round another routing: other experts, from DRAM

    def call():
        return cpu.fused_moe(x, p13, p2, *routes[next(turn) % len(routes)])

    def check(out):
        tw, ids = routes[0]
        ref = reference.fused_moe(x, p13.orig, p2.orig, tw, ids)
        assert rel(out, ref) <= BOUND["int4" if fmt == "int4" else "fused_moe"], (fmt, t, rel(out, ref))

    touched = sum(len(ids.unique()) for _, ids in routes) / len(routes)
    run(benchmark, call, shapes, check, bytes=touched * expert_bytes(p13.orig, p2.orig),
        flops=2 * t * shape.k * 3 * shape.i * shape.d)


@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_linear(benchmark, shapes, fmt, t):
    n, k = SHAPES[shapes][1]
    g = torch.Generator().manual_seed(2)
    w = random_weight((n, k), fmt, g)
    nbytes = w.nbytes
    # few tokens: copies that together exceed the last-level cache (suites/kernels.py), as in decode
    extra = weight_copies(nbytes) - 1 if t < 64 and shapes == "small" else 0
    copies = [w] + [random_weight((n, k), fmt, g) for _ in range(extra)]
    prepared = [cpu.prepare(c) for c in copies]
    x = torch.randn(t, k, generator=g).to(torch.bfloat16)
    turn = itertools.count()

    def call():
        return cpu.linear(x, prepared[next(turn) % len(prepared)])

    def check(out):
        ref = reference.linear(x, prepared[0].orig)
        assert rel(out, ref) <= BOUND["int4" if fmt == "int4" else "linear"], (fmt, t, rel(out, ref))

    run(benchmark, call, shapes, check, bytes=nbytes, flops=2 * t * n * k)


@pytest.mark.parametrize("b,keys", MLA_CASES)
def test_mla_decode(benchmark, shapes, b, keys):
    h, r, p = SHAPES[shapes][2]
    g = torch.Generator().manual_seed(3)
    # four regions: consecutive rounds read other blocks
    cache, regions, lens = paged_latent_cache(g, b, keys, r + p, 4 * b * -(-keys // CACHE_BLOCK))
    q_lat, q_pe = bf16_randn(g, b, h, r), bf16_randn(g, b, h, p)
    scale = (r + p) ** -0.5
    turn = itertools.count()

    def call():
        return cpu.mla_decode(q_lat, q_pe, cache, regions[next(turn) % len(regions)], lens, scale)

    def check(out):
        ref = reference.mla_decode(q_lat, q_pe, cache, regions[0], lens, scale)
        assert rel(out, ref) <= BOUND["mla_decode"], (b, keys, rel(out, ref))

    run(benchmark, call, shapes, check, bytes=b * keys * (r + p) * 2, flops=b * keys * h * (2 * (r + p) + 2 * r))
