"""The "cpu" kernel backend: AVX-512 C++ kernels (kernels/cpu/csrc) for linear, fused MoE,
RMSNorm (+ residual), RoPE, SiLU·mul and attention; the other ops (routing, per-head linear)
delegate to `kernels.reference`.

Weights: every format of kernels.formats (dense float32/bfloat16, INT8-channel, FP8-block,
INT4-group) is consumed in its own row-major [N, K] layout; `prepare_weights` wraps each weight
once at load in a `Packed` holding the kernel's arguments (contiguous tensors, float32 scales,
FP8 bytes viewed as uint8), so nothing is converted per call. Dense float16 weights fall back to the reference.
BF16, INT8, INT4 (groups of 128) and FP8 expert stacks and linears may instead be repacked once into the r16
layout (16 rows interleaved by 4-byte unit: a bf16 pair, 4 int8, 8 nibbles, 4 fp8; `R16Weight`, `Int8R16Weight`,
`Int4R16Weight`, `Fp8R16Weight`; knobs cpu_{bf16,int8,int4,fp8}_{expert,linear}_layout), which only the fused MoE
and linear kernels read: on their r16 register tiles at every token count, except BF16 and INT8 r16 on AMX CPUs,
whose GEMM reads the blocks in place as B tiles from cpu_amx_min_tokens, and BF16 r16 linears with bf16 activations,
on oneDNN over rows restored block by block from cpu_r16_onednn_min_tokens.

Run-time knobs (declared in kernels/cpu_knobs.py, collected by engine.knobs, `cpu_*`) reach C++ as
one named struct, `_ext.Knobs`, whose fields are the per-call knobs without "cpu_" (bound by
pybind11; string choices as enums named by the choice strings). At import the field set and every
enum are checked against the declarations, so a mismatch cannot load; C++ holds no defaults. Set
the backend's values once by `configure(knobs)`; per call, `knobs=` takes a dict of overrides (the
tests and the suites sweep them that way) or a struct from `make_knobs(values)` used as is (build
it once per layer shape and token bucket: the call then converts nothing).

`with recording() as rec:` makes each call append what it used (op, format, tokens, knobs by name,
the instruction variants run). ISA variants (cpu_int8_isa: vpdpbusd; cpu_bf16_isa and cpu_attn_isa:
vdpbf16ps, in the weight microkernels and in attention's QK / PV products; cpu_int8_gemm /
cpu_bf16_gemm = amx: AMX tiles on the GEMM path) are resolved at the call against cpuid under a
feature mask (`feature_mask(...)`); `emulate(...)` runs them on C++ models of the instructions
(tests), `isa_variants()` says which run here.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from kernels import reference
from kernels.cpu_build import load as _load
from kernels.cpu_knobs import (ATTN_KNOBS, CPU_KNOBS, ISA_KNOBS, ISA_VARIANTS, LOAD_KNOBS,  # noqa: F401 - re-exported
                               MODELLED_FEATURES, PER_CALL_KNOBS)
from kernels.formats import DenseWeight, Fp8BlockWeight, Int4GroupWeight, Int8ChannelWeight

_ext = _load()  # ImportError (with the reason) where the kernels cannot run or build

# Knob name → default, from the declarations (kernels/cpu_knobs.py): the one source.
KNOB_DEFAULTS: dict[str, Any] = {k.name: k.default for k in CPU_KNOBS}
_DECLARED = {k.name: k for k in CPU_KNOBS}
_knobs = dict(KNOB_DEFAULTS)

FORMAT_IDS = {"f32": 0, "bf16": 1, "int8": 2, "fp8": 3, "int4": 4}
FORMAT_NAMES = {v: k for k, v in FORMAT_IDS.items()}
# BF16 weights in the r16 layout (csrc/common.h kBF16R16; knobs cpu_bf16_expert_layout / _linear_layout): the format
# is still bf16 for every table, record and profile; the call record's "isa" names the layout ("+r16")
R16_ID = 19
FORMAT_NAMES[R16_ID] = "bf16"
BF16_IDS = (FORMAT_IDS["bf16"], R16_ID)
# INT8 weights in r16 (kInt8R16; knobs cpu_int8_expert_layout / _linear_layout): still int8 everywhere but "isa"
I8R16_ID = 20
FORMAT_NAMES[I8R16_ID] = "int8"
INT8_IDS = (FORMAT_IDS["int8"], I8R16_ID)
# INT4 (groups of 128) in r16 (kInt4R16; knobs cpu_int4_expert_layout / _linear_layout)
I4R16_ID = 21
FORMAT_NAMES[I4R16_ID] = "int4"
INT4_IDS = (FORMAT_IDS["int4"], I4R16_ID)
# FP8 E4M3 blocks in r16 (kFp8R16; knobs cpu_fp8_expert_layout / _linear_layout)
F8R16_ID = 22
FORMAT_NAMES[F8R16_ID] = "fp8"
FP8_IDS = (FORMAT_IDS["fp8"], F8R16_ID)
_EMPTY = torch.empty(0)

# ---------------------------------------------------------------- knobs: the named struct


def _bind_knob_fields() -> dict[str, Any]:
    """Per per-call knob, the converter of its value to the C++ field's type; ImportError when the
    C++ struct's fields (_ext.Knobs) and the declarations differ, or a choice has no enum member."""
    fields = {n for n, v in vars(_ext.Knobs).items() if isinstance(v, property)}
    want = {n[len("cpu_"):] for n in PER_CALL_KNOBS}
    if fields != want:
        raise ImportError(f"kernels/cpu: the C++ Knobs fields and the per-call knobs of kernels/cpu_knobs.py differ: "
                          f"only in C++ {sorted(fields - want)}, only declared {sorted(want - fields)}")
    convert = {}
    for name in PER_CALL_KNOBS:
        knob, current = _DECLARED[name], getattr(_ext.Knobs(), name[len("cpu_"):])
        members = getattr(type(current), "__members__", None)
        if knob.type is str:
            if members is None or set(members) != set(knob.choices):
                raise ImportError(f"kernels/cpu: {name}'s choices {list(knob.choices)} ≠ the C++ enum's "
                                  f"{sorted(members or [])}")
            convert[name] = members.__getitem__
        elif knob.type is int and members is None and isinstance(current, int):
            convert[name] = int
        else:
            raise ImportError(f"kernels/cpu: {name} is a {knob.type.__name__} but its C++ field is {type(current).__name__}")
    return convert


