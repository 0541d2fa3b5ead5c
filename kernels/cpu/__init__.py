"""The "cpu" kernel backend: AVX-512 C++ kernels (kernels/cpu/csrc) for linear, fused MoE,
RMSNorm (+ residual) and RoPE; the other ops (routing, attention, per-head linear, SiLU·mul)
delegate to `kernels.reference`.

Weights: every format of kernels.formats (dense float32/bfloat16, INT8-channel, FP8-block,
INT4-group) is consumed in its own row-major [N, K] layout; `prepare_weights` wraps each weight
once at load in a `Packed` holding the kernel's arguments (contiguous tensors, float32 scales,
FP8 bytes viewed as uint8), so nothing is converted per call. Dense float16 weights fall back to the reference.

Run-time knobs (engine.knobs CATALOGUE, `cpu_*`): set once by `configure(knobs)`, or per call with
`knobs={...}` on linear / fused_moe (the tests and the kernel suite sweep them that way).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kernels import reference
from kernels.cpu_build import load as _load
from kernels.formats import DenseWeight, Fp8BlockWeight, Int4GroupWeight, Int8ChannelWeight

_ext = _load()  # ImportError (with the reason) where the kernels cannot run or build

# Knob name → default; the order is the C++ Knobs vector's. Defaults mirror engine/knobs.py.
KNOB_DEFAULTS: dict[str, Any] = {
    "cpu_micro_rows": 4,
    "cpu_micro_tokens": 1,
    "cpu_linear_block_n": 64,
    "cpu_moe_block_n": 32,
    "cpu_gemm_min_tokens": 32,
    "cpu_gemm_block_n": 256,
    "cpu_fp8_method": "vector",
}
FP8_METHODS = {"vector": 0, "lut": 1}
_knobs = dict(KNOB_DEFAULTS)

FORMAT_IDS = {"f32": 0, "bf16": 1, "int8": 2, "fp8": 3, "int4": 4}
_EMPTY = torch.empty(0)


def configure(knobs: dict) -> None:
    """Adopt the `cpu_*` values of a resolved knob dict as this backend's defaults."""
    _knobs.update({k: v for k, v in knobs.items() if k in KNOB_DEFAULTS})


def _knob_vector(overrides: dict | None) -> list[int]:
    k = {**_knobs, **(overrides or {})}
    unknown = set(overrides or {}) - set(KNOB_DEFAULTS)
    if unknown:
        raise KeyError(f"unknown cpu knobs: {sorted(unknown)}")
    return [int(k["cpu_micro_rows"]), int(k["cpu_micro_tokens"]), int(k["cpu_linear_block_n"]),
            int(k["cpu_moe_block_n"]), int(k["cpu_gemm_min_tokens"]), int(k["cpu_gemm_block_n"]),
            FP8_METHODS[k["cpu_fp8_method"]]]


# ---------------------------------------------------------------- weights


@dataclass
class Packed:
    """A weight plus the argument tuple the C++ kernels take; other attributes read through to it.

    args: (format id, w, N, K, scale, zero, group, block_n) with w [E?, N, K-ish] contiguous.
    """

    orig: Any
    args: tuple

    def __getattr__(self, name):  # shape, nbytes, dequantize, format, ...
        if name in ("orig", "args"):
            raise AttributeError(name)
        return getattr(self.orig, name)

    def __getitem__(self, e):
        return self.orig[e]


def _pack(weight) -> tuple | None:
    """The kernel arguments for a weight, or None when the kernels do not take its format."""
    if isinstance(weight, Packed):
        return weight.args
    n, k = weight.shape[-2], weight.shape[-1]
    if isinstance(weight, DenseWeight):
        fmt = {torch.float32: "f32", torch.bfloat16: "bf16"}.get(weight.w.dtype)
        return None if fmt is None else (FORMAT_IDS[fmt], weight.w.contiguous(), n, k, _EMPTY, _EMPTY, 0, 1)
    if isinstance(weight, Int8ChannelWeight):
        return (FORMAT_IDS["int8"], weight.w.contiguous(), n, k, weight.scale.float().contiguous(), _EMPTY, 0, 1)
    if isinstance(weight, Fp8BlockWeight):
        bn, bk = weight.block
        if bk % 32:
            return None
        scale = weight.scale_inv.float().contiguous()
        return (FORMAT_IDS["fp8"], weight.w.view(torch.uint8).contiguous(), n, k, scale, _EMPTY, bk, bn)
    if isinstance(weight, Int4GroupWeight):
        return (FORMAT_IDS["int4"], weight.packed.contiguous(), n, k, weight.scale.float().contiguous(),
                weight.zero.float().contiguous(), weight.group, 1)
    return None


