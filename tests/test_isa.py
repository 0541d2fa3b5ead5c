"""ISA variants of the cpu kernels (kernels/cpu): the named knob struct between Python and C++, the call
record, run-time dispatch under a forced feature mask, and the dot-product microkernels
(kernels/cpu/csrc/micro_dot.inc) on their instruction where the CPU has it and on the C++ model of
that instruction (csrc/dot.h) on every machine.

Bounds (‖got − ref‖ / ‖ref‖ on the same quantized weights, as tests/test_kernels_cpu.py):
- INT8 and the INT4 int8 method through vpdpbusd (cpu_int8_isa=vnni): the integer sums are exact, so
  the native instruction, its model and the vpmaddwd path (avx512) are bitwise equal, and each is
  within the conformance bound of its format (INT8 2e-5, INT4 int8 method 1.5e-2, fused MoE 3e-2).
- BF16 / FP8 weights through vdpbf16ps (cpu_bf16_isa): with bf16 activations the conformance bf16
  bounds (1e-2 linear, 2e-2 fused MoE); float32 activations forced through it (avx512bf16) are
  rounded to bf16: 1e-2 against the float reference (measured 1.5e-3 to 1.8e-3), and 2e-5 against
  the reference fed the rounded activations (what is left is float32 summation order). The native
  instruction equals its model bitwise (same order of the two products per lane, same denormal rules).
- INT4 prefill on the VNNI INT4 GEMM (cpu_int4_gemm=vnni, amx.cpp gemm_int4): activations rounded to
  int8 per (token, group) as the int8 INT4 method; equal to the reference fed those activations
  within 2e-5 (exact integer sums, float32 order), so within that method's 1.5e-2 of the float
  reference (fused MoE 3e-2); native and model bitwise equal.
Native paths are skipped, naming the feature, where cpuid does not report it.
"""
import functools
import itertools
import re
import shutil
import subprocess

import pytest
import torch

from kernels import formats, reference
from kernels import cpu_build
from kernels.cpu_build import missing_isa

if missing_isa():
    pytest.skip(f"this CPU lacks {missing_isa()}: the cpu backend cannot run here", allow_module_level=True)

import kernels.cpu as cpu  # noqa: E402
from kernels.knobspec import Knob  # noqa: E402
from test_kernels_cpu import (BF16_LINEAR, BF16_MOE, INT4_INT8, INT4_INT8_MOE, LINEAR_SHAPES, MOE_CASES, TIGHT,  # noqa: E402
                              bf16_bound, check, make_weight, moe_weights, quantize_act_int8_groups, routing, tight)

HAS = cpu.detected_features()
# what the unpack GEMM path records under cpu_unpack_gemm=auto: our FMA tiles in the AVX2 build, BLAS in the AVX-512 one
UNPACK = "fma" if cpu._ext.BUILD == "avx2" else "blas"
# what the INT8 / INT4 GEMM path records under cpu_int8_gemm / cpu_int4_gemm=auto where no VNNI runs:
# the vpmaddubsw engine in the AVX2 build, the unpack path in the AVX-512 one
AUTO_INT_GEMM = "maddubs" if cpu._ext.BUILD == "avx2" else UNPACK
# what an INT8 microkernel records under cpu_int8_isa=auto where no VNNI runs: vpmaddubsw in the AVX2 build,
# the int16 vpmaddwd kernel in the AVX-512 one
AUTO_INT8_MICRO = "maddubs" if cpu._ext.BUILD == "avx2" else "avx512"
# what a BF16 microkernel on float32 FMAs records under cpu_bf16_method=auto: the 256-bit split kernel
# (micro_bf16y) in the AVX2 build, the 512-bit one in the AVX-512 build
AUTO_BF16_MICRO = "avx2" if cpu._ext.BUILD == "avx2" else "avx512"
# every shape through the microkernels, in token groups of cpu_micro_tokens (the wide tiles: their own tests)
MICRO = {"cpu_gemm_min_tokens": 4096, "cpu_dot_gemm_min_tokens": 4096, "cpu_amx_min_tokens": 4096, "cpu_micro_wide": 0}
ROWS_TOKENS = [(r, t) for r in (4, 8) for t in (1, 2, 4)]


def needs(feature: str):
    return pytest.mark.skipif(feature not in HAS, reason=f"native path: this CPU lacks {feature}")


def run_linear(x, w, knobs, emulate=()):
    with cpu.emulate(emulate), cpu.recording() as rec:
        y = cpu.linear(x, w, knobs={**MICRO, **knobs})
    return y, rec[-1]["isa"]


def run_moe(x, w13, w2, tw, ids, knobs, emulate=()):
    with cpu.emulate(emulate), cpu.recording() as rec:
        y = cpu.fused_moe(x, w13, w2, tw, ids, knobs={**MICRO, **knobs})
    return y, rec[-1]["isa"]


# ------------------------------------------------------------------ the named knob struct


def test_struct_fields_are_the_per_call_knobs():
    fields = {n for n, v in vars(cpu._ext.Knobs).items() if isinstance(v, property)}
    assert fields == {n[len("cpu_"):] for n in cpu.PER_CALL_KNOBS}
    assert not {n[len("cpu_"):] for n in cpu.LOAD_KNOBS} & fields
    assert set(cpu.PER_CALL_KNOBS) == set(cpu.KNOB_DEFAULTS) - set(cpu.LOAD_KNOBS)


def test_a_mismatch_between_cpp_and_the_declarations_cannot_load(monkeypatch):
    monkeypatch.setattr(cpu, "PER_CALL_KNOBS", cpu.PER_CALL_KNOBS + ("cpu_new_tile",))
    with pytest.raises(ImportError, match=r"only declared \['new_tile'\]"):
        cpu._bind_knob_fields()
    monkeypatch.setattr(cpu, "PER_CALL_KNOBS", tuple(n for n in cpu.PER_CALL_KNOBS if n != "cpu_new_tile"
                                                     and n != "cpu_task_chunk"))
    with pytest.raises(ImportError, match=r"only in C\+\+ \['task_chunk'\]"):
        cpu._bind_knob_fields()
    monkeypatch.undo()
    declared = dict(cpu._DECLARED)
    fp8 = declared["cpu_fp8_method"]
    declared["cpu_fp8_method"] = Knob(fp8.name, str, fp8.default, fp8.component, fp8.help,
                                      choices=fp8.choices + ("turbo",))
    monkeypatch.setattr(cpu, "_DECLARED", declared)
    with pytest.raises(ImportError, match="cpu_fp8_method.*turbo"):
        cpu._bind_knob_fields()
    declared["cpu_fp8_method"] = fp8
    rows = declared["cpu_micro_rows"]
    declared["cpu_micro_rows"] = Knob(rows.name, str, "4", rows.component, rows.help, choices=("4", "8"))
    with pytest.raises(ImportError, match="cpu_micro_rows"):
        cpu._bind_knob_fields()


def test_make_knobs_fills_every_field_and_overlays_a_partial_dict():
    base = {n: cpu._knobs[n] for n in cpu.PER_CALL_KNOBS}
    assert cpu.knob_values(cpu.make_knobs()) == base
    kn = cpu.make_knobs({"cpu_micro_rows": 8, "cpu_int8_isa": "avx512", "cpu_attn_kv_splits": 3})
    assert cpu.knob_values(kn) == {**base, "cpu_micro_rows": 8, "cpu_int8_isa": "avx512", "cpu_attn_kv_splits": 3}
    assert kn.micro_rows == 8 and kn.int8_isa == cpu._ext.Int8Isa.avx512
    with pytest.raises(KeyError, match="cpu_nonsense"):
        cpu.make_knobs({"cpu_nonsense": 1})
    with pytest.raises(ValueError, match="cpu_bf16_isa: 'amx' is not one of"):
        cpu.make_knobs({"cpu_bf16_isa": "amx"})
    with pytest.raises(ValueError, match="cpu_linear_block_n: 'many' is not an integer"):
        cpu.make_knobs({"cpu_linear_block_n": "many"})
    w = formats.DenseWeight(torch.randn(8, 64))
    with pytest.raises(RuntimeError, match="micro_rows"):  # an unset struct is refused, not run on zeros
        cpu.linear(torch.randn(1, 64), w, knobs=cpu._ext.Knobs())


def test_a_prebuilt_struct_is_used_as_is_and_configure_sets_the_default():
    w = formats.quantize_int8_channel(torch.randn(40, 100))
    x = torch.randn(3, 100)
    kn = cpu.make_knobs({"cpu_micro_tokens": 4})
    kn.micro_rows = 8
    with cpu.recording() as rec:
        cpu.linear(x, w, knobs=kn)
        cpu.linear(x, w, knobs={"cpu_micro_tokens": 2})
    assert rec[0]["knobs"]["cpu_micro_rows"] == 8 and rec[0]["knobs"]["cpu_micro_tokens"] == 4
    assert rec[1]["knobs"]["cpu_micro_rows"] == cpu._knobs["cpu_micro_rows"] and rec[1]["knobs"]["cpu_micro_tokens"] == 2
    old = cpu._knobs["cpu_micro_rows"]
    try:
        cpu.configure({"cpu_micro_rows": 8, "threads": 2})
        with cpu.recording() as rec:
            cpu.linear(x, w)
        assert rec[0]["knobs"]["cpu_micro_rows"] == 8
    finally:
        cpu.configure({"cpu_micro_rows": old})


def test_a_prebuilt_struct_is_not_converted_at_the_call(monkeypatch):
    kn = cpu.make_knobs({"cpu_micro_rows": 8})
    monkeypatch.setattr(cpu, "make_knobs", lambda *a: pytest.fail("a call converted knobs"))
    w = formats.quantize_int8_channel(torch.randn(16, 64))
    assert cpu._struct(kn) is kn and cpu._struct(None) is cpu._default_struct
    cpu.linear(torch.randn(2, 64), w, knobs=kn)
    cpu.linear(torch.randn(2, 64), w)


def test_the_record_is_off_outside_and_nests():
    assert cpu._records is None
    w13, w2 = moe_weights(4, 64, 32, "int8")
    tw, ids = routing(2, 4, 2, seed=1)
    x = torch.randn(2, 64)
    with cpu.recording() as outer:
        cpu.linear(x, w13[0])
        with cpu.recording() as inner:
            cpu.fused_moe(x, w13, w2, tw, ids)
        cache = torch.randn(4, 16, 40)
        cpu.mla_decode(torch.randn(2, 3, 32), torch.randn(2, 3, 8), cache, torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
                       torch.tensor([20, 5], dtype=torch.int32), 0.1)
        cpu.extend_attention(torch.randn(5, 2, 16), torch.randn(7, 2, 16), torch.randn(7, 2, 16), 0.25)
    assert cpu._records is None
    assert [r["op"] for r in outer] == ["linear", "mla_decode", "extend_attention"]
    assert [(r["op"], r["format"], r["tokens"]) for r in inner] == [("fused_moe", "int8", 2)]
    assert outer[0]["format"] == "int8" and outer[0]["tokens"] == 2 and outer[1]["format"] == "f32"
    assert set(outer[0]["knobs"]) == set(cpu.PER_CALL_KNOBS) and outer[0]["isa"]


