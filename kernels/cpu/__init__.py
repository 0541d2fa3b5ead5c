"""The "cpu" kernel backend: AVX-512 C++ kernels (kernels/cpu/csrc) for linear, fused MoE,
RMSNorm (+ residual) and RoPE; the other ops (routing, attention, per-head linear, SiLU·mul)
delegate to `kernels.reference`.

Weights: every format of kernels.formats (dense float32/bfloat16, INT8-channel, FP8-block,
INT4-group) is consumed in its own row-major [N, K] layout; `prepare_weights` wraps each weight
once at load in a `Packed` holding the kernel's arguments (contiguous tensors, float32 scales,
FP8 bytes viewed as uint8), so nothing is converted per call. Dense float16 weights fall back to the reference.

Run-time knobs (declared in kernels/cpu_knobs.py, collected by engine.knobs, `cpu_*`): set once by `configure(knobs)`, or per call with
`knobs={...}` on linear / fused_moe (the tests and the kernel suite sweep them that way).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from kernels import reference
from kernels.cpu_build import load as _load
from kernels.cpu_knobs import ATTN_KNOBS, CPU_KNOBS, LOAD_KNOBS  # noqa: F401 - re-exported
from kernels.formats import DenseWeight, Fp8BlockWeight, Int4GroupWeight, Int8ChannelWeight

_ext = _load()  # ImportError (with the reason) where the kernels cannot run or build

# Knob name → default, from the declarations (kernels/cpu_knobs.py): the one source.
KNOB_DEFAULTS: dict[str, Any] = {k.name: k.default for k in CPU_KNOBS}
FP8_METHODS = {"vector": 0, "lut": 1, "widen": 2}
INT4_METHODS = {"float": 0, "int16": 1, "int8": 2}
_knobs = dict(KNOB_DEFAULTS)

FORMAT_IDS = {"f32": 0, "bf16": 1, "int8": 2, "fp8": 3, "int4": 4}
_EMPTY = torch.empty(0)


def configure(knobs: dict) -> None:
    """Adopt the `cpu_*` values of a resolved knob dict as this backend's defaults."""
    _knobs.update({k: v for k, v in knobs.items() if k in KNOB_DEFAULTS})


def _merged(overrides: dict | None) -> dict:
    unknown = set(overrides or {}) - set(KNOB_DEFAULTS)
    if unknown:
        raise KeyError(f"unknown cpu knobs: {sorted(unknown)}")
    return {**_knobs, **(overrides or {})}


def _attn_knob_vector(overrides: dict | None) -> list[int]:
    k = _merged(overrides)
    return [int(k[n]) for n in ATTN_KNOBS]


def _knob_vector(overrides: dict | None) -> list[int]:
    k = _merged(overrides)
    return [int(k["cpu_micro_rows"]), int(k["cpu_micro_tokens"]), int(k["cpu_linear_block_n"]),
            int(k["cpu_moe_block_n"]), int(k["cpu_gemm_min_tokens"]), int(k["cpu_gemm_block_n"]),
            FP8_METHODS[k["cpu_fp8_method"]], INT4_METHODS[k["cpu_int4_method"]], int(k["cpu_task_chunk"]),
            int(k["cpu_amx_min_tokens"])]


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


HUGE_MIN_BYTES = 2 << 20  # below one huge page the copy gains nothing
_BULK_FIELD = {DenseWeight: "w", Int8ChannelWeight: "w", Fp8BlockWeight: "w", Int4GroupWeight: "packed"}


def _huge_copy(t: torch.Tensor) -> torch.Tensor:
    """`t` copied into 2 MiB-aligned storage advised for huge pages (the bulk of a weight)."""
    out = _ext.huge_empty(t.nbytes).view(t.dtype).view(t.shape)
    out.copy_(t)
    return out


def prepare(weight):
    """Wrap one weight for the kernels (once, at load); formats they do not take pass unchanged.

    With cpu_huge_pages (off by default) a weight of at least 2 MiB is first copied into memory
    advised for transparent huge pages (the wrapper then holds that copy, and the caller's original
    can be freed). On this project's VM it measured +8-10 % on a 0.5 GB INT8 MoE layer but -13 to
    -35 % on a 2.8 GB one (docs/cpu_kernels.md), so it is a per-machine setting.
    """
    args = _pack(weight)
    if args is None or isinstance(weight, Packed):
        return weight
    field = _BULK_FIELD.get(type(weight))
    bulk = getattr(weight, field) if field else None
    if _knobs["cpu_huge_pages"] and bulk is not None and bulk.nbytes >= HUGE_MIN_BYTES:
        weight = dataclasses.replace(weight, **{field: _huge_copy(bulk.contiguous())})
        args = _pack(weight)
    return Packed(weight, args)


def prepare_weights(weights: dict) -> dict:
    """The engine's weight dict with every kernel-ready weight wrapped (tensors pass unchanged)."""
    return {key: (w if isinstance(w, torch.Tensor) else prepare(w)) for key, w in weights.items()}


