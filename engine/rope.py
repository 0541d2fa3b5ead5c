"""Rotary angles: plain RoPE, YaRN (DeepSeek's and Qwen's long-context scaling) or Llama 3's scaling,
as cos/sin per position."""
from __future__ import annotations

import math

import torch

from engine.config import Llama3Rope, ModelConfig, YarnConfig, yarn_mscale


def _correction_dim(rotations: float, dim: int, base: float, max_pos: int) -> float:
    """The rotary dimension whose wavelength fits `rotations` times into max_pos."""
    return dim * math.log(max_pos / (rotations * 2 * math.pi)) / (2 * math.log(base))


def _yarn_inv_freq(y: YarnConfig, dim: int, base: float) -> torch.Tensor:
    """Blend of interpolated (1/factor) and original frequencies over YaRN's correction range."""
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolated, interpolated = 1.0 / pos_freqs, 1.0 / (y.factor * pos_freqs)
    low = _correction_dim(y.beta_fast, dim, base, y.original_max_position_embeddings)
    high = _correction_dim(y.beta_slow, dim, base, y.original_max_position_embeddings)
    if y.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep_original = 1 - ramp
    return interpolated * (1 - keep_original) + extrapolated * keep_original


def _llama3_inv_freq(r: Llama3Rope, dim: int, base: float) -> torch.Tensor:
    """Wavelengths longer than original/low_freq_factor are stretched by `factor`, shorter than
    original/high_freq_factor kept, those between blended linearly in original/wavelength."""
    inv_freq = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    wavelen = 2 * math.pi / inv_freq
    low_wavelen = r.original_max_position_embeddings / r.low_freq_factor
    high_wavelen = r.original_max_position_embeddings / r.high_freq_factor
    smooth = (r.original_max_position_embeddings / wavelen - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor)
    blended = (1 - smooth) * inv_freq / r.factor + smooth * inv_freq
    out = torch.where(wavelen > low_wavelen, inv_freq / r.factor, inv_freq)
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, out)


def _attention_factor(y: YarnConfig) -> float:
    """The magnitude factor applied to cos and sin (so q·k scales by its square)."""
    if y.attention_factor is not None:
        return float(y.attention_factor)
    if y.mscale and y.mscale_all_dim:
        return yarn_mscale(y.factor, y.mscale) / yarn_mscale(y.factor, y.mscale_all_dim)
    return yarn_mscale(y.factor)


class RotaryAngles:
    """cos/sin [T, P/2] for given positions; P = qk_rope_head_dim (a GQA family's head_dim)."""

    def __init__(self, cfg: ModelConfig):
        dim, base = cfg.qk_rope_head_dim, cfg.rope_theta
        self.factor = 1.0
        if cfg.llama3_rope is not None:
            self.inv_freq = _llama3_inv_freq(cfg.llama3_rope, dim, base)
        elif cfg.yarn is None:
            self.inv_freq = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
        else:
            self.inv_freq = _yarn_inv_freq(cfg.yarn, dim, base)
            self.factor = _attention_factor(cfg.yarn)

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = positions.float().unsqueeze(-1) * self.inv_freq  # [T, P/2]
        return angles.cos() * self.factor, angles.sin() * self.factor