# ------------------------------------------------------------------ dispatch under a feature mask


def allowed_variants(mask: set[str]) -> set[str]:
    need = {"vnni": "avx512_vnni", "avx512bf16": "avx512_bf16", "amx": "amx"}
    # onednn: torch's bf16 linear, which dispatches its own instructions (cpu_bf16_gemm=onednn forces it); r16,
    # grouped and fp8rows name forms of the data beside the instruction, not instructions
    return ({"avx512", "avx2", "blas", "fma", "onednn", "maddubs", "r16", "grouped", "fp8rows"}
            | {v for v, f in need.items() if f in mask})


def test_dispatch_never_selects_an_instruction_the_mask_lacks():
    g = torch.Generator().manual_seed(5)
    weights = {f: make_weight(torch.randn(70, 256, generator=g) * 0.05, f) for f in ("int8", "int4_g128", "bf16", "fp8")}
    masks = [set(c) for n in range(len(cpu.FEATURES) + 1) for c in itertools.combinations(sorted(cpu.FEATURES), n)]
    for mask in masks:
        with cpu.feature_mask(mask) as now:
            assert now == mask & HAS == cpu.features()
            for knob in cpu.ISA_KNOBS:
                assert set(cpu.runnable_choices(knob)) <= {"auto", "avx512", "unpack"} | allowed_variants(mask)
            for (fmt, w), t, dtype in itertools.product(weights.items(), (1, 5, 40), (torch.float32, torch.bfloat16)):
                x = torch.randn(t, 256, generator=g).to(dtype)
                for int8_isa, bf16_isa in itertools.product(("auto", "avx512", "vnni", "maddubs"), ("auto", "avx512", "avx512bf16")):
                    with cpu.recording() as rec:
                        cpu.linear(x, w, knobs={"cpu_int8_isa": int8_isa, "cpu_bf16_isa": bf16_isa,
                                                "cpu_amx_min_tokens": 1})
                    used = set(rec[0]["isa"].split("+"))
                    assert used <= allowed_variants(mask & HAS), (mask, fmt, t, int8_isa, bf16_isa, used)
                    if fmt == "int4_g128" and t < 32:  # the int8 INT4 method's microkernel: VNNI, else vpmaddubsw
                        # (INT4 enters the GEMM path from cpu_dot_gemm_min_tokens, 8, whatever cpu_amx_min_tokens says)
                        vnni = int8_isa in ("auto", "vnni") and "avx512_vnni" in mask & HAS
                        assert used == {"vnni" if vnni else "maddubs"}, (mask, t, int8_isa, used)
            for fmt, dtype in itertools.product(("int8", "bf16"), (torch.float32, torch.bfloat16)):  # the GEMM path
                x = torch.randn(40, 256, generator=g).to(dtype)
                for int8_gemm, bf16_gemm in itertools.product(("auto", "unpack", "vnni", "maddubs", "amx"),
                                                              ("auto", "unpack", "onednn", "avx512bf16", "amx")):
                    with cpu.recording() as rec:
                        cpu.linear(x, weights[fmt], knobs={"cpu_int8_gemm": int8_gemm, "cpu_bf16_gemm": bf16_gemm,
                                                           "cpu_gemm_min_tokens": 32, "cpu_dot_gemm_min_tokens": 32, "cpu_amx_min_tokens": 1})
                    used = set(rec[0]["isa"].split("+"))
                    assert used <= allowed_variants(mask & HAS), (mask, fmt, int8_gemm, bf16_gemm, used)
                    if fmt == "int8" and int8_gemm == "maddubs":  # named: runs on any CPU, even beside AMX
                        assert used == {"maddubs"}, (mask, used)
                    amx_named = (fmt == "int8" and int8_gemm in ("amx", "auto")) or (fmt == "bf16" and (
                        bf16_gemm == "amx" or (bf16_gemm == "auto" and dtype == torch.bfloat16)))
                    assert ("amx" in used) == (amx_named and "amx" in mask & HAS), (mask, fmt, int8_gemm, bf16_gemm, used)
                    if fmt == "int8" and int8_gemm == "auto" and not mask & HAS & {"avx512_vnni", "amx"}:
                        assert used == {AUTO_INT_GEMM}, (mask, used)
            for int4_gemm in ("auto", "unpack", "vnni", "maddubs", "amx"):  # INT4's GEMM path (40 rows: AMX's too)
                with cpu.recording() as rec:
                    cpu.linear(torch.randn(40, 256, generator=g), weights["int4_g128"],
                               knobs={"cpu_int4_gemm": int4_gemm, "cpu_gemm_min_tokens": 32, "cpu_dot_gemm_min_tokens": 32})
                used = set(rec[0]["isa"].split("+"))
                assert used <= allowed_variants(mask & HAS), (mask, int4_gemm, used)
                amx = int4_gemm in ("auto", "amx") and "amx" in mask & HAS
                vnni = int4_gemm in ("auto", "vnni", "amx") and "avx512_vnni" in mask & HAS
                want = ("amx" if amx else "vnni" if vnni else "maddubs" if int4_gemm == "maddubs"
                        else AUTO_INT_GEMM if int4_gemm == "auto" else UNPACK)
                assert used == {want}, (mask, int4_gemm, used)
            for fp8_gemm, dtype in itertools.product(("auto", "unpack", "onednn", "avx512bf16", "amx"),
                                                     (torch.float32, torch.bfloat16)):
                with cpu.recording() as rec:  # FP8's GEMM path (40 rows: from cpu_amx_min_tokens, 8)
                    cpu.linear(torch.randn(40, 256, generator=g).to(dtype), weights["fp8"],
                               knobs={"cpu_fp8_gemm": fp8_gemm, "cpu_gemm_min_tokens": 32})
                auto_bf16 = fp8_gemm == "auto" and dtype == torch.bfloat16
                amx = (fp8_gemm == "amx" or auto_bf16) and "amx" in mask & HAS  # auto: bf16 activations only
                onednn = fp8_gemm == "onednn"
                dot = (fp8_gemm == "avx512bf16" or auto_bf16) and "avx512_bf16" in mask & HAS
                # (40 rows on AMX: the blocks expanded to bf16 rows as A tiles, up to cpu_amx_fp8_direct_max_tokens)
                want = "amx+fp8rows" if amx else "onednn" if onednn else "avx512bf16" if dot else UNPACK
                assert rec[0]["isa"] == want, (mask, fp8_gemm, dtype, rec[0]["isa"])
    assert cpu.features() == HAS  # the mask is restored


def test_auto_and_requested_variants_resolve_to_the_best_present():
    w = formats.quantize_int8_channel(torch.randn(64, 256))
    x = torch.randn(1, 256)
    vnni = "avx512_vnni" in HAS
    assert run_linear(x, w, {"cpu_int8_isa": "auto"})[1] == ("vnni" if vnni else AUTO_INT8_MICRO)
    assert run_linear(x, w, {"cpu_int8_isa": "vnni"})[1] == ("vnni" if vnni else "avx512")
    assert run_linear(x, w, {"cpu_int8_isa": "avx512"})[1] == "avx512"
    assert run_linear(x, w, {"cpu_int8_isa": "maddubs"})[1] == "maddubs"
    with cpu.feature_mask(set()):
        assert run_linear(x, w, {"cpu_int8_isa": "auto"})[1] == AUTO_INT8_MICRO
        assert run_linear(x, w, {"cpu_int8_isa": "maddubs"})[1] == "maddubs"  # needs nothing beyond the build
        assert run_linear(x, w, {"cpu_int8_isa": "vnni"})[1] == "avx512"
        assert cpu.isa_variants()["cpu_int8_isa"]["vnni"] == "unavailable"
        assert run_linear(x, w, {"cpu_int8_isa": "vnni"}, emulate=["avx512_vnni"])[1] == "vnni-model"
    wb = formats.DenseWeight(torch.randn(64, 256).to(torch.bfloat16))
    bf16 = "avx512_bf16" in HAS
    assert run_linear(x, wb, {"cpu_bf16_isa": "auto"})[1] == AUTO_BF16_MICRO  # float32 activations: not rounded
    assert run_linear(x.bfloat16(), wb, {"cpu_bf16_isa": "auto"})[1] == ("avx512bf16" if bf16 else AUTO_BF16_MICRO)
    assert run_linear(x, wb, {"cpu_bf16_isa": "avx512bf16"})[1] == ("avx512bf16" if bf16 else AUTO_BF16_MICRO)
    for method, want in (("split", "avx512"), ("widen", "avx512"), ("split256", "avx2")):
        assert run_linear(x, wb, {"cpu_bf16_isa": "avx512", "cpu_bf16_method": method})[1] == want
    with pytest.raises(ValueError, match="no C\\+\\+ model"):
        with cpu.emulate(["avx512_fp16"]):
            pass


def test_the_tuner_searches_only_variants_that_run_here():
    from tuner.cpu_ops import runnable_catalogue

    cat = runnable_catalogue(cpu)
    for knob in cpu.ISA_KNOBS:
        assert cat[knob].choices == cpu.runnable_choices(knob)
        assert all(v == "auto" or cpu.isa_variants()[knob][v] == "native" for v in cat[knob].choices)
    with cpu.feature_mask(set()):
        assert runnable_catalogue(cpu)["cpu_int8_isa"].choices == ("auto", "avx512", "maddubs")  # any CPU
        assert runnable_catalogue(cpu)["cpu_bf16_isa"].choices == ("auto", "avx512")
        assert runnable_catalogue(cpu)["cpu_bf16_gemm"].choices == ("auto", "unpack", "onednn")  # anywhere
        assert runnable_catalogue(cpu)["cpu_fp8_gemm"].choices == ("auto", "unpack", "onednn")
        assert runnable_catalogue(cpu)["cpu_int4_gemm"].choices == ("auto", "unpack", "maddubs")  # AVX2: any CPU
        assert runnable_catalogue(cpu)["cpu_int8_gemm"].choices == ("auto", "unpack", "maddubs")


@functools.lru_cache(maxsize=1)
def disassembly() -> dict[str, list[tuple[int, str]]]:
    """The AVX-512 build's functions (objdump, demangled names): per function, its (address, instruction);
    compiled here if the CPU runs the AVX2 build (cpu_build.library)."""
    out = subprocess.run(["objdump", "-d", "--no-show-raw-insn", "-C", str(cpu_build.library("avx512"))], capture_output=True,
                         text=True, check=True).stdout
    funcs, fn = {}, None
    for line in out.splitlines():
        if line.endswith(">:") and "<" in line:
            fn = line[line.index("<") + 1:-2]
            funcs.setdefault(fn, [])
        elif fn and ":\t" in line:
            addr, _, text = line.strip().partition(":\t")
            funcs[fn].append((int(addr, 16), text.strip()))
    return funcs


