"""The AMX GEMM (kernels/cpu/csrc/amx.cpp) against exact math.

The kernel is instantiated twice: on the AMX tile instructions, which run only where the CPU reports
AMX and Linux grants the tile state (skipped elsewhere, with that reason), and on a C++ model of the
same tile registers and instructions, run everywhere, which checks the packing of weights into B
tiles, the 2 × 2 tile blocking, the loop nest's column groups, row chunks and K passes
(cpu_amx_n_group, cpu_amx_m_block, cpu_amx_k_block) and every zero-padded tail (M, N, K not multiples of
the tiles).

Bounds, against float64 math on the same inputs: INT8 (TDPBSSD, exact int32 sums) equal; BF16
(TDPBF16PS, bf16 inputs, float32 accumulation) ‖Δ‖/‖ref‖ ≤ 2e-6 (measured ≤ 4.2e-7 at K = 2048).
Through linear / fused_moe, AMX is the `amx` variant of cpu_int8_gemm (also auto's choice) and of
cpu_bf16_gemm (by name only): INT8 from the quantized integers equals the VNNI GEMM bitwise (both exact
sums, scaled in the same write-back); BF16 within 1e-2 (the bf16 bound of tests/test_kernels_cpu.py);
float32 activations under auto keep the float32 path (2e-5).
"""
import contextlib

import itertools

import pytest
import torch

from kernels import formats, reference
from kernels.cpu_build import missing_isa

if missing_isa():
    pytest.skip(f"this CPU lacks {missing_isa()}: the cpu backend cannot run here", allow_module_level=True)

import kernels.cpu as cpu  # noqa: E402
from int4_streams import with_zero_stream  # noqa: E402

BF16_BOUND = 2e-6
SHAPES = {  # name → (M, N, K)
    "one": (1, 1, 1), "regular": (64, 256, 512), "odd": (33, 70, 1000), "tails": (5, 17, 40),
    "many_blocks": (100, 97, 130), "long_k": (17, 33, 2048), "k_tail_1": (3, 40, 65),
    # whole K tiles in every row (the direct path runs): one / two token tiles, N tails, K 64 and 4096
    "direct_16": (16, 70, 128), "direct_odd": (29, 45, 192), "direct_k64": (40, 32, 64), "direct_long": (9, 33, 4096),
}
HW = cpu.amx_status()


def run(x, w, emulate, k_block=0, direct=False, n_group=1, m_block=0):
    fmt = cpu.FORMAT_IDS["int8" if w.dtype == torch.int8 else "bf16"]
    return cpu._ext.amx_linear_raw(x.float().contiguous(), fmt, w.contiguous(), w.shape[0], w.shape[1], emulate,
                                   k_block, direct, n_group, m_block)


def inputs(m, n, k, seed):
    g = torch.Generator().manual_seed(seed)
    xb = torch.randn(m, k, generator=g).to(torch.bfloat16)
    wb = torch.randn(n, k, generator=g).to(torch.bfloat16)
    xi = torch.randint(-127, 128, (m, k), generator=g).float()
    wi = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    return xb, wb, xi, wi


