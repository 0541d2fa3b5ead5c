"""Kernel-tier adapters for the "cpu" backend (kernels/cpu): linear and fused MoE with their tile
knobs, MLA decode and extend attention with the cpu_attn_* knobs.

Registered by `register_cpu_ops()` (called from tuner.kernel_tier.kernel_ops) only when the
backend imports on this machine and its knobs (kernels.cpu.KNOB_DEFAULTS) are in the catalogue.
Shapes are the `small` preset's (D = 2048, I = 1408, top-6) with 8 experts, so one configuration
is checked and timed in seconds; the verify step compares with kernels.reference on the same
quantized weights. Attention: the small preset's too (H = 16; MLA decode over a bf16 latent
cache R = 512, P = 64 in shuffled blocks of 64; extend in the naive MLA form Dk = 192, Dv = 128,
no prefix), bf16 queries.

The ISA knobs (cpu_int8_isa, cpu_bf16_isa) are searched over the variants that run natively here
("auto" and those cpu.runnable_choices names): the ops' catalogue narrows their choices, so no trial
asks for an instruction the CPU lacks (it would only measure the fallback again).
"""
from __future__ import annotations

import dataclasses

import torch

from engine.knobs import CATALOGUE
from tuner.kernel_tier import KernelOp, register_kernel_op

D, I, E, TOPK, N_LINEAR = 2048, 1408, 8, 6, 2048
FORMATS = ("bf16", "int8", "fp8", "int4")
BUCKETS = ({"tokens": 1}, {"tokens": 16}, {"tokens": 128})
HEADS, R, P, BLOCK, DK, DV = 16, 512, 64, 64, 192, 128
MLA_BUCKETS = ({"batch": 1, "context": 2048}, {"batch": 16, "context": 2048})
EXTEND_BUCKETS = ({"tokens": 512}, {"tokens": 2048})
DECODE_KNOBS = ("cpu_attn_head_fold", "cpu_attn_kv_splits", "cpu_attn_decode_kv_block", "cpu_attn_blas_rows",
                "cpu_attn_blas_kv_block")  # blas_rows also decides the extend form; searched here
EXTEND_KNOBS = ("cpu_attn_extend_q_block", "cpu_attn_extend_kv_block")


def quantized(w: torch.Tensor, fmt: str):
    """A float32 weight [..., N, K] in `fmt` (kernels.formats)."""
    from kernels import formats

    if fmt == "bf16":
        return formats.DenseWeight(w.to(torch.bfloat16))
    return {"int8": formats.quantize_int8_channel, "fp8": formats.quantize_fp8_block,
            "int4": formats.quantize_int4_group}[fmt](w)


def _linear_inputs(bucket: dict, fmt: str) -> tuple:
    import kernels.cpu as cpu

    g = torch.Generator().manual_seed(bucket["tokens"])
    w = quantized(torch.randn(N_LINEAR, D, generator=g) * 0.02, fmt)
    return torch.randn(bucket["tokens"], D, generator=g).to(torch.bfloat16), cpu.prepare(w), w


def _moe_inputs(bucket: dict, fmt: str) -> tuple:
    import kernels.cpu as cpu

    t = bucket["tokens"]
    g = torch.Generator().manual_seed(t)
    w13 = quantized(torch.randn(E, 2 * I, D, generator=g) * 0.02, fmt)
    w2 = quantized(torch.randn(E, D, I, generator=g) * 0.02, fmt)
    ids = torch.stack([torch.randperm(E, generator=g)[:TOPK] for _ in range(t)])
    weights = torch.softmax(torch.randn(t, TOPK, generator=g), -1)
    x = torch.randn(t, D, generator=g).to(torch.bfloat16)
    return x, cpu.prepare(w13), cpu.prepare(w2), weights, ids, w13, w2


