"""The CUDA (Triton) kernels, run by the Triton interpreter on the CPU, against the torch references.

Inputs are fp16/fp32: the interpreter's bf16 tl.dot is wrong in triton 3.9 (bf16 and the FP8
dots are checked on a GPU by suites/gpu_check.py). The interpreter's float→fp8 cast is wrong too
(it drops the mantissa carry), so when interpreted the quantizer first rounds in float32 to the
e4m3 grid (fp8_gemm._round_to_e4m3); the GPU casts in hardware. FP8 dots (e4m3 × e4m3) are exact
in the interpreter, so the FP8 GEMMs run their real code path here.

Tolerances are relative Frobenius errors ‖out − ref‖ / ‖ref‖: 1e-5 in float32, 3e-3 in float16
(outputs and per-pair intermediates rounded to fp16), against the w8a8 references of kernels.fp8_act
for FP8 weights; the worst element is reported on failure.
"""
from __future__ import annotations

import importlib
import os
import random
import sys

import pytest
import torch

import kernels
from engine.knobs import CATALOGUE
from kernels import reference
from kernels.formats import DenseWeight, Fp8BlockWeight, quantize_fp8_block, quantize_int8_channel
from kernels.fp8_act import fused_moe_fp8_w8a8, linear_fp8_w8a8, quantize_activation_fp8
from kernels.cuda.moe_layout import contiguous_layout, masked_layout
from kernels.cuda.tiles import CudaTiles, Fp8GemmTiles, GemmTiles, MlaTiles, QuantTiles

_KERNEL_MODULES = ("kernels.cuda.fp8_gemm", "kernels.cuda.fused_moe", "kernels.cuda.mla_decode",
                   "kernels.cuda.backend")


def _check_triton_not_compiled_mode() -> None:
    """Triton's own @jit library (tl.max, tl.cdiv, ...) is compiled or interpreted from its first
    import: imported without TRITON_INTERPRET in this process, the interpreter cannot call it."""
    standard = sys.modules.get("triton.language.standard")
    if standard is not None and type(standard.cdiv).__name__ != "InterpretedFunction":
        raise RuntimeError("triton was imported without TRITON_INTERPRET=1 before this module; run "
                           "GPU-compiling code in a subprocess (see test_kernels_cuda_compile.py)")


def _import_interpreted() -> dict:
    """Import the kernel modules with TRITON_INTERPRET=1 (read when @triton.jit runs), then put the
    variable back; the `interpret` fixture sets it again while this module's tests run (Triton reads
    it lazily during launches too), so no other test module sees it."""
    prev = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton  # noqa: F401 - first import, interpreted

        _check_triton_not_compiled_mode()
        for name in _KERNEL_MODULES:
            sys.modules.pop(name, None)
        return {name.rsplit(".", 1)[1]: importlib.import_module(name) for name in _KERNEL_MODULES}
    finally:
        if prev is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = prev


_ENV_BEFORE = os.environ.get("TRITON_INTERPRET")
_mods = _import_interpreted()
fp8_gemm, fused_moe_mod, mla_mod, backend = (_mods[n] for n in ("fp8_gemm", "fused_moe", "mla_decode", "backend"))


def cuda_knobs() -> dict:
    """The catalogue's defaults of the cuda_* knobs (without resolving other components' "auto"
    knobs, which these tests do not need)."""
    return {n: k.default for n, k in CATALOGUE.items() if k.component == "kernels/cuda"}


TILES = CudaTiles.from_knobs(cuda_knobs())
assert os.environ.get("TRITON_INTERPRET") == _ENV_BEFORE


@pytest.fixture(autouse=True, scope="module")
def interpret():
    prev = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    yield
    if prev is None:
        del os.environ["TRITON_INTERPRET"]
    else:
        os.environ["TRITON_INTERPRET"] = prev


def test_kernels_are_interpreted():
    assert fp8_gemm.INTERPRETED


