"""Kernel-tier adapters for the "cuda" backend (kernels/cuda, Triton): its tile knobs, searched per op.

`register_cuda_ops()` registers four ops when a CUDA GPU and Triton are present (else nothing):
cuda_fused_moe_decode (masked layout, cuda_moe_decode_* knobs), cuda_fused_moe_prefill (contiguous,
cuda_moe_*), cuda_fp8_linear (cuda_fp8_gemm_*) and cuda_mla_decode (cuda_mla_*). Shapes are
DeepSeek-V3's (D 7168, I 2048, top-8 of 64 experts to bound the set-up; R 512 + P 64, 16 heads as
on one of 8 GPUs, 64-token cache blocks). Each run synchronizes the GPU, so the tier's host timer
sees the kernels' time. The verify step compares with the references of kernels.reference /
kernels.fp8_act (w8a8 for FP8 weights).
"""
from __future__ import annotations

import importlib.util

import torch

from engine.knobs import CATALOGUE
from tuner.kernel_tier import KernelOp, register_kernel_op

D, I, E, TOPK = 7168, 2048, 64, 8
R, P, HEADS, BLOCK, CONTEXT = 512, 64, 16, 64, 8192


def available() -> bool:
    return torch.cuda.is_available() and importlib.util.find_spec("triton") is not None


def _names(prefix: str, exclude: tuple = ()) -> tuple[str, ...]:
    return tuple(n for n, k in CATALOGUE.items() if k.component == "kernels/cuda" and n.startswith(prefix)
                 and not any(n.startswith(x) for x in exclude))


def _tiles(knobs: dict):
    from kernels.cuda.tiles import CudaTiles

    defaults = {n: k.default for n, k in CATALOGUE.items() if k.component == "kernels/cuda"}
    return CudaTiles.from_knobs({**defaults, **knobs})


def _synced(out):
    torch.cuda.synchronize()
    return out


# ---------------------------------------------------------------- fused MoE


def _moe_inputs(bucket: dict, fmt: str) -> tuple:
    from kernels.formats import DenseWeight, quantize_fp8_block

    g = torch.Generator(device="cuda").manual_seed(bucket["tokens"])
    w13 = torch.randn(E, 2 * I, D, generator=g, device="cuda", dtype=torch.bfloat16) * D ** -0.5
    w2 = torch.randn(E, D, I, generator=g, device="cuda", dtype=torch.bfloat16) * I ** -0.5
    if fmt == "fp8":
        w13, w2 = quantize_fp8_block(w13), quantize_fp8_block(w2)
    else:
        w13, w2 = DenseWeight(w13), DenseWeight(w2)
    t = bucket["tokens"]
    ids = torch.rand(t, E, generator=g, device="cuda").topk(TOPK, dim=-1).indices
    weights = torch.rand(t, TOPK, generator=g, device="cuda")
    return torch.randn(t, D, generator=g, device="cuda", dtype=torch.bfloat16), w13, w2, weights, ids


def _moe_run(args: tuple, masked: bool, **knobs):
    from kernels.cuda import fused_moe

    t = _tiles(knobs)
    return _synced(fused_moe.fused_moe(*args, prefill=t.moe_prefill, decode=t.moe_decode,
                                       masked_max_tokens=10 ** 9 if masked else 0, quant=t.fp8_quant))


def _moe_reference(args: tuple):
    from kernels import reference
    from kernels.formats import Fp8BlockWeight
    from kernels.fp8_act import fused_moe_fp8_w8a8

    return (fused_moe_fp8_w8a8 if isinstance(args[1], Fp8BlockWeight) else reference.fused_moe)(*args)


def _moe_work(bucket: dict, fmt: str) -> dict:
    touched = min(E, bucket["tokens"] * TOPK)
    return {"bytes": touched * 3 * I * D * (1 if fmt == "fp8" else 2), "flops": 2 * bucket["tokens"] * TOPK * 3 * I * D}


