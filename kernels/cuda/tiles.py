"""Tile parameters of the Triton kernels, passed to every launch as run-time arguments.

Each field is a knob of engine.knobs.CATALOGUE (component "kernels/cuda") named prefix + field,
e.g. MoeTiles from "cuda_moe_block_m" …; the catalogue holds the defaults and ranges, this module
holds none (nothing in kernels imports the engine): callers build tiles with `from_knobs`.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Mapping


_NOT_POW2 = ("num_stages", "kv_splits")  # every other tile field is a power of two (tl.arange, warps)


class _FromKnobs:
    @classmethod
    def from_knobs(cls, knobs: Mapping, prefix: str):
        """The tiles named prefix + field in `knobs` (e.g. engine.knobs.resolve_knobs())."""
        missing = [prefix + f.name for f in fields(cls) if prefix + f.name not in knobs]
        if missing:
            raise KeyError(f"tile knobs missing: {', '.join(missing)}")
        return cls(**{f.name: int(knobs[prefix + f.name]) for f in fields(cls)})

    def __post_init__(self):
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name not in _NOT_POW2 and (v < 1 or v & (v - 1)):
                raise ValueError(f"{type(self).__name__}.{f.name} must be a power of two, got {v}")

    @classmethod
    def knob_names(cls, prefix: str) -> list[str]:
        return [prefix + f.name for f in fields(cls)]


@dataclass(frozen=True)
class GemmTiles(_FromKnobs):
    """A GEMM launch: output tile block_m × block_n, K step block_k, software pipelining depth."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class Fp8GemmTiles(_FromKnobs):
    """FP8 block GEMM: GemmTiles plus group_m (row tiles walked together, for L2 reuse of B)."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class QuantTiles(_FromKnobs):
    """FP8 activation quantizer: block_m rows × one 128-channel group per program."""

    block_m: int
    num_warps: int


@dataclass(frozen=True)
class MlaTiles(_FromKnobs):
    """MLA decode: head_block query heads folded into one program (the GEMM M side), block_n
    cached tokens per step, kv_splits splits of each sequence (0: chosen from the batch to fill
    the GPU), merge_num_warps for the log-sum-exp merge kernel."""

    head_block: int
    block_n: int
    kv_splits: int
    num_warps: int
    num_stages: int
    merge_num_warps: int


MOE_PREFILL = "cuda_moe_"  # contiguous layout (more tokens than cuda_moe_masked_max_tokens)
MOE_DECODE = "cuda_moe_decode_"  # masked layout (fixed shapes, CUDA-graph capturable)
FP8_GEMM = "cuda_fp8_gemm_"
FP8_QUANT = "cuda_fp8_quant_"
MLA = "cuda_mla_"


@dataclass(frozen=True)
class CudaTiles:
    """Every tile knob of the CUDA backend, built from a resolved knob mapping."""

    moe_prefill: GemmTiles
    moe_decode: GemmTiles
    moe_masked_max_tokens: int
    fp8_gemm: Fp8GemmTiles
    fp8_quant: QuantTiles
    mla: MlaTiles

    @classmethod
    def from_knobs(cls, knobs: Mapping) -> "CudaTiles":
        if "cuda_moe_masked_max_tokens" not in knobs:
            raise KeyError("tile knobs missing: cuda_moe_masked_max_tokens")
        return cls(GemmTiles.from_knobs(knobs, MOE_PREFILL), GemmTiles.from_knobs(knobs, MOE_DECODE),
                   int(knobs["cuda_moe_masked_max_tokens"]), Fp8GemmTiles.from_knobs(knobs, FP8_GEMM),
                   QuantTiles.from_knobs(knobs, FP8_QUANT), MlaTiles.from_knobs(knobs, MLA))

    @staticmethod
    def knob_names() -> list[str]:
        return (GemmTiles.knob_names(MOE_PREFILL) + GemmTiles.knob_names(MOE_DECODE)
                + ["cuda_moe_masked_max_tokens"] + Fp8GemmTiles.knob_names(FP8_GEMM)
                + QuantTiles.knob_names(FP8_QUANT) + MlaTiles.knob_names(MLA))
