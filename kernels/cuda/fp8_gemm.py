"""FP8 block GEMM (w8a8) for the dense projections of FP8 checkpoints, and the FP8 activation quantizer.

Math (kernels.fp8_act is the readable reference):
  a_q, a_s = quantize(x)     per token per 128 channels: a_s [M, Kg] = amax / 448, a_q float8_e4m3fn
  y[m, n]  = Σ_g a_s[m, g] · b_s[n // 128, g] · Σ_{k ∈ group g} a_q[m, k] · b_q[n, k]
with b_q float8_e4m3fn [N, K] and b_s = scale_inv float32 [ceil(N/128), ceil(K/128)] (the checkpoint's
blocks). Each K step of the kernel lies inside one scale group (block_k divides the group), so the
partial dot of a step is scaled once by a_s ⊗ b_s and added to a float32 accumulator.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.cuda.tiles import Fp8GemmTiles, QuantTiles
from kernels.formats import FP8_MAX, Fp8BlockWeight


@triton.jit
def _round_to_e4m3(v):
    """v (float32, |v| ≤ 448) rounded to the float8_e4m3fn grid, to nearest even, still float32.

    Only for the Triton interpreter, whose float→fp8 cast (triton 3.9) drops the mantissa carry
    (31.6 → 16); once v is on the grid that cast is exact. The GPU casts in hardware instead.
    """
    bits = v.to(tl.int32, bitcast=True)
    exponent = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)  # spacing below 2^-6 is subnormal: 2^-9
    ulp = ((exponent - 3 + 127) << 23).to(tl.float32, bitcast=True)
    magic = ulp * 12582912.0  # 1.5 · 2^23 ulps: adding it rounds |v| to a multiple of ulp (RNE)
    r = (tl.abs(v) + magic) - magic
    return tl.where(bits < 0, -r, r)  # the sign bit, −0 included


@triton.jit
def _act_quant_kernel(
    x_ptr, q_ptr, s_ptr, M, K, stride_xm, stride_qm, stride_sm,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, QMAX: tl.constexpr, ROUND_IN_FP32: tl.constexpr,
):
    """One program: BLOCK_M rows × one channel group. x [M, K] → q fp8 [M, K], s float32 [M, Kg]."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    g = tl.program_id(1)
    cols = g * GROUP + tl.arange(0, GROUP)
    mask = (rows[:, None] < M) & (cols[None, :] < K)
    x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + cols[None, :], mask=mask, other=0.0)
    x = x.to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    scale = tl.where(amax > 0, amax / QMAX, 1.0)
    q = x / scale[:, None]
    q = tl.minimum(tl.maximum(q, -QMAX), QMAX)
    if ROUND_IN_FP32:
        q = _round_to_e4m3(q)
    tl.store(q_ptr + rows[:, None].to(tl.int64) * stride_qm + cols[None, :], q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + rows * stride_sm + g, scale, mask=rows < M)