def assert_close(out: torch.Tensor, ref: torch.Tensor, rel: float, what: str) -> None:
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} ≠ {tuple(ref.shape)}"
    o, r = out.double(), ref.double()
    assert torch.isfinite(o).all(), f"{what}: non-finite output"
    err = ((o - r).norm() / r.norm().clamp_min(1e-30)).item()
    if err > rel:
        i = int((o - r).abs().flatten().argmax())
        pytest.fail(f"{what}: relative error {err:.3g} > {rel:g}; worst element {i}: "
                    f"{o.flatten()[i].item():.6g} vs {r.flatten()[i].item():.6g}")


REL = {torch.float32: 1e-5, torch.float16: 3e-3}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------- FP8 activation quantizer


def _tie_row(k: int) -> torch.Tensor:
    """A row whose first group has scale 1 (amax 448) and values on rounding ties and carries."""
    row = torch.zeros(k)
    vals = [448.0, 17.0, 19.0, 2.0 ** -10, 3 * 2.0 ** -10, 447.0, -31.6, 0.3, -0.0]
    row[: len(vals)] = torch.tensor(vals)
    return row


@pytest.mark.parametrize("m,k,block_m", [(1, 128, 1), (37, 300, 8), (5, 64, 4), (16, 256, 16)])
def test_quantizer_matches_torch_bit_for_bit(m, k, block_m):
    x = torch.randn(m, k, generator=_gen(m * k)) * 30
    x[0] = _tie_row(k)
    if m > 3:
        x[1, :128] = 0  # an all-zero group: scale 1
        x[2] *= 1e-4  # values that land on fp8 subnormals
    q, s = fp8_gemm.quantize_act_fp8(x, QuantTiles(block_m, 4))
    rq, rs = quantize_activation_fp8(x)
    assert torch.equal(s, rs)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8))


def test_quantizer_takes_fp16_and_empty():
    x = (torch.randn(6, 200, generator=_gen(1)) * 5).half()
    q, s = fp8_gemm.quantize_act_fp8(x, TILES.fp8_quant)
    rq, rs = quantize_activation_fp8(x)
    assert torch.equal(s, rs) and torch.equal(q.view(torch.uint8), rq.view(torch.uint8))
    q, s = fp8_gemm.quantize_act_fp8(torch.empty(0, 256), TILES.fp8_quant)
    assert q.shape == (0, 256) and s.shape == (0, 2)


# ---------------------------------------------------------------- FP8 block GEMM

GEMM_TILES = [Fp8GemmTiles(32, 64, 128, 4, 4, 3), Fp8GemmTiles(16, 32, 64, 1, 2, 2),
              Fp8GemmTiles(64, 128, 32, 8, 8, 3)]