# ---------------------------------------------------------------- FP8 linear and MLA decode


def _linear_inputs(bucket: dict, fmt: str) -> tuple:
    from kernels.formats import quantize_fp8_block

    g = torch.Generator(device="cuda").manual_seed(bucket["tokens"])
    w = quantize_fp8_block(torch.randn(D, D, generator=g, device="cuda") * D ** -0.5)
    return torch.randn(bucket["tokens"], D, generator=g, device="cuda", dtype=torch.bfloat16), w


def _linear_run(args: tuple, **knobs):
    from kernels.cuda import fp8_gemm

    t = _tiles(knobs)
    return _synced(fp8_gemm.fp8_block_linear(args[0], args[1], t.fp8_gemm, t.fp8_quant))


def _mla_inputs(bucket: dict, fmt: str) -> tuple:
    b = bucket["batch"]
    g = torch.Generator(device="cuda").manual_seed(b)
    per_seq = CONTEXT // BLOCK
    cache = torch.randn(b * per_seq, BLOCK, R + P, generator=g, device="cuda", dtype=torch.bfloat16)
    tables = torch.randperm(b * per_seq, generator=g, device="cuda").to(torch.int32).view(b, per_seq)
    lens = torch.full((b,), CONTEXT, dtype=torch.int32, device="cuda")
    q_lat = torch.randn(b, HEADS, R, generator=g, device="cuda", dtype=torch.bfloat16)
    q_pe = torch.randn(b, HEADS, P, generator=g, device="cuda", dtype=torch.bfloat16)
    return q_lat, q_pe, cache, tables, lens, (R // 4 + P) ** -0.5


def _mla_run(args: tuple, **knobs):
    from kernels.cuda import mla_decode

    return _synced(mla_decode.mla_decode(*args, tiles=_tiles(knobs).mla))


def register_cuda_ops() -> bool:
    """Register the cuda ops when a GPU and Triton are here; False (and nothing) otherwise."""
    if not available():
        return False
    from kernels import reference
    from kernels.fp8_act import linear_fp8_w8a8

    fmts = ("bf16", "fp8")
    register_kernel_op(KernelOp(
        "cuda_fused_moe_decode", _names("cuda_moe_decode_"), fmts, ({"tokens": 1}, {"tokens": 8}, {"tokens": 64}),
        _moe_inputs, run=lambda a, **k: _moe_run(a, True, **k), reference=_moe_reference, atol=3e-2, rtol=3e-2,
        work=_moe_work))
    register_kernel_op(KernelOp(
        "cuda_fused_moe_prefill", _names("cuda_moe_", exclude=("cuda_moe_decode_", "cuda_moe_masked")), fmts,
        ({"tokens": 512}, {"tokens": 4096}), _moe_inputs, run=lambda a, **k: _moe_run(a, False, **k),
        reference=_moe_reference, atol=3e-2, rtol=3e-2, work=_moe_work))
    register_kernel_op(KernelOp(
        "cuda_fp8_linear", _names("cuda_fp8_"), ("fp8",), ({"tokens": 16}, {"tokens": 512}, {"tokens": 4096}),
        _linear_inputs, run=_linear_run, reference=lambda a: linear_fp8_w8a8(*a), atol=3e-2, rtol=3e-2,
        work=lambda b, f: {"bytes": D * D, "flops": 2 * b["tokens"] * D * D}))
    register_kernel_op(KernelOp(
        "cuda_mla_decode", _names("cuda_mla_"), ("bf16",), ({"batch": 1}, {"batch": 16}, {"batch": 64}),
        _mla_inputs, run=_mla_run, reference=lambda a: reference.mla_decode(*a), atol=2e-2, rtol=2e-2,
        work=lambda b, f: {"bytes": b["batch"] * CONTEXT * (R + P) * 2,
                           "flops": 2 * b["batch"] * HEADS * CONTEXT * (2 * R + P)}))
    return True