def _orig(weight):
    return weight.orig if isinstance(weight, Packed) else weight


# ---------------------------------------------------------------- ops


def amx_status() -> str:
    """Why the AMX tiles cannot run on this machine ("" when they can: then BF16 / INT8 GEMMs of at
    least cpu_amx_min_tokens rows use them)."""
    return _ext.amx_status()


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


# ---------------------------------------------------------------- attention
# One C++ core (csrc/attention.cpp) for every form: rows (heads folded, or query rows) × cache blocks,
# keys read through a block table (a dense K/V is one block), online softmax in float32.

_ATTN_DTYPES = (torch.float32, torch.bfloat16)


def _kv4(t: torch.Tensor) -> torch.Tensor:
    """A K or V source as [blocks, block_size, kv_heads, dim] (a dense [S, Hkv, D] is one block)."""
    return t.unsqueeze(0) if t.dim() == 3 else t


def _attn_usable(q: torch.Tensor, *kv: torch.Tensor) -> bool:
    return (q.device.type == "cpu" and q.numel() > 0 and all(t.dtype in _ATTN_DTYPES and t.stride(-1) == 1
                                                               and t.device.type == "cpu" for t in kv)
            and kv[0].dtype == kv[1].dtype)


def mla_decode(q_lat, q_pe, kv_cache, block_tables, seq_lens, scale, new_rows=None, slots=None,
               knobs: dict | None = None):
    """As kernels.reference.mla_decode: flash decoding over the paged latent cache (K = the whole row,
    V = its first R columns, one KV head), heads folded into the rows; the new rows written first."""
    r = q_lat.shape[-1]
    if not _attn_usable(q_lat, kv_cache, kv_cache) or q_lat.dim() != 3:
        return reference.mla_decode(q_lat, q_pe, kv_cache, block_tables, seq_lens, scale, new_rows, slots)
    q = torch.cat([q_lat.float(), q_pe.float()], dim=-1)
    rows = new_rows if new_rows is not None else _EMPTY
    where = slots.long().contiguous() if slots is not None else _EMPTY.long()
    out = _ext.attn_decode(q, kv_cache.unsqueeze(2), kv_cache[..., :r].unsqueeze(2),
                           block_tables.to(torch.int32).contiguous(), seq_lens.to(torch.int32).contiguous(),
                           float(scale), kv_cache, rows, where, _attn_knob_vector(knobs))
    return out.to(q_lat.dtype)


def paged_decode(q, k_cache, v_cache, block_tables, seq_lens, scale, knobs: dict | None = None):
    """As kernels.reference.paged_decode (MHA/GQA): the query heads of one KV head folded into the rows."""
    if not _attn_usable(q, k_cache, v_cache) or k_cache.dim() != 4:
        return reference.paged_decode(q, k_cache, v_cache, block_tables, seq_lens, scale)
    out = _ext.attn_decode(q.float().contiguous(), k_cache, v_cache, block_tables.to(torch.int32).contiguous(),
                           seq_lens.to(torch.int32).contiguous(), float(scale), _EMPTY, _EMPTY, _EMPTY.long(),
                           _attn_knob_vector(knobs))
    return out.to(q.dtype)


def _extend(q, k4, v4, table, kv_len, scale, knobs):
    out = _ext.attn_extend(q.float().contiguous(), k4, v4, table.to(torch.int32).contiguous(), int(kv_len),
                           float(scale), _attn_knob_vector(knobs))
    return out.to(q.dtype)


def extend_attention(q, k, v, scale, knobs: dict | None = None):
    """As kernels.reference.extend_attention (prefix rectangle + causal part, MHA or GQA)."""
    if not _attn_usable(q, k, v) or k.dim() != 3 or q.shape[0] > k.shape[0]:
        return reference.extend_attention(q, k, v, scale)
    return _extend(q, _kv4(k), _kv4(v), torch.zeros(1, dtype=torch.int32), k.shape[0], scale, knobs)


def paged_extend(q, k_cache, v_cache, block_table, kv_len, scale, knobs: dict | None = None):
    """As kernels.reference.paged_extend: one sequence's new tokens over its paged keys."""
    if not _attn_usable(q, k_cache, v_cache) or k_cache.dim() != 4 or q.shape[0] > kv_len:
        return reference.paged_extend(q, k_cache, v_cache, block_table, kv_len, scale)
    return _extend(q, k_cache, v_cache, block_table, kv_len, scale, knobs)


silu_and_mul = reference.silu_and_mul
head_linear = reference.head_linear
grouped_topk = reference.grouped_topk
write_cache = reference.write_cache

NATIVE_OPS = ("linear", "fused_moe", "rms_norm", "add_rms_norm", "rope", "mla_decode", "paged_decode",
              "extend_attention", "paged_extend")


def extension():
    """The compiled module (the probe and the suites use its timing helpers)."""
    return _ext