@pytest.mark.parametrize("m,n,k", [(1, 128, 128), (37, 200, 300), (64, 256, 256), (3, 130, 129)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fp8_gemm_matches_w8a8_reference(m, n, k, dtype):
    g = _gen(m + n + k)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = quantize_fp8_block(torch.randn(n, k, generator=g) / k ** 0.5)
    y = fp8_gemm.fp8_block_linear(x, w, GEMM_TILES[(m + n) % 3], TILES.fp8_quant)
    assert y.dtype == dtype
    assert_close(y, linear_fp8_w8a8(x, w), REL[dtype], f"fp8 gemm {m}x{n}x{k}")
    assert_close(y, reference.linear(x, w), 0.06, "fp8 gemm vs weight-only reference")  # activation rounding


def test_fp8_gemm_every_tile_sample_same_answer():
    g = _gen(7)
    x = torch.randn(40, 256, generator=g)
    w = quantize_fp8_block(torch.randn(96, 256, generator=g))
    ref = linear_fp8_w8a8(x, w)
    for tiles in _tile_sample(Fp8GemmTiles, "cuda_fp8_gemm_", 4, seed=3):
        assert_close(fp8_gemm.fp8_block_linear(x, w, tiles, TILES.fp8_quant), ref, 1e-5, str(tiles))


@pytest.mark.parametrize("block_n", [256, 32])  # a tile over two weight-scale rows; one row per tile
def test_fp8_gemm_scale_rows_per_tile(block_n):
    g = _gen(block_n)
    x = torch.randn(19, 384, generator=g)
    w = quantize_fp8_block(torch.randn(300, 384, generator=g))
    y = fp8_gemm.fp8_block_linear(x, w, Fp8GemmTiles(16, block_n, 128, 1, 4, 2), TILES.fp8_quant)
    assert_close(y, linear_fp8_w8a8(x, w), 1e-5, f"fp8 gemm block_n={block_n}")


def test_fp8_gemm_rejects_block_k_not_dividing_scale_block():
    w = quantize_fp8_block(torch.randn(64, 128), block=(64, 64))
    with pytest.raises(ValueError, match="block_k"):
        fp8_gemm.fp8_block_linear(torch.randn(2, 128), w, Fp8GemmTiles(16, 32, 128, 1, 4, 2), TILES.fp8_quant)


def test_fp8_gemm_other_weight_block():
    g = _gen(11)
    x = torch.randn(9, 192, generator=g)
    w = quantize_fp8_block(torch.randn(80, 192, generator=g), block=(64, 64))
    y = fp8_gemm.fp8_block_linear(x, w, Fp8GemmTiles(16, 32, 64, 1, 4, 2), TILES.fp8_quant)
    assert_close(y, linear_fp8_w8a8(x, w), 1e-5, "fp8 gemm, 64x64 blocks")


# ---------------------------------------------------------------- MoE layouts (plain torch)


def _routing(t: int, k: int, e: int, seed: int, unused: tuple = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """topk ids [T, K] (distinct per token, never in `unused`) and weights [T, K] float32."""
    g = _gen(seed)
    allowed = torch.tensor([i for i in range(e) if i not in unused])
    ids = torch.stack([allowed[torch.randperm(len(allowed), generator=g)[:k]] for _ in range(t)])
    return torch.rand(t, k, generator=g), ids


def _pairs_by_expert(ids: torch.Tensor) -> dict[int, list[int]]:
    flat = ids.flatten().tolist()
    out: dict[int, list[int]] = {}
    for p, e in enumerate(flat):
        out.setdefault(e, []).append(p)
    return out


@pytest.mark.parametrize("t,k,e,block_m", [(1, 1, 4, 16), (7, 2, 6, 4), (33, 4, 16, 8), (5, 3, 3, 16)])
def test_contiguous_layout_lists_each_pair_once_grouped_by_expert(t, k, e, block_m):
    _, ids = _routing(t, k, e, seed=t, unused=(0,) if e > k + 1 else ())
    lay = contiguous_layout(ids, e, block_m)
    total, p = int(lay.total_rows), t * k
    want = _pairs_by_expert(ids)
    assert total == sum(-(-len(v) // block_m) * block_m for v in want.values())
    rows = lay.rows.view(-1, block_m)
    seen = {}
    for b in range(total // block_m):
        e_b = int(lay.block_expert[b])
        seen.setdefault(e_b, []).extend(r for r in rows[b].tolist() if r != p)
    assert seen == want
    assert (lay.rows[total:] == p).all() and (lay.block_expert[total // block_m:] == e).all()


@pytest.mark.parametrize("t,k,e", [(1, 1, 4), (1, 8, 32), (7, 2, 6), (12, 4, 5)])
def test_masked_layout_fixed_shapes_and_each_pair_once(t, k, e):
    _, ids = _routing(t, k, e, seed=100 + t, unused=(1,) if e > k + 1 else ())
    lay = masked_layout(ids, e)
    assert lay.rows.shape == (min(e, t * k), t) and lay.capacity == t
    want = _pairs_by_expert(ids)
    got = {int(lay.slot_expert[s]): lay.rows[s, : int(lay.slot_count[s])].tolist()
           for s in range(lay.num_slots) if lay.slot_count[s] > 0}
    assert got == want
    assert int(lay.slot_count.sum()) == t * k


# ---------------------------------------------------------------- fused MoE


def _moe_weights(e: int, d: int, i: int, seed: int, dtype: torch.dtype, fp8: bool):
    g = _gen(seed)
    w13 = torch.randn(e, 2 * i, d, generator=g) / d ** 0.5
    w2 = torch.randn(e, d, i, generator=g) / i ** 0.5
    if fp8:
        return quantize_fp8_block(w13), quantize_fp8_block(w2)
    return DenseWeight(w13.to(dtype)), DenseWeight(w2.to(dtype))


PREFILL = GemmTiles(16, 64, 64, 4, 2)
DECODE = GemmTiles(16, 64, 128, 4, 2)


def _run_moe(x, w13, w2, tw, ti, masked: bool, prefill=PREFILL, decode=DECODE):
    return fused_moe_mod.fused_moe(x, w13, w2, tw, ti, prefill=prefill, decode=decode,
                                   masked_max_tokens=10 ** 6 if masked else 0, quant=TILES.fp8_quant)


MOE_CASES = [  # T, D, I, E, K, experts never routed to
    (1, 64, 32, 8, 2, ()),  # decode, one token
    (7, 96, 40, 6, 2, (5,)),  # odd sizes, an expert with no tokens
    (20, 128, 64, 4, 4, ()),  # every expert, K = E
    (3, 72, 24, 16, 1, (0, 1, 2, 3)),  # K = 1, most experts empty
]


@pytest.mark.parametrize("case", MOE_CASES)
@pytest.mark.parametrize("masked", [False, True], ids=["contiguous", "masked"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_moe_dense_matches_reference(case, masked, dtype):
    t, d, i, e, k, unused = case
    tw, ti = _routing(t, k, e, seed=t * d, unused=unused)
    x = torch.randn(t, d, generator=_gen(d)).to(dtype)
    w13, w2 = _moe_weights(e, d, i, seed=e, dtype=dtype, fp8=False)
    out = _run_moe(x, w13, w2, tw, ti, masked)
    assert out.dtype == dtype
    assert_close(out, reference.fused_moe(x, w13, w2, tw, ti), REL[dtype], f"moe {case}")


@pytest.mark.parametrize("case", [MOE_CASES[0], MOE_CASES[1], (5, 256, 136, 4, 2, (3,)), (4, 128, 128, 3, 2, ())])
@pytest.mark.parametrize("masked", [False, True], ids=["contiguous", "masked"])
def test_fused_moe_fp8_matches_w8a8_reference(case, masked):
    t, d, i, e, k, unused = case
    tw, ti = _routing(t, k, e, seed=t + d, unused=unused)
    x = torch.randn(t, d, generator=_gen(d + 1)).half()
    w13, w2 = _moe_weights(e, d, i, seed=e + 1, dtype=torch.float32, fp8=True)
    out = _run_moe(x, w13, w2, tw, ti, masked)
    assert_close(out, fused_moe_fp8_w8a8(x, w13, w2, tw, ti), REL[torch.float16], f"fp8 moe {case}")
    assert_close(out, reference.fused_moe(x, w13, w2, tw, ti), 0.08, "fp8 moe vs weight-only reference")


def _tile_sample(cls, prefix: str, n: int, seed: int, fixed: dict | None = None) -> list:
    """n tile configurations drawn from the catalogue's ranges (powers of two where pow2)."""
    rnd = random.Random(seed)
    out = []
    for _ in range(n):
        values = {}
        for name in cls.knob_names(prefix):
            knob = CATALOGUE[name]
            lo, hi = knob.low, knob.high
            choices = [v for v in range(lo, hi + 1) if not knob.pow2 or (v & (v - 1)) == 0]
            values[name] = rnd.choice(choices)
        values.update(fixed or {})
        out.append(cls.from_knobs(values, prefix))
    return out


def test_fused_moe_every_tile_sample_same_answer():
    """Tiles drawn from the catalogue's ranges (both layouts, FP8 weights: block_k ≤ 128 always
    divides the scale block) give the reference's answer."""
    t, d, i, e, k = 6, 128, 48, 5, 2
    tw, ti = _routing(t, k, e, seed=5, unused=(2,))
    x = torch.randn(t, d, generator=_gen(3))
    w13, w2 = _moe_weights(e, d, i, seed=9, dtype=torch.float32, fp8=True)
    ref = fused_moe_fp8_w8a8(x, w13, w2, tw, ti)
    for n, tiles in enumerate(_tile_sample(GemmTiles, "cuda_moe_", 4, seed=1)):
        out = _run_moe(x, w13, w2, tw, ti, masked=bool(n % 2), prefill=tiles, decode=tiles)
        assert_close(out, ref, 1e-5, str(tiles))


def test_fused_moe_no_tokens_and_bad_shapes():
    w13, w2 = _moe_weights(4, 64, 32, seed=0, dtype=torch.float32, fp8=False)
    out = _run_moe(torch.empty(0, 64), w13, w2, torch.empty(0, 2), torch.empty(0, 2, dtype=torch.long), True)
    assert out.shape == (0, 64)
    with pytest.raises(ValueError, match="w13"):
        _run_moe(torch.randn(2, 32), w13, w2, torch.rand(2, 2), torch.zeros(2, 2, dtype=torch.long), True)


# ---------------------------------------------------------------- MLA decode


def _paged_case(lens: list[int], nb: int, bs: int, r: int, p: int, h: int, dtype, seed: int):
    """A cache of nb blocks, tables of shuffled (out-of-order) blocks, holes (-1) past each length."""
    g = _gen(seed)
    cache = torch.randn(nb, bs, r + p, generator=g).to(dtype)
    width = max(1, max(-(-n // bs) for n in lens) + 2)
    tables = torch.full((len(lens), width), -1, dtype=torch.int32)
    perm = torch.randperm(nb, generator=g)
    used = 0
    for b, n in enumerate(lens):
        need = -(-n // bs)
        tables[b, :need] = perm[used:used + need].int()
        used += need
    assert used <= nb
    q_lat = torch.randn(len(lens), h, r, generator=g).to(dtype)
    q_pe = torch.randn(len(lens), h, p, generator=g).to(dtype)
    return q_lat, q_pe, cache, tables, torch.tensor(lens, dtype=torch.int32)


def _mla_ref(q_lat, q_pe, cache, tables, lens, scale):
    return reference.mla_decode(q_lat, q_pe, cache, tables.clamp(min=0), lens, scale)


MLA_CASES = [  # seq lens, blocks, block size, R, P, H
    ([1], 4, 4, 32, 16, 16),  # one token
    ([0, 9, 37], 40, 4, 40, 8, 5),  # empty sequence, odd R, heads < head block
    ([17, 64], 24, 8, 64, 16, 20),  # two head blocks, the last partial
    ([5, 1, 30], 40, 1, 32, 16, 4),  # block size 1: every token its own block
]


@pytest.mark.parametrize("case", MLA_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_mla_decode_matches_reference(case, dtype):
    lens, nb, bs, r, p, h = case
    args = _paged_case(lens, nb, bs, r, p, h, dtype, seed=sum(lens) + nb)
    tiles = MlaTiles(16, 16, 3, 4, 2, 2)  # 3 splits: some empty for short sequences
    out = mla_mod.mla_decode(*args, 0.125, tiles=tiles)
    assert out.dtype == dtype
    assert_close(out, _mla_ref(*args, 0.125), REL[dtype] * 3, f"mla {case}")
    if 0 in lens:
        assert (out[lens.index(0)] == 0).all()


def test_mla_decode_every_tile_sample_same_answer():
    args = _paged_case([23, 6], 16, 4, 32, 16, 8, torch.float32, seed=2)
    ref = _mla_ref(*args, 0.3)
    splits = [0, 8, 1, 3]  # auto; more splits than the short sequence's tokens; none; a few
    for tiles, n in zip(_tile_sample(MlaTiles, "cuda_mla_", 4, seed=4), splits):
        tiles = MlaTiles(**{**tiles.__dict__, "kv_splits": n})
        assert_close(mla_mod.mla_decode(*args, 0.3, tiles=tiles), ref, 1e-5, str(tiles))


def test_mla_auto_splits():
    assert mla_mod.auto_splits(batch=1, heads=16, head_block=16, num_sms=132) == 64
    assert mla_mod.auto_splits(batch=64, heads=128, head_block=16, num_sms=132) == 1
    assert mla_mod.auto_splits(batch=8, heads=128, head_block=16, num_sms=132) == 5


# ---------------------------------------------------------------- the backend


def test_backend_registered_lazily_and_exposes_every_op():
    assert "cuda" in kernels.available_backends()
    for op in kernels.OPS:
        assert callable(getattr(backend, op)), op


def test_backend_needs_configure_and_every_cuda_knob_is_read():
    backend._tiles = None
    with pytest.raises(RuntimeError, match="configure"):
        backend.tiles()
    tiles = backend.configure(cuda_knobs())
    assert set(cuda_knobs()) == set(CudaTiles.knob_names())
    assert tiles == TILES
    with pytest.raises(ValueError, match="power of two"):
        backend.configure({**cuda_knobs(), "cuda_moe_block_m": 48})


def test_backend_ops_against_reference():
    backend.configure(cuda_knobs())
    g = _gen(21)
    x = torch.randn(5, 256, generator=g)
    w = torch.randn(72, 256, generator=g)
    assert_close(backend.linear(x, DenseWeight(w)), reference.linear(x, DenseWeight(w)), 1e-5, "dense linear")
    q8 = quantize_int8_channel(w)
    assert_close(backend.linear(x, q8), reference.linear(x, q8), 1e-6, "int8 linear")
    f8 = quantize_fp8_block(w)
    assert_close(backend.linear(x, f8), linear_fp8_w8a8(x, f8), 1e-5, "fp8 linear")
    q, k, v = (torch.randn(*shape, generator=g) for shape in ((3, 4, 24), (7, 4, 24), (7, 4, 16)))
    assert_close(backend.extend_attention(q, k, v, 0.2), reference.extend_attention(q, k, v, 0.2), 1e-5, "extend")
    hw = torch.randn(4, 8, 24, generator=g)
    assert_close(backend.head_linear(q, hw), reference.head_linear(q, hw), 1e-5, "head_linear")


def test_backend_moe_falls_back_to_reference_for_int8_experts():
    backend.configure(cuda_knobs())
    g = _gen(5)
    tw, ti = _routing(3, 2, 4, seed=1)
    x = torch.randn(3, 64, generator=g)
    w13 = quantize_int8_channel(torch.randn(4, 64, 64, generator=g))
    w2 = quantize_int8_channel(torch.randn(4, 64, 32, generator=g))
    assert_close(backend.fused_moe(x, w13, w2, tw, ti), reference.fused_moe(x, w13, w2, tw, ti), 1e-6, "int8 moe")


# ---------------------------------------------------------------- the whole engine on the cuda backend


def test_engine_tiny_model_on_cuda_backend_matches_reference():
    """The tiny preset (MLA + MoE) with every op from the cuda backend (interpreted, float32, CPU
    tensors): prefill logits and greedy decoding (mla_decode, masked MoE) agree with the reference."""
    from engine.llm import LLM, SamplingParams

    llm = LLM("tiny", dtype="float32", progress=False, knobs={"kernel_backend": "reference"})
    ids = [3, 17, 42, 7, 99, 5, 250, 11]
    ref_logits = llm.logits(ids)
    ref_out = llm.generate(ids, SamplingParams(max_tokens=4, ignore_eos=True))[0].token_ids
    llm.model.ops = backend
    backend.configure(llm.knobs)
    assert_close(llm.logits(ids), ref_logits, 1e-4, "tiny prefill logits")
    assert llm.generate(ids, SamplingParams(max_tokens=4, ignore_eos=True))[0].token_ids == ref_out