def instruction_counts(ops: tuple[str, ...]) -> dict[str, int]:
    """Per function of the built extension, how many of its instructions are one of `ops`."""
    return {f: sum(1 for _, text in body if any(op in text for op in ops)) for f, body in disassembly().items()}


@pytest.mark.skipif(shutil.which("objdump") is None, reason="objdump is not installed")
def test_dot_instructions_appear_only_in_dispatched_functions():
    """The extension loads on any AVX-512 CPU: vpdpbusd / vdpbf16ps / AMX tile instructions are only
    in the functions compiled for them (dot_hw kernels, attention's attn_hw products, the dot-product GEMM's native
    blocks, the probe's peaks, the AMX tile class)."""
    where = {f: n for f, n in instruction_counts(("vpdpbusd", "vdpbf16ps", "tdpb", "tileloadd")).items() if n}
    assert where, "no dot-product instruction at all: the variants were not compiled"
    allowed = ("dot_hw::", "attn_hw::", "dot_block_int8_hw", "dot_block_bf16_hw", "int4_block_hw", "vnni_int8_gops", "bf16_dot_gflops",
               "AmxHw", "amx_peak_gops")
    stray = [f for f in where if not any(a in f for a in allowed)]
    assert not stray, stray
    assert any("dot_hw::micro_int8_dp" in f for f in where) and any("dot_hw::micro_bf16_dp" in f for f in where)
    assert any("attn_hw::qk_dot_tile" in f for f in where) and any("attn_hw::pv_dot_tile" in f for f in where)


@pytest.mark.skipif(shutil.which("objdump") is None, reason="objdump is not installed")
def test_every_microkernel_keeps_its_weight_prefetch():
    """Each microkernel instantiation (every format, native dot and model, rows × tokens) contains the
    software prefetch of its weight rows (cpu_prefetch_ahead): GCC 12 once dropped _mm_prefetch of
    that address from the dot-product kernels without a word, which cost 10-25 % of their bandwidth.
    Each holds the instruction of every cpu_prefetch_hint (t0, t1, t2), chosen per weight at run time."""
    for op in ("prefetcht0", "prefetcht1", "prefetcht2"):
        prefetches = {f: n for f, n in instruction_counts((op,)).items()
                      if "micro_" in f and "(moetune::WeightView const&, long, moetune::Act const&" in f}
        assert len(prefetches) >= 6 * 12, (op, sorted(prefetches))  # 12+ kernels × (rows 4, 8) × (tokens 1, 2, 4)
        missing = [f for f, n in prefetches.items() if n == 0]
        assert not missing, (op, missing)


def hot_loop_stack_stores(fn_filter) -> dict[str, tuple[int, int]]:
    """Per function whose demangled name passes `fn_filter` (name → the FMA / dot instructions one step of
    its K loop holds): (vector stores to the stack, FMA / dot instructions) inside the shortest loop (a
    backward jump's range) holding at least that many FMA / dot instructions: the K loop's body."""
    funcs = {f: body for f, body in disassembly().items() if fn_filter(f)}
    fma = re.compile(r"^(vfmadd\w+|vpdpbusd|vdpbf16ps|vpmaddwd)\b")
    store = re.compile(r"^vmov\w*\s+%zmm\d+,(-?0x[0-9a-f]+)?\(%rsp\)")
    result = {}
    for f, body in funcs.items():
        best, size = (0, 0), None
        for addr, text in body:
            m = re.match(r"^j\w+\s+([0-9a-f]+) ", text)
            if m and int(m.group(1), 16) < addr:
                inner = [t for a, t in body if int(m.group(1), 16) <= a <= addr]
                n_fma = sum(1 for t in inner if fma.match(t))
                if n_fma >= fn_filter(f) and (size is None or len(inner) < size):
                    best, size = (sum(1 for t in inner if store.match(t)), n_fma), len(inner)
        result[f] = best
    return result


@pytest.mark.skipif(shutil.which("objdump") is None, reason="objdump is not installed")
def test_multi_token_microkernels_keep_their_accumulators_in_registers():
    """The 4-row tiles of the formats that load one vector per row and step (INT8 int16 and VNNI, BF16
    split and dot) keep their 4 × 1/2/4 accumulators in registers through the K loop. A memory operand on
    the prefetch's inline assembly, and a load chosen per step inside the loop, once made GCC store all 16
    accumulators of the 4 × 4 tiles to the stack on every step (the BF16 4 × 4 tile at 87 GFLOP/s against
    109 without the stores, one thread, 12 tokens, L2-resident weights)."""
    kernels = re.compile(r"(micro_int8|micro_bf16s|dot_hw::micro_int8_dp<moetune::VnniHw|"
                         r"dot_hw::micro_bf16_dp<moetune::Bf16Hw)(<|, )4, ([124])>\(moetune::WeightView const&")
    # one K step: 4 rows × tokens FMA / dot instructions (BF16 split: two per row and token)
    loops = hot_loop_stack_stores(lambda f: (m := kernels.search(f)) and 4 * int(m.group(3)) or 0)
    assert len(loops) == 4 * 3, sorted(loops)  # 4 kernels × tokens 1, 2, 4
    spilled = {f: v for f, v in loops.items() if v[1] == 0 or v[0] > 1}
    assert not spilled, spilled  # at most one (register pressure of the VNNI 4 × 4 tile), never one per accumulator


# ------------------------------------------------------------------ VNNI: INT8 and the INT4 int8 method

VNNI_FORMATS = ("int8", "int4_g128")


@pytest.mark.parametrize("fmt", VNNI_FORMATS)
@pytest.mark.parametrize("shape", sorted(LINEAR_SHAPES))
def test_vnni_linear_equals_the_int16_path_bitwise_and_the_reference(fmt, shape):
    t, n, k = LINEAR_SHAPES[shape]
    g = torch.Generator().manual_seed(t * n + k)
    w = make_weight(torch.randn(n, k, generator=g) * 0.05, fmt)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(t, k, generator=g).to(dtype)
        ref = reference.linear(x, w)
        base, used = run_linear(x, w, {"cpu_int8_isa": "avx512"})
        # INT4's int8 method has no int16 form: without VNNI its dot-product kernel runs on vpmaddubsw
        assert used == ("maddubs" if fmt == "int4_g128" else "avx512")
        model, used = run_linear(x, w, {"cpu_int8_isa": "vnni"}, emulate=["avx512_vnni"])
        assert used == "vnni-model" and torch.equal(model, base), (fmt, shape, dtype)
        check(model, ref, tight(fmt) if dtype == torch.float32 else bf16_bound(fmt, BF16_LINEAR), f"vnni model {fmt} {shape}")
        if "avx512_vnni" in HAS:
            native, used = run_linear(x, w, {"cpu_int8_isa": "vnni"})
            assert used == "vnni" and torch.equal(native, model)


@pytest.mark.parametrize("k", [128, 2048 + 5, 256 * 128, 256 * 128 + 1])
@pytest.mark.parametrize("tokens", [1, 4])
def test_vnni_int4_group_kernel_in_chunks_of_scale_products(k, tokens):
    """micro_int4b_dp's scale products, computed for up to 256 groups of 128 at a time (rows of 32768), and
    a second chunk for longer rows: bitwise the int16 path's, on the model and the instruction."""
    g = torch.Generator().manual_seed(k + tokens)
    w = make_weight(torch.randn(9, k, generator=g) * 0.05, "int4_g128")
    x = torch.randn(tokens, k, generator=g)
    knobs = {"cpu_micro_tokens": tokens}
    base, _ = run_linear(x, w, {**knobs, "cpu_int8_isa": "avx512"})
    model, used = run_linear(x, w, {**knobs, "cpu_int8_isa": "vnni"}, emulate=["avx512_vnni"])
    assert used == "vnni-model" and torch.equal(model, base)
    check(model, reference.linear(x, w), tight("int4_g128"), f"vnni int4 k={k}")
    if "avx512_vnni" in HAS:
        native, used = run_linear(x, w, {**knobs, "cpu_int8_isa": "vnni"})
        assert used == "vnni" and torch.equal(native, model)


@pytest.mark.parametrize("fmt", VNNI_FORMATS)
@pytest.mark.parametrize("rows,tokens", ROWS_TOKENS)
def test_vnni_every_microkernel_instantiation(fmt, rows, tokens):
    g = torch.Generator().manual_seed(rows * 10 + tokens)
    w = make_weight(torch.randn(37, 1000, generator=g) * 0.05, fmt)
    x = torch.randn(7, 1000, generator=g)  # 7 tokens: full token groups and single-token tails
    knobs = {"cpu_micro_rows": rows, "cpu_micro_tokens": tokens}
    base, _ = run_linear(x, w, {**knobs, "cpu_int8_isa": "avx512"})
    model, used = run_linear(x, w, {**knobs, "cpu_int8_isa": "vnni"}, emulate=["avx512_vnni"])
    assert used == "vnni-model" and torch.equal(model, base)
    check(model, reference.linear(x, w), tight(fmt), f"vnni {fmt} R={rows} MT={tokens}")
    if "avx512_vnni" in HAS:
        native, used = run_linear(x, w, {**knobs, "cpu_int8_isa": "vnni"})
        assert used == "vnni" and torch.equal(native, model)


@pytest.mark.parametrize("fmt", VNNI_FORMATS)
@pytest.mark.parametrize("case", sorted(MOE_CASES))
def test_vnni_fused_moe(fmt, case):
    t, e, d, i, k, pool = MOE_CASES[case]
    w13, w2 = moe_weights(e, d, i, fmt)
    tw, ids = routing(t, e, k, seed=t, experts=pool)
    x = torch.randn(t, d, generator=torch.Generator().manual_seed(7))
    base, _ = run_moe(x, w13, w2, tw, ids, {"cpu_int8_isa": "avx512"})
    model, used = run_moe(x, w13, w2, tw, ids, {"cpu_int8_isa": "vnni"}, emulate=["avx512_vnni"])
    assert used == "vnni-model" and torch.equal(model, base)
    check(model, reference.fused_moe(x, w13, w2, tw, ids), tight(fmt, op="fused_moe"), f"vnni moe {fmt} {case}")
    if "avx512_vnni" in HAS:
        native, used = run_moe(x, w13, w2, tw, ids, {"cpu_int8_isa": "vnni"})
        assert used == "vnni" and torch.equal(native, model)


