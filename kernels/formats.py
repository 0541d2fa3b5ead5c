"""Weight formats, kept quantized in memory; every op dequantizes inside itself.

All formats hold a weight of logical shape [..., N, K] (N out features, K in features; a leading
expert dimension E for stacked experts) and support `w[e]` to take one expert.

- DenseWeight        w: float32 / bfloat16 / float16 [..., N, K]
- Fp8BlockWeight     the official DeepSeek-V3 layout: w float8_e4m3fn [..., N, K] and
                     scale_inv float32 [..., ceil(N/bn), ceil(K/bk)]; real = fp8 · scale_inv of its block
- Int8ChannelWeight  the channel-INT8 (w8a8) layout: w int8 [..., N, K] and scale float32 [..., N];
                     real = int8 · scale of its row; activations are quantized per token at run time
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


Weight = DenseWeight | Fp8BlockWeight | Int8ChannelWeight

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
