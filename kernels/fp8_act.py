"""FP8 activations (w8a8) for FP8-block checkpoints: the quantizer and the readable references.

The GPU path multiplies FP8 weights by FP8 activations (DeepSeek-V3's own inference math):
activations are quantized at run time per token per `group` channels (group = the weight block's
K side, 128), with scale = amax / 448 (1 where the group is all zero) and values rounded to
float8_e4m3fn (round to nearest even). These references define that math in plain torch, float32
inside; `kernels.reference.linear` / `fused_moe` stay the weight-only oracle (no activation
rounding), from which w8a8 differs by the activation rounding alone (≈ 2–4 % relative per output).
"""
from __future__ import annotations

import torch

from kernels import reference
from kernels.formats import FP8_MAX, Fp8BlockWeight


def quantize_activation_fp8(x: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] → (q float8_e4m3fn [T, K], scale float32 [T, ceil(K/group)]); x ≈ q · scale of its group."""
    t, k = x.shape
    pad = -k % group
    xf = torch.nn.functional.pad(x.float(), (0, pad)).view(t, -1, group)
    amax = xf.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (xf / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(t, -1)[:, :k].contiguous(), scale


def dequantize_activation_fp8(q: torch.Tensor, scale: torch.Tensor, group: int = 128) -> torch.Tensor:
    """Inverse of quantize_activation_fp8: float32 [T, K]."""
    s = scale.repeat_interleave(group, dim=-1)[:, : q.shape[-1]]
    return q.float() * s


def fake_quantize_activation_fp8(x: torch.Tensor, group: int = 128) -> torch.Tensor:
    """x rounded through the FP8 activation format, float32 [T, K]."""
    return dequantize_activation_fp8(*quantize_activation_fp8(x, group), group)


def _w8a8(x: torch.Tensor, weight: Fp8BlockWeight) -> torch.Tensor:
    """q(x) · Wᵀ in float32, [T, N]."""
    return fake_quantize_activation_fp8(x, weight.block[1]) @ weight.dequantize(torch.float32).T


def linear_fp8_w8a8(x: torch.Tensor, weight: Fp8BlockWeight) -> torch.Tensor:
    """y = q(x) · Wᵀ with x quantized per token per weight-block K side. x [T, K] → [T, N] in x.dtype."""
    return _w8a8(x, weight).to(x.dtype)


def fused_moe_fp8_w8a8(
    x: torch.Tensor,
    w13: Fp8BlockWeight,
    w2: Fp8BlockWeight,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """kernels.reference.fused_moe with both GEMM inputs quantized to FP8 (x, then SiLU(gate)·up
    rounded to x.dtype). Shapes as there: x [T, D], w13 [E, 2I, D], w2 [E, D, I] → [T, D] x.dtype."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in topk_ids.reshape(-1).unique().tolist():
        token, slot = (topk_ids == e).nonzero(as_tuple=True)
        h = reference.silu_and_mul(_w8a8(x[token], w13[e])).to(x.dtype)
        y = _w8a8(h, w2[e])
        out.index_add_(0, token, y * topk_weights[token, slot].unsqueeze(-1).float())
    return out.to(x.dtype)