def test_vnni_extreme_values_are_exact():
    """Weights at −128 and 127, activations at ±amax (u8 1 and 255 after + 128), a K tail: the
    +128 compensation and the model's sign handling exact (equal to the int16 path and the reference)."""
    g = torch.Generator().manual_seed(11)
    wi = torch.randint(-128, 128, (13, 1001), generator=g, dtype=torch.int8)
    wi[0], wi[1], wi[2, ::2] = -128, 127, -128
    w = formats.Int8ChannelWeight(wi, torch.rand(13, generator=g) + 0.5)
    x = torch.randn(4, 1001, generator=g)
    x[0], x[1, ::3], x[2] = 1.0, -3.0, -1.0
    base, _ = run_linear(x, w, {"cpu_int8_isa": "avx512", "cpu_micro_tokens": 4})
    model, _ = run_linear(x, w, {"cpu_int8_isa": "vnni", "cpu_micro_tokens": 4}, emulate=["avx512_vnni"])
    assert torch.equal(model, base)
    check(model, reference.linear(x, w), TIGHT, "vnni extremes")
    if "avx512_vnni" in HAS:
        assert torch.equal(run_linear(x, w, {"cpu_int8_isa": "vnni", "cpu_micro_tokens": 4})[0], model)


# ------------------------------------------------------------------ INT8 on vpmaddubsw (cpu_int8_isa=maddubs)
# |w| · (x negated where w < 0) through vpmaddubsw + vpmaddwd: the same int32 sums as the int16 path, so
# bitwise its result, on any CPU the kernels run on (AVX-512BW, or AVX2 in that build).


@pytest.mark.parametrize("shape", sorted(LINEAR_SHAPES))
def test_maddubs_int8_linear_equals_the_int16_path_bitwise(shape):
    t, n, k = LINEAR_SHAPES[shape]
    g = torch.Generator().manual_seed(3 * t + n + k)
    w = make_weight(torch.randn(n, k, generator=g) * 0.05, "int8")
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(t, k, generator=g).to(dtype)
        base, used = run_linear(x, w, {"cpu_int8_isa": "avx512"})
        assert used == "avx512"
        got, used = run_linear(x, w, {"cpu_int8_isa": "maddubs"})
        assert used == "maddubs" and torch.equal(got, base), (shape, dtype)
        check(got, reference.linear(x, w), tight("int8") if dtype == torch.float32 else bf16_bound("int8", BF16_LINEAR),
              f"maddubs int8 {shape}")


WIDE_ISA = {"int8": ("cpu_int8_isa", "vnni", "avx512_vnni"), "bf16": ("cpu_bf16_isa", "avx512bf16", "avx512_bf16")}


@pytest.mark.parametrize("fmt", sorted(WIDE_ISA))
@pytest.mark.parametrize("wide", [6, 8, 12])
@pytest.mark.parametrize("rows", [4, 8])
@pytest.mark.parametrize("layout", ["spread", "adjacent", "tiles_next", "groups"])
def test_wide_tiles_equal_the_token_groups(fmt, wide, rows, layout):
    """cpu_micro_wide: groups of 6 / 8 / 12 tokens on wide tiles (4 or 2 rows each, so a tile of 4 or 8 rows
    in parts), the rest in groups of cpu_micro_tokens. Every (row, token) sum takes the same products in the
    same order as in the token groups, so the result is bitwise theirs, on the model and on the
    instruction; 37 rows (partial tiles), K = 1000 (a masked tail), 1 / 2 / 3 wide groups with and
    without tokens left over, every tile-row layout and sweep order."""
    knob, value, feature = WIDE_ISA[fmt]
    g = torch.Generator().manual_seed(wide * 10 + rows)
    w = make_weight(torch.randn(37, 1000, generator=g) * 0.05, fmt)
    order = {"tiles_next": {"cpu_micro_order": "tiles_next"}, "groups": {"cpu_micro_order": "groups"}}.get(layout, {})
    tiles = {"cpu_tile_rows": "adjacent"} if layout == "adjacent" else {}
    base_knobs = {"cpu_micro_rows": rows, knob: value, **order, **tiles}
    for tokens in (wide - 1, wide, wide + 1, 2 * wide + 3, 3 * wide):
        x = torch.randn(tokens, 1000, generator=g).bfloat16().float()
        groups, used = run_linear(x, w, base_knobs, [feature])
        wide_out, used_w = run_linear(x, w, {**base_knobs, "cpu_micro_wide": wide}, [feature])
        assert used == used_w == f"{value}-model"
        assert torch.equal(wide_out, groups), (fmt, wide, rows, layout, tokens)
        check(wide_out, reference.linear(x, w), TIGHT if fmt == "bf16" else tight(fmt), f"wide {fmt} {wide} {tokens}")
        if feature in HAS:
            native, used = run_linear(x, w, {**base_knobs, "cpu_micro_wide": wide})
            assert used == value and torch.equal(native, wide_out)


@pytest.mark.parametrize("fmt", sorted(WIDE_ISA))
def test_wide_tiles_in_fused_moe(fmt):
    """The fused MoE's sweeps on wide tiles (experts with 6 to 40 tokens): bitwise the token groups'."""
    knob, value, feature = WIDE_ISA[fmt]
    w13, w2 = moe_weights(8, 256, 192, fmt)
    tw, ids = routing(40, 8, 2, seed=3)
    x = torch.randn(40, 256, generator=torch.Generator().manual_seed(5)).bfloat16().float()
    groups, _ = run_moe(x, w13, w2, tw, ids, {knob: value}, [feature])
    for wide in (6, 8, 12):
        got, used = run_moe(x, w13, w2, tw, ids, {knob: value, "cpu_micro_wide": wide}, [feature])
        assert used == f"{value}-model" and torch.equal(got, groups), wide
        if feature in HAS:
            assert torch.equal(run_moe(x, w13, w2, tw, ids, {knob: value, "cpu_micro_wide": wide})[0], got)


def test_wide_tiles_knob_is_checked():
    kn = cpu.make_knobs({"cpu_micro_wide": 5})  # past the declared choices (the catalogue refuses it before): C++ does too
    x, w = torch.randn(7, 64), make_weight(torch.randn(16, 64), "bf16")
    with pytest.raises(RuntimeError, match="micro_wide must be 0, 6, 8 or 12"):
        cpu.linear(x, w, knobs=kn)


@pytest.mark.parametrize("rows,tokens", ROWS_TOKENS)
def test_maddubs_int8_every_microkernel_instantiation(rows, tokens):
    g = torch.Generator().manual_seed(rows * 7 + tokens)
    w = make_weight(torch.randn(37, 1000, generator=g) * 0.05, "int8")
    x = torch.randn(7, 1000, generator=g)  # full token groups and single-token tails; K: a 40-byte tail
    knobs = {"cpu_micro_rows": rows, "cpu_micro_tokens": tokens}
    base, _ = run_linear(x, w, {**knobs, "cpu_int8_isa": "avx512"})
    got, used = run_linear(x, w, {**knobs, "cpu_int8_isa": "maddubs"})
    assert used == "maddubs" and torch.equal(got, base)
    check(got, reference.linear(x, w), tight("int8"), f"maddubs R={rows} MT={tokens}")


@pytest.mark.parametrize("case", sorted(MOE_CASES))
def test_maddubs_int8_fused_moe(case):
    t, e, d, i, k, pool = MOE_CASES[case]
    w13, w2 = moe_weights(e, d, i, "int8")
    tw, ids = routing(t, e, k, seed=t, experts=pool)
    x = torch.randn(t, d, generator=torch.Generator().manual_seed(9))
    base, _ = run_moe(x, w13, w2, tw, ids, {"cpu_int8_isa": "avx512"})
    got, used = run_moe(x, w13, w2, tw, ids, {"cpu_int8_isa": "maddubs"})
    assert used == "maddubs" and torch.equal(got, base)
    check(got, reference.fused_moe(x, w13, w2, tw, ids), tight("int8", op="fused_moe"), f"maddubs moe {case}")


def test_maddubs_int8_extreme_values_are_exact():
    """Weights at −128 (|w| = 128 as the unsigned operand, a pair up to 2·128·127) and 127, activations at
    ±amax (±127), zero weights, a K tail: equal to the int16 path and the reference."""
    g = torch.Generator().manual_seed(12)
    wi = torch.randint(-128, 128, (13, 1001), generator=g, dtype=torch.int8)
    wi[0], wi[1], wi[2, ::2], wi[3] = -128, 127, -128, 0
    w = formats.Int8ChannelWeight(wi, torch.rand(13, generator=g) + 0.5)
    x = torch.randn(4, 1001, generator=g)
    x[0], x[1, ::3], x[2] = 1.0, -3.0, -1.0
    for rows in (4, 8):
        knobs = {"cpu_micro_tokens": 4, "cpu_micro_rows": rows}
        base, _ = run_linear(x, w, {**knobs, "cpu_int8_isa": "avx512"})
        got, _ = run_linear(x, w, {**knobs, "cpu_int8_isa": "maddubs"})
        assert torch.equal(got, base)
        check(got, reference.linear(x, w), TIGHT, "maddubs extremes")


@needs("avx512_vnni")
def test_native_vnni_is_the_default_here():
    w = formats.quantize_int8_channel(torch.randn(64, 256))
    with cpu.recording() as rec:
        cpu.linear(torch.randn(1, 256), w)
    assert rec[0]["isa"] == "vnni"


# ------------------------------------------------------------------ AVX512-BF16: BF16 and FP8 weights

BF16_FORMATS = ("bf16", "fp8")


@pytest.mark.parametrize("fmt", BF16_FORMATS)
@pytest.mark.parametrize("shape", sorted(LINEAR_SHAPES))
def test_bf16_dot_linear(fmt, shape):
    t, n, k = LINEAR_SHAPES[shape]
    g = torch.Generator().manual_seed(t * n + k)
    w = make_weight(torch.randn(n, k, generator=g) * 0.05, fmt)
    x = torch.randn(t, k, generator=g)
    xr = x.bfloat16()
    emulate = ["avx512_bf16"]
    got, used = run_linear(xr, w, {"cpu_bf16_isa": "auto"}, emulate)  # bf16 activations: taken by auto
    assert used == "avx512bf16-model"
    check(got, reference.linear(xr, w), BF16_LINEAR, f"bf16 dot {fmt} {shape} bf16 activations")
    assert run_linear(x, w, {"cpu_bf16_isa": "auto"}, emulate)[1] == (AUTO_BF16_MICRO if fmt == "bf16" else "avx512")  # float32 ones: not rounded
    forced, used = run_linear(x, w, {"cpu_bf16_isa": "avx512bf16"}, emulate)
    assert used == "avx512bf16-model"
    check(forced, reference.linear(xr.float(), w), TIGHT, f"bf16 dot {fmt} {shape} vs rounded activations")
    check(forced, reference.linear(x, w), BF16_LINEAR, f"bf16 dot {fmt} {shape} vs float activations")
    if "avx512_bf16" in HAS:
        native, used = run_linear(x, w, {"cpu_bf16_isa": "avx512bf16"})
        assert used == "avx512bf16" and torch.equal(native, forced)