@triton.jit(do_not_specialize=["M"])  # one compiled kernel for every token count (M = 1 included)
def _fp8_gemm_kernel(
    a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, M, N, K,
    stride_am, stride_asm, stride_bn, stride_bsn, stride_cm,
    SCALE_N: tl.constexpr, SCALE_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, UNIFORM_SCALE_N: tl.constexpr,
):
    """C [M, N] = dequant(A) · dequant(B)ᵀ; one program per BLOCK_M × BLOCK_N tile, grouped order.

    UNIFORM_SCALE_N: the tile's columns lie in one weight-scale row (BLOCK_N divides SCALE_N), so
    each K step scales by a row vector a_s · b_s instead of a full a_s ⊗ b_s tile (fewer registers).
    """
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * tiles_n
    first_m = (pid // width) * GROUP_M
    rows_in_group = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % rows_in_group
    pid_n = (pid % width) // rows_in_group

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    am = rm % M  # wrapped rows/cols: loads need no M/N mask, stores are masked
    bn = rn % N
    a_ptrs = a_ptr + am[:, None].to(tl.int64) * stride_am + rk[None, :]
    b_ptrs = b_ptr + bn[None, :].to(tl.int64) * stride_bn + rk[:, None]  # [BLOCK_K, BLOCK_N]
    as_ptrs = as_ptr + am * stride_asm
    if UNIFORM_SCALE_N:
        bs_ptrs = bs_ptr + (pid_n * BLOCK_N // SCALE_N) * stride_bsn  # one pointer: a scalar per step
    else:
        bs_ptrs = bs_ptr + (bn // SCALE_N) * stride_bsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            kmask = (k0 + rk) < K
            a = tl.load(a_ptrs, mask=kmask[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=kmask[:, None], other=0.0)
        g = k0 // SCALE_K
        a_s = tl.load(as_ptrs + g)
        b_s = tl.load(bs_ptrs + g)
        if UNIFORM_SCALE_N:
            acc += tl.dot(a, b) * (a_s * b_s)[:, None]
        else:
            acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    c_ptrs = c_ptr + rm[:, None].to(tl.int64) * stride_cm + rn[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


INTERPRETED = not isinstance(_act_quant_kernel, triton.runtime.JITFunction)


def quantize_act_fp8(x: torch.Tensor, tiles: QuantTiles, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (fp16/bf16/fp32, rows contiguous) → (q float8_e4m3fn [M, K], scale float32 [M, ceil(K/group)])."""
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"quantize_act_fp8 wants a 2-D row-major x, got shape {tuple(x.shape)} strides {x.stride()}")
    m, k = x.shape
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((m, triton.cdiv(k, group)), dtype=torch.float32, device=x.device)
    if m == 0 or k == 0:
        return q, s
    grid = (triton.cdiv(m, tiles.block_m), s.shape[1])
    _act_quant_kernel[grid](x, q, s, m, k, x.stride(0), q.stride(0), s.stride(0), GROUP=group,
                            BLOCK_M=tiles.block_m, QMAX=FP8_MAX, ROUND_IN_FP32=INTERPRETED,
                            num_warps=tiles.num_warps)
    return q, s


def _check_block_k(block_k: int, scale_k: int) -> None:
    if scale_k % block_k:
        raise ValueError(f"block_k={block_k} must divide the weight's K block {scale_k}")


def fp8_gemm(a: torch.Tensor, a_scale: torch.Tensor, weight: Fp8BlockWeight, out_dtype: torch.dtype,
             tiles: Fp8GemmTiles) -> torch.Tensor:
    """a float8 [M, K] with a_scale float32 [M, ceil(K/bk)], weight [N, K] FP8-block → [M, N] out_dtype."""
    (m, k), (n, k2) = a.shape, weight.w.shape
    if k != k2:
        raise ValueError(f"fp8_gemm: a has K={k}, weight has K={k2}")
    scale_n, scale_k = weight.block
    _check_block_k(tiles.block_k, scale_k)
    c = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0 or n == 0:
        return c
    if k == 0:
        return c.zero_()
    w, ws = weight.w, weight.scale_inv
    grid = (triton.cdiv(m, tiles.block_m) * triton.cdiv(n, tiles.block_n),)
    _fp8_gemm_kernel[grid](
        a, a_scale, w, ws, c, m, n, k, a.stride(0), a_scale.stride(0), w.stride(0), ws.stride(0), c.stride(0),
        SCALE_N=scale_n, SCALE_K=scale_k, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        GROUP_M=tiles.group_m, EVEN_K=k % tiles.block_k == 0, UNIFORM_SCALE_N=scale_n % tiles.block_n == 0,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    return c


def fp8_block_linear(x: torch.Tensor, weight: Fp8BlockWeight, gemm: Fp8GemmTiles, quant: QuantTiles) -> torch.Tensor:
    """y = x · Wᵀ in w8a8: x [..., K] (fp16/bf16/fp32) quantized per token per 128 → [..., N] in x.dtype."""
    if not isinstance(weight, Fp8BlockWeight) or weight.w.dim() != 2:
        raise ValueError("fp8_block_linear wants one 2-D Fp8BlockWeight")
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k).contiguous()
    q, s = quantize_act_fp8(x2, quant, weight.block[1])
    return fp8_gemm(q, s, weight, x.dtype, gemm).view(*lead, weight.w.shape[0])