def prepare(weight):
    """Wrap one weight for the kernels (once, at load); formats they do not take pass unchanged."""
    args = _pack(weight)
    return weight if args is None or isinstance(weight, Packed) else Packed(weight, args)


def prepare_weights(weights: dict) -> dict:
    """The engine's weight dict with every kernel-ready weight wrapped (tensors pass unchanged)."""
    return {key: (w if isinstance(w, torch.Tensor) else prepare(w)) for key, w in weights.items()}


def _orig(weight):
    return weight.orig if isinstance(weight, Packed) else weight


# ---------------------------------------------------------------- ops


def linear(x: torch.Tensor, weight, knobs: dict | None = None) -> torch.Tensor:
    """y = x · Wᵀ: x [..., K] float, weight [N, K] any format → [..., N] in x.dtype."""
    args = _pack(weight)
    if args is None or x.dtype not in (torch.float32, torch.bfloat16) or args[1].dim() != 2:
        return reference.linear(x, _orig(weight))
    n, k = args[2], args[3]
    out = _ext.linear(x.reshape(-1, k), *args, _knob_vector(knobs))
    return out.to(x.dtype).reshape(*x.shape[:-1], n)


def fused_moe(x, w13, w2, topk_weights, topk_ids, knobs: dict | None = None) -> torch.Tensor:
    """Σ_k w_k · down_e(SiLU(gate_e · x) ⊙ up_e · x); shapes as kernels.reference.fused_moe."""
    a13, a2 = _pack(w13), _pack(w2)
    usable = (a13 is not None and a2 is not None and a13[0] == a2[0] and a13[6:] == a2[6:]
              and x.dtype in (torch.float32, torch.bfloat16) and a13[1].dim() == 3)
    if not usable:
        return reference.fused_moe(x, _orig(w13), _orig(w2), topk_weights, topk_ids)
    fmt, w13t, n13, d, s13, z13, group, block_n = a13
    out = _ext.fused_moe(x.contiguous(), fmt, w13t, s13, z13, a2[1], a2[4], a2[5], n13 // 2, group, block_n,
                         topk_weights.float().contiguous(), topk_ids.long().contiguous(), _knob_vector(knobs))
    return out.to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype not in (torch.float32, torch.bfloat16) or x.numel() == 0:
        return reference.rms_norm(x, weight, eps)
    return _ext.rms_norm(x, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    if x.dtype not in (torch.float32, torch.bfloat16) or x.dtype != residual.dtype or x.numel() == 0:
        return reference.add_rms_norm(x, residual, weight, eps)
    normed, summed = _ext.add_rms_norm(x, residual, weight, eps)
    return normed, summed


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """As kernels.reference.rope: x [T, H, P], cos/sin [T, P/2] → [T, H, P] de-interleaved, x.dtype."""
    if x.dim() != 3 or x.dtype not in (torch.float32, torch.bfloat16) or x.numel() == 0:
        return reference.rope(x, cos, sin, interleave)
    return _ext.rope(x, cos, sin, interleave)


silu_and_mul = reference.silu_and_mul
head_linear = reference.head_linear
grouped_topk = reference.grouped_topk
extend_attention = reference.extend_attention
mla_decode = reference.mla_decode

NATIVE_OPS = ("linear", "fused_moe", "rms_norm", "add_rms_norm", "rope")


def extension():
    """The compiled module (the probe and the suites use its timing helpers)."""
    return _ext