@pytest.mark.parametrize("fmt", BF16_FORMATS)
@pytest.mark.parametrize("rows,tokens", ROWS_TOKENS)
def test_bf16_dot_every_microkernel_instantiation(fmt, rows, tokens):
    g = torch.Generator().manual_seed(rows * 10 + tokens)
    w = make_weight(torch.randn(37, 1000, generator=g) * 0.05, fmt)
    x = torch.randn(7, 1000, generator=g).bfloat16().float()
    knobs = {"cpu_micro_rows": rows, "cpu_micro_tokens": tokens, "cpu_bf16_isa": "avx512bf16"}
    model, used = run_linear(x, w, knobs, ["avx512_bf16"])
    assert used == "avx512bf16-model"
    check(model, reference.linear(x, w), TIGHT, f"bf16 dot {fmt} R={rows} MT={tokens}")
    if "avx512_bf16" in HAS:
        assert torch.equal(run_linear(x, w, knobs)[0], model)


@pytest.mark.parametrize("fmt", BF16_FORMATS)
@pytest.mark.parametrize("case", sorted(MOE_CASES))
def test_bf16_dot_fused_moe(fmt, case):
    t, e, d, i, k, pool = MOE_CASES[case]
    w13, w2 = moe_weights(e, d, i, fmt)
    tw, ids = routing(t, e, k, seed=t, experts=pool)
    x = torch.randn(t, d, generator=torch.Generator().manual_seed(7)).bfloat16()
    got, used = run_moe(x, w13, w2, tw, ids, {"cpu_bf16_isa": "auto"}, ["avx512_bf16"])
    assert used == "avx512bf16-model"
    check(got, reference.fused_moe(x, w13, w2, tw, ids), bf16_bound(fmt, BF16_MOE, "fused_moe"), f"bf16 dot moe {fmt} {case}")
    xf = x.float()
    forced, _ = run_moe(xf, w13, w2, tw, ids, {"cpu_bf16_isa": "avx512bf16"}, ["avx512_bf16"])
    check(forced, reference.fused_moe(xf, w13, w2, tw, ids), BF16_LINEAR, f"bf16 dot moe {fmt} {case} float32")
    if "avx512_bf16" in HAS:
        assert torch.equal(run_moe(xf, w13, w2, tw, ids, {"cpu_bf16_isa": "avx512bf16"})[0], forced)


def _bf16_semantics_case():
    """Three rows of K = 34 against one activation row, each probing one rule of vdpbf16ps:
    row 0: lane 0 gets 1 (even), then 2^-24 (odd) before −1 (even): odd-first rounds 1 + 2^-24 to 1,
    so the lane ends at 0 (the other order, or float32 FMAs, give 2^-24); row 1: a bf16 denormal
    weight × 2^100 reads as 0 (float32 FMAs: 1.2e-10); row 2: 2^-70 · 2^-70 = 2^-140 is flushed to 0."""
    w = torch.zeros(3, 34)
    w[0, 0], w[0, 32], w[0, 33] = 1.0, -1.0, 2.0 ** -24
    w[1, 2] = torch.tensor([1], dtype=torch.int16).view(torch.bfloat16).float()  # the smallest denormal
    w[2, 4] = 2.0 ** -70
    x = torch.ones(1, 34)
    x[0, 2], x[0, 4] = 2.0 ** 100, 2.0 ** -70
    return formats.DenseWeight(w.bfloat16()), x


def test_bf16_dot_model_has_the_instructions_order_and_denormal_rules():
    w, x = _bf16_semantics_case()
    fma, _ = run_linear(x, w, {"cpu_bf16_isa": "avx512"})
    assert fma[0, 0] == 2.0 ** -24 and fma[0, 1] > 1e-11 and fma[0, 2] > 0  # the case discriminates
    model, used = run_linear(x, w, {"cpu_bf16_isa": "avx512bf16"}, ["avx512_bf16"])
    assert used == "avx512bf16-model"
    assert model.tolist() == [[0.0, 0.0, 0.0]]


@needs("avx512_bf16")
def test_native_bf16_dot_has_the_same_rules():
    w, x = _bf16_semantics_case()
    native, used = run_linear(x, w, {"cpu_bf16_isa": "avx512bf16"})
    assert used == "avx512bf16" and native.tolist() == [[0.0, 0.0, 0.0]]


# ------------------------------------------------------------------ BF16 prefill: oneDNN through torch


@pytest.mark.parametrize("shape", ["regular_t64", "odd_t37"])
def test_bf16_gemm_onednn_is_torch_linear_bitwise(shape):
    """cpu_bf16_gemm=onednn on the GEMM path (T ≥ cpu_gemm_min_tokens) is torch's bf16 F.linear:
    bitwise equal to it on bf16 activations; float32 ones are rounded to bf16 (the bf16 bound)."""
    t, n, k = LINEAR_SHAPES[shape]
    g = torch.Generator().manual_seed(t + n)
    w = make_weight(torch.randn(n, k, generator=g) * 0.05, "bf16")
    x = torch.randn(t, k, generator=g)
    knobs = {"cpu_bf16_gemm": "onednn", "cpu_gemm_min_tokens": 32, "cpu_dot_gemm_min_tokens": 32, "cpu_amx_min_tokens": 4096}
    with cpu.recording() as rec:
        got = cpu.linear(x.bfloat16(), w, knobs=knobs)
        forced = cpu.linear(x, w, knobs=knobs)
        below = cpu.linear(x[:3].bfloat16(), w, knobs=knobs)  # below the GEMM threshold: the microkernels
    assert [r["isa"] for r in rec][:2] == ["onednn", "onednn"] and "onednn" not in rec[2]["isa"]
    assert torch.equal(got, torch.nn.functional.linear(x.bfloat16(), w.w))
    check(forced, reference.linear(x, w), BF16_LINEAR, f"onednn {shape} float32 activations")
    check(below, reference.linear(x[:3].bfloat16(), w), BF16_LINEAR, "below the threshold")
    auto = "onednn" if {"avx512_bf16", "amx"} & HAS else UNPACK  # AMX off here (MICRO: cpu_amx_min_tokens 4096)
    gemm = {"cpu_gemm_min_tokens": 32, "cpu_dot_gemm_min_tokens": 32, "cpu_bf16_gemm_min_tokens": 32}
    assert run_linear(x.bfloat16(), w, gemm)[1] == auto
    amx = {**gemm, "cpu_amx_min_tokens": 32}  # auto takes AMX first where it runs, bf16 activations only
    assert run_linear(x.bfloat16(), w, amx)[1] == ("amx" if "amx" in HAS else auto)
    assert run_linear(x, w, amx)[1] == UNPACK
    assert run_linear(x, w, gemm)[1] == UNPACK  # float32 activations: not rounded by auto
    with cpu.feature_mask(set()):
        assert run_linear(x.bfloat16(), w, gemm)[1] == UNPACK
        # the unpack path of BF16 starts at cpu_bf16_gemm_min_tokens, not cpu_gemm_min_tokens
        assert run_linear(x.bfloat16(), w, {**gemm, "cpu_bf16_gemm_min_tokens": t + 1})[1] == AUTO_BF16_MICRO
        assert run_linear(x.bfloat16(), w, {**gemm, "cpu_gemm_min_tokens": t + 1, "cpu_bf16_gemm_min_tokens": t})[1] == UNPACK


def test_bf16_gemm_onednn_in_fused_moe():
    t, e, d, i, k, pool = MOE_CASES["all_on_one"]  # 37 tokens on one expert: its GEMM path
    w13, w2 = moe_weights(e, d, i, "bf16")
    tw, ids = routing(t, e, k, seed=t, experts=pool)
    x = torch.randn(t, d, generator=torch.Generator().manual_seed(7)).bfloat16()
    with cpu.recording() as rec:
        got = cpu.fused_moe(x, w13, w2, tw, ids, knobs={"cpu_bf16_gemm": "onednn", "cpu_gemm_min_tokens": 32, "cpu_dot_gemm_min_tokens": 32})
    assert rec[0]["isa"] == "onednn"
    check(got, reference.fused_moe(x, w13, w2, tw, ids), BF16_MOE, "onednn fused MoE")


@pytest.mark.parametrize("shape", ["regular_t64", "odd_t37"])
def test_fp8_gemm_onednn_is_torch_linear_on_the_bf16_cast(shape):
    """cpu_fp8_gemm=onednn on the GEMM path: the FP8 weight times its block scales, rounded to bf16 (K
    1000: a partial last scale block), then torch's bf16 F.linear, bitwise; within the bf16 bound of
    the FP8 reference on float32 activations (rounded to bf16); auto takes it only for bf16 activations
    on a CPU with AMX (with AVX512-BF16 alone: our tile GEMM, cpu_fp8_gemm=avx512bf16)."""
    t, n, k = LINEAR_SHAPES[shape]
    g = torch.Generator().manual_seed(t + n + 1)
    w = make_weight(torch.randn(n, k, generator=g) * 0.05, "fp8")
    x = torch.randn(t, k, generator=g)
    knobs = {"cpu_fp8_gemm": "onednn", "cpu_gemm_min_tokens": 32}
    with cpu.recording() as rec:
        got = cpu.linear(x.bfloat16(), w, knobs=knobs)
        forced = cpu.linear(x, w, knobs=knobs)
        below = cpu.linear(x[:3].bfloat16(), w, knobs=knobs)  # below the GEMM threshold: the microkernels
    assert [r["isa"] for r in rec][:2] == ["onednn", "onednn"] and "onednn" not in rec[2]["isa"]
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, torch.nn.functional.linear(x.bfloat16(), w.dequantize().float().to(torch.bfloat16)))
    check(got, reference.linear(x.bfloat16(), w), BF16_LINEAR, f"fp8 onednn {shape}")
    check(forced, reference.linear(x, w), BF16_LINEAR, f"fp8 onednn {shape} float32 activations")
    check(below, reference.linear(x[:3].bfloat16(), w), BF16_LINEAR, "below the threshold")
    auto = "avx512bf16" if "avx512_bf16" in HAS else UNPACK  # AMX off here (MICRO: cpu_amx_min_tokens 4096)
    assert run_linear(x.bfloat16(), w, {"cpu_gemm_min_tokens": 32})[1] == auto
    # auto takes AMX first where it runs (here with the blocks expanded to bf16 rows as A tiles: fp8rows)
    amx = {"cpu_gemm_min_tokens": 32, "cpu_amx_min_tokens": 32, "cpu_amx_fp8_direct_max_tokens": 4096}
    assert run_linear(x.bfloat16(), w, amx)[1] == ("amx+fp8rows" if "amx" in HAS else auto)
    assert run_linear(x, w, amx)[1] == UNPACK
    assert run_linear(x, w, {"cpu_gemm_min_tokens": 32})[1] == UNPACK  # float32 activations: not rounded by auto
    assert run_linear(x.bfloat16(), w, {"cpu_gemm_min_tokens": 32, "cpu_fp8_gemm": "unpack"})[1] == UNPACK
    with cpu.feature_mask(set()):
        assert run_linear(x.bfloat16(), w, {"cpu_gemm_min_tokens": 32})[1] == UNPACK


