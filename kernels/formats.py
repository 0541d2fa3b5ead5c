"""Weight formats, kept quantized in memory; every op dequantizes inside itself.

All formats hold a weight of logical shape [..., N, K] (N out features, K in features; a leading
expert dimension E for stacked experts) and support `w[e]` to take one expert.

- DenseWeight        w: float32 / bfloat16 / float16 [..., N, K]
- Fp8BlockWeight     the official DeepSeek-V3 layout: w float8_e4m3fn [..., N, K] and
                     scale_inv float32 [..., ceil(N/bn), ceil(K/bk)]; real = fp8 · scale_inv of its block
- Int8ChannelWeight  the channel-INT8 (w8a8) layout: w int8 [..., N, K] and scale float32 [..., N];
                     real = int8 · scale of its row; activations are quantized per token at run time
- Int4GroupWeight    group-wise INT4 (weight-only): packed uint8 [..., N, Kp/2] (Kp = K rounded up to
                     the group size), scale and zero float32 [..., N, Kp/group];
                     real = (q - zero) · scale of its group (symmetric: zero = 8)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DenseWeight:
    w: torch.Tensor

    format = "dense"

    @property
    def shape(self) -> torch.Size:
        return self.w.shape

    def __getitem__(self, e) -> "DenseWeight":
        return DenseWeight(self.w[e])

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.w.to(dtype)

    @property
    def nbytes(self) -> int:
        return self.w.nbytes


@dataclass
class Fp8BlockWeight:
    w: torch.Tensor  # float8_e4m3fn [..., N, K]
    scale_inv: torch.Tensor  # float32 [..., ceil(N/bn), ceil(K/bk)]
    block: tuple[int, int] = (128, 128)

    format = "fp8_block"

    @property
    def shape(self) -> torch.Size:
        return self.w.shape

    def __getitem__(self, e) -> "Fp8BlockWeight":
        return Fp8BlockWeight(self.w[e], self.scale_inv[e], self.block)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        n, k = self.w.shape[-2:]
        bn, bk = self.block
        s = self.scale_inv.repeat_interleave(bn, dim=-2).repeat_interleave(bk, dim=-1)
        return (self.w.to(torch.float32) * s[..., :n, :k]).to(dtype)

    @property
    def nbytes(self) -> int:
        return self.w.nbytes + self.scale_inv.nbytes


@dataclass
class Int8ChannelWeight:
    w: torch.Tensor  # int8 [..., N, K]
    scale: torch.Tensor  # float32 [..., N]

    format = "int8_channel"

    @property
    def shape(self) -> torch.Size:
        return self.w.shape

    def __getitem__(self, e) -> "Int8ChannelWeight":
        return Int8ChannelWeight(self.w[e], self.scale[e])

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.w.to(torch.float32) * self.scale.unsqueeze(-1)).to(dtype)

    @property
    def nbytes(self) -> int:
        return self.w.nbytes + self.scale.nbytes


@dataclass
class Int4GroupWeight:
    """INT4 with one scale (and zero point) per `group` consecutive inputs of a row.

    Nibble layout, chosen so a kernel unpacks 32 values from 16 bytes with one shift and one mask:
    within each 32-element chunk of a row, byte i holds q[i] in its low nibble and q[i + 16] in its
    high nibble (q unsigned, 0..15). Rows are zero-padded to a whole number of groups.
    """

    packed: torch.Tensor  # uint8 [..., N, Kp / 2]
    scale: torch.Tensor  # float32 [..., N, Kp / group]
    zero: torch.Tensor  # float32 [..., N, Kp / group], in quantized units
    k: int  # logical in features K
    group: int = 128

    format = "int4_group"

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.packed.shape[:-1], self.k))

    def __getitem__(self, e) -> "Int4GroupWeight":
        return Int4GroupWeight(self.packed[e], self.scale[e], self.zero[e], self.k, self.group)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        q = unpack_int4(self.packed).float()  # [..., N, Kp]
        s = self.scale.repeat_interleave(self.group, dim=-1)
        z = self.zero.repeat_interleave(self.group, dim=-1)
        return ((q - z) * s)[..., : self.k].to(dtype)

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scale.nbytes + self.zero.nbytes


Weight = DenseWeight | Fp8BlockWeight | Int8ChannelWeight | Int4GroupWeight

FP8_MAX = 448.0  # largest finite float8_e4m3fn
INT8_MAX = 127.0


def quantize_fp8_block(w: torch.Tensor, block: tuple[int, int] = (128, 128)) -> Fp8BlockWeight:
    """Quantize [..., N, K] to FP8 with one scale per bn×bk block (amax / 448)."""
    n, k = w.shape[-2:]
    bn, bk = block
    pn, pk = -n % bn, -k % bk
    wf = torch.nn.functional.pad(w.float(), (0, pk, 0, pn))
    blocks = wf.unflatten(-1, (-1, bk)).unflatten(-3, (-1, bn))  # [..., N/bn, bn, K/bk, bk]
    amax = blocks.abs().amax(dim=(-3, -1))  # [..., N/bn, K/bk]
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = blocks / scale.unsqueeze(-1).unsqueeze(-3)
    q = q.flatten(-2).flatten(-3, -2)[..., :n, :k]
    return Fp8BlockWeight(q.to(torch.float8_e4m3fn).contiguous(), scale.contiguous(), block)


def quantize_int8_channel(w: torch.Tensor) -> Int8ChannelWeight:
    """Quantize [..., N, K] to int8 with one symmetric scale per output row (amax / 127)."""
    wf = w.float()
    amax = wf.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / INT8_MAX, torch.ones_like(amax))
    q = torch.round(wf / scale.unsqueeze(-1)).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return Int8ChannelWeight(q.contiguous(), scale.contiguous())


INT4_GROUPS = (32, 64, 128)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q uint8 values 0..15 [..., Kp] (Kp a multiple of 32) → [..., Kp / 2] in the chunk layout."""
    chunks = q.to(torch.uint8).unflatten(-1, (-1, 2, 16))  # [..., Kp/32, 2, 16]
    return (chunks[..., 0, :] | (chunks[..., 1, :] << 4)).flatten(-2).contiguous()


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_int4: [..., Kp / 2] → uint8 [..., Kp]."""
    chunks = packed.unflatten(-1, (-1, 16))
    return torch.stack([chunks & 0xF, chunks >> 4], dim=-2).flatten(-3)


def quantize_int4_group(w: torch.Tensor, group: int = 128, symmetric: bool = True) -> Int4GroupWeight:
    """Quantize [..., N, K] to INT4 per group of `group` inputs.

    symmetric: scale = amax / 7, q = round(w / scale) + 8 (zero 8, q in 1..15);
    else: scale = (max - min) / 15, zero = round(-min / scale), q = clamp(round(w / scale) + zero, 0, 15).
    """
    if group not in INT4_GROUPS:
        raise ValueError(f"int4 group must be one of {INT4_GROUPS}, got {group}")
    k = w.shape[-1]
    wf = torch.nn.functional.pad(w.float(), (0, -k % group)).unflatten(-1, (-1, group))  # [..., N, G, g]
    if symmetric:
        amax = wf.abs().amax(-1)
        # rounded to bfloat16 (nearest): the r16 tiles then read the scales in half the bytes (|w| / scale stays ≤ 7
        # within the rounding, so no value leaves 1..15 before the clamp)
        scale = torch.where(amax > 0, amax / 7.0, torch.ones_like(amax)).bfloat16().float()
        zero = torch.full_like(scale, 8.0)
    else:
        lo, hi = wf.amin(-1).clamp(max=0), wf.amax(-1).clamp(min=0)
        scale = torch.where(hi > lo, (hi - lo) / 15.0, torch.ones_like(hi))
        zero = torch.round(-lo / scale).clamp(0, 15)
    q = torch.round(wf / scale.unsqueeze(-1) + zero.unsqueeze(-1)).clamp(0, 15).flatten(-2)
    return Int4GroupWeight(pack_int4(q), scale.contiguous(), zero.contiguous(), k, group)