_CONVERT = _bind_knob_fields()


def _merged(overrides: dict | None) -> dict:
    unknown = set(overrides or {}) - set(KNOB_DEFAULTS)
    if unknown:
        raise KeyError(f"unknown cpu knobs: {sorted(unknown)}")
    return {**_knobs, **(overrides or {})}


def make_knobs(values: dict | None = None) -> "_ext.Knobs":
    """The C++ knob struct for `values` (cpu_* knobs, all or some) over this backend's configured ones.

    Build it once per layer shape and token bucket and pass it as `knobs=`: a call then converts
    nothing. KeyError for an unknown knob, ValueError for a choice the C++ enum lacks; ranges are
    checked by the kernels at the call (RuntimeError)."""
    merged = _merged({k: v for k, v in (values or {}).items() if k not in LOAD_KNOBS})
    kn = _ext.Knobs()
    for name in PER_CALL_KNOBS:
        try:
            setattr(kn, name[len("cpu_"):], _CONVERT[name](merged[name]))
        except (KeyError, TypeError, ValueError) as e:
            want = f"one of {list(_DECLARED[name].choices)}" if _DECLARED[name].choices else "an integer"
            raise ValueError(f"{name}: {merged[name]!r} is not {want}") from e
    return kn


def knob_values(kn) -> dict[str, Any]:
    """A knob struct as {cpu_* name: value} (choices as their strings)."""
    out = {}
    for name in PER_CALL_KNOBS:
        v = getattr(kn, name[len("cpu_"):])
        out[name] = v.name if hasattr(v, "name") and not isinstance(v, int) else v
    return out


_default_struct = make_knobs()


def configure(knobs: dict) -> None:
    """Adopt the `cpu_*` values of a resolved knob dict as this backend's defaults."""
    global _default_struct
    _knobs.update({k: v for k, v in knobs.items() if k in KNOB_DEFAULTS})
    _default_struct = make_knobs()


def _struct(knobs) -> "_ext.Knobs":
    """A call's knobs: a prebuilt struct as is, None → the configured ones, a dict → its overrides."""
    if knobs is None:
        return _default_struct
    if isinstance(knobs, _ext.Knobs):
        return knobs
    return make_knobs(knobs)


# ---------------------------------------------------------------- call record

_records: list | None = None  # the innermost recording() list, None when nothing records


@contextlib.contextmanager
def recording() -> Iterator[list[dict]]:
    """`with cpu.recording() as rec:` each linear / fused_moe / attention call of the cpu kernels in
    the block appends {"op", "format", "tokens", "knobs" (cpu_* name → value it used), "isa" (the
    instruction variants it ran, "+"-joined: avx512, vnni, vnni-model, avx512bf16, avx512bf16-model,
    amx, blas, onednn, fma, maddubs, amx-model, avx2; and beside them the forms r16, grouped, fp8rows)} to `rec`. Off (one global test per call) outside the block."""
    global _records
    previous, rec = _records, []
    _records = rec
    try:
        yield rec
    finally:
        _records = previous


def _record(op: str, fmt: str, tokens: int, kn, isa: str | None = None) -> None:
    _records.append({"op": op, "format": fmt, "tokens": int(tokens), "knobs": knob_values(kn),
                     "isa": _ext.last_variant() if isa is None else isa})


def is_recording() -> bool:
    """Whether a recording() block is open (the decode runner then reports its calls)."""
    return _records is not None


def record_call(op: str, fmt: str, tokens: int, kn, isa: str) -> None:
    """Append a call made by the C++ decode runner (not through these wrappers) to the recording."""
    if _records is not None:
        _record(op, fmt, tokens, kn, isa)


# ---------------------------------------------------------------- ISA features and dispatch

FEATURES = {"avx512_vnni": 1, "avx512_bf16": 2, "amx": 4}  # the C++ feature bits (csrc/isa.cpp)
EMULATED = MODELLED_FEATURES  # the features with a C++ model of their instructions