# ------------------------------------------------------------------ prefill: the tile GEMM on dot-product instructions

TILE_SHAPES = {"one": (1, 1, 1), "regular": (64, 256, 512), "odd": (33, 70, 1000), "tails": (5, 17, 40),
               "long_k": (17, 33, 2048), "k_tail_1": (3, 40, 65)}  # (M, N, K), as tests/test_amx.py


def tile_inputs(m, n, k, seed):
    g = torch.Generator().manual_seed(seed)
    xb, wb = torch.randn(m, k, generator=g).bfloat16(), torch.randn(n, k, generator=g).bfloat16()
    xi = torch.randint(-127, 128, (m, k), generator=g).float()
    wi = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    return xb, wb, xi, wi


def tiles(x, w, engine):
    fmt = cpu.FORMAT_IDS["int8" if w.dtype == torch.int8 else "bf16"]
    return cpu._ext.tile_linear_raw(x.float().contiguous(), fmt, w.contiguous(), w.shape[0], w.shape[1], engine)


@pytest.mark.parametrize("shape", sorted(TILE_SHAPES))
def test_dot_tiles_match_exact_math(shape):
    """The AMX tile machine on AVX-512 dot products (amx.cpp DotTiles), model (engine 3) everywhere and
    native (engine 2) where present: INT8 (vpdpbusd on A + 128, minus 128·Σw) equal to exact math;
    BF16 (vdpbf16ps) within tests/test_amx.py's 2e-6 of float64 math."""
    xb, wb, xi, wi = tile_inputs(*TILE_SHAPES[shape], seed=len(shape))
    exact = xi.double() @ wi.double().T
    ref = xb.double() @ wb.double().T
    assert torch.equal(tiles(xi, wi, 3).double(), exact)
    assert ((tiles(xb, wb, 3).double() - ref).norm() / ref.norm().clamp_min(1e-30)).item() <= 2e-6
    if "avx512_vnni" in HAS:
        assert torch.equal(tiles(xi, wi, 2).double(), exact)
    if "avx512_bf16" in HAS:
        assert torch.equal(tiles(xb, wb, 2), tiles(xb, wb, 3))
    with cpu.feature_mask(set()):
        with pytest.raises(RuntimeError, match="no AVX512-VNNI"):
            tiles(xi, wi, 2)
    # engine 4: INT8 on vpmaddubsw with the sign trick (every CPU), exact; it takes no BF16
    assert torch.equal(tiles(xi, wi, 4).double(), exact)
    with pytest.raises(RuntimeError, match="INT8 weights only"):
        tiles(xb, wb, 4)


def test_maddubs_tiles_take_the_whole_int8_range_but_refuse_minus_128_activations():
    """The sign trick: |w| is vpmaddubsw's unsigned side, so w = −128 (|w| = 128 unsigned) is exact, and
    a pair of products at the extremes (2·128·127) does not saturate int16; an activation of −128
    cannot be negated by vpsignb, so a row holding one is refused with one error (the engine's
    quantizers never produce it: symmetric, ±127)."""
    k = 70
    wi = torch.full((3, k), -128, dtype=torch.int8)
    wi[1] = 127
    wi[2, ::2] = 0
    xi = torch.full((2, k), 127.0)
    xi[1] = -127.0
    exact = xi.double() @ wi.double().T
    assert torch.equal(tiles(xi, wi, 4).double(), exact)
    xi[1, 5] = -128.0
    with pytest.raises(RuntimeError, match=r"activations in \[-127, 127\]"):
        tiles(xi, wi, 4)


@pytest.mark.parametrize("fmt", ["int8", "int4_g128"])
def test_maddubs_gemm_through_linear_and_fused_moe(fmt):
    """cpu_int8_gemm / cpu_int4_gemm=maddubs through linear and fused MoE (every expert on the GEMM path):
    INT8 equal to the unpack path (both exact integer sums, the same scaling), INT4 equal to the VNNI
    INT4 GEMM on its model (the same int32 group sums and the same float32 steps), and within the
    stated bounds of the reference."""
    g = torch.Generator().manual_seed(13)
    w = make_weight(torch.randn(130, 1024, generator=g) * 0.05, fmt)
    x = torch.randn(37, 1024, generator=g)
    on = {"cpu_gemm_min_tokens": 1, "cpu_dot_gemm_min_tokens": 1, "cpu_amx_min_tokens": 4096}
    knob = "cpu_int8_gemm" if fmt == "int8" else "cpu_int4_gemm"
    other, other_isa, emulate = (("unpack", UNPACK, []) if fmt == "int8" else ("vnni", "vnni-model", ["avx512_vnni"]))
    got, used = run_linear(x, w, {**on, knob: "maddubs"})
    assert used == "maddubs"
    want, used = run_linear(x, w, {**on, knob: other}, emulate=emulate)
    assert used == other_isa and torch.equal(got, want)
    check(got, reference.linear(x, w), TIGHT if fmt == "int8" else INT4_INT8, f"{fmt} maddubs linear")
    t, e, d, i, k, pool = MOE_CASES["all_on_one"]
    w13, w2 = moe_weights(e, d, i, fmt)
    for t in (t, 40):
        tw, ids = routing(t, e, k, seed=t, experts=pool)
        xm = torch.randn(t, d, generator=g)
        got, used = run_moe(xm, w13, w2, tw, ids, {**on, knob: "maddubs"})
        assert used == "maddubs"
        want, _ = run_moe(xm, w13, w2, tw, ids, {**on, knob: other}, emulate=emulate)
        assert torch.equal(got, want), (fmt, t)
        check(got, reference.fused_moe(xm, w13, w2, tw, ids), TIGHT if fmt == "int8" else INT4_INT8_MOE,
              f"{fmt} maddubs moe")


@pytest.mark.parametrize("fmt", ["int8", "bf16", "fp8"])
def test_prefill_on_dot_tiles_through_linear_and_fused_moe(fmt):
    """The tile GEMM on vpdpbusd / vdpbf16ps through linear and fused MoE, model and native. FP8 runs
    on the BF16 engine with each 32-row block expanded to bf16(value × block scale) as it is packed:
    within float32 rounding of torch's linear on that cast, within the bf16 bound of the reference."""
    knob, value, feature = (("cpu_int8_gemm", "vnni", "avx512_vnni") if fmt == "int8"
                            else (f"cpu_{fmt}_gemm", "avx512bf16", "avx512_bf16"))
    g = torch.Generator().manual_seed(9)
    w = make_weight(torch.randn(130, 1000, generator=g) * 0.05, fmt)
    x = torch.randn(37, 1000, generator=g)
    knobs = {knob: value, "cpu_gemm_min_tokens": 32, "cpu_dot_gemm_min_tokens": 32, "cpu_amx_min_tokens": 4096}
    with cpu.emulate([feature]), cpu.recording() as rec:
        got = cpu.linear(x, w, knobs=knobs)
    assert rec[0]["isa"] == ("vnni-model" if fmt == "int8" else "avx512bf16-model")
    if fmt == "int8":  # exact integer sums: equal to the unpack + BLAS path
        assert torch.equal(got, cpu.linear(x, w, knobs={**knobs, knob: "unpack"}))
        check(got, reference.linear(x, w), TIGHT, "vnni tiles")
        # bf16 rows: the GEMM writes bf16 itself, the unpack path's float32 result rounded by .to()
        xb = x.bfloat16()
        with cpu.emulate([feature]):
            gb = cpu.linear(xb, w, knobs=knobs)
        assert gb.dtype == torch.bfloat16 and torch.equal(gb, cpu.linear(xb, w, knobs={**knobs, knob: "unpack"}))
    elif fmt == "fp8":
        cast = w.dequantize().float().bfloat16().float()
        check(got, torch.nn.functional.linear(x.bfloat16().float(), cast), TIGHT, "fp8 dot tiles vs the bf16 cast")
        check(got, reference.linear(x, w), BF16_LINEAR, "fp8 dot tiles vs the reference")
    else:
        check(got, reference.linear(x.bfloat16().float(), w), TIGHT, "bf16 dot tiles vs rounded activations")
    if feature in HAS:
        with cpu.recording() as rec:
            assert torch.equal(cpu.linear(x, w, knobs=knobs), got)
        assert rec[0]["isa"] == ("vnni" if fmt == "int8" else "avx512bf16")
    t, e, d, i, k, pool = MOE_CASES["all_on_one"]
    w13, w2 = moe_weights(e, d, i, fmt)
    tw, ids = routing(t, e, k, seed=t, experts=pool)
    xm = torch.randn(t, d, generator=g)
    with cpu.emulate([feature]), cpu.recording() as rec:
        got = cpu.fused_moe(xm, w13, w2, tw, ids, knobs=knobs)
    assert "model" in rec[0]["isa"]
    check(got, reference.fused_moe(xm, w13, w2, tw, ids), TIGHT if fmt == "int8" else BF16_LINEAR, f"{fmt} moe tiles")


# ------------------------------------------------------------------ INT4 prefill: the VNNI INT4 GEMM

# (M, N, K, group): M below / at / above the kernel's 8-row block and a multi-block odd one; N under 16,
# not a multiple of 16 or 32, several 32-column blocks; K one group, whole groups, a partial last group
INT4_GEMM_SHAPES = {
    "m1_one_group": (1, 5, 32, 32), "m7_n17": (7, 17, 128, 128), "m8_n16_k64": (8, 16, 64, 64),
    "m9_n33_partial_group": (9, 33, 100, 64), "odd": (37, 130, 1000, 128), "regular": (64, 256, 512, 128),
    "g32_long": (19, 70, 2048, 32), "n1_k_tail": (3, 1, 200, 128),
}
INT4_GEMM = {"cpu_int4_gemm": "vnni", "cpu_gemm_min_tokens": 1, "cpu_dot_gemm_min_tokens": 1, "cpu_amx_min_tokens": 4096}


