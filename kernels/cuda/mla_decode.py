"""MLA decode over the paged latent cache: split-KV flash decoding with head folding, then an LSE merge.

Shape legend: B queries (one per decode row), H heads, R kv_lora_rank, P rope dims, S splits,
NB cache blocks of BS tokens. The cache row of a token is [latent c (R) | k_pe (P)]; with W_UK
absorbed into the query, c is both the key (with k_pe) and the value, shared by all heads.

Stage 1 (grid: head blocks × B × S): each program folds head_block query heads into the GEMM M
side, walks its split of the sequence block_n tokens at a time through the block table, loads each
latent tile once and uses it twice (scores q_lat·cᵀ + q_pe·k_peᵀ, then p·c), with an online softmax;
it writes the split's normalized output and log-sum-exp. Head blocks vary fastest in the grid, so
the programs that share a KV tile run together and the re-reads hit L2.
Stage 2 (grid: H × B): out = Σ_s exp(lse_s − lse) · o_s over the splits that saw any token.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.cuda.tiles import MlaTiles

_LOG2E = 1.4426950408889634


@triton.jit(do_not_specialize=["num_splits"])
def _mla_split_kernel(
    q_lat_ptr, q_pe_ptr, kv_ptr, table_ptr, lens_ptr, mid_o_ptr, mid_lse_ptr,
    H, R, P, block_size, num_splits, scale_log2,
    stride_qb, stride_qh, stride_pb, stride_ph, stride_kv_block, stride_kv_token, stride_tb,
    stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
):
    """mid_o [B, H, S, R] float32 (normalized per split), mid_lse [B, H, S] float32 (−inf: empty split)."""
    hb = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)  # B · H · S · R outgrows int32 for large batches
    s = tl.program_id(2)
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    rr = tl.arange(0, BLOCK_R)
    pp = tl.arange(0, BLOCK_P)
    hmask = heads < H
    q = tl.load(q_lat_ptr + b * stride_qb + heads[:, None] * stride_qh + rr[None, :],
                mask=hmask[:, None] & (rr[None, :] < R), other=0.0)  # [BLOCK_H, BLOCK_R]
    q_pe = tl.load(q_pe_ptr + b * stride_pb + heads[:, None] * stride_ph + pp[None, :],
                   mask=hmask[:, None] & (pp[None, :] < P), other=0.0)  # [BLOCK_H, BLOCK_P]
    length = tl.load(lens_ptr + b)
    chunk = tl.cdiv(length, num_splits)
    start = s * chunk
    end = tl.minimum(start + chunk, length)

    m = tl.full((BLOCK_H,), float("-inf"), dtype=tl.float32)
    l = tl.zeros((BLOCK_H,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_R), dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        tok = n0 + tl.arange(0, BLOCK_N)
        tmask = tok < end
        block = tl.load(table_ptr + b * stride_tb + tok // block_size, mask=tmask, other=0)
        row = block.to(tl.int64) * stride_kv_block + (tok % block_size) * stride_kv_token
        kv = tl.load(kv_ptr + row[:, None] + rr[None, :], mask=tmask[:, None] & (rr[None, :] < R), other=0.0)
        pe = tl.load(kv_ptr + row[:, None] + R + pp[None, :], mask=tmask[:, None] & (pp[None, :] < P), other=0.0)
        scores = tl.dot(q, tl.trans(kv)) + tl.dot(q_pe, tl.trans(pe))  # [BLOCK_H, BLOCK_N] float32
        scores = tl.where(tmask[None, :], scores * scale_log2, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(kv.dtype), kv)
        m = m_new

    seen = l > 0
    out = acc / tl.where(seen, l, 1.0)[:, None]
    lse = tl.where(seen, m * 0.6931471805599453 + tl.log(tl.where(seen, l, 1.0)), float("-inf"))
    o_ptrs = mid_o_ptr + b * stride_ob + heads[:, None] * stride_oh + s * stride_os + rr[None, :]
    tl.store(o_ptrs, out, mask=hmask[:, None] & (rr[None, :] < R))
    tl.store(mid_lse_ptr + b * stride_lb + heads * stride_lh + s, lse, mask=hmask)


@triton.jit(do_not_specialize=["num_splits"])
def _mla_merge_kernel(
    mid_o_ptr, mid_lse_ptr, out_ptr, R, num_splits,
    stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_outb, stride_outh,
    BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """out [B, H, R] = Σ_s w_s · mid_o[s] with w_s = exp(lse_s − max) / Σ; all splits empty → 0."""
    h = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    ss = tl.arange(0, BLOCK_S)
    rr = tl.arange(0, BLOCK_R)
    lse_base = mid_lse_ptr + b * stride_lb + h * stride_lh
    lse = tl.load(lse_base + ss, mask=ss < num_splits, other=float("-inf"))
    top = tl.max(lse, axis=0)
    top = tl.where(top == float("-inf"), 0.0, top)
    total = tl.sum(tl.exp(lse - top), axis=0)
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    o_base = mid_o_ptr + b * stride_ob + h * stride_oh
    for s in range(0, num_splits):
        w = tl.exp(tl.load(lse_base + s) - top)
        acc += w * tl.load(o_base + s * stride_os + rr, mask=rr < R, other=0.0)
    acc = acc / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + b * stride_outb + h * stride_outh + rr, acc.to(out_ptr.dtype.element_ty), mask=rr < R)


def auto_splits(batch: int, heads: int, head_block: int, num_sms: int) -> int:
    """Splits that give ≈ 2 programs per multiprocessor, 1..64 (kv_splits = 0)."""
    programs = batch * triton.cdiv(heads, head_block)
    return max(1, min(64, triton.cdiv(2 * num_sms, max(programs, 1))))


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter: a few splits, to exercise the merge


def _check(q_lat, q_pe, kv_cache, block_tables, seq_lens) -> None:
    b, h, r = q_lat.shape
    p = q_pe.shape[-1]
    if q_pe.shape[:2] != (b, h) or kv_cache.dim() != 3 or kv_cache.shape[-1] != r + p:
        raise ValueError(f"mla_decode: q_lat {tuple(q_lat.shape)}, q_pe {tuple(q_pe.shape)}, "
                         f"kv_cache {tuple(kv_cache.shape)} do not fit (want [B,H,R], [B,H,P], [NB,BS,R+P])")
    if block_tables.shape[0] != b or seq_lens.shape != (b,):
        raise ValueError(f"mla_decode: block_tables {tuple(block_tables.shape)} / seq_lens "
                         f"{tuple(seq_lens.shape)} do not match B={b}")
    if q_lat.stride(-1) != 1 or q_pe.stride(-1) != 1 or kv_cache.stride(-1) != 1 or block_tables.stride(-1) != 1:
        raise ValueError("mla_decode: last dims must be contiguous")


def mla_decode(q_lat: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
               seq_lens: torch.Tensor, scale: float, *, tiles: MlaTiles) -> torch.Tensor:
    """Weight-absorbed MLA decode (kernels.reference.mla_decode's contract).

    q_lat [B, H, R], q_pe [B, H, P] (same float dtype as kv_cache); kv_cache [NB, BS, R + P];
    block_tables [B, MB] int32 (entries past a sequence's length are never read); seq_lens [B] int32.
    Returns [B, H, R] in q_lat.dtype; a sequence of length 0 gives zeros.
    """
    _check(q_lat, q_pe, kv_cache, block_tables, seq_lens)
    b, h, r = q_lat.shape
    p = q_pe.shape[-1]
    out = torch.empty((b, h, r), dtype=q_lat.dtype, device=q_lat.device)
    if b == 0 or h == 0:
        return out
    splits = tiles.kv_splits or auto_splits(b, h, tiles.head_block, _num_sms(q_lat.device))
    mid_o = torch.empty((b, h, splits, r), dtype=torch.float32, device=q_lat.device)
    mid_lse = torch.empty((b, h, splits), dtype=torch.float32, device=q_lat.device)
    tables = block_tables.to(torch.int32)
    lens = seq_lens.to(device=q_lat.device, dtype=torch.int32)
    block_r = max(16, triton.next_power_of_2(r))
    block_p = max(16, triton.next_power_of_2(p))
    grid = (triton.cdiv(h, tiles.head_block), b, splits)
    _mla_split_kernel[grid](
        q_lat, q_pe, kv_cache, tables, lens, mid_o, mid_lse, h, r, p, kv_cache.shape[1], splits,
        scale * _LOG2E, q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), tables.stride(0), *mid_o.stride()[:3], *mid_lse.stride()[:2],
        BLOCK_H=tiles.head_block, BLOCK_N=tiles.block_n, BLOCK_R=block_r, BLOCK_P=block_p,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    _mla_merge_kernel[(h, b)](
        mid_o, mid_lse, out, r, splits, *mid_o.stride()[:3], *mid_lse.stride()[:2], out.stride(0), out.stride(1),
        BLOCK_R=block_r, BLOCK_S=triton.next_power_of_2(splits), num_warps=tiles.merge_num_warps)
    return out