def _names(bits: int) -> set[str]:
    return {n for n, b in FEATURES.items() if bits & b}


def _bits(names) -> int:
    unknown = set(names) - set(FEATURES)
    if unknown:
        raise ValueError(f"unknown ISA features {sorted(unknown)}; known: {sorted(FEATURES)}")
    return sum(FEATURES[n] for n in set(names))


def detected_features() -> set[str]:
    """The dot-product ISA cpuid reports here (AMX: and Linux grants the tile state)."""
    return _names(_ext.detected_features())


def features() -> set[str]:
    """The features dispatch may use now: detected_features() under the feature mask."""
    return _names(_ext.usable_features())


@contextlib.contextmanager
def feature_mask(allowed) -> Iterator[set[str]]:
    """Within the block, dispatch uses only the features in `allowed` (names of FEATURES; process-wide,
    for tests and portable runs): a variant needing another falls back as on a CPU without it."""
    previous = _ext.feature_mask()
    _ext.set_feature_mask(_bits(allowed))
    try:
        yield features()
    finally:
        _ext.set_feature_mask(previous)


@contextlib.contextmanager
def emulate(names) -> Iterator[None]:
    """Within the block, the variants of these features (of EMULATED) run on the C++ models of their
    instructions, whether or not the CPU has them (tests: the kernel logic on every machine)."""
    bad = set(names) - set(EMULATED)
    if bad:
        raise ValueError(f"no C++ model for {sorted(bad)}; modelled: {list(EMULATED)}")
    previous = _ext.emulated_features()
    _ext.set_emulated_features(_bits(names))
    try:
        yield
    finally:
        _ext.set_emulated_features(previous)


def isa_variants() -> dict[str, dict[str, str]]:
    """Per ISA knob, each variant → "native" (runs here), "emulated" (on its C++ model, tests only)
    or "unavailable" (the CPU lacks it: a call asking for it runs avx512)."""
    have, emulated = features(), _names(_ext.emulated_features())
    return {knob: {v: ("emulated" if need in emulated else "native" if need is None or need in have else "unavailable")
                   for v, need in variants.items()} for knob, variants in ISA_VARIANTS.items()}


def runnable_choices(knob: str) -> tuple[str, ...]:
    """The values of an ISA knob whose variant runs natively here ("auto" always)."""
    return ("auto",) + tuple(v for v, how in isa_variants()[knob].items() if how == "native")


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

    @property
    def nbytes(self) -> int:
        """The bytes the kernels read: a symmetric row-major INT4 weight's zero points are not passed (_pack)."""
        n = self.orig.nbytes
        if isinstance(self.orig, Int4GroupWeight) and self.args[5].numel() == 0:
            n -= self.orig.zero.nbytes
        return n