@pytest.mark.parametrize("shape", sorted(INT4_GEMM_SHAPES))
@pytest.mark.parametrize("symmetric", [True, False])
def test_int4_gemm_matches_the_reference_on_its_quantized_activations(shape, symmetric):
    """cpu_int4_gemm=vnni (amx.cpp gemm_int4) on the C++ model of vpdpbusd everywhere and natively where
    present: equal to the reference fed the activations rounded per (token, group) to int8 within 2e-5
    (the integer sums are exact; what is left is float32 order), and so to the float reference within
    the int8 INT4 method's 1.5e-2 (that rounding: ~0.5/127 of the group's max per element); native and
    model bitwise equal."""
    m, n, k, group = INT4_GEMM_SHAPES[shape]
    g = torch.Generator().manual_seed(m * n + k)
    w = formats.quantize_int4_group(torch.randn(n, k, generator=g) * 0.05, group, symmetric=symmetric)
    x = torch.randn(m, k, generator=g)
    model, used = run_linear(x, w, INT4_GEMM, emulate=["avx512_vnni"])
    assert used == "vnni-model"
    check(model, reference.linear(quantize_act_int8_groups(x, group), w), TIGHT, f"int4 gemm {shape}, exact part")
    check(model, reference.linear(x, w), INT4_INT8, f"int4 gemm {shape} vs float activations")
    if "avx512_vnni" in HAS:
        native, used = run_linear(x, w, INT4_GEMM)
        assert used == "vnni" and torch.equal(native, model), shape
    maddubs, used = run_linear(x, w, {**INT4_GEMM, "cpu_int4_gemm": "maddubs"})  # the same sums on vpmaddubsw
    assert used == "maddubs" and torch.equal(maddubs, model), shape
    xb = x.bfloat16()  # bf16 activations: the same GEMM on their float32 values
    got, _ = run_linear(xb, w, INT4_GEMM, emulate=["avx512_vnni"])
    check(got, reference.linear(xb, w), max(BF16_LINEAR, INT4_INT8), f"int4 gemm {shape} bf16 activations")


INT4_AMX = {**INT4_GEMM, "cpu_int4_gemm": "amx", "cpu_amx_min_tokens": 1}
INT4_AMX_SHAPES = {**INT4_GEMM_SHAPES, "m70_n97_three_row_blocks": (70, 97, 768, 64), "m33_n64": (33, 64, 512, 128)}


@pytest.mark.parametrize("shape", sorted(INT4_AMX_SHAPES))
def test_int4_gemm_on_amx_equals_the_vnni_gemm(shape):
    """cpu_int4_gemm=amx (amx.cpp gemm_int4_amx: TDPBSSD on the nibbles as bytes, a K pass per scale group) on
    the AMX tile model everywhere and natively where AMX runs: bitwise the VNNI GEMM's result (the same exact
    integer sums per group, scaled in the same order), so within 2e-5 of the reference on the quantized
    activations. Groups of 32 (not whole K tiles) run the VNNI GEMM instead."""
    m, n, k, group = INT4_AMX_SHAPES[shape]
    g = torch.Generator().manual_seed(m * n + k + 1)
    w = formats.quantize_int4_group(torch.randn(n, k, generator=g) * 0.05, group, symmetric=False)
    x = torch.randn(m, k, generator=g)
    vnni, _ = run_linear(x, w, INT4_GEMM, emulate=["avx512_vnni"])
    model, used = run_linear(x, w, INT4_AMX, emulate=["amx", "avx512_vnni"])
    whole_tiles = group % 64 == 0
    assert used == ("amx-model" if whole_tiles else "vnni-model"), (shape, used)
    assert torch.equal(model, vnni), shape
    check(model, reference.linear(quantize_act_int8_groups(x, group), w), TIGHT, f"int4 amx {shape}, exact part")
    if "amx" in HAS:
        native, used = run_linear(x, w, INT4_AMX)
        assert used == ("amx" if whole_tiles else "vnni") and torch.equal(native, model), (shape, used)
    # bf16 rows: the GEMM writes bf16 itself, each value the float32 result rounded as .to(bfloat16) rounds
    xb = x.bfloat16()
    for knobs, models in ((INT4_AMX, ["amx", "avx512_vnni"]), (INT4_GEMM, ["avx512_vnni"])):
        got, _ = run_linear(xb, w, knobs, emulate=models)
        want, _ = run_linear(xb.float(), w, knobs, emulate=models)
        assert got.dtype == torch.bfloat16 and torch.equal(got, want.bfloat16()), shape


@needs("avx512_vnni")
def test_native_int4_gemm_activation_range():
    """Large, tiny and all-zero activation groups: the per-group scale follows them (a zero group is
    scale 1, sums 0), so the relative error stays the int8 rounding's."""
    g = torch.Generator().manual_seed(3)
    w = formats.quantize_int4_group(torch.randn(40, 512, generator=g) * 0.05, 128, symmetric=False)
    x = torch.randn(9, 512, generator=g)
    x[0] *= 1e6
    x[1] *= 1e-12
    x[2, 128:256] = 0
    x[3] = 0
    got, used = run_linear(x, w, INT4_GEMM)
    assert used == "vnni" and torch.equal(got[3], torch.zeros(40))
    ref = reference.linear(quantize_act_int8_groups(x, 128), w)
    for r in (0, 1, 2):
        check(got[r:r + 1], ref[r:r + 1], TIGHT, f"row {r}")


@pytest.mark.parametrize("fmt", ["int4_g32", "int4_g64_asym", "int4_g128"])
@pytest.mark.parametrize("case", ["all_on_one", "odd_t37"])
def test_int4_gemm_in_fused_moe(fmt, case):
    """Experts at or above cpu_gemm_min_tokens (here 4: most of odd_t37's, all of all_on_one's 37) take
    the INT4 GEMM, the rest the microkernels: within the int8 INT4 method's fused-MoE bound (3e-2; the
    down projection's input is quantized too); native = model bitwise."""
    t, e, d, i, k, pool = MOE_CASES[case]
    w13, w2 = moe_weights(e, d, i, fmt)
    tw, ids = routing(t, e, k, seed=t, experts=pool)
    x = torch.randn(t, d, generator=torch.Generator().manual_seed(7))
    knobs = {"cpu_int4_gemm": "vnni", "cpu_gemm_min_tokens": 4, "cpu_dot_gemm_min_tokens": 4}
    with cpu.emulate(["avx512_vnni"]), cpu.recording() as rec:
        model = cpu.fused_moe(x, w13, w2, tw, ids, knobs=knobs)
    assert "vnni-model" in rec[0]["isa"].split("+"), rec[0]["isa"]
    ref = reference.fused_moe(x, w13, w2, tw, ids)
    check(model, ref, INT4_INT8_MOE, f"int4 gemm moe {fmt} {case}")
    with cpu.recording() as rec:
        unpacked = cpu.fused_moe(x, w13, w2, tw, ids, knobs={**knobs, "cpu_int4_gemm": "unpack"})
    assert UNPACK in rec[0]["isa"].split("+")  # (the small experts' microkernels: their own variant)
    check(unpacked, ref, tight(fmt, op="fused_moe"), f"int4 unpack moe {fmt} {case}")
    if "avx512_vnni" in HAS:
        with cpu.recording() as rec:
            native = cpu.fused_moe(x, w13, w2, tw, ids, knobs=knobs)
        assert "vnni" in rec[0]["isa"].split("+") and torch.equal(native, model)


def test_int4_gemm_knob_and_feature_mask():
    """auto takes the INT4 GEMM where the CPU has VNNI (elsewhere: its vpmaddubsw form in the AVX2 build,
    unpack in the AVX-512 one); unpack forces unpack + BLAS (float activations: the tight bound); a feature
    mask without VNNI never runs vnni (vnni falls back to unpack, auto as without VNNI); below
    cpu_gemm_min_tokens the knob is inert (the microkernels)."""
    g = torch.Generator().manual_seed(11)
    w = make_weight(torch.randn(70, 256, generator=g) * 0.05, "int4_g64_asym")
    x = torch.randn(40, 256, generator=g)
    base = {"cpu_gemm_min_tokens": 32, "cpu_dot_gemm_min_tokens": 32, "cpu_amx_min_tokens": 4096}
    ref = reference.linear(x, w)
    vnni = "avx512_vnni" in HAS
    got, used = run_linear(x, w, {**base, "cpu_int4_gemm": "auto"})
    assert used == ("vnni" if vnni else AUTO_INT_GEMM)
    unpacked, used = run_linear(x, w, {**base, "cpu_int4_gemm": "unpack"})
    assert used == UNPACK
    check(unpacked, ref, TIGHT, "int4 unpack")
    check(got, ref, INT4_INT8 if vnni or AUTO_INT_GEMM == "maddubs" else TIGHT, "int4 auto")
    with cpu.feature_mask(set()):
        assert cpu.isa_variants()["cpu_int4_gemm"]["vnni"] == "unavailable"
        for value in ("auto", "vnni", "unpack"):
            masked, used = run_linear(x, w, {**base, "cpu_int4_gemm": value})
            want = AUTO_INT_GEMM if value == "auto" else UNPACK
            assert used == want and (want != UNPACK or torch.equal(masked, unpacked)), value
        assert run_linear(x, w, {**base, "cpu_int4_gemm": "vnni"}, emulate=["avx512_vnni"])[1] == "vnni-model"
    assert run_linear(x[:5], w, {**base, "cpu_int4_gemm": "vnni"})[1] != UNPACK  # 5 rows: microkernels


# ------------------------------------------------------------------ the probe's readers and peaks


def test_probe_read_methods_and_peaks():
    import math

    ext = cpu.extension()
    buf = torch.ones(1 << 16)
    for streams, lines, ahead, nt in itertools.product((1, 4, 16), (1, 4), (0, 2048), (False, True)):
        d = ext.read_seconds_method(buf, streams, lines, ahead, nt)
        assert d > 0 and math.isfinite(d)
    for bad in ((0, 1, 0, False), (4, 9, 0, False), (4, 1, -1, False)):
        with pytest.raises(RuntimeError, match="read_seconds_method"):
            ext.read_seconds_method(buf, *bad)
    if "avx512_vnni" in HAS:
        assert ext.vnni_int8_gops(1000) > 0
    with cpu.feature_mask(set()):
        with pytest.raises(RuntimeError, match="VNNI"):
            ext.vnni_int8_gops(10)
        with pytest.raises(RuntimeError, match="BF16"):
            ext.bf16_dot_gflops(10)
        with pytest.raises(RuntimeError, match="AMX"):
            ext.amx_peak_gops(10, True)


def test_probe_records_every_read_method_and_the_peaks_of_the_instructions_present():
    """tuner.probe on a tiny buffer and few iterations (no figure asserted: that is the probe's job):
    the limit is the best of every method, each method is recorded, a peak is given exactly for the
    instructions present, and the variants line names the model-only ones."""
    import tuner.probe as probe

    r = probe.measure(repeats=2, buffer_bytes=4 << 20, iters=2000)
    assert len(r["read_methods"]) == len(probe.READ_METHODS) + 2
    assert r["read_gbps"] >= max(r["read_methods"].values()) and r["read_method"] in r["read_methods"]
    assert r["read_gbps_sequential"] == r["read_methods"]["sequential"]
    assert r["fp32_fma_gflops"] > 0 and r["int16_madd_gops"] > 0
    for key, feature in (("vnni_int8_gops", "avx512_vnni"), ("bf16_dot_gflops", "avx512_bf16"), ("amx_int8_gops", "amx")):
        assert (r[key] is not None) == (feature in HAS), key
    assert r["isa_variants"] == cpu.isa_variants() and r["version"] == probe.VERSION
    line = probe.variants_line(r["isa_variants"])
    assert line.startswith("cpu_int8_isa avx512") and "cpu_bf16_gemm unpack, onednn" in line
    assert "maddubs" in line.split(";")[0]  # cpu_int8_isa's vpmaddubsw form runs on every CPU
    assert ("C++ model only" in line) == (not {"avx512_vnni", "avx512_bf16", "amx"} <= HAS)  # AMX too (session 14)


