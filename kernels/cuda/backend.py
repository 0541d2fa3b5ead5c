"""The "cuda" kernel backend: Triton kernels where they pay, torch on the tensors' device elsewhere.

Triton: fused_moe (DenseWeight or Fp8BlockWeight experts), linear on Fp8BlockWeight (w8a8 FP8 block
GEMM), mla_decode (split-KV flash decoding). torch (cuBLAS / SDPA / elementwise): dense linear,
head_linear, extend_attention, norms, RoPE, routing. INT8-channel weights run the reference's
formula on the device. FP8-block ops quantize activations per token per 128 channels
(kernels.fp8_act is their reference), where kernels.reference keeps activations unrounded.

Tile knobs: `configure(knobs)` with the resolved knob mapping (engine.knobs.resolve_knobs(), the
"cuda_*" entries, component "kernels/cuda") before the first op; the engine does this.
"""
from __future__ import annotations

from typing import Mapping

import torch
import torch.nn.functional as F

from kernels import reference
from kernels.cuda import fp8_gemm as _fp8
from kernels.cuda import fused_moe as _moe
from kernels.cuda import mla_decode as _mla
from kernels.cuda.tiles import CudaTiles
from kernels.formats import DenseWeight, Fp8BlockWeight

_tiles: CudaTiles | None = None


def configure(knobs: Mapping) -> CudaTiles:
    """Set every tile knob from a resolved knob mapping; returns the tiles now in force."""
    global _tiles
    _tiles = CudaTiles.from_knobs(knobs)
    return _tiles


def tiles() -> CudaTiles:
    if _tiles is None:
        raise RuntimeError("kernels.cuda.backend is not configured: call "
                           "configure(engine.knobs.resolve_knobs(...)) first")
    return _tiles


# ---------------------------------------------------------------- torch on the device

rms_norm = reference.rms_norm
add_rms_norm = reference.add_rms_norm
silu_and_mul = reference.silu_and_mul
rope = reference.rope
grouped_topk = reference.grouped_topk
paged_decode = reference.paged_decode  # MHA/GQA families: torch on the device until Triton kernels exist
paged_extend = reference.paged_extend


def head_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """out[t, h] = w[h] · x[t, h]; x [T, H, A], w [H, B, A] → [T, H, B] (batched GEMM in x.dtype)."""
    return torch.einsum("tha,hba->thb", x, w.to(x.dtype))


def extend_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of T new tokens over S keys (reference contract), through torch's SDPA."""
    t, s = q.shape[0], k.shape[0]
    rows = torch.arange(t, device=q.device) + (s - t)
    visible = torch.arange(s, device=q.device)[None, :] <= rows[:, None]  # [T, S]
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1).to(q.dtype),
                                         v.transpose(0, 1).to(q.dtype), attn_mask=visible, scale=scale)
    return out.transpose(0, 1).contiguous()


# ---------------------------------------------------------------- Triton


def linear(x: torch.Tensor, weight) -> torch.Tensor:
    """y = x · Wᵀ; x [T, K], weight [N, K] → [T, N] in x.dtype."""
    if isinstance(weight, Fp8BlockWeight):
        t = tiles()
        return _fp8.fp8_block_linear(x, weight, t.fp8_gemm, t.fp8_quant)
    if isinstance(weight, DenseWeight):
        return F.linear(x, weight.w.to(x.dtype))
    return reference.linear(x, weight)


def fused_moe(x: torch.Tensor, w13, w2, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """Reference contract: x [T, D], w13 [E, 2I, D], w2 [E, D, I], topk [T, K] → [T, D] in x.dtype."""
    if type(w13) is not type(w2) or not isinstance(w13, (DenseWeight, Fp8BlockWeight)):
        return reference.fused_moe(x, w13, w2, topk_weights, topk_ids)
    t = tiles()
    return _moe.fused_moe(x, w13, w2, topk_weights.to(x.device), topk_ids.to(x.device), prefill=t.moe_prefill,
                          decode=t.moe_decode, masked_max_tokens=t.moe_masked_max_tokens, quant=t.fp8_quant)


def mla_decode(q_lat: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
               seq_lens: torch.Tensor, scale: float, new_rows: torch.Tensor | None = None,
               slots: torch.Tensor | None = None) -> torch.Tensor:
    """Reference contract (kernels.reference.mla_decode); queries cast to the cache's dtype."""
    dev, dt = kv_cache.device, kv_cache.dtype
    if new_rows is not None:
        reference.write_cache(kv_cache, slots.to(dev), new_rows.to(dev))
    out = _mla.mla_decode(q_lat.to(dt).contiguous(), q_pe.to(dt).contiguous(), kv_cache,
                          block_tables.to(dev, torch.int32).contiguous(), seq_lens.to(dev, torch.int32), scale,
                          tiles=tiles().mla)
    return out.to(q_lat.dtype)