def _linear_work(bucket: dict, fmt: str) -> dict:
    bits = {"bf16": 16, "int8": 8, "fp8": 8, "int4": 4}[fmt]
    return {"bytes": N_LINEAR * D * bits // 8, "flops": 2 * bucket["tokens"] * N_LINEAR * D}


def _moe_work(bucket: dict, fmt: str) -> dict:
    bits = {"bf16": 16, "int8": 8, "fp8": 8, "int4": 4}[fmt]
    touched = min(E, bucket["tokens"] * TOPK)
    return {"bytes": touched * 3 * I * D * bits // 8, "flops": 2 * bucket["tokens"] * TOPK * 3 * I * D}


def _mla_inputs(bucket: dict, fmt: str) -> tuple:
    b, context = bucket["batch"], bucket["context"]
    g = torch.Generator().manual_seed(b * context)
    per_seq = -(-context // BLOCK)
    cache = torch.randn(b * per_seq, BLOCK, R + P, generator=g).to(torch.bfloat16)
    tables = torch.randperm(b * per_seq, generator=g).to(torch.int32).view(b, per_seq)
    lens = torch.full((b,), context, dtype=torch.int32)
    q_lat, q_pe = (torch.randn(b, HEADS, n, generator=g).to(torch.bfloat16) for n in (R, P))
    return q_lat, q_pe, cache, tables, lens, DK ** -0.5


def _mla_work(bucket: dict, fmt: str) -> dict:
    keys = bucket["batch"] * bucket["context"]
    return {"bytes": keys * (R + P) * 2, "flops": keys * HEADS * (2 * (R + P) + 2 * R)}


def _extend_inputs(bucket: dict, fmt: str) -> tuple:
    t = bucket["tokens"]
    g = torch.Generator().manual_seed(t)
    q, k, v = (torch.randn(t, HEADS, d, generator=g).to(torch.bfloat16) for d in (DK, DK, DV))
    return q, k, v, DK ** -0.5


def _extend_work(bucket: dict, fmt: str) -> dict:
    t = bucket["tokens"]
    return {"bytes": 2 * t * HEADS * (2 * DK + 2 * DV), "flops": HEADS * (DK + DV) * t * (t + 1)}


def runnable_catalogue(cpu) -> dict:
    """The catalogue with each ISA knob's choices narrowed to the variants this machine runs."""
    cat = dict(CATALOGUE)
    for name in cpu.ISA_KNOBS:
        if name in cat:
            cat[name] = dataclasses.replace(cat[name], choices=cpu.runnable_choices(name))
    return cat


def register_cpu_ops() -> bool:
    """Register linear, fused_moe, cpu_mla_decode and cpu_extend_attention when the cpu backend runs
    here; False (and nothing) otherwise."""
    try:
        import kernels.cpu as cpu
        from kernels import reference
    except ImportError:
        return False
    names = tuple(n for n in getattr(cpu, "KNOB_DEFAULTS", {}) if n in CATALOGUE)
    if not names:
        return False
    # the load-time knobs (cpu.LOAD_KNOBS) are read once by prepare(): not per-call tiles
    weight_knobs = tuple(n for n in names if not n.startswith("cpu_attn_") and n not in cpu.LOAD_KNOBS)
    linear_knobs = tuple(n for n in weight_knobs if n != "cpu_moe_block_n")  # each op: the tiles it reads
    catalogue = runnable_catalogue(cpu)
    moe_knobs = tuple(n for n in weight_knobs if n != "cpu_linear_block_n")
    register_kernel_op(KernelOp(
        "linear", linear_knobs, FORMATS, BUCKETS, _linear_inputs,
        run=lambda a, **k: cpu.linear(a[0], a[1], knobs=k),
        reference=lambda a: reference.linear(a[0], a[2]), atol=5e-2, rtol=3e-2, work=_linear_work,
        catalogue=catalogue))
    register_kernel_op(KernelOp(
        "fused_moe", moe_knobs, FORMATS, BUCKETS, _moe_inputs,
        run=lambda a, **k: cpu.fused_moe(*a[:5], knobs=k),
        reference=lambda a: reference.fused_moe(a[0], a[5], a[6], a[3], a[4]), atol=5e-2, rtol=3e-2,
        work=_moe_work, catalogue=catalogue))
    if set(DECODE_KNOBS + EXTEND_KNOBS) <= set(names):
        register_kernel_op(KernelOp(
            "cpu_mla_decode", DECODE_KNOBS, ("bf16",), MLA_BUCKETS, _mla_inputs,
            run=lambda a, **k: cpu.mla_decode(*a, knobs=k), reference=lambda a: reference.mla_decode(*a),
            atol=1e-2, rtol=1e-2, work=_mla_work))
        register_kernel_op(KernelOp(
            "cpu_extend_attention", EXTEND_KNOBS, ("bf16",), EXTEND_BUCKETS, _extend_inputs,
            run=lambda a, **k: cpu.extend_attention(*a, knobs=k), reference=lambda a: reference.extend_attention(*a),
            atol=1e-2, rtol=1e-2, work=_extend_work))
    return True