def test_probe_cache_gives_the_variants_of_the_code_now(tmp_path, monkeypatch):
    """A cached probe written before a variant was added: the variants come from the kernels, the limits
    from the cache."""
    import json

    import tuner.probe as probe

    path = tmp_path / "probe.json"
    monkeypatch.setattr(probe, "_path", lambda: path)
    stale = {"version": probe.VERSION, "read_gbps": 12.5, "isa_variants": {"cpu_int8_isa": {"avx512": "native"}}}
    path.write_text(json.dumps(stale))
    r = probe.probe()
    assert r["read_gbps"] == 12.5 and r["isa_variants"] == cpu.isa_variants()


def test_probe_refresh_keeps_the_fastest_read_of_this_machine(tmp_path, monkeypatch, capsys):
    """A refresh keeps the fastest read measured before on the same machine (version, hardware key,
    threads) with its method, takes the refresh's peaks, and records the refreshes; another hardware key
    or --reset starts again; a corrupt cache is measured again."""
    import json

    import tuner.probe as probe

    path = tmp_path / "probe.json"
    monkeypatch.setattr(probe, "_path", lambda: path)
    runs = iter([(77.0, "8 streams", 453.0), (44.0, "sequential", 460.0), (80.0, "4 streams", 450.0),
                 (30.0, "sequential", 455.0), (31.0, "sequential", 455.0)])

    def fake_measure():
        gbps, method, fma = next(runs)
        return {"version": probe.VERSION, "hardware_key": key, "threads": 2, "read_gbps": gbps,
                "read_gbps_median": gbps - 1, "read_method": method, "read_methods": {method: gbps, "other": gbps / 2},
                "read_gbps_sequential": gbps / 2, "read_gbps_4_streams_prefetch": gbps / 3, "fp32_fma_gflops": fma,
                "isa_variants": {}}

    monkeypatch.setattr(probe, "measure", fake_measure)
    key = "k1"
    first = probe.probe(refresh=True)
    assert first["read_gbps"] == 77.0 and first["read_gbps_this_run"] == 77.0 and len(first["read_history"]) == 1
    slow = probe.probe(refresh=True)  # a slow minute: the limit stays
    assert (slow["read_gbps"], slow["read_method"], slow["read_gbps_median"]) == (77.0, "8 streams", 76.0)
    assert slow["read_gbps_this_run"] == 44.0 and slow["fp32_fma_gflops"] == 460.0
    assert slow["read_methods"] == {"sequential": 44.0, "other": 38.5} and slow["read_gbps_sequential"] == 38.5
    assert [g for _, g in slow["read_history"]] == [77.0, 44.0]
    assert json.loads(path.read_text())["read_gbps"] == 77.0 and probe.probe()["read_gbps"] == 77.0
    assert probe.main(["--refresh"]) == 0  # faster: the new best
    assert "this run's best read" not in capsys.readouterr().out and probe.probe()["read_gbps"] == 80.0
    key = "k2"  # another machine's cache (same path here): not mixed in
    assert probe.probe(refresh=True)["read_gbps"] == 30.0
    path.write_text("{not json")
    key = "k1"
    assert probe.probe()["read_gbps"] == 31.0 and len(probe.probe()["read_history"]) == 1


def test_probe_buffer_outgrows_the_last_level_cache():
    """The read buffer is at least 512 MiB and twice the largest cache (a 480 MiB L3 seen on an AMX VM)."""
    from tuner.probe import read_buffer_bytes

    assert read_buffer_bytes("L1d:48K,L1i:64K,L2:2048K,L3:491520K") == 960 << 20
    assert read_buffer_bytes("L1d:32K,L2:1024K,L3:33792K") == 512 << 20
    assert read_buffer_bytes("") == 512 << 20


def test_fingerprint_lists_the_variants_native_and_model_only():
    from kernels.cpu_knobs import variants_for
    from tuner.fingerprint import fingerprint

    fp = fingerprint()
    flags = set(fp["isa"].split(","))
    assert fp["cpu_kernel_build"] == cpu._ext.BUILD
    native = variants_for(flags, cpu._ext.BUILD)
    for knob, variants in native.items():
        for v, how in variants.items():
            assert (f"{v}" in fp["cpu_kernel_variants"].split(f"{knob}=")[1].split(";")[0].split(",")) == (how == "native")
    runs_bf16 = "avx512_bf16" in flags and cpu._ext.BUILD == "avx512"
    assert ("avx512bf16" in fp["cpu_kernel_variants_model_only"]) == (not runs_bf16)
    if cpu._ext.BUILD == "avx512":  # cpuid = cpuinfo
        assert {f for f in cpu.detected_features() if f != "amx"} == flags & {"avx512_vnni", "avx512_bf16"}
    else:  # the AVX2 build runs none of them, whatever the CPU has
        assert cpu.detected_features() == set()


@pytest.mark.parametrize("t", [1, 7, 8, 31, 40])
def test_dot_gemm_threshold_is_its_own(t):
    """cpu_dot_gemm_min_tokens decides where a weight whose GEMM is a dot-product engine here (INT8 on
    VNNI) leaves the microkernels, cpu_bf16_gemm_min_tokens where BF16 on the unpack + BLAS path (float32
    activations) does, cpu_gemm_min_tokens where the other unpack + BLAS formats (FP8) do. The INT8
    microkernels run the int16 path here (cpu_int8_isa=avx512) so the recorded variant names the path:
    avx512 (microkernel), vnni (the GEMM), blas or fma (unpack + BLAS or our FMA tiles: UNPACK)."""
    emulate = [] if "avx512_vnni" in HAS else ["avx512_vnni"]
    vnni = "vnni" if not emulate else "vnni-model"
    g = torch.Generator().manual_seed(t)
    x = torch.randn(t, 256, generator=g)
    w8 = make_weight(torch.randn(70, 256, generator=g) * 0.05, "int8")
    wb = make_weight(torch.randn(70, 256, generator=g) * 0.05, "bf16")
    wf = make_weight(torch.randn(70, 256, generator=g) * 0.05, "fp8")
    base = {"cpu_int8_isa": "avx512", "cpu_int8_gemm": "vnni", "cpu_amx_min_tokens": 4096, "cpu_bf16_gemm": "unpack"}
    for dot, gemm, bf16 in ((8, 4096, 4096), (8, 1, 4096), (4096, 1, 8), (1, 4096, 1), (4096, 8, 1)):
        knobs = {**base, "cpu_dot_gemm_min_tokens": dot, "cpu_gemm_min_tokens": gemm, "cpu_bf16_gemm_min_tokens": bf16}
        y8, used8 = run_linear(x, w8, knobs, emulate)
        assert used8 == (vnni if t >= dot else "avx512"), (dot, gemm, used8)
        yb, usedb = run_linear(x, wb, knobs)
        assert usedb == (UNPACK if t >= bf16 else AUTO_BF16_MICRO), (bf16, usedb)
        yf, usedf = run_linear(x, wf, knobs)
        assert usedf == (UNPACK if t >= gemm else "avx512"), (gemm, usedf)
        check(y8, reference.linear(x, w8), tight("int8"), f"int8 T={t} dot={dot}")
        check(yb, reference.linear(x, wb), tight("bf16"), f"bf16 T={t} bf16={bf16}")
    assert cpu.KNOB_DEFAULTS["cpu_dot_gemm_min_tokens"] < cpu.KNOB_DEFAULTS["cpu_gemm_min_tokens"] < \
        cpu.KNOB_DEFAULTS["cpu_bf16_gemm_min_tokens"]


@pytest.mark.parametrize("fmt", ["f32", "bf16", "int8", "fp8", "int4_g128"])
def test_unpack_gemm_fma_tiles_match_the_reference(fmt):
    """cpu_unpack_gemm=fma (our 6 × 16 FMA register tiles on K-major panels, matmul.cpp gemm_fma) against the
    reference and against BLAS on the same unpacked weights, on regular, odd and corner shapes: rows of x
    around the 6-row tile (1, 5, 6, 7, 37), weight rows around the 16-row panel (1, 15, 16, 17, 70), K odd
    and tiny, K in one pass and in passes of cpu_k_block. Bound: 2e-5 with float32 activations (float32 sums, only the order differs); INT4's int8
    method does not apply (the GEMM path multiplies float activations), so INT4 is within 2e-5 too."""
    g = torch.Generator().manual_seed(11)
    gemm = {"cpu_gemm_min_tokens": 1, "cpu_bf16_gemm_min_tokens": 1, "cpu_dot_gemm_min_tokens": 4096,
            "cpu_amx_min_tokens": 4096, "cpu_int4_gemm": "unpack", "cpu_int8_gemm": "unpack", "cpu_fp8_gemm": "unpack",
            "cpu_bf16_gemm": "unpack"}
    for m, n, k in itertools.product((1, 5, 6, 7, 37), (1, 15, 16, 17, 70), (128, 1000)):
        if fmt.startswith("int4") and k % 128:
            continue
        w = make_weight(torch.randn(n, k, generator=g) * 0.05, fmt)
        x = torch.randn(m, k, generator=g)
        with cpu.recording() as rec:
            y = cpu.linear(x, w, knobs={**gemm, "cpu_unpack_gemm": "fma"})
        assert rec[-1]["isa"] == "fma", rec[-1]
        check(y, reference.linear(x, w), TIGHT, f"fma {fmt} {m}x{n}x{k}")
        check(y, cpu.linear(x, w, knobs={**gemm, "cpu_unpack_gemm": "blas"}), TIGHT, f"fma vs blas {fmt} {m}x{n}x{k}")
        for kb in (64, 4096):  # K in passes (1000: 16 of 64, the last one 40 long) or in one
            check(cpu.linear(x, w, knobs={**gemm, "cpu_unpack_gemm": "fma", "cpu_k_block": kb}), y, TIGHT,
                  f"fma k_block {kb} {fmt} {m}x{n}x{k}")
    x = torch.randn(3, 40, generator=g)  # K smaller than a cache line of the panel strips
    w = make_weight(torch.randn(17, 40, generator=g) * 0.05, "f32")
    check(cpu.linear(x, w, knobs={**gemm, "cpu_unpack_gemm": "fma"}), reference.linear(x, w), TIGHT, "fma K=40")
