"""Fused MoE on the GPU: two grouped GEMMs over the tokens grouped by expert.

Shape legend: T tokens, D hidden, E experts, K experts per token, I expert intermediate,
P = T·K (token, expert) pairs (pair p = t·K + k).

1. gate/up:  h[p]  = SiLU(x[t] · W1[e]ᵀ) ⊙ (x[t] · W3[e]ᵀ)   one program computes the gate and up
             tiles of the same I columns and writes SiLU(gate)·up ([P, I], x.dtype)
2. down:     y[p]  = w[p] · (h[p] · W2[e]ᵀ)                 routing weight applied in the epilogue
3. combine:  out[t] = Σ_k y[t·K + k]                          float32 sum over the K pairs

Weights: DenseWeight (fp16/bf16/fp32; the kernel casts each tile to x.dtype) or Fp8BlockWeight
(w8a8: x and h are quantized per token per 128 channels by fp8_gemm.quantize_act_fp8, each K step
scaled by activation ⊗ weight-block scales). Two layouts of the rows (moe_layout): contiguous for
prefill, masked (fixed shapes, CUDA-graph capturable) for decode, chosen by T ≤ masked_max_tokens.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.cuda.fp8_gemm import quantize_act_fp8
from kernels.cuda.moe_layout import ContiguousLayout, MaskedLayout, contiguous_layout, masked_layout
from kernels.cuda.tiles import GemmTiles, QuantTiles
from kernels.formats import DenseWeight, Fp8BlockWeight


@triton.jit(do_not_specialize=["num_pairs", "capacity"])  # one kernel for every batch size
def _moe_gemm_kernel(
    a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, out_ptr, route_ptr,
    rows_ptr, expert_ptr, count_ptr,
    N, K, num_pairs, top_k, capacity,
    stride_am, stride_asm, stride_we, stride_wn, stride_wse, stride_wsn, stride_om,
    MASKED: tl.constexpr, GATE_UP: tl.constexpr, FP8: tl.constexpr,
    SCALE_N: tl.constexpr, SCALE_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    UNIFORM_SCALE_N: tl.constexpr,
):
    """One program: BLOCK_M pairs of one expert × BLOCK_N output columns (gate/up: N = I, down: N = D).

    Contiguous: program_id(0) is a row block of `rows_ptr`, expert_ptr its expert, count_ptr the
    padded row total. Masked: program_id(0) = slot · ceil(capacity / BLOCK_M) + row block,
    expert_ptr / count_ptr the slot's expert and pair count, rows_ptr [slots, capacity].
    UNIFORM_SCALE_N (FP8): the tile's weight rows (gate and up) each lie in one scale row, so a K
    step scales by a row vector instead of a full activation ⊗ weight scale tile.
    """
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    if MASKED:
        blocks_per_slot = tl.cdiv(capacity, BLOCK_M)
        slot = pid_m // blocks_per_slot
        first = (pid_m % blocks_per_slot) * BLOCK_M
        count = tl.load(count_ptr + slot)
        if first >= count:
            return
        expert = tl.load(expert_ptr + slot)
        valid = first + offs_m < count
        pair = tl.load(rows_ptr + slot * capacity + first + offs_m, mask=valid, other=0)
    else:
        if pid_m * BLOCK_M >= tl.load(count_ptr):
            return
        expert = tl.load(expert_ptr + pid_m)
        pair = tl.load(rows_ptr + pid_m * BLOCK_M + offs_m)
        valid = pair < num_pairs
        pair = tl.where(valid, pair, 0)
    if GATE_UP:
        a_row = pair // top_k  # gate/up reads the token's row of x
    else:
        a_row = pair  # down reads the pair's row of h

    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    bn = rn % N  # wrapped: weight loads need no N mask
    rk = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_row[:, None].to(tl.int64) * stride_am + rk[None, :]
    w_ptrs = w_ptr + expert.to(tl.int64) * stride_we + bn[None, :].to(tl.int64) * stride_wn + rk[:, None]
    up_ptrs = w_ptrs + N * stride_wn  # gate/up only: the up rows follow the I gate rows
    if FP8:
        as_ptrs = a_scale_ptr + a_row * stride_asm
        ws_base = w_scale_ptr + expert.to(tl.int64) * stride_wse
        if UNIFORM_SCALE_N:  # scalar pointers
            ws_ptrs = ws_base + (pid_n * BLOCK_N // SCALE_N) * stride_wsn
            ws_up_ptrs = ws_base + ((pid_n * BLOCK_N + N) // SCALE_N) * stride_wsn
        else:
            ws_ptrs = ws_base + (bn // SCALE_N) * stride_wsn
            ws_up_ptrs = ws_base + ((bn + N) // SCALE_N) * stride_wsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=valid[:, None], other=0.0)
            b = tl.load(w_ptrs)
        else:
            kmask = (k0 + rk) < K
            a = tl.load(a_ptrs, mask=valid[:, None] & kmask[None, :], other=0.0)
            b = tl.load(w_ptrs, mask=kmask[:, None], other=0.0)
        if FP8:
            g = k0 // SCALE_K
            a_s = tl.load(as_ptrs + g, mask=valid, other=0.0)
            if UNIFORM_SCALE_N:
                acc += tl.dot(a, b) * (a_s * tl.load(ws_ptrs + g))[:, None]
            else:
                acc += tl.dot(a, b) * a_s[:, None] * tl.load(ws_ptrs + g)[None, :]
        else:
            acc = tl.dot(a, b.to(a.dtype), acc)
        if GATE_UP:
            if EVEN_K:
                b_up = tl.load(up_ptrs)
            else:
                b_up = tl.load(up_ptrs, mask=kmask[:, None], other=0.0)
            if FP8:
                if UNIFORM_SCALE_N:
                    acc_up += tl.dot(a, b_up) * (a_s * tl.load(ws_up_ptrs + g))[:, None]
                else:
                    acc_up += tl.dot(a, b_up) * a_s[:, None] * tl.load(ws_up_ptrs + g)[None, :]
            else:
                acc_up = tl.dot(a, b_up.to(a.dtype), acc_up)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
        up_ptrs += BLOCK_K
    if GATE_UP:
        res = acc / (1.0 + tl.exp(-acc)) * acc_up
    else:
        res = acc * tl.load(route_ptr + pair, mask=valid, other=0.0)[:, None]
    out_ptrs = out_ptr + pair[:, None].to(tl.int64) * stride_om + rn[None, :]
    tl.store(out_ptrs, res.to(out_ptr.dtype.element_ty), mask=valid[:, None] & (rn[None, :] < N))


def _check(x: torch.Tensor, w13, w2, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> None:
    t, d = x.shape
    e, two_i, d1 = w13.shape
    if two_i % 2 or d1 != d or tuple(w2.shape) != (e, d, two_i // 2):
        raise ValueError(f"fused_moe: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)} do not fit "
                         "(want w13 [E, 2I, D], w2 [E, D, I])")
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != t:
        raise ValueError(f"fused_moe: topk_ids {tuple(topk_ids.shape)} / topk_weights "
                         f"{tuple(topk_weights.shape)} do not match {t} tokens")
    if type(w13) is not type(w2) or not isinstance(w13, (DenseWeight, Fp8BlockWeight)):
        raise ValueError("fused_moe (cuda): w13 and w2 must both be DenseWeight or both Fp8BlockWeight")


def _launch(a, a_scale, weight, out, route, layout, n: int, k: int, top_k: int, gate_up: bool,
            tiles: GemmTiles) -> None:
    """One grouped GEMM over `layout` (a [rows, k] → out [P, n])."""
    fp8 = isinstance(weight, Fp8BlockWeight)
    w = weight.w
    ws = weight.scale_inv if fp8 else w
    scale_n, scale_k = weight.block if fp8 else (1, 1)
    if fp8 and scale_k % tiles.block_k:
        raise ValueError(f"block_k={tiles.block_k} must divide the weight's K block {scale_k}")
    masked = isinstance(layout, MaskedLayout)
    if masked:
        grid_m = layout.num_slots * triton.cdiv(layout.capacity, tiles.block_m)
        meta = (layout.rows, layout.slot_expert, layout.slot_count)
    else:
        if layout.block_m != tiles.block_m:
            raise ValueError("contiguous layout built for another block_m")
        grid_m = layout.num_blocks
        meta = (layout.rows, layout.block_expert, layout.total_rows)
    grid = (grid_m, triton.cdiv(n, tiles.block_n))
    _moe_gemm_kernel[grid](
        a, a_scale, w, ws, out, route, *meta, n, k, out.shape[0], top_k, getattr(layout, "capacity", 1),
        a.stride(0), a_scale.stride(0), w.stride(0), w.stride(1), ws.stride(0), ws.stride(1), out.stride(0),
        MASKED=masked, GATE_UP=gate_up, FP8=fp8, SCALE_N=scale_n, SCALE_K=scale_k,
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, EVEN_K=k % tiles.block_k == 0,
        UNIFORM_SCALE_N=fp8 and scale_n % tiles.block_n == 0 and (not gate_up or n % scale_n == 0),
        num_warps=tiles.num_warps, num_stages=tiles.num_stages)


def build_layout(topk_ids: torch.Tensor, num_experts: int, masked: bool, block_m: int):
    """The masked (decode) or contiguous (prefill) layout of the pairs; see moe_layout."""
    return masked_layout(topk_ids, num_experts) if masked else contiguous_layout(topk_ids, num_experts, block_m)


def fused_moe(x: torch.Tensor, w13, w2, topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
              prefill: GemmTiles, decode: GemmTiles, masked_max_tokens: int, quant: QuantTiles,
              layout: ContiguousLayout | MaskedLayout | None = None) -> torch.Tensor:
    """Σ_k w_k · down_e(SiLU(gate_e · x) ⊙ up_e · x); x [T, D], w13 [E, 2I, D], w2 [E, D, I],
    topk_weights [T, K] float, topk_ids [T, K] int → [T, D] in x.dtype.

    `layout` may be given (e.g. built once outside a CUDA graph); by default it is built here, masked
    when T ≤ masked_max_tokens (then the `decode` tiles are used, else `prefill`).
    """
    _check(x, w13, w2, topk_weights, topk_ids)
    (t, d), (e, two_i, _), top_k = x.shape, w13.shape, topk_ids.shape[1]
    i = two_i // 2
    if t == 0 or top_k == 0:
        return torch.zeros_like(x)
    masked = t <= masked_max_tokens if layout is None else isinstance(layout, MaskedLayout)
    tiles = decode if masked else prefill
    layout = layout if layout is not None else build_layout(topk_ids, e, masked, tiles.block_m)
    x = x.contiguous()
    p = t * top_k
    route = topk_weights.reshape(-1).float().contiguous()
    fp8 = isinstance(w13, Fp8BlockWeight)
    a, a_scale = quantize_act_fp8(x, quant, w13.block[1]) if fp8 else (x, x)
    h = torch.empty((p, i), dtype=x.dtype, device=x.device)
    _launch(a, a_scale, w13, h, route, layout, i, d, top_k, True, tiles)
    a, a_scale = quantize_act_fp8(h, quant, w2.block[1]) if fp8 else (h, h)
    y = torch.empty((p, d), dtype=x.dtype, device=x.device)
    _launch(a, a_scale, w2, y, route, layout, d, i, top_k, False, tiles)
    return y.view(t, top_k, d).sum(dim=1, dtype=torch.float32).to(x.dtype)