def _swap_r16_axes(w: torch.Tensor, packed: bool) -> torch.Tensor:
    """Each 16-row block of a bf16 or int8 [..., N, K] with its (row, 4-byte unit) axes swapped: rows → r16
    (packed False), r16 → rows (packed True)."""
    *lead, n, k = w.shape
    u = k * w.element_size() // 4  # 4-byte units per row: bf16 pairs, int8 quads
    a, b = (u, 16) if packed else (16, u)
    src = w.contiguous().view(torch.int32).view(*lead, n // 16, a, b)
    out = torch.empty(*lead, n // 16, b, a, dtype=torch.int32)  # (not .contiguous(): one unit is "contiguous")
    out.copy_(src.transpose(-1, -2))
    return out.view(*lead, n, u).view(w.dtype)


def r16_pack(w: torch.Tensor) -> torch.Tensor:
    """A bf16 [..., N, K] (N % 16 == 0, K even) or int8 one (K % 4 == 0) in the r16 layout, same shape: each block
    of 16 rows holds [units][16] 4-byte units (bf16 pairs, int8 quads; unit u of the block's row r at 32-bit
    offset u·16 + r), in the bytes the rows held."""
    return _swap_r16_axes(w, packed=False)


def r16_unpack(w: torch.Tensor) -> torch.Tensor:
    """The row-major [..., N, K] of an r16 tensor (r16_pack's inverse)."""
    return _swap_r16_axes(w, packed=True)


def r16_fits(shape, dtype: torch.dtype = torch.bfloat16, group: int | None = None, block: tuple | None = None) -> bool:
    """Whether a BF16 (or INT8: dtype int8) weight of this shape can take the r16 layout: K in whole 4-byte units
    (even for bf16, a multiple of 4 for int8), and rows in whole 16s (a linear) or 32s (an expert stack, so
    that gate|up's halves each start a 16-row block)."""
    if group is not None:  # INT4: groups of 128 (the tiles take one group per 16 units)
        return len(shape) in (2, 3) and shape[-2] % (32 if len(shape) == 3 else 16) == 0 and group == 128
    if block is not None:  # FP8: scale blocks of whole 16-row blocks and of whole 4-byte units
        if block[0] % 16 or block[1] % 4:
            return False
    per_unit = 4 if dtype in (torch.int8, torch.uint8) else 2
    return len(shape) in (2, 3) and shape[-2] % (32 if len(shape) == 3 else 16) == 0 and shape[-1] % per_unit == 0


def _r16_auto(knob: str) -> str:
    v = _knobs[knob]
    if v != "auto":
        return v
    have = features()
    if knob.startswith("cpu_int4_"):  # no AMX form of INT4: r16 wherever VNNI runs
        return "r16" if "avx512_vnni" in have else "rows"
    if "amx" in have:
        # AMX's GEMM reads BF16 / INT8 r16 blocks in place as B tiles, and so does the fused MoE's grouped AMX
        # path (cpu_moe_gemm_experts). Measured on an AMX VM, r16 against rows: linears [11264, 2048] from DRAM,
        # BF16 x1.07 / x1.24 / x1.08 / x1.83 / x1.15 at 1 / 16 / 32 / 64 / 512 tokens, INT8 x1.08 / x1.58 /
        # x1.70 / x1.49 / x1.07 at 1 / 16 / 32 / 128 / 512; experts as the engine runs them (`small`): INT8 TPOT
        # x1.01, TTFT x1.05 at 512 and 2048 tokens; BF16 TPOT x1.00, TTFT x1.09 / x1.11. FP8 stays rows: its
        # AMX GEMM expands row-major blocks as it packs them, and r16 FP8 has no AMX path
        return "rows" if knob.startswith("cpu_fp8_") else "r16"
    if knob.startswith("cpu_int8_"):
        return "r16" if "avx512_vnni" in have else "rows"
    # BF16 and FP8: r16 on vdpbf16ps where AVX512-BF16 runs, and on the AVX-512 build's float32 FMAs without it
    # (an Emerald Rapids VM, AVX512-BF16 hidden: fused MoE x1.00 / x1.13 / x1.58 / x1.45 rows' speed at 1 / 16 /
    # 128 / 512 tokens, FP8 x1.00 / x1.02 / x1.64 / x1.38). The AVX2 build's model of those 512-bit tiles is
    # unmeasured: rows there.
    return "r16" if "avx512_bf16" in have or _ext.BUILD == "avx512" else "rows"


def bf16_expert_layout() -> str:
    """What cpu_bf16_expert_layout resolves to here: auto is r16 where AMX runs, or dispatch may use AVX512-BF16
    or the AVX-512 build's float32 FMAs, else rows."""
    return _r16_auto("cpu_bf16_expert_layout")


def bf16_linear_layout() -> str:
    """What cpu_bf16_linear_layout resolves to here (auto: as bf16_expert_layout)."""
    return _r16_auto("cpu_bf16_linear_layout")


def int8_expert_layout() -> str:
    """What cpu_int8_expert_layout resolves to here: auto is r16 where dispatch may use AVX512-VNNI or AMX."""
    return _r16_auto("cpu_int8_expert_layout")


def int8_linear_layout() -> str:
    """What cpu_int8_linear_layout resolves to here (auto: as int8_expert_layout)."""
    return _r16_auto("cpu_int8_linear_layout")


def int4_expert_layout() -> str:
    """What cpu_int4_expert_layout resolves to here: auto is r16 where dispatch may use AVX512-VNNI."""
    return _r16_auto("cpu_int4_expert_layout")


def int4_linear_layout() -> str:
    """What cpu_int4_linear_layout resolves to here (auto: as int4_expert_layout)."""
    return _r16_auto("cpu_int4_linear_layout")


def fp8_expert_layout() -> str:
    """What cpu_fp8_expert_layout resolves to here: auto as bf16_expert_layout's (r16 without AMX on AVX512-BF16
    or the AVX-512 build's float32 FMAs)."""
    return _r16_auto("cpu_fp8_expert_layout")


def fp8_linear_layout() -> str:
    """What cpu_fp8_linear_layout resolves to here (auto: as fp8_expert_layout)."""
    return _r16_auto("cpu_fp8_linear_layout")


def _block_groups(t: torch.Tensor) -> torch.Tensor:
    """[..., N, G] per-group values of a weight's rows as the INT4 r16 tiles read them: per 16-row block [G][16]
    (group g of the block's row r at g·16 + r), same shape."""
    *lead, n, g = t.shape
    return t.reshape(*lead, n // 16, 16, g).transpose(-1, -2).contiguous().view(*lead, n, g)


@dataclass
class R16Weight:
    """A BF16 weight, [N, K] or an expert stack [E, N, K], whose bytes are in the r16 layout (r16_pack), as the
    linear and fused MoE kernels read it; the row-major values on demand (dequantize, [e]) for the reference
    paths."""

    w: torch.Tensor  # bfloat16 [E?, N, K], r16 bytes

    format = "dense"

    @property
    def shape(self) -> torch.Size:
        return self.w.shape

    @property
    def nbytes(self) -> int:
        return self.w.nbytes

    def __getitem__(self, e) -> DenseWeight:
        return DenseWeight(r16_unpack(self.w[e]) if self.w.dim() == 3 else r16_unpack(self.w)[e])

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return r16_unpack(self.w).to(dtype)


@dataclass
class Int8R16Weight:
    """An INT8-channel weight, [N, K] or [E, N, K], whose integers are in the r16 layout (r16_pack), with its
    row scales and row sums Σw (the VNNI kernels' +128 compensation, taken before the repack); the row-major
    Int8ChannelWeight on demand ([e], dequantize) for the reference paths."""

    w: torch.Tensor  # int8 [E?, N, K], r16 bytes
    scale: torch.Tensor  # float32 [E?, N]
    wsum: torch.Tensor  # int32 [E?, N]

    format = "int8_channel"

    @property
    def shape(self) -> torch.Size:
        return self.w.shape

    @property
    def nbytes(self) -> int:
        return self.w.nbytes + self.scale.nbytes

    def rows(self) -> Int8ChannelWeight:
        return Int8ChannelWeight(r16_unpack(self.w), self.scale)

    def __getitem__(self, e) -> Int8ChannelWeight:
        if self.w.dim() == 3:
            return Int8ChannelWeight(r16_unpack(self.w[e]), self.scale[e])
        return self.rows()[e]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.rows().dequantize(dtype)


@dataclass
class Int4R16Weight:
    """An INT4-group weight (groups of 128), [N, K] or [E, N, K], whose packed bytes are in the r16 layout
    (r16_pack of its 4-byte units) with its scales and scale·zero products per block (_block_groups), as the r16
    tiles read them; the row-major Int4GroupWeight (rows(), [e], dequantize) for the reference paths."""

    packed: torch.Tensor  # uint8 [E?, N, Kp/2], r16 bytes
    scale: torch.Tensor  # float32 [E?, N, G], row-major (the reference's)
    zero: torch.Tensor  # float32 [E?, N, G], row-major
    k: int
    group: int
    block_scale: torch.Tensor  # float32 [E?, N, G], per block [G][16]; bfloat16 where every scale is exact in it
    block_sz: torch.Tensor  # float32 [E?, N, G], scale·zero, per block [G][16]; empty when every zero point is 8

    format = "int4_group"

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.packed.shape[:-1], self.k))

    @property
    def nbytes(self) -> int:  # what the tiles read: the packed bytes, the block scales, the scale·zero products if any
        return self.packed.nbytes + self.block_scale.nbytes + self.block_sz.nbytes

    def rows(self) -> Int4GroupWeight:
        return Int4GroupWeight(r16_unpack(self.packed), self.scale, self.zero, self.k, self.group)

    def __getitem__(self, e) -> Int4GroupWeight:
        if self.packed.dim() == 3:
            return Int4GroupWeight(r16_unpack(self.packed[e]), self.scale[e], self.zero[e], self.k, self.group)
        return self.rows()[e]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.rows().dequantize(dtype)


@dataclass
class Fp8R16Weight:
    """An FP8-block weight, [N, K] or [E, N, K], whose bytes are in the r16 layout (r16_pack of its 4-byte units),
    its block scales as they are; the row-major Fp8BlockWeight (rows(), [e], dequantize) for the reference paths."""

    w: torch.Tensor  # uint8 [E?, N, K], r16 bytes of float8_e4m3fn
    scale_inv: torch.Tensor  # float32 [E?, ceil(N/bn), ceil(K/bk)]
    block: tuple

    format = "fp8_block"

    @property
    def shape(self) -> torch.Size:
        return self.w.shape

    @property
    def nbytes(self) -> int:
        return self.w.nbytes + self.scale_inv.nbytes

    def rows(self) -> Fp8BlockWeight:
        return Fp8BlockWeight(r16_unpack(self.w).view(torch.float8_e4m3fn), self.scale_inv, self.block)

    def __getitem__(self, e) -> Fp8BlockWeight:
        if self.w.dim() == 3:
            return Fp8BlockWeight(r16_unpack(self.w[e]).view(torch.float8_e4m3fn), self.scale_inv[e], self.block)
        return self.rows()[e]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.rows().dequantize(dtype)


def _r16_in_place(w: torch.Tensor) -> None:
    """w (contiguous bf16 or int8 [E?, N, K]) repacked into r16 in its own storage, one expert (or 1024 rows of a
    linear) at a time: no second copy of the whole weight."""
    if w.dim() == 2:
        for r in range(0, w.shape[0], 1024):
            w[r:r + 1024].copy_(r16_pack(w[r:r + 1024]))
        return
    for e in range(w.shape[0]):
        w[e].copy_(r16_pack(w[e]))


def _pack(weight) -> tuple | None:
    """The kernel arguments for a weight, or None when the kernels do not take its format."""
    if isinstance(weight, Packed):
        return weight.args
    if isinstance(weight, R16Weight):
        return (R16_ID, weight.w, weight.shape[-2], weight.shape[-1], _EMPTY, _EMPTY, 0, 1)
    if isinstance(weight, Int8R16Weight):
        return (I8R16_ID, weight.w, weight.shape[-2], weight.shape[-1], weight.scale, weight.wsum, 0, 1)
    if isinstance(weight, Fp8R16Weight):
        bn, bk = weight.block
        return (F8R16_ID, weight.w, weight.shape[-2], weight.shape[-1], weight.scale_inv, _EMPTY, bk, bn)
    if isinstance(weight, Int4R16Weight):
        return (I4R16_ID, weight.packed, weight.shape[-2], weight.k, weight.block_scale, weight.block_sz, weight.group, 1)
    n, k = weight.shape[-2], weight.shape[-1]
    if isinstance(weight, DenseWeight):
        fmt = {torch.float32: "f32", torch.bfloat16: "bf16"}.get(weight.w.dtype)
        return None if fmt is None else (FORMAT_IDS[fmt], weight.w.contiguous(), n, k, _EMPTY, _EMPTY, 0, 1)
    if isinstance(weight, Int8ChannelWeight):
        w = weight.w.contiguous()  # and its row sums (int32): the VNNI kernels' +128 compensation
        return (FORMAT_IDS["int8"], w, n, k, weight.scale.float().contiguous(), w.sum(-1, dtype=torch.int32), 0, 1)
    if isinstance(weight, Fp8BlockWeight):
        bn, bk = weight.block
        if bk % 32:
            return None
        scale = weight.scale_inv.float().contiguous()
        return (FORMAT_IDS["fp8"], weight.w.view(torch.uint8).contiguous(), n, k, scale, _EMPTY, bk, bn)
    if isinstance(weight, Int4GroupWeight):
        # symmetric weights (every zero point 8: the loader's and the quantizer's) pass no zero points: the kernels
        # take 8, and read 4 bytes fewer per group of a row (68 per 128 weights instead of 72)
        zero = weight.zero.float()
        return (FORMAT_IDS["int4"], weight.packed.contiguous(), n, k, weight.scale.float().contiguous(),
                _EMPTY if bool((zero == 8.0).all()) else zero.contiguous(), weight.group, 1)
    return None


HUGE_MIN_BYTES = 2 << 20  # below one huge page the copy gains nothing
_BULK_FIELD = {DenseWeight: "w", Int8ChannelWeight: "w", Fp8BlockWeight: "w", Int4GroupWeight: "packed"}


def _nbytes(shape, dtype: torch.dtype) -> int:
    return math.prod(shape) * torch.empty(0, dtype=dtype).element_size()


def huge_empty(shape, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized tensor in 2 MiB-aligned storage advised for transparent huge pages (the
    loader places weights straight into it when cpu_huge_pages is on: no copy at prepare())."""
    return _ext.huge_empty(_nbytes(shape, dtype)).view(dtype).view(tuple(shape))


def weight_empty(shape, dtype: torch.dtype) -> torch.Tensor:
    """Storage for a weight's bytes as the loader allocates it with cpu_huge_pages on: huge_empty from
    one huge page (2 MiB) on, torch's allocator below (a smaller weight would waste most of a page)."""
    big = _nbytes(shape, dtype) >= HUGE_MIN_BYTES
    return huge_empty(shape, dtype) if big else torch.empty(tuple(shape), dtype=dtype)


def _in_huge_pages(t: torch.Tensor) -> bool:
    """Whether t's bytes start on a 2 MiB boundary, as huge_empty's storage does (torch's large
    allocations start just past a page boundary; one that landed on 2 MiB would merely keep ordinary
    pages: slower, never wrong)."""
    return t.data_ptr() % HUGE_MIN_BYTES == 0


def _huge_copy(t: torch.Tensor) -> torch.Tensor:
    """`t` copied into 2 MiB-aligned storage advised for huge pages (the bulk of a weight)."""
    out = huge_empty(t.shape, t.dtype)
    out.copy_(t)
    return out


def prepare(weight, in_place: bool = False, layout: str | None = None):
    """Wrap one weight for the kernels (once, at load); formats they do not take pass unchanged.

    A BF16 expert stack (3-D) takes the layout cpu_bf16_expert_layout resolves to (bf16_expert_layout), a
    BF16 linear cpu_bf16_linear_layout's (bf16_linear_layout), INT8 ones cpu_int8_expert_layout's and
    cpu_int8_linear_layout's, or any `layout` (rows | r16: tests, suites), r16 where r16_fits: repacked in
    a copy, or with `in_place` in the storage it (or its huge-page copy) has, which the caller then must
    not read as row-major again (prepare_weights: the engine's loaded weights).

    With cpu_huge_pages (on by default) a weight of at least 2 MiB not already in huge-page storage
    (the engine's loader places it there: kernels.cpu.weight_empty) is first copied into memory advised
    for transparent huge pages (the wrapper then holds that copy, and the caller's original can be
    freed). So are an INT4 weight's scales (and zero points or scale·zero products where the kernels get them)
    from 2 MiB (_int4_groups_in_huge_pages). Measured per machine in docs/cpu_kernels.md ("Huge pages").
    """
    args = _pack(weight)
    if args is None or isinstance(weight, Packed):
        return weight
    field = _BULK_FIELD.get(type(weight))
    bulk = getattr(weight, field) if field else None
    if (_knobs["cpu_huge_pages"] and bulk is not None and bulk.nbytes >= HUGE_MIN_BYTES
            and not _in_huge_pages(bulk)):
        weight = dataclasses.replace(weight, **{field: _huge_copy(bulk.contiguous())})
        args = _pack(weight)
        in_place = True  # the copy is ours
    w = args[1]
    if layout not in (None, "rows", "r16"):
        raise ValueError(f"layout {layout!r}: expected rows or r16")
    int8, int4, fp8 = (args[0] == FORMAT_IDS[f] for f in ("int8", "int4", "fp8"))
    expert = w.dim() == 3
    if fp8:
        wanted = layout or (fp8_expert_layout() if expert else fp8_linear_layout())
    elif int8:
        wanted = layout or (int8_expert_layout() if expert else int8_linear_layout())
    elif int4:
        wanted = layout or (int4_expert_layout() if expert else int4_linear_layout())
    else:
        wanted = layout or (bf16_expert_layout() if expert else bf16_linear_layout())
    fits = (r16_fits(w.shape, group=weight.group) if int4 else r16_fits(w.shape, w.dtype, block=weight.block) if fp8
            else args[0] in (FORMAT_IDS["bf16"], FORMAT_IDS["int8"]) and r16_fits(w.shape, w.dtype))
    if fits and wanted == "r16":
        if in_place and w.data_ptr() == getattr(weight, "packed" if int4 else "w").data_ptr():
            _r16_in_place(w)
        else:
            w = _huge_copy(r16_pack(w)) if _knobs["cpu_huge_pages"] and w.nbytes >= HUGE_MIN_BYTES else r16_pack(w)
        if int8:  # the scales and row sums as _pack made them from the row-major integers
            weight = Int8R16Weight(w, args[4], args[5])
        elif fp8:
            weight = Fp8R16Weight(w, args[4], weight.block)
        elif int4:
            scale, zero = args[4], weight.zero.float().contiguous()
            # symmetric weights (every zero point 8, as the loader's and the quantizer's; _pack passes them no zero
            # points): no scale·zero stream, the tiles take 8·scale, the same float32 product (6 % fewer bytes read)
            sz = _EMPTY if args[5].numel() == 0 else _block_groups(scale * zero)
            # block scales exact in bfloat16 (the quantizer's symmetric ones) are kept so: half their bytes, the same
            # float32 values in the tiles (66 bytes per 128 weights of a row instead of 68)
            bs = _block_groups(scale)
            if bool((bs.bfloat16().float() == bs).all()):
                bs = bs.bfloat16()
            weight = Int4R16Weight(w, scale, zero, weight.k, weight.group, bs, sz)
        else:
            weight = R16Weight(w)
        args = _pack(weight)
    if _knobs["cpu_huge_pages"] and isinstance(weight, (Int4GroupWeight, Int4R16Weight)):
        weight, args = _int4_groups_in_huge_pages(weight, args)
    return Packed(weight, args)


def _int4_groups_in_huge_pages(weight, args: tuple):
    """An INT4 weight whose per-group values that the kernels read (the scales, and the zero points or scale·zero
    products where passed: args[4], args[5]) lie in huge-page storage where they fill one (as the weight bytes do):
    the tiles read them as a stream beside the weights, one value per 128 of a row, which in ordinary pages costs
    a TLB walk every 4 KiB (an expert stack's: 11-45 MB for `small` and V3). Returns the weight and its args, the
    copies in both (no second _pack)."""
    names = ("scale", "zero") if isinstance(weight, Int4GroupWeight) else ("block_scale", "block_sz")
    new, args = {}, list(args)
    for slot, name in zip((4, 5), names):
        t = getattr(weight, name)
        if (args[slot].numel() and t.data_ptr() == args[slot].data_ptr() and t.nbytes >= HUGE_MIN_BYTES
                and not _in_huge_pages(t)):
            new[name] = args[slot] = _huge_copy(t.contiguous())
    return (dataclasses.replace(weight, **new) if new else weight), tuple(args)


def prepare_weights(weights: dict) -> dict:
    """The engine's weight dict with every kernel-ready weight wrapped (tensors pass unchanged). BF16 and INT8
    weights taking the r16 layout are repacked in their own storage, so the dict is consumed: each of its
    weights is replaced by its wrapper there too, and a second engine built on the same dict (the tuner's
    trials share one load) finds them prepared instead of reading r16 bytes as rows."""
    for key, w in weights.items():
        if not isinstance(w, torch.Tensor):
            weights[key] = prepare(w, in_place=True)
    return dict(weights)


def _orig(weight):
    """The weight as kernels.reference takes it (an INT8 or INT4 r16 weight: its row-major one, so the
    reference keeps its w8a8 products and reads the bytes in their order)."""
    w = weight.orig if isinstance(weight, Packed) else weight
    return w.rows() if isinstance(w, (Int8R16Weight, Int4R16Weight, Fp8R16Weight)) else w


# ---------------------------------------------------------------- ops


def amx_status() -> str:
    """Why the AMX tiles cannot run on this machine ("" when they can: then the amx variants of
    cpu_int8_gemm (auto's choice too) and cpu_bf16_gemm run from cpu_amx_min_tokens rows)."""
    return _ext.amx_status()


def linear(x: torch.Tensor, weight, knobs: dict | None = None) -> torch.Tensor:
    """y = x · Wᵀ: x [..., K] float, weight [N, K] any format → [..., N] in x.dtype."""
    args = _pack(weight)
    if args is None or x.dtype not in (torch.float32, torch.bfloat16) or args[1].dim() != 2:
        return reference.linear(x, _orig(weight))
    n, k = args[2], args[3]
    kn = _struct(knobs)
    x2 = x.reshape(-1, k)
    out = _ext.linear(x2, *args, kn)
    if _records is not None:
        _record("linear", FORMAT_NAMES[args[0]], x2.shape[0], kn)
    return out.to(x.dtype).reshape(*x.shape[:-1], n)


def moe_formats_match(f13: int, f2: int) -> bool:
    """Whether the fused MoE kernel takes these two stacks' format ids together: one format, in either layout
    each (BF16, INT8: each stack takes r16 by its own shape)."""
    return f13 == f2 or any(f13 in ids and f2 in ids for ids in (BF16_IDS, INT8_IDS, INT4_IDS, FP8_IDS))


def fused_moe(x, w13, w2, topk_weights, topk_ids, knobs: dict | None = None) -> torch.Tensor:
    """Σ_k w_k · down_e(SiLU(gate_e · x) ⊙ up_e · x); shapes as kernels.reference.fused_moe."""
    a13, a2 = _pack(w13), _pack(w2)
    usable = (a13 is not None and a2 is not None and moe_formats_match(a13[0], a2[0]) and a13[6:] == a2[6:]
              and x.dtype in (torch.float32, torch.bfloat16) and a13[1].dim() == 3)
    if not usable:
        return reference.fused_moe(x, _orig(w13), _orig(w2), topk_weights, topk_ids)
    fmt, w13t, n13, d, s13, z13, group, block_n = a13
    kn = _struct(knobs)
    out = _ext.fused_moe(x.contiguous(), fmt, w13t, s13, z13, a2[0], a2[1], a2[4], a2[5], n13 // 2, group, block_n,
                         topk_weights.float().contiguous(), topk_ids.long().contiguous(), kn)
    if _records is not None:
        _record("fused_moe", FORMAT_NAMES[fmt], x.shape[0], kn)
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
    kn = _struct(knobs)
    out = _ext.attn_decode(q, kv_cache.unsqueeze(2), kv_cache[..., :r].unsqueeze(2),
                           block_tables.to(torch.int32).contiguous(), seq_lens.to(torch.int32).contiguous(),
                           float(scale), kv_cache, rows, where, kn)
    if _records is not None:
        _record("mla_decode", _dtype_name(kv_cache), q.shape[0], kn)
    return out.to(q_lat.dtype)


def paged_decode(q, k_cache, v_cache, block_tables, seq_lens, scale, knobs: dict | None = None):
    """As kernels.reference.paged_decode (MHA/GQA): the query heads of one KV head folded into the rows."""
    if not _attn_usable(q, k_cache, v_cache) or k_cache.dim() != 4:
        return reference.paged_decode(q, k_cache, v_cache, block_tables, seq_lens, scale)
    kn = _struct(knobs)
    out = _ext.attn_decode(q.float().contiguous(), k_cache, v_cache, block_tables.to(torch.int32).contiguous(),
                           seq_lens.to(torch.int32).contiguous(), float(scale), _EMPTY, _EMPTY, _EMPTY.long(), kn)
    if _records is not None:
        _record("paged_decode", _dtype_name(k_cache), q.shape[0], kn)
    return out.to(q.dtype)


def _dtype_name(t: torch.Tensor) -> str:
    return "bf16" if t.dtype == torch.bfloat16 else "f32"


def _extend(q, k4, v4, table, kv_len, scale, knobs, op):
    kn = _struct(knobs)
    out = _ext.attn_extend(q.float().contiguous(), k4, v4, table.to(torch.int32).contiguous(), int(kv_len),
                           float(scale), kn)
    if _records is not None:
        _record(op, _dtype_name(k4), q.shape[0], kn)
    return out.to(q.dtype)


def extend_attention(q, k, v, scale, knobs: dict | None = None):
    """As kernels.reference.extend_attention (prefix rectangle + causal part, MHA or GQA)."""
    if not _attn_usable(q, k, v) or k.dim() != 3 or q.shape[0] > k.shape[0]:
        return reference.extend_attention(q, k, v, scale)
    return _extend(q, _kv4(k), _kv4(v), torch.zeros(1, dtype=torch.int32), k.shape[0], scale, knobs, "extend_attention")


def paged_extend(q, k_cache, v_cache, block_table, kv_len, scale, knobs: dict | None = None):
    """As kernels.reference.paged_extend: one sequence's new tokens over its paged keys."""
    if not _attn_usable(q, k_cache, v_cache) or k_cache.dim() != 4 or q.shape[0] > kv_len:
        return reference.paged_extend(q, k_cache, v_cache, block_table, kv_len, scale)
    return _extend(q, k_cache, v_cache, block_table, kv_len, scale, knobs, "paged_extend")


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2I] → SiLU(gate) · up [..., I] in gate_up's dtype (float32 inside): C++ for float32 and bfloat16,
    the reference otherwise."""
    if gate_up.dtype not in (torch.float32, torch.bfloat16) or gate_up.dim() == 0 or gate_up.shape[-1] % 2:
        return reference.silu_and_mul(gate_up)
    return _ext.silu_and_mul(gate_up)
head_linear = reference.head_linear
grouped_topk = reference.grouped_topk
write_cache = reference.write_cache

NATIVE_OPS = ("linear", "fused_moe", "rms_norm", "add_rms_norm", "rope", "mla_decode", "paged_decode",
              "extend_attention", "paged_extend")


def extension():
    """The compiled module (the probe and the suites use its timing helpers)."""
    return _ext
