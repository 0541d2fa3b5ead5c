"""The knob catalogue: every performance setting, declared once (type, range, default, help).

The engine reads its settings only through `resolve_knobs`; the tuner builds its search space from
CATALOGUE. A value of "auto" is resolved once at start-up from the hardware.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from engine.errors import MoetuneError


@dataclass(frozen=True)
class Divides:
    """This knob's value divides knob `other`'s (both searched as powers of two)."""
    other: str

    def depends(self) -> tuple[str, ...]:
        return (self.other,)

    def upper(self, values: dict, limits: dict) -> int:
        return values[self.other]

    def allows(self, value: int, values: dict, limits: dict) -> bool:
        return values[self.other] % value == 0


@dataclass(frozen=True)
class AtMost:
    """This knob's value ≤ `limit`: another knob's value or a machine limit ("cores", "ranks")."""
    limit: str

    def depends(self) -> tuple[str, ...]:
        return (self.limit,) if self.limit in CATALOGUE else ()

    def upper(self, values: dict, limits: dict) -> int:
        return values[self.limit] if self.limit in values else limits[self.limit]

    def allows(self, value: int, values: dict, limits: dict) -> bool:
        return value <= self.upper(values, limits)


@dataclass(frozen=True)
class ProductAtMost:
    """This knob × knob `other` ≤ `limit` (a knob or a machine limit), e.g. TP × EP ≤ ranks."""
    other: str
    limit: str

    def depends(self) -> tuple[str, ...]:
        return (self.other,) + ((self.limit,) if self.limit in CATALOGUE else ())

    def upper(self, values: dict, limits: dict) -> int:
        cap = values[self.limit] if self.limit in values else limits[self.limit]
        return cap // values[self.other]

    def allows(self, value: int, values: dict, limits: dict) -> bool:
        return value <= self.upper(values, limits)


@dataclass(frozen=True)
class Knob:
    name: str
    type: type  # int | str | bool
    default: Any
    component: str  # who reads it
    help: str
    choices: tuple | None = None  # categorical values
    low: int | None = None  # integer range, inclusive
    high: int | None = None
    log: bool = False  # search the integer range on a log scale
    auto: bool = False  # "auto" is allowed and resolved from the hardware
    pow2: bool = False  # the tuner searches powers of two only (block sizes)
    tune: bool = True  # False: a setting, not a speed knob; the tuner leaves it at its default
    constraints: tuple = ()  # Divides / AtMost / ProductAtMost: built into the tuner's space

    def validate(self, value: Any) -> Any:
        if self.auto and value == "auto":
            return value
        if self.type is int and isinstance(value, str) and value.strip().lstrip("-").isdigit():
            value = int(value)
        if self.type is bool and isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
            value = value.lower() in ("true", "1")
        if not isinstance(value, self.type) or (self.type is int and isinstance(value, bool)):
            raise MoetuneError(f"knob {self.name}: {value!r} is not a {self.type.__name__}")
        if self.choices is not None and value not in self.choices:
            raise MoetuneError(f"knob {self.name}: {value!r} is not one of {list(self.choices)}")
        if self.low is not None and not self.low <= value <= self.high:
            raise MoetuneError(f"knob {self.name}: {value} is outside [{self.low}, {self.high}]")
        return value


CATALOGUE: dict[str, Knob] = {k.name: k for k in (
    Knob("threads", int, "auto", "engine", "intra-op threads (auto: the usable cores)",
         low=1, high=1024, auto=True, constraints=(AtMost("cores"),)),
    Knob("kernel_backend", str, "auto", "engine",
         "kernel backend running every op (auto: the C++ \"cpu\" kernels where they build and run, "
         "else the torch reference)", choices=("auto", "cpu", "reference"), tune=False),
    Knob("kv_block_size", int, 64, "engine/cache", "tokens per paged KV-cache block",
         low=1, high=1024, log=True, pow2=True),
    Knob("max_total_tokens", int, 16384, "engine/scheduler",
         "KV-cache capacity in tokens, all sequences together", low=64, high=1 << 22, log=True,
         tune=False),
    Knob("mla_absorb", str, "decode", "engine/models",
         "where MLA uses the weight-absorbed form (else the naive form that expands the latent)",
         choices=("decode", "always", "never")),
    Knob("chunked_prefill_size", int, 512, "engine/scheduler",
         "most prompt tokens prefilled in one step (a longer prompt is split across steps)",
         low=16, high=1 << 16, log=True),
    Knob("decode_batch_cap", int, 256, "engine/scheduler",
         "most sequences decoded together in one step", low=1, high=4096, log=True),
    Knob("max_running_requests", int, 256, "engine/scheduler",
         "most requests holding KV cache at once (the rest wait)", low=1, high=4096, log=True),
    Knob("batch_invariant", bool, False, "engine",
         "compute every matmul one token row at a time and MLA in one (absorbed) form, so a "
         "sequence's result never depends on what it is batched with (slow; for reproducibility)",
         choices=(False, True), tune=False),
    # CPU (AVX-512 C++) tiles, read by kernels/cpu (configure(), or knobs= per call)
    Knob("cpu_micro_rows", int, 4, "kernels/cpu",
         "CPU matmul microkernel: weight rows per register tile", choices=(4, 8)),
    Knob("cpu_micro_tokens", int, 1, "kernels/cpu",
         "CPU matmul microkernel: tokens per register tile (each weight chunk is converted once for them)",
         choices=(1, 2, 4)),
    Knob("cpu_linear_block_n", int, 64, "kernels/cpu",
         "CPU linear, few tokens: output rows per parallel task", low=8, high=1024, log=True, pow2=True),
    Knob("cpu_moe_block_n", int, 32, "kernels/cpu",
         "CPU fused MoE: rows per task (intermediate rows in gate/up, output rows in down); tasks are "
         "experts × tiles", low=8, high=512, log=True, pow2=True),
    Knob("cpu_gemm_min_tokens", int, 32, "kernels/cpu",
         "CPU linear / fused MoE (tokens per expert): from this many, weight blocks are unpacked to "
         "float32 and multiplied with BLAS instead of the register microkernel", low=1, high=4096, log=True),
    Knob("cpu_gemm_block_n", int, 256, "kernels/cpu",
         "CPU GEMM path: weight rows unpacked per BLAS call (the unpack cache block)",
         low=16, high=4096, log=True, pow2=True),
    Knob("cpu_fp8_method", str, "widen", "kernels/cpu",
         "CPU FP8 weights: E4M3 expanded by bit arithmetic in 32-bit lanes (vector), by a 256-entry "
         "table gather (lut), or widened through 16-bit lanes to bfloat16 bits against activations "
         "permuted to match (widen; exact, half the instructions; block K a multiple of 64, else vector)",
         choices=("vector", "lut", "widen")),
    Knob("cpu_int4_method", str, "int8", "kernels/cpu",
         "CPU INT4 weights: integer products against activations quantized per token to int16 (int16; "
         "groups of a multiple of 64), byte products against activations quantized per token and group "
         "to int8 (int8, as llama.cpp's Q4 x Q8: half the instructions again, ~0.5 % activation error; "
         "groups of a multiple of 128, else int16), or float products (float)",
         choices=("float", "int16", "int8")),
    Knob("cpu_task_chunk", int, 1, "kernels/cpu",
         "CPU linear / fused MoE: consecutive parallel tasks a thread takes at once (1: fully dynamic; "
         "more: each thread streams longer runs of adjacent weight rows, which its software prefetch "
         "has already fetched)", low=1, high=64, log=True),
    Knob("cpu_amx_min_tokens", int, 32, "kernels/cpu",
         "CPU linear / fused MoE (tokens per expert), BF16 and INT8 weights: from this many rows the "
         "GEMM runs on AMX tiles where the CPU has AMX (inert elsewhere)", low=1, high=4096, log=True),
    Knob("cpu_huge_pages", bool, False, "kernels/cpu",
         "CPU kernels: copy each weight of ≥ 2 MiB at load into 2 MiB-aligned memory advised for "
         "transparent huge pages (fewer TLB misses while streaming experts from DRAM; measured both "
         "faster and slower on a VM, so off unless it helps on the machine)",
         choices=(False, True), tune=False),
    Knob("cpu_attn_head_fold", int, 128, "kernels/cpu",
         "CPU attention decode: query heads sharing a KV head folded into one task's rows (each cache "
         "block converted once for them; register groups of ≤ 16, or sgemm from cpu_attn_blas_rows)",
         low=1, high=256, log=True),
    Knob("cpu_attn_kv_splits", int, 8, "kernels/cpu",
         "CPU attention decode (flash decoding): most pieces one sequence's keys are cut into, computed "
         "in parallel and merged by log-sum-exp", low=1, high=64, log=True),
    Knob("cpu_attn_decode_kv_block", int, 64, "kernels/cpu",
         "CPU attention decode: keys per cache block (converted and transposed once, used for the QK "
         "and the PV products while L2-resident)", low=16, high=1024, log=True, pow2=True),
    Knob("cpu_attn_extend_q_block", int, 128, "kernels/cpu",
         "CPU extend attention (prefill): query rows per task", low=8, high=256, log=True, pow2=True),
    Knob("cpu_attn_extend_kv_block", int, 512, "kernels/cpu",
         "CPU extend attention (prefill): keys per online-softmax step", low=16, high=1024, log=True,
         pow2=True),
    Knob("cpu_attn_blas_rows", int, 32, "kernels/cpu",
         "CPU attention: from this many rows per task (folded heads, or a query tile) the QK and PV products "
         "run as sgemm on float32-converted cache blocks instead of the register kernels", low=1, high=1024,
         log=True),
    Knob("cpu_attn_blas_kv_block", int, 256, "kernels/cpu",
         "CPU attention decode, sgemm form (rows ≥ cpu_attn_blas_rows): keys per converted cache block",
         low=16, high=4096, log=True, pow2=True),
    # CUDA (Triton) tiles, read by kernels/cuda at every launch (kernels.cuda.tiles)
    Knob("cuda_moe_block_m", int, 64, "kernels/cuda",
         "GPU MoE, prefill (contiguous layout): (token, expert) pairs per program", low=16, high=128, pow2=True),
    Knob("cuda_moe_block_n", int, 64, "kernels/cuda",
         "GPU MoE, prefill (contiguous layout): output columns per program", low=16, high=256, pow2=True),
    Knob("cuda_moe_block_k", int, 64, "kernels/cuda",
         "GPU MoE, prefill (contiguous layout): K step (≥ 32 for FP8 dots; divides the 128-wide scale block)",
         low=32, high=128, pow2=True),
    Knob("cuda_moe_num_warps", int, 4, "kernels/cuda",
         "GPU MoE, prefill (contiguous layout): warps per program", low=1, high=8, pow2=True),
    Knob("cuda_moe_num_stages", int, 3, "kernels/cuda",
         "GPU MoE, prefill (contiguous layout): software-pipelining depth", low=1, high=6),
    Knob("cuda_moe_decode_block_m", int, 16, "kernels/cuda",
         "GPU MoE, decode (masked layout): (token, expert) pairs per program", low=16, high=128, pow2=True),
    Knob("cuda_moe_decode_block_n", int, 64, "kernels/cuda",
         "GPU MoE, decode (masked layout): output columns per program", low=16, high=256, pow2=True),
    Knob("cuda_moe_decode_block_k", int, 128, "kernels/cuda",
         "GPU MoE, decode (masked layout): K step (≥ 32 for FP8 dots; divides the 128-wide scale block)",
         low=32, high=128, pow2=True),
    Knob("cuda_moe_decode_num_warps", int, 4, "kernels/cuda",
         "GPU MoE, decode (masked layout): warps per program", low=1, high=8, pow2=True),
    Knob("cuda_moe_decode_num_stages", int, 4, "kernels/cuda",
         "GPU MoE, decode (masked layout): software-pipelining depth", low=1, high=6),
    Knob("cuda_moe_masked_max_tokens", int, 64, "kernels/cuda",
         "GPU fused MoE: most tokens run in the masked (decode, CUDA-graph) layout; more use the "
         "contiguous one", low=0, high=4096),
    Knob("cuda_fp8_gemm_block_m", int, 128, "kernels/cuda", "GPU FP8 block GEMM: rows per program",
         low=16, high=256, pow2=True),
    Knob("cuda_fp8_gemm_block_n", int, 128, "kernels/cuda", "GPU FP8 block GEMM: columns per program",
         low=16, high=256, pow2=True),
    Knob("cuda_fp8_gemm_block_k", int, 128, "kernels/cuda",
         "GPU FP8 block GEMM: K step (divides the 128-wide scale block)", low=32, high=128, pow2=True),
    Knob("cuda_fp8_gemm_group_m", int, 8, "kernels/cuda",
         "GPU FP8 block GEMM: row tiles walked together (L2 reuse of the weight)", low=1, high=32, pow2=True),
    Knob("cuda_fp8_gemm_num_warps", int, 8, "kernels/cuda", "GPU FP8 block GEMM: warps per program",
         low=2, high=8, pow2=True),
    Knob("cuda_fp8_gemm_num_stages", int, 3, "kernels/cuda", "GPU FP8 block GEMM: software-pipelining depth",
         low=1, high=6),
    Knob("cuda_fp8_quant_block_m", int, 8, "kernels/cuda",
         "GPU FP8 activation quantizer: token rows per program (one 128-channel group each)",
         low=1, high=64, pow2=True),
    Knob("cuda_fp8_quant_num_warps", int, 4, "kernels/cuda", "GPU FP8 activation quantizer: warps per program",
         low=1, high=8, pow2=True),
    Knob("cuda_mla_head_block", int, 16, "kernels/cuda",
         "GPU MLA decode: query heads folded into one program (the GEMM M side)", low=16, high=64, pow2=True),
    Knob("cuda_mla_block_n", int, 32, "kernels/cuda", "GPU MLA decode: cached tokens per step",
         low=16, high=128, pow2=True),
    Knob("cuda_mla_kv_splits", int, 0, "kernels/cuda",
         "GPU MLA decode: splits of each sequence's cache (flash decoding); 0: enough to give every "
         "multiprocessor two programs", low=0, high=64),
    Knob("cuda_mla_num_warps", int, 4, "kernels/cuda", "GPU MLA decode: warps per program", low=1, high=8,
         pow2=True),
    Knob("cuda_mla_num_stages", int, 2, "kernels/cuda", "GPU MLA decode: software-pipelining depth",
         low=1, high=4),
    Knob("cuda_mla_merge_num_warps", int, 2, "kernels/cuda",
         "GPU MLA decode: warps per program of the log-sum-exp merge over splits", low=1, high=8, pow2=True),
)}


def resolve_knobs(overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """Defaults overlaid with `overrides` (validated), "auto" resolved for this machine."""
    values = {name: knob.default for name, knob in CATALOGUE.items()}
    for name, value in (overrides or {}).items():
        if name not in CATALOGUE:
            raise MoetuneError(f"unknown knob {name!r} (known: {', '.join(sorted(CATALOGUE))})")
        values[name] = CATALOGUE[name].validate(value)
    if values["threads"] == "auto":
        values["threads"] = len(os.sched_getaffinity(0))
    if values["kernel_backend"] == "auto":
        values["kernel_backend"] = auto_kernel_backend()
    check_constraints(values)
    return values


@lru_cache(maxsize=1)
def auto_kernel_backend() -> str:
    """"cpu" when the C++ kernels build and run on this machine (compiled once, cached), else
    "reference", saying why once."""
    from kernels.cpu_build import availability

    ok, why = availability()
    if not ok:
        logging.getLogger("moetune").warning("kernel_backend auto: using the reference kernels (%s)", why)
    return "cpu" if ok else "reference"


def check_constraints(values: dict[str, Any], limits: dict | None = None,
                      catalogue: dict[str, Knob] | None = None) -> None:
    """Raise MoetuneError for a constraint between knobs that `values` break.

    Constraints on machine limits ("cores", "ranks") are checked only when `limits` names them:
    the tuner never leaves them, a user may (oversubscribing cores, say)."""
    limits = limits or {}
    for knob in (catalogue or CATALOGUE).values():
        for con in knob.constraints:
            needed = [d for d in con.depends() if not isinstance(values.get(d), int)]
            machine = getattr(con, "limit", None)
            if needed or (machine and machine not in values and machine not in limits):
                continue
            if isinstance(values.get(knob.name), int) and not con.allows(values[knob.name], values, limits):
                raise MoetuneError(f"knob {knob.name}={values[knob.name]} breaks {con} "
                                   f"(values: { {d: values.get(d) for d in con.depends()} })")
