"""The AMX GEMM (kernels/cpu/csrc/amx.cpp) against exact math.

The kernel is instantiated twice: on the AMX tile instructions, which run only where the CPU reports
AMX and Linux grants the tile state (skipped elsewhere, with that reason), and on a C++ model of the
same tile registers and instructions, run everywhere, which checks the packing of weights into B
tiles, the 2 × 2 tile blocking and every zero-padded tail (M, N, K not multiples of the tiles).

Bounds, against float64 math on the same inputs: INT8 (TDPBSSD, exact int32 sums) equal; BF16
(TDPBF16PS, bf16 inputs, float32 accumulation) ‖Δ‖/‖ref‖ ≤ 2e-6 (measured ≤ 4.2e-7 at K = 2048).
Through linear / fused_moe, BF16 weights take AMX on bf16 activations only (1e-2, the bf16 bound of
tests/test_kernels_cpu.py); float32 activations keep the float32 path (2e-5).
"""
import pytest
import torch

from kernels import formats, reference
from kernels.cpu_build import missing_isa

if missing_isa():
    pytest.skip(f"this CPU lacks {missing_isa()}: the cpu backend cannot run here", allow_module_level=True)

import kernels.cpu as cpu  # noqa: E402

BF16_BOUND = 2e-6
SHAPES = {  # name → (M, N, K)
    "one": (1, 1, 1), "regular": (64, 256, 512), "odd": (33, 70, 1000), "tails": (5, 17, 40),
    "many_blocks": (100, 97, 130), "long_k": (17, 33, 2048), "k_tail_1": (3, 40, 65),
}
HW = cpu.amx_status()


def run(x, w, emulate):
    fmt = cpu.FORMAT_IDS["int8" if w.dtype == torch.int8 else "bf16"]
    return cpu._ext.amx_linear_raw(x.float().contiguous(), fmt, w.contiguous(), w.shape[0], w.shape[1], emulate)


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
    got = run(xb, wb, emulate)
    assert got.shape == (m, n) and got.dtype == torch.float32
    assert ((got.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item() <= BF16_BOUND
    refi = xi.double() @ wi.double().T  # |sums| < 2^24 at these K: exact in float32 too
    assert torch.equal(run(xi, wi, emulate).double(), refi)


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_emulated_tiles_match_exact_math(shape):
    check_gemm(True, *SHAPES[shape], seed=len(shape))


@pytest.mark.skipif(bool(HW), reason=f"AMX hardware path: {HW}")
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_amx_tiles_match_exact_math(shape):
    check_gemm(False, *SHAPES[shape], seed=len(shape))


@pytest.mark.skipif(bool(HW), reason=f"AMX hardware path: {HW}")
@pytest.mark.parametrize("fmt", ["bf16", "int8"])
def test_linear_and_moe_take_amx_above_the_threshold(fmt):
    """Seen in the call record: AMX from cpu_amx_min_tokens rows on, not below. BF16 weights take it
    on bf16 activations only (cpu_bf16_gemm=unpack, else oneDNN comes first); float32 activations
    keep their float32 path (never rounded to bf16 by the hardware's presence): the tight bound."""
    g = torch.Generator().manual_seed(4)
    wt = torch.randn(300, 1000, generator=g) * 0.05
    w = formats.DenseWeight(wt.to(torch.bfloat16)) if fmt == "bf16" else formats.quantize_int8_channel(wt)
    x32 = torch.randn(40, 1000, generator=g)
    x = x32.to(torch.bfloat16) if fmt == "bf16" else x32
    tol = 1e-2 if fmt == "bf16" else 2e-5
    base = {"cpu_bf16_gemm": "unpack", "cpu_int8_gemm": "unpack"}
    ref = reference.linear(x.float(), w)
    for amx_min in (1, 4096):
        with cpu.recording() as rec:
            got = cpu.linear(x, w, knobs={**base, "cpu_amx_min_tokens": amx_min, "cpu_gemm_min_tokens": 1, "cpu_dot_gemm_min_tokens": 1})
        assert ("amx" in rec[-1]["isa"].split("+")) == (amx_min == 1), rec[-1]["isa"]
        assert ((got.float() - ref).norm() / ref.norm()).item() <= tol
    # a dot-product tile GEMM asked for by name runs instead of AMX (every AMX CPU has VNNI and BF16)
    named = {"cpu_bf16_gemm": "avx512bf16"} if fmt == "bf16" else {"cpu_int8_gemm": "vnni"}
    with cpu.recording() as rec:
        got = cpu.linear(x, w, knobs={**named, "cpu_amx_min_tokens": 1, "cpu_gemm_min_tokens": 1, "cpu_dot_gemm_min_tokens": 1})
    assert "amx" not in rec[-1]["isa"].split("+"), rec[-1]["isa"]
    assert ((got.float() - ref).norm() / ref.norm()).item() <= tol
    if fmt == "bf16":
        with cpu.recording() as rec:
            got = cpu.linear(x32, w, knobs={**base, "cpu_amx_min_tokens": 1})
        assert "amx" not in rec[-1]["isa"].split("+"), rec[-1]["isa"]
        ref32 = reference.linear(x32, w)
        assert ((got - ref32).norm() / ref32.norm()).item() <= 2e-5
    # fused MoE: 40 tokens on 2 of 3 experts (each ≥ 32 rows: the GEMM path, on AMX with amx_min 32)
    w13 = torch.randn(3, 200, 1000, generator=g) * 0.05
    w2 = torch.randn(3, 1000, 100, generator=g) * 0.05
    mk = (lambda t: formats.DenseWeight(t.to(torch.bfloat16))) if fmt == "bf16" else formats.quantize_int8_channel
    w13, w2 = mk(w13), mk(w2)
    ids = torch.tensor([[0, 2]] * 40)
    tw = torch.rand(40, 2, generator=g) + 0.1
    ref = reference.fused_moe(x.float(), w13, w2, tw, ids)
    with cpu.recording() as rec:
        got = cpu.fused_moe(x, w13, w2, tw, ids, knobs={**base, "cpu_amx_min_tokens": 32})
    assert "amx" in rec[-1]["isa"].split("+"), rec[-1]["isa"]
    assert ((got.float() - ref).norm() / ref.norm()).item() <= (2e-2 if fmt == "bf16" else 2e-5)


def test_status_names_the_reason_and_the_hardware_path_refuses_without_it():
    assert isinstance(HW, str)
    if HW:
        assert "AMX" in HW
        with pytest.raises(RuntimeError, match="AMX"):
            run(torch.ones(1, 32), torch.ones(1, 32, dtype=torch.bfloat16), emulate=False)