def check_gemm(emulate, m, n, k, seed):
    xb, wb, xi, wi = inputs(m, n, k, seed)
    ref = xb.double() @ wb.double().T
    refi = xi.double() @ wi.double().T  # |sums| < 2^24 at these K: exact in float32 too
    # K in one pass, or in passes of one and two K tiles (sums kept between); the weight rows in place
    # (direct: where rows hold whole K tiles, else the packed path runs); groups of 2, 3 and 8 column blocks
    # per task (more than N holds, and a last group short) with rows in chunks of 32 and 64 (one chunk,
    # several, a short last one) or all, in one pass and in several
    for k_block, direct, n_group, m_block in ((0, False, 1, 0), (64, False, 1, 0), (128, False, 1, 0), (0, True, 1, 0),
                                              (64, False, 3, 32), (128, False, 8, 64), (0, False, 2, 32),
                                              (64, False, 2, 0)):
        got = run(xb, wb, emulate, k_block, direct, n_group, m_block)
        assert got.shape == (m, n) and got.dtype == torch.float32
        assert ((got.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item() <= BF16_BOUND, k_block
        got_i = run(xi, wi, emulate, k_block, direct, n_group, m_block).double()
        assert torch.equal(got_i, refi), (k_block, direct, n_group, m_block)


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_emulated_tiles_match_exact_math(shape):
    check_gemm(True, *SHAPES[shape], seed=len(shape))


@pytest.mark.skipif(bool(HW), reason=f"AMX hardware path: {HW}")
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_amx_tiles_match_exact_math(shape):
    check_gemm(False, *SHAPES[shape], seed=len(shape))


def amx_here(native):
    """(context, the call record's name) for AMX natively (skipped without it) or on its model."""
    if native and HW:
        pytest.skip(f"AMX hardware path: {HW}")
    return (contextlib.nullcontext(), "amx") if native else (cpu.emulate(["amx"]), "amx-model")


@pytest.mark.parametrize("native", [False, True], ids=["model", "native"])
@pytest.mark.parametrize("fmt", ["bf16", "int8"])
def test_linear_and_moe_take_amx_by_name_from_the_threshold(fmt, native):
    """Seen in the call record: the amx variant from cpu_amx_min_tokens rows on, not below, through
    linear and fused MoE, on bf16 and float32 activations (BF16: rounded to bf16 by name), in one pass
    over K or in passes."""
    ctx, tag = amx_here(native)
    g = torch.Generator().manual_seed(4)
    wt = torch.randn(300, 1000, generator=g) * 0.05
    w = formats.DenseWeight(wt.to(torch.bfloat16)) if fmt == "bf16" else formats.quantize_int8_channel(wt)
    x32 = torch.randn(40, 1000, generator=g)
    named = {"cpu_bf16_gemm": "amx", "cpu_int8_gemm": "amx", "cpu_gemm_min_tokens": 1, "cpu_dot_gemm_min_tokens": 1}
    with ctx:
        for x, amx_min, k_block in ((x32.bfloat16(), 1, 0), (x32.bfloat16(), 4096, 0), (x32, 1, 128), (x32, 1, 0)):
            ref = reference.linear(x.float(), w)
            with cpu.recording() as rec:
                got = cpu.linear(x, w, knobs={**named, "cpu_amx_min_tokens": amx_min, "cpu_amx_k_block": k_block})
            assert (tag in rec[-1]["isa"].split("+")) == (amx_min == 1), rec[-1]["isa"]
            assert got.dtype == x.dtype
            tol = 2e-5 if fmt == "int8" and x.dtype == torch.float32 else 1e-2  # a bf16 output, or bf16 products
            assert ((got.float() - ref).norm() / ref.norm()).item() <= tol
        # fused MoE: 40 tokens on 2 of 3 experts (each ≥ 32 rows: the GEMM path, on AMX with amx_min 32)
        w13 = torch.randn(3, 200, 1000, generator=g) * 0.05
        w2 = torch.randn(3, 1000, 100, generator=g) * 0.05
        mk = (lambda t: formats.DenseWeight(t.to(torch.bfloat16))) if fmt == "bf16" else formats.quantize_int8_channel
        w13, w2 = mk(w13), mk(w2)
        ids = torch.tensor([[0, 2]] * 40)
        tw = torch.rand(40, 2, generator=g) + 0.1
        x = x32.bfloat16() if fmt == "bf16" else x32
        ref = reference.fused_moe(x.float(), w13, w2, tw, ids)
        with cpu.recording() as rec:
            got = cpu.fused_moe(x, w13, w2, tw, ids, knobs={**named, "cpu_amx_min_tokens": 32})
        assert tag in rec[-1]["isa"].split("+"), rec[-1]["isa"]
        assert ((got.float() - ref).norm() / ref.norm()).item() <= (2e-2 if fmt == "bf16" else 2e-5)


@pytest.mark.parametrize("native", [False, True], ids=["model", "native"])
def test_int8_amx_equals_the_vnni_gemm_bitwise_and_auto_takes_it(native):
    """INT8 on AMX (signed × signed, no compensation) and on vpdpbusd (A + 128, minus 128·Σw) give the same
    exact integer sums, scaled in the same write-back: bitwise equal outputs, float32 and bf16, in linear
    and fused MoE. auto takes AMX from cpu_amx_min_tokens rows where AMX runs, VNNI's GEMM below that."""
    ctx, tag = amx_here(native)
    g = torch.Generator().manual_seed(7)
    base = {"cpu_gemm_min_tokens": 1, "cpu_dot_gemm_min_tokens": 1, "cpu_amx_min_tokens": 16}
    with ctx:
        # K = 128: whole K tiles, the weight rows in place up to cpu_amx_direct_max_tokens (64), packed above
        for k, t, dtype in itertools.product((130, 128), (1, 15, 16, 33, 100), (torch.float32, torch.bfloat16)):
            w = formats.quantize_int8_channel(torch.randn(70, k, generator=g) * 0.05)
            x = torch.randn(t, k, generator=g).to(dtype)
            want = cpu.linear(x, w, knobs={**base, "cpu_int8_gemm": "vnni"})
            for k_block in (0, 64):
                with cpu.recording() as rec:
                    got = cpu.linear(x, w, knobs={**base, "cpu_int8_gemm": "amx", "cpu_amx_k_block": k_block})
                assert torch.equal(got, want), (t, dtype, k_block)
                assert (rec[-1]["isa"] == tag) == (t >= 16), rec[-1]["isa"]
            with cpu.recording() as rec:
                got = cpu.linear(x, w, knobs={**base, "cpu_int8_gemm": "auto"})
            assert torch.equal(got, want)
            vnni = "vnni" if "avx512_vnni" in cpu.features() else "vnni-model"
            assert rec[-1]["isa"] == (tag if t >= 16 else vnni) or "avx512_vnni" not in cpu.features(), rec[-1]["isa"]
        w13 = formats.quantize_int8_channel(torch.randn(4, 96, 130, generator=g) * 0.05)
        w2 = formats.quantize_int8_channel(torch.randn(4, 130, 48, generator=g) * 0.05)
        x = torch.randn(50, 130, generator=g)
        ids = torch.randint(0, 4, (50, 2), generator=g)
        ids[:, 1] = (ids[:, 0] + 1) % 4
        tw = torch.rand(50, 2, generator=g)
        want = cpu.fused_moe(x, w13, w2, tw, ids, knobs={**base, "cpu_int8_gemm": "vnni"})
        with cpu.recording() as rec:
            got = cpu.fused_moe(x, w13, w2, tw, ids, knobs={**base, "cpu_int8_gemm": "amx"})
        assert tag in rec[-1]["isa"].split("+") and torch.equal(got, want)


def routing_with_counts(counts, g):
    """top-2 ids whose experts get exactly `counts` slots (no token routed twice to one expert), and weights."""
    slots = torch.cat([torch.full((c,), e) for e, c in enumerate(counts)])  # sorted by expert
    half = len(slots) // 2
    assert max(counts) <= half  # so slot j and slot j + half never share an expert
    ids = torch.stack([slots[:half], slots[half:]], 1)[torch.randperm(half, generator=g)]
    return ids, torch.rand(ids.shape, generator=g) + 0.1


@pytest.mark.parametrize("native", [False, True], ids=["model", "native"])
@pytest.mark.parametrize("fmt, layout", [("int8", "rows"), ("int8", "r16"), ("bf16", "rows"), ("bf16", "r16"),
                                         ("fp8", "rows")])  # (FP8 r16 has no AMX form: its stacks stay on the microkernels)
@pytest.mark.parametrize("d, i", [(128, 64), (192, 96), (256, 48)], ids=["both", "gate_up_only", "neither"])
def test_grouped_moe_experts_equal_one_call_each(native, fmt, d, i, layout):
    """cpu_moe_gemm_experts=grouped (the INT8 and BF16 experts AMX runs in place, one parallel region per phase; SiLU in
    phase 1's tasks, phase 2 accumulating over the experts per 32 output columns) against one GEMM call per expert
    (each), and for INT8 against VNNI's GEMM (exact integer sums, the same scaling): bitwise equal where every GEMM-path expert is
    grouped, with experts of 1, 2 and 3 token tiles, below cpu_amx_min_tokens (the microkernels) and at
    cpu_amx_direct_max_tokens. Phases that cannot be grouped (I not in whole 32-row blocks, K not in whole 64-byte
    tiles) run each. With an expert past cpu_amx_direct_max_tokens (packed: one call) the experts' sums meet a token
    in another order: within 1e-6 then. r16 stacks (their 16-row blocks read in place as B tiles against the tokens'
    A tiles) give the row-major stacks' outputs bit for bit, grouped or not. FP8 experts (rows expanded to bf16 per
    task, in place of reading them where they lie; any K, so the down phase groups with I = 48 too) the same way."""
    ctx, tag = amx_here(native)
    g = torch.Generator().manual_seed(31)
    base = {"cpu_gemm_min_tokens": 1, "cpu_dot_gemm_min_tokens": 1, "cpu_amx_min_tokens": 16,
            "cpu_amx_direct_max_tokens": 64, "cpu_amx_fp8_direct_max_tokens": 64, "cpu_bf16_gemm": "amx",
            "cpu_fp8_gemm": "amx"}
    make = {"int8": formats.quantize_int8_channel, "fp8": formats.quantize_fp8_block,
            "bf16": lambda t: formats.DenseWeight(t.bfloat16())}[fmt]
    w13 = make(torch.randn(6, 2 * i, d, generator=g) * 0.05)
    w2 = make(torch.randn(6, d, i, generator=g) * 0.05)
    p13, p2 = cpu.prepare(w13, layout=layout), cpu.prepare(w2, layout=layout)
    rows13, rows2 = cpu.prepare(w13, layout="rows"), cpu.prepare(w2, layout="rows")
    assert (p13.args[0] == rows13.args[0]) == (layout == "rows")  # r16 taken
    with ctx:
        for counts, exact in (((5, 16, 33, 40, 64, 2), True), ((5, 16, 33, 40, 70, 4), False)):
            ids, tw = routing_with_counts(counts, g)
            x = torch.randn(ids.shape[0], d, generator=g).bfloat16()
            with cpu.recording() as rec:
                got = cpu.fused_moe(x, p13, p2, tw, ids, knobs={**base, "cpu_moe_gemm_experts": "grouped"})
            assert tag in rec[-1]["isa"].split("+"), rec[-1]["isa"]
            # the call record names the grouped phases (I in whole 32-row blocks and D in whole 64-byte K tiles)
            grouped = (i % 32 == 0 or d % 32 == 0) if fmt == "fp8" else (i % 32 == 0 and d * (1 if fmt == "int8" else 2) % 64 == 0)
            assert ("grouped" in rec[-1]["isa"].split("+")) == grouped
            assert ("fp8rows" in rec[-1]["isa"].split("+")) == (fmt == "fp8")
            with cpu.recording() as rec:
                each = cpu.fused_moe(x, p13, p2, tw, ids, knobs={**base, "cpu_moe_gemm_experts": "each"})
            assert "grouped" not in rec[-1]["isa"].split("+")
            ref = reference.fused_moe(x.float(), w13, w2, tw, ids)
            assert ((got.float() - ref).norm() / ref.norm()).item() <= 2e-2
            if exact:
                assert torch.equal(got, each)
            if exact and fmt == "int8":
                with cpu.emulate([] if "avx512_vnni" in cpu.detected_features() else ["avx512_vnni"]):
                    vnni = cpu.fused_moe(x, rows13, rows2, tw, ids, knobs={**base, "cpu_int8_gemm": "vnni"})
                assert torch.equal(got, vnni)
            elif not exact:
                assert ((got.float() - each.float()).norm() / each.float().norm()).item() <= 1e-6
            if layout == "r16":  # INT8: bitwise (integer sums); BF16: the microkernels' sums (2 and 5 tokens) differ
                rows = cpu.fused_moe(x, rows13, rows2, tw, ids, knobs={**base, "cpu_moe_gemm_experts": "grouped"})
                if fmt == "int8":
                    assert torch.equal(got, rows)
                else:
                    assert ((got.float() - rows.float()).norm() / rows.float().norm()).item() <= 1e-2
        if layout == "r16":  # every expert on the GEMM path: the tiles' sums, bitwise the row-major stacks'
            ids, tw = routing_with_counts((16, 33, 40, 64, 20, 17), g)
            x = torch.randn(ids.shape[0], d, generator=g).bfloat16()
            kn = {**base, "cpu_moe_gemm_experts": "grouped"}
            assert torch.equal(cpu.fused_moe(x, p13, p2, tw, ids, knobs=kn), cpu.fused_moe(x, rows13, rows2, tw, ids, knobs=kn))


@pytest.mark.parametrize("native", [False, True], ids=["model", "native"])
def test_int4_r16_on_amx_equals_the_r16_microkernels_bitwise(native):
    """INT4 r16 weights (groups of 128) on AMX by name from cpu_amx_min_tokens rows (gemm_int4_r16: each r16 line's low and
    high nibbles are rows of a group's two B tiles, the microkernels' int8 activations as A, each group's exact sums
    scaled in r16_int4_tile's order): bitwise the r16 microkernels' result, through linear (N in one 16-row block,
    one and several 32-row blocks; M tails; float32 and bf16 rows, a bf16 output for bf16 rows) and fused MoE (experts
    on AMX, on the microkernels, and mixed), within the INT4 bound of the reference; the call record names AMX and
    r16. auto takes it from cpu_int4_r16_amx_min_tokens rows (tokens per expert), unpack never."""
    ctx, tag = amx_here(native)
    g = torch.Generator().manual_seed(41)
    micro = {"cpu_amx_min_tokens": 4096, "cpu_int4_gemm": "amx"}
    amx = {"cpu_amx_min_tokens": 1, "cpu_int4_gemm": "amx"}
    with ctx:
        for n, k, m in ((16, 128, 5), (48, 256, 33), (96, 384, 70), (64, 128, 1)):
            w = formats.quantize_int4_group(torch.randn(n, k, generator=g) * 0.05, 128, symmetric=False)
            p = cpu.prepare(w, layout="r16")
            assert p.args[0] == cpu.I4R16_ID
            x = torch.randn(m, k, generator=g)
            for xd in (torch.float32, torch.bfloat16):
                want = cpu.linear(x.to(xd), p, knobs=micro)
                with cpu.recording() as rec:
                    got = cpu.linear(x.to(xd), p, knobs=amx)
                assert {tag, "r16"} <= set(rec[-1]["isa"].split("+")), rec[-1]["isa"]
                assert got.dtype == xd and torch.equal(got, want), (n, k, m, xd)
            ref = reference.linear(x, w)
            assert ((cpu.linear(x, p, knobs=amx) - ref).norm() / ref.norm()).item() <= 2e-2
            # auto: AMX from cpu_int4_r16_amx_min_tokens rows (here 33 and 70 of them reach 32, and none 4096);
            # unpack keeps r16 on the microkernels
            for value, threshold in (("auto", 32), ("auto", 4096), ("unpack", 1)):
                kn = {**amx, "cpu_int4_gemm": value, "cpu_int4_r16_amx_min_tokens": threshold}
                with cpu.recording() as rec:
                    got = cpu.linear(x, p, knobs=kn)
                assert (tag in rec[-1]["isa"].split("+")) == (value == "auto" and m >= threshold), (value, rec[-1]["isa"])
                assert torch.equal(got, cpu.linear(x, p, knobs=micro)), (value, threshold)
        d, i = 256, 128
        w13 = formats.quantize_int4_group(torch.randn(6, 2 * i, d, generator=g) * 0.05, 128, symmetric=False)
        w2 = formats.quantize_int4_group(torch.randn(6, d, i, generator=g) * 0.05, 128, symmetric=False)
        p13, p2 = cpu.prepare(w13, layout="r16"), cpu.prepare(w2, layout="r16")
        assert p13.args[0] == p2.args[0] == cpu.I4R16_ID
        ids, tw = routing_with_counts((5, 16, 33, 40, 2, 20), g)
        x = torch.randn(ids.shape[0], d, generator=g)
        want = cpu.fused_moe(x, p13, p2, tw, ids, knobs=micro)
        with cpu.recording() as rec:
            got = cpu.fused_moe(x, p13, p2, tw, ids, knobs=amx)
        assert tag in rec[-1]["isa"].split("+"), rec[-1]["isa"]
        assert torch.equal(got, want)  # every expert on one path: each output sums the experts in order
        mixed = cpu.fused_moe(x, p13, p2, tw, ids, knobs={**amx, "cpu_amx_min_tokens": 16})  # 2 and 5 tokens: microkernels
        ref = reference.fused_moe(x, w13, w2, tw, ids)
        for out in (got, mixed):
            assert ((out - ref).norm() / ref.norm()).item() <= 2e-2
        assert ((mixed - want).norm() / want.norm()).item() <= 1e-6
        # auto: the experts of 33 and 40 tokens on AMX from a threshold of 32, none from 4096 (then the microkernels' bits)
        for threshold in (32, 4096):
            kn = {"cpu_amx_min_tokens": 1, "cpu_int4_gemm": "auto", "cpu_int4_r16_amx_min_tokens": threshold}
            with cpu.recording() as rec:
                auto = cpu.fused_moe(x, p13, p2, tw, ids, knobs=kn)
            assert (tag in rec[-1]["isa"].split("+")) == (threshold == 32), rec[-1]["isa"]
            if threshold == 32:
                assert ((auto - want).norm() / want.norm()).item() <= 1e-6
            else:
                assert torch.equal(auto, want)
        # symmetric weights (every zero point 8): no scale·zero stream, the tiles' 8·scale gives the stream's bits
        w13 = formats.quantize_int4_group(torch.randn(6, 2 * i, d, generator=g) * 0.05, 128)
        w2 = formats.quantize_int4_group(torch.randn(6, d, i, generator=g) * 0.05, 128)
        p13, p2 = cpu.prepare(w13, layout="r16"), cpu.prepare(w2, layout="r16")
        assert p13.orig.block_sz.numel() == 0 == p2.orig.block_sz.numel()
        s13, s2 = with_zero_stream(p13), with_zero_stream(p2)
        with cpu.recording() as rec:
            got = cpu.fused_moe(x, p13, p2, tw, ids, knobs=amx)
        assert tag in rec[-1]["isa"].split("+"), rec[-1]["isa"]
        assert torch.equal(got, cpu.fused_moe(x, s13, s2, tw, ids, knobs=amx))
        assert torch.equal(got, cpu.fused_moe(x, p13, p2, tw, ids, knobs=micro))


@pytest.mark.parametrize("native", [False, True], ids=["model", "native"])
def test_fp8_on_amx_expands_blocks_to_bf16_as_it_packs(native):
    """cpu_fp8_gemm=amx (auto's choice for bf16 activations on AMX CPUs): each 32-row block of the FP8
    weight expanded to bf16(value × block scale) as it is packed, then TDPBF16PS, the products the
    avx512bf16 FP8 GEMM makes: within 1e-5 of it (summation order), within the bf16 bound of the
    reference; linear (odd shape, N and K tails) and fused MoE."""
    ctx, tag = amx_here(native)
    g = torch.Generator().manual_seed(11)
    w = formats.quantize_fp8_block(torch.randn(300, 384, generator=g) * 0.05)
    base = {"cpu_gemm_min_tokens": 1, "cpu_dot_gemm_min_tokens": 1, "cpu_amx_min_tokens": 8}
    with ctx:
        for t in (9, 40):
            x = torch.randn(t, 384, generator=g).bfloat16()
            ref = reference.linear(x.float(), w)
            with cpu.recording() as rec:
                got = cpu.linear(x, w, knobs={**base, "cpu_fp8_gemm": "amx"})
            assert rec[-1]["isa"] == tag + "+fp8rows"  # 9 and 40 rows: the blocks expanded to bf16 rows as A tiles
            assert got.dtype == torch.bfloat16
            assert ((got.float() - ref).norm() / ref.norm()).item() <= 1e-2
            # the vdpbf16ps GEMM, on its model where the CPU lacks it (beside AMX's model when that runs)
            models = (["amx"] if not native else []) + ([] if "avx512_bf16" in cpu.detected_features() else ["avx512_bf16"])
            with cpu.emulate(models):
                dotted = cpu.linear(x.float(), w, knobs={**base, "cpu_fp8_gemm": "avx512bf16", "cpu_amx_min_tokens": 4096})
                amx32 = cpu.linear(x.float(), w, knobs={**base, "cpu_fp8_gemm": "amx"})
            assert ((amx32 - dotted).norm() / dotted.norm()).item() <= 1e-5
        w13 = formats.quantize_fp8_block(torch.randn(3, 256, 384, generator=g) * 0.05)
        w2 = formats.quantize_fp8_block(torch.randn(3, 384, 128, generator=g) * 0.05)
        x = torch.randn(40, 384, generator=g).bfloat16()
        ids = torch.tensor([[0, 2]] * 40)
        tw = torch.rand(40, 2, generator=g) + 0.1
        ref = reference.fused_moe(x.float(), w13, w2, tw, ids)
        with cpu.recording() as rec:
            got = cpu.fused_moe(x, w13, w2, tw, ids, knobs={**base, "cpu_fp8_gemm": "amx"})
        assert tag in rec[-1]["isa"].split("+"), rec[-1]["isa"]
        assert ((got.float() - ref).norm() / ref.norm()).item() <= 2e-2


def fp8_bf16_cast(w: formats.Fp8BlockWeight) -> torch.Tensor:
    """The FP8 GEMMs' bf16 weight, in plain torch: each E4M3 byte as the kernels read it (sign, then exponent and
    mantissa moved into float32's fields and rebased by 120; ±0 stays 0, E4M3 denormals read as 2^-7·(1 + m/8), NaN
    bytes as ±480), times its block scale in float32, rounded to bf16 to nearest even."""
    b = w.w.view(torch.uint8).int()
    mag = b & 0x7F
    bits = torch.where(mag != 0, (mag << 20) + (120 << 23), 0) | ((b & 0x80) << 24)
    vals = bits.view(torch.float32)
    bn, bk = w.block
    n, k = vals.shape
    s = w.scale_inv.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return (vals * s).bfloat16()


@pytest.mark.parametrize("native", [False, True], ids=["model", "native"])
def test_fp8_packing_in_registers_gives_the_bf16_cast_bit_for_bit(native):
    """pack_fp8_b's two forms (whole 32-row blocks: FP8 bytes to bf16 through a per-block table and a register
    transpose; the rest: float32 products into scratch rows, then pack_b) and the expanded rows of the in-place path
    (Fp8RowsBf16: the same table per scale block and row, the float32 form where it refuses a scale or K has a tail;
    cpu_amx_fp8_direct_max_tokens, the call record's fp8rows) give the BF16 engines the bf16 cast of the weight
    exactly: the FP8 linear on AMX, either way (and on the vdpbf16ps GEMM), equals the BF16 linear of the cast weight
    bit for bit. Every byte value (NaN, denormals, ±0), scale blocks of 128 × 128, 64 × 96 and 40 × 64 (the scratch
    form; a 32-row block under two scale rows), K with and without a tail of 32, an N tail, and scales the table
    refuses (0, negative, tiny, huge)."""
    ctx, tag = amx_here(native)
    g = torch.Generator().manual_seed(23)
    base = {"cpu_gemm_min_tokens": 1, "cpu_dot_gemm_min_tokens": 1, "cpu_amx_min_tokens": 8}
    with ctx:
        for (n, k), block in itertools.product(((300, 384), (96, 400), (64, 2048)), ((128, 128), (64, 96), (40, 64))):
            q = torch.arange(n * k).remainder(256).to(torch.uint8)[torch.randperm(n * k, generator=g)]
            scale = torch.rand(-(-n // block[0]), -(-k // block[1]), generator=g) * 0.01 + 1e-4
            flat = scale.view(-1)
            # refused by the table: 0, negative, too small; taken: the smallest and a large one; refused, too large
            # (its rows' sums overflow: only the infinities must agree there)
            for i, special in enumerate((0.0, -0.003, 2.0 ** -125, 2.0 ** -119, 2.0 ** 100)):
                if i < flat.numel() - 1:
                    flat[1 + i] = special
            if scale.shape[0] > 1:  # the last row block's outputs only
                flat[-1] = 2.0 ** 121
            w = formats.Fp8BlockWeight(q.view(n, k).view(torch.float8_e4m3fn), scale, block)
            cast = cpu.prepare(formats.DenseWeight(fp8_bf16_cast(w)), layout="rows")
            x = torch.randn(40, k, generator=g).bfloat16()
            want = cpu.linear(x, cast, knobs={**base, "cpu_bf16_gemm": "amx"})
            finite = torch.isfinite(want)
            assert finite.float().mean() > 0.2
            for direct, form in ((0, ""), (128, "+fp8rows")):  # packed B tiles; rows as A tiles
                with cpu.recording() as rec:
                    got = cpu.linear(x, w, knobs={**base, "cpu_fp8_gemm": "amx", "cpu_amx_fp8_direct_max_tokens": direct})
                assert rec[-1]["isa"] == tag + form
                assert torch.equal(got[finite], want[finite]), ((n, k), block, direct)
                assert torch.equal(torch.isfinite(got), finite)
            models = (["amx"] if not native else []) + ([] if "avx512_bf16" in cpu.detected_features() else ["avx512_bf16"])
            with cpu.emulate(models):
                knobs = {**base, "cpu_amx_min_tokens": 4096}
                dotted = cpu.linear(x, w, knobs={**knobs, "cpu_fp8_gemm": "avx512bf16"})
                dotted_cast = cpu.linear(x, cast, knobs={**knobs, "cpu_bf16_gemm": "avx512bf16"})
            assert torch.equal(dotted[finite], dotted_cast[finite]), ((n, k), block)


def test_status_names_the_reason_and_the_hardware_path_refuses_without_it():
    assert isinstance(HW, str)
    if HW:
        assert "AMX" in HW
        with pytest.raises(RuntimeError, match="AMX"):
            run(torch.ones(1, 32), torch.ones(1, 32, dtype=torch.bfloat16), emulate=False)


@pytest.mark.parametrize("native", [False, True], ids=["model", "native"])
@pytest.mark.parametrize("fmt", ["bf16", "int8"])
def test_r16_weights_on_amx_equal_the_row_major_ones_bitwise(fmt, native):
    """r16 weights (each 16-row block's K tile is one B tile: gemm_r16 reads them in place, no packing) give
    the sums the packed row-major path gives, in the same tile order: bitwise equal outputs through linear
    (N in one and several 32-column blocks and an odd last 16-row block, K tails, M tails, K passes) and
    fused MoE (both stacks r16, and each mixed with a row-major one), within the reference's bound; the call
    record names AMX and the layout. Without AMX, r16 stays on the r16 sweep."""
    ctx, tag = amx_here(native)
    g = torch.Generator().manual_seed(21)
    mk = (lambda t: formats.DenseWeight(t.to(torch.bfloat16))) if fmt == "bf16" else formats.quantize_int8_channel
    base = {"cpu_bf16_gemm": "amx", "cpu_int8_gemm": "amx", "cpu_amx_min_tokens": 1, "cpu_gemm_min_tokens": 1,
            "cpu_dot_gemm_min_tokens": 1, "cpu_amx_direct_max_tokens": 0}
    ks = (40, 1000, 64) if fmt == "bf16" else (132, 64, 1000)  # bf16 K = 40 / 1000, int8 K = 132: a K tail
    with ctx:
        for (n, k), m in itertools.product(zip((16, 48, 80, 304), ks + (256,)), (1, 15, 17, 33, 100)):
            w = mk(torch.randn(n, k, generator=g) * 0.05)
            rows, r16 = cpu.prepare(w, layout="rows"), cpu.prepare(w, layout="r16")
            assert r16.args[0] != rows.args[0]  # r16 taken
            x = torch.randn(m, k, generator=g)
            for xd, (k_block, n_group, m_block) in itertools.product(
                    (torch.float32, torch.bfloat16), ((0, 1, 0), (64, 1, 0), (128, 1, 0), (64, 3, 64), (128, 2, 32))):
                if fmt == "int8" and xd == torch.bfloat16 and k_block == 128:
                    continue  # bf16 activations on INT8: covered at 0 and 64
                kn = {**base, "cpu_amx_k_block": k_block, "cpu_amx_n_group": n_group, "cpu_amx_m_block": m_block}
                want = cpu.linear(x.to(xd), rows, knobs=kn)
                with cpu.recording() as rec:
                    got = cpu.linear(x.to(xd), r16, knobs=kn)
                assert {tag, "r16"} <= set(rec[-1]["isa"].split("+")), rec[-1]["isa"]
                assert torch.equal(got, want), (n, k, m, xd, k_block, n_group, m_block)
            ref = reference.linear(x, w)
            tol = 2e-5 if fmt == "int8" else 1e-2
            assert ((cpu.linear(x, r16, knobs=base).float() - ref).norm() / ref.norm()).item() <= tol
        # fused MoE: 40 tokens on 2 of 3 experts (each ≥ 32 rows: the GEMM path from cpu_amx_min_tokens = 32)
        w13 = mk(torch.randn(3, 224, 288, generator=g) * 0.05)
        w2 = mk(torch.randn(3, 288, 112, generator=g) * 0.05)
        ids = torch.tensor([[0, 2]] * 40)
        ids[::7, 1] = 1  # expert 1 with 6 tokens: the sweep beside the GEMM
        tw = torch.rand(40, 2, generator=g) + 0.1
        x = torch.randn(40, 288, generator=g)
        x = x.bfloat16() if fmt == "bf16" else x
        kn = {**base, "cpu_amx_min_tokens": 32}
        rows13, rows2 = cpu.prepare(w13, layout="rows"), cpu.prepare(w2, layout="rows")
        r13, r2 = cpu.prepare(w13, layout="r16"), cpu.prepare(w2, layout="r16")
        assert r13.args[0] != rows13.args[0] and r2.args[0] != rows2.args[0]  # both stacks r16
        small = {"cpu_amx_min_tokens": 4096, "cpu_gemm_min_tokens": 4096, "cpu_dot_gemm_min_tokens": 4096}
        # the small expert's sweep differs between the layouts (summation order): compare it alone first
        sweep_rows = cpu.fused_moe(x, rows13, rows2, tw, ids, knobs={**kn, **small})
        sweep_r16 = cpu.fused_moe(x, r13, r2, tw, ids, knobs={**kn, **small})
        ref = reference.fused_moe(x.float(), w13, w2, tw, ids)
        want = cpu.fused_moe(x, rows13, rows2, tw, ids, knobs=kn)
        for a, b in ((r13, r2), (r13, rows2), (rows13, r2)):
            with cpu.recording() as rec:
                got = cpu.fused_moe(x, a, b, tw, ids, knobs=kn)
            assert {tag, "r16"} <= set(rec[-1]["isa"].split("+")), rec[-1]["isa"]
            assert ((got.float() - ref).norm() / ref.norm()).item() <= (2e-2 if fmt == "bf16" else 2e-5)
            # the GEMM experts bitwise as the row-major run's: every difference is the small expert's
            diff = (got.float() - want.float()).abs().amax(1) > 0
            assert not diff[ids[:, 1] != 1].any(), (a is r13, b is r2)
        assert ((sweep_r16.float() - sweep_rows.float()).norm() / sweep_rows.float().norm()).item() <= 2e-2
    # AMX masked off (its model not on): the r16 weight keeps the r16 sweep at any row count
    with cpu.feature_mask(cpu.features() - {"amx"}):
        w = mk(torch.randn(48, 256, generator=g) * 0.05)
        with cpu.recording() as rec:
            cpu.linear(torch.randn(64, 256, generator=g), cpu.prepare(w, layout="r16"), knobs=base)
        assert "amx" not in rec[-1]["isa"] and "r16" in rec[-1]["isa"].split("+"), rec[-1]["isa"]
