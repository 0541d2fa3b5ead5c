"""The "cpu" backend (kernels/cpu, AVX-512 C++) against kernels.reference.

One conformance class runs every op × weight format over regular, odd (D=1000, I=700, E=9, top-3,
T=1..37) and corner shapes (an expert with no tokens, every token on one expert, T=1), and every
cpu_* knob value (sampled from its catalogue range) must give the same answer.

Tolerances, ‖got − ref‖ / ‖ref‖ on the same quantized weights:
- float32 activations, any weight format: 2e-5 — the same math, only the summation order differs
  (INT8: the integer products are exact in both, activations quantized identically); except INT4
  under its integer methods, where the kernel quantizes the activations and the reference multiplies
  float ones: cpu_int4_method=int16 (groups of a multiple of 64): 1e-4 (int16 steps of the row's
  max / 32767, ≈ 3e-5 on random rows); cpu_int4_method=int8 (the default; groups of a multiple of
  128, as llama.cpp's Q4 × Q8): 1.5e-2 (int8 steps of each group's max / 127, measured 5.9e-3 to
  6.8e-3; fused MoE 3e-2, its down projection's input being quantized too, and SiLU·up's
  outliers widening the groups' steps: measured up to 1.7e-2); and that method equals the
  reference fed its quantized activations within 2e-5; the same 1.5e-2 / 3e-2 for every INT4 group
  size on the GEMM path (from cpu_dot_gemm_min_tokens rows) where cpu_int4_gemm takes the INT4 GEMM on
  VNNI or vpmaddubsw (auto where the CPU has AVX512-VNNI, and in the AVX2 build; tests/test_isa.py), which
  quantizes the activations the same way;
- bfloat16 activations: 1e-2 for linear (both round the output to bf16), 2e-2 for fused MoE (the
  reference also rounds the gate/up output to bf16 before SiLU, the kernel keeps float32); the
  INT4 int8 method's 1.5e-2 where larger;
- cpu_bf16_isa=avx512bf16 forced on float32 activations (BF16 / FP8 weights, where the CPU has
  AVX512-BF16): 1e-2, the bf16 bound (the activations are rounded to bf16; measured 1.5e-3 to 1.8e-3;
  tests/test_isa.py checks the rest of that path to 2e-5).
Plus: the engine's logits with this backend still match transformers (the bf16 bound of
test_oracle_transformers).
"""
import contextlib
from functools import lru_cache

import pytest
import torch

from kernels import formats, reference
from kernels.cpu_build import missing_isa

if missing_isa():
    pytest.skip(f"this CPU lacks {missing_isa()}: the cpu backend cannot run here", allow_module_level=True)

import kernels.cpu as cpu  # noqa: E402  (compiles the extension on first use)
from engine.knobs import CATALOGUE  # noqa: E402
from int4_streams import with_float_scales, with_zero_points, with_zero_stream  # noqa: E402

TIGHT, BF16_LINEAR, BF16_MOE, INT4_INT16, INT4_INT8, INT4_INT8_MOE = 2e-5, 1e-2, 2e-2, 1e-4, 1.5e-2, 3e-2


def int4_gemm_vnni(fmt: str, knobs: dict | None, tokens: int | None) -> bool:
    """Whether an INT4 call with `tokens` rows (an upper bound on any expert's) may take the INT4 GEMM
    on int8 activations per group here (from cpu_dot_gemm_min_tokens rows): cpu_int4_gemm maddubs, vnni
    where VNNI runs, auto where VNNI runs or in the AVX2 build (its vpmaddubsw form)."""
    k = {**cpu.KNOB_DEFAULTS, **(knobs or {})}
    vnni = cpu.isa_variants()["cpu_int4_gemm"]["vnni"] != "unavailable"
    takes = {"maddubs": True, "vnni": vnni, "auto": vnni or cpu._ext.BUILD == "avx2"}.get(k["cpu_int4_gemm"], False)
    return fmt.startswith("int4") and tokens is not None and tokens >= k["cpu_dot_gemm_min_tokens"] and takes


def tight(fmt: str, knobs: dict | None = None, op: str = "linear", tokens: int | None = None) -> float:
    """The float32-activation bound of a format for an op of `tokens` rows (see the module docstring)."""
    method = (knobs or {}).get("cpu_int4_method", cpu.KNOB_DEFAULTS["cpu_int4_method"])
    bf16_isa = (knobs or {}).get("cpu_bf16_isa", cpu.KNOB_DEFAULTS["cpu_bf16_isa"])
    if (bf16_isa == "avx512bf16" and fmt in ("bf16", "fp8")
            and cpu.isa_variants()["cpu_bf16_isa"]["avx512bf16"] != "unavailable"):
        return BF16_LINEAR
    if (method == "int8" and fmt == "int4_g128") or int4_gemm_vnni(fmt, knobs, tokens):
        return INT4_INT8_MOE if op == "fused_moe" else INT4_INT8
    if method in ("int16", "int8") and fmt in ("int4_g64_asym", "int4_g128"):
        return INT4_INT16
    return TIGHT


def bf16_bound(fmt: str, base: float, op: str = "linear", tokens: int | None = None) -> float:
    """The bf16-activation bound: the op's, or the int8-activation INT4 method's / GEMM's if larger."""
    return max(base, tight(fmt, op=op, tokens=tokens))


FORMATS = ("f32", "bf16", "int8", "fp8", "int4_g32", "int4_g64_asym", "int4_g128")


def make_weight(w: torch.Tensor, fmt: str):
    if fmt == "f32":
        return formats.DenseWeight(w)
    if fmt == "bf16":
        return formats.DenseWeight(w.to(torch.bfloat16))
    if fmt == "int8":
        return formats.quantize_int8_channel(w)
    if fmt == "fp8":
        return formats.quantize_fp8_block(w)
    group = int(fmt.split("_g")[1].split("_")[0])
    return formats.quantize_int4_group(w, group, symmetric=not fmt.endswith("asym"))


def rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()


def check(got, ref, tol, what):
    assert got.shape == ref.shape and got.dtype == ref.dtype, (what, got.shape, ref.shape, got.dtype, ref.dtype)
    diff = (got.float() - ref.float()).abs()
    worst = divmod(int(diff.argmax()), ref.shape[-1]) if ref.dim() == 2 else int(diff.argmax())
    assert rel(got, ref) <= tol, f"{what}: rel {rel(got, ref):.2e} > {tol}; worst element {worst} Δ {diff.max():.3e}"


def routing(t: int, e: int, k: int, seed: int, experts: list[int] | None = None):
    """Random distinct top-k ids per token (from `experts` if given) and positive weights."""
    g = torch.Generator().manual_seed(seed)
    pool = torch.tensor(experts if experts is not None else list(range(e)))
    ids = torch.stack([pool[torch.randperm(len(pool), generator=g)[:k]] for _ in range(t)])
    return torch.rand(t, k, generator=g) + 0.1, ids


def moe_weights(e: int, d: int, i: int, fmt: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(e, 2 * i, d, generator=g) * 0.05
    w2 = torch.randn(e, d, i, generator=g) * 0.05
    return make_weight(w13, fmt), make_weight(w2, fmt)


# ------------------------------------------------------------------ the conformance class

LINEAR_SHAPES = {  # name → (T, N, K)
    "regular_t1": (1, 256, 512), "regular_t16": (16, 256, 512), "regular_t64": (64, 128, 512),
    "odd_t1": (1, 700, 1000), "odd_t3": (3, 70, 1000), "odd_t37": (37, 130, 1000), "tiny": (2, 5, 40),
}
MOE_CASES = {  # name → (T, E, D, I, top-k, experts the router may pick)
    "regular": (8, 8, 256, 128, 2, None),
    "odd_t1": (1, 9, 1000, 700, 3, None),
    "odd_t5": (5, 9, 1000, 700, 3, None),
    "odd_t37": (37, 9, 1000, 700, 3, None),
    "empty_expert": (6, 9, 256, 96, 3, [0, 1, 2, 3, 5, 6, 7, 8]),
    "all_on_one": (37, 9, 256, 96, 1, [4]),
}


class BackendConformance:
    """Every op of a backend against kernels.reference; subclasses set `backend`."""

    backend = None

    @pytest.mark.parametrize("fmt", FORMATS)
    @pytest.mark.parametrize("shape", sorted(LINEAR_SHAPES))
    def test_linear(self, fmt, shape):
        t, n, k = LINEAR_SHAPES[shape]
        g = torch.Generator().manual_seed(t * n + k)
        w = make_weight(torch.randn(n, k, generator=g) * 0.05, fmt)
        x = torch.randn(t, k, generator=g)
        check(self.backend.linear(x, w), reference.linear(x, w), tight(fmt, tokens=t), f"linear {fmt} {shape}")
        xb = x.to(torch.bfloat16)
        check(self.backend.linear(xb, w), reference.linear(xb, w), bf16_bound(fmt, BF16_LINEAR, tokens=t),
              f"linear bf16-act {fmt} {shape}")

    @pytest.mark.parametrize("fmt", FORMATS)
    @pytest.mark.parametrize("case", sorted(MOE_CASES))
    def test_fused_moe(self, fmt, case):
        t, e, d, i, k, pool = MOE_CASES[case]
        w13, w2 = moe_weights(e, d, i, fmt)
        tw, ids = routing(t, e, k, seed=t, experts=pool)
        x = torch.randn(t, d, generator=torch.Generator().manual_seed(7))
        check(self.backend.fused_moe(x, w13, w2, tw, ids), reference.fused_moe(x, w13, w2, tw, ids), tight(fmt, op="fused_moe", tokens=t),
              f"fused_moe {fmt} {case}")
        xb = x.to(torch.bfloat16)
        check(self.backend.fused_moe(xb, w13, w2, tw, ids), reference.fused_moe(xb, w13, w2, tw, ids), bf16_bound(fmt, BF16_MOE, "fused_moe", t),
              f"fused_moe bf16-act {fmt} {case}")

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    @pytest.mark.parametrize("t,d", [(1, 2048), (7, 1000), (3, 5), (64, 2048), (2, 7168)])
    def test_norms(self, dtype, t, d):
        g = torch.Generator().manual_seed(d)
        x, res = torch.randn(t, d, generator=g).to(dtype), torch.randn(t, d, generator=g).to(dtype)
        w = (torch.rand(d, generator=g) + 0.5).to(dtype)
        tol = 1e-6 if dtype == torch.float32 else 8e-3  # bf16: one rounding step apart at most
        check(self.backend.rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6), tol, "rms_norm")
        got, ref = self.backend.add_rms_norm(x, res, w, 1e-6), reference.add_rms_norm(x, res, w, 1e-6)
        check(got[0], ref[0], tol, "add_rms_norm normed")
        assert torch.equal(got[1], ref[1]), "add_rms_norm residual sum"
        # contiguous bf16 rows take the vector bf16 path, a strided view the float32-row one: bitwise equal
        xs, rs = torch.cat([x, x], 1)[:, :d], torch.cat([res, res], 1)[:, :d]
        assert torch.equal(self.backend.rms_norm(x, w, 1e-6), self.backend.rms_norm(xs, w, 1e-6)), "strided rms_norm"
        gs = self.backend.add_rms_norm(xs, rs, w, 1e-6)
        assert torch.equal(got[0], gs[0]) and torch.equal(got[1], gs[1]), "strided add_rms_norm"

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    @pytest.mark.parametrize("interleave", [True, False])
    @pytest.mark.parametrize("t,h,p", [(1, 16, 64), (37, 3, 6), (5, 1, 64)])
    def test_rope(self, dtype, interleave, t, h, p):
        g = torch.Generator().manual_seed(t * h)
        x = torch.randn(t, h, p + 5, generator=g).to(dtype)[..., 5:]  # a strided view, as the engine's split
        ang = torch.rand(t, p // 2, generator=g) * 100
        got, ref = self.backend.rope(x, ang.cos(), ang.sin(), interleave), reference.rope(x, ang.cos(), ang.sin(), interleave)
        check(got, ref, 1e-6 if dtype == torch.float32 else 4e-3, "rope")

    def test_other_ops_match_reference(self):
        g = torch.Generator().manual_seed(0)
        logits = torch.randn(5, 16, generator=g)
        bias = torch.randn(16, generator=g) * 0.1
        a = self.backend.grouped_topk(logits, bias, 3, 4, 2, "sigmoid", True, 2.5)
        b = reference.grouped_topk(logits, bias, 3, 4, 2, "sigmoid", True, 2.5)
        assert torch.equal(a[1], b[1]) and torch.allclose(a[0], b[0])
        gu = torch.randn(3, 10, generator=g)
        assert torch.allclose(self.backend.silu_and_mul(gu), reference.silu_and_mul(gu))


class TestCpuBackend(BackendConformance):
    backend = cpu


# ------------------------------------------------------------------ knobs: every value, same answer


def knob_samples(name: str) -> list:
    """Every choice, or low / default / high (and a middle power of two) of an integer range."""
    k = CATALOGUE[name]
    if k.choices is not None:
        return list(k.choices)
    mid = 1 << ((k.low.bit_length() + k.high.bit_length()) // 2)
    return sorted({k.low, k.default, k.high, min(max(mid, k.low), k.high)})


# The weight ops' per-call knobs (the attention knobs are swept by tests/test_attention_cpu.py; the
# load-time ones, read by prepare(), by their own tests below).
KNOB_CASES = [(name, v) for name in cpu.KNOB_DEFAULTS if name not in cpu.ATTN_KNOBS + cpu.LOAD_KNOBS
              for v in knob_samples(name)]


@lru_cache(maxsize=None)
def knob_case(fmt: str):
    """Weights, inputs and reference answers of the knob sweep, made once per format."""
    w13, w2 = moe_weights(9, 1000, 700, fmt, seed=3)
    w13, w2 = cpu.prepare(w13), cpu.prepare(w2)
    cases = []
    for t in (1, 5):
        tw, ids = routing(t, 9, 3, seed=t)
        x = torch.randn(t, 1000, generator=torch.Generator().manual_seed(t))
        cases.append((x, tw, ids, reference.fused_moe(x, w13.orig, w2.orig, tw, ids), reference.linear(x, w13.orig[1])))
    return w13, w2, cases


@pytest.mark.parametrize("name,value", KNOB_CASES, ids=[f"{n}={v}" for n, v in KNOB_CASES])
def test_every_knob_value_gives_the_same_answer(name, value):
    knobs = {name: value}
    for fmt in ("bf16", "int8", "fp8", "int4_g64_asym"):
        w13, w2, cases = knob_case(fmt)
        w13_1 = cpu.prepare(w13.orig[1])
        for x, tw, ids, ref_moe, ref_linear in cases:
            t = x.shape[0]
            check(cpu.fused_moe(x, w13, w2, tw, ids, knobs=knobs), ref_moe, tight(fmt, knobs, "fused_moe", t),
                  f"fused_moe {fmt} T={t} {knobs}")
            check(cpu.linear(x, w13_1, knobs=knobs), ref_linear, tight(fmt, knobs, tokens=t), f"linear {fmt} T={t} {knobs}")


def test_knob_defaults_mirror_the_catalogue():
    for name, default in cpu.KNOB_DEFAULTS.items():
        assert CATALOGUE[name].default == default, name
        assert CATALOGUE[name].component == "kernels/cpu"


def test_bad_knob_is_refused():
    w = formats.DenseWeight(torch.randn(8, 64))
    with pytest.raises(KeyError):
        cpu.linear(torch.randn(1, 64), w, knobs={"cpu_nonsense": 1})
    with pytest.raises(RuntimeError, match="micro_rows"):
        cpu.linear(torch.randn(1, 64), w, knobs={"cpu_micro_rows": 3})


# ------------------------------------------------------------------ weights, formats, engine


def test_prepare_weights_wraps_formats_and_keeps_their_attributes():
    w = formats.quantize_fp8_block(torch.randn(256, 384))
    packed = cpu.prepare_weights({"a": w, "norm": torch.ones(4)})
    assert isinstance(packed["a"], cpu.Packed) and packed["norm"] is not None
    assert packed["a"].shape == w.shape and packed["a"].nbytes == w.nbytes
    assert torch.equal(packed["a"].dequantize(), w.dequantize())
    x = torch.randn(3, 384)
    check(cpu.linear(x, packed["a"]), reference.linear(x, w), TIGHT, "packed fp8")
    assert cpu.prepare(formats.DenseWeight(torch.randn(4, 4, dtype=torch.float16))).w.dtype == torch.float16


ROWS_LAYOUTS = {"cpu_int8_expert_layout": "rows", "cpu_int8_linear_layout": "rows"}


def test_huge_page_copy_is_aligned_and_equal_and_switchable():
    big = formats.quantize_int8_channel(torch.randn(4, 1024, 700))  # 2.7 MiB of int8: copied
    small = formats.quantize_int8_channel(torch.randn(64, 64))  # below one huge page: kept
    try:  # the row-major layout (an r16 weight is always a copy, or repacked in place: its own test)
        cpu.configure({"cpu_huge_pages": False, **ROWS_LAYOUTS})
        assert cpu.prepare(big).args[1].data_ptr() == big.w.data_ptr()  # off: no copy
    finally:
        cpu.configure({k: cpu.KNOB_DEFAULTS[k] for k in ("cpu_huge_pages", *ROWS_LAYOUTS)})
    w2 = formats.quantize_int8_channel(torch.randn(4, 700, 1024))
    fp8 = formats.quantize_fp8_block(torch.randn(2048, 1100))  # the float8 bytes, 2.1 MiB
    try:
        cpu.configure({"cpu_huge_pages": True, **ROWS_LAYOUTS})
        p = cpu.prepare(big)
        assert p.args[1].data_ptr() % (2 << 20) == 0 and p.args[1].data_ptr() != big.w.data_ptr()
        assert torch.equal(p.orig.w, big.w) and p.orig.w.dtype == torch.int8 and p.orig.scale is big.scale
        assert cpu.prepare(small).args[1].data_ptr() == small.w.data_ptr()
        tw, ids = routing(3, 4, 2, seed=1)
        x = torch.randn(3, 700)
        assert torch.equal(cpu.fused_moe(x, p, cpu.prepare(w2), tw, ids), cpu.fused_moe(x, big, w2, tw, ids))
        pf = cpu.prepare(fp8)
        assert pf.orig.w.dtype == torch.float8_e4m3fn and pf.args[1].data_ptr() % (2 << 20) == 0
        xf = torch.randn(2, 1100)
        check(cpu.linear(xf, pf), reference.linear(xf, fp8), TIGHT, "fp8 from huge pages")
        r = cpu.prepare(big, layout="r16")  # the r16 copy in huge pages too
        assert r.args[1].data_ptr() % (2 << 20) == 0 and torch.equal(r.orig.rows().w, big.w)
    finally:
        cpu.configure({k: cpu.KNOB_DEFAULTS[k] for k in ("cpu_huge_pages", *ROWS_LAYOUTS)})


def _fp8_every_byte():
    """A [254, 256] FP8 weight whose row i holds byte i (every E4M3 value but the two NaNs) at column
    i, and one scale 2^-3 per block; its exact value and the value with denormals read as zero."""
    b = torch.tensor([v for v in range(256) if v & 0x7F != 0x7F], dtype=torch.uint8)
    w = torch.zeros(254, 256, dtype=torch.uint8)
    w[torch.arange(254), torch.arange(254)] = b
    weight = formats.Fp8BlockWeight(w.view(torch.float8_e4m3fn), torch.full((2, 2), 0.125), (128, 128))
    exact = b.view(torch.float8_e4m3fn).float() * 0.125
    exp0 = (b & 0x78) == 0
    return weight, exact, torch.where(exp0, torch.zeros_like(exact), exact), int(exp0.sum())


@pytest.mark.parametrize("method", ["vector", "lut", "widen"])
def test_fp8_every_byte_value(method):
    """Each E4M3 byte through each expansion method: exact for normal numbers and ±0; denormals
    (exponent 0) read as zero by widen (MXCSR.DAZ) and as 2^-7·(1 + m/8) by vector/lut, the
    documented "no denormal handling"; tokens 1, 2 and 4 per microkernel pass."""
    weight, exact, flushed, n_denormal = _fp8_every_byte()
    assert n_denormal == 16  # exponent 0: ±0 and the 14 denormals
    x = torch.zeros(4, 256)
    x[:, :254] = torch.tensor([1.0, -2.0, 0.5, 4.0])[:, None]
    for tokens in (1, 2, 4):
        got = cpu.linear(x, weight, knobs={"cpu_fp8_method": method, "cpu_micro_tokens": tokens})
        for t, f in enumerate((1.0, -2.0, 0.5, 4.0)):
            row = got[t] / f
            if method == "widen":
                assert torch.equal(row, flushed), (method, tokens, (row - flushed).abs().max())
            else:
                normal = flushed != 0
                assert torch.equal(row[normal], exact[normal]) and (row[~normal].abs() <= 2 ** -7 * 2 * 0.125).all()


def test_fp8_widen_activation_range_and_odd_blocks():
    """widen scales activations by 2^60 inside: large (1e6) and tiny (1e-12) activations stay exact
    to float32 summation; a block K of 32 (not a multiple of 64) falls back to the vector method."""
    g = torch.Generator().manual_seed(5)
    w = formats.quantize_fp8_block(torch.randn(96, 1000, generator=g))
    for mag in (1e6, 1e-12):
        x = torch.randn(3, 1000, generator=g) * mag
        check(cpu.linear(x, w, knobs={"cpu_fp8_method": "widen"}), reference.linear(x, w), TIGHT, f"widen |x|~{mag}")
    w32 = formats.Fp8BlockWeight(w.w, w.scale_inv.repeat_interleave(4, -1)[..., :32], (128, 32))
    x = torch.randn(2, 1000, generator=g)
    check(cpu.linear(x, w32, knobs={"cpu_fp8_method": "widen"}), reference.linear(x, w32), TIGHT, "widen, block K 32")


def quantize_act_int8_groups(x: torch.Tensor, group: int) -> torch.Tensor:
    """What the int8 INT4 method multiplies: x rounded per (token, group) to int8 steps of amax/127."""
    t, k = x.shape
    xp = torch.nn.functional.pad(x, (0, -k % group)).view(t, -1, group)
    s = xp.abs().amax(-1, keepdim=True) / 127
    s = torch.where(s > 0, s, torch.ones_like(s))
    return (torch.round(xp / s).clamp(-127, 127) * s).view(t, -1)[:, :k]


@pytest.mark.parametrize("t,n,k", [(1, 256, 512), (3, 700, 1000), (37, 130, 1000), (4, 64, 7168)])
@pytest.mark.parametrize("tokens", [1, 2, 4])
def test_int4_int8_method_is_exact_on_its_quantized_activations(t, n, k, tokens):
    """The int8 INT4 method equals the reference fed the activations it quantizes (2e-5), so its whole
    error against float activations is that rounding (≤ INT4_INT8; measured 5.9e-3–6.8e-3)."""
    g = torch.Generator().manual_seed(n + k)
    w = formats.quantize_int4_group(torch.randn(n, k, generator=g) * 0.05, 128, symmetric=False)
    x = torch.randn(t, k, generator=g)
    knobs = {"cpu_int4_method": "int8", "cpu_micro_tokens": tokens, "cpu_gemm_min_tokens": 4096, "cpu_dot_gemm_min_tokens": 4096}
    got = cpu.linear(x, w, knobs=knobs)
    check(got, reference.linear(quantize_act_int8_groups(x, 128), w), TIGHT, "int4 int8-method, exact part")
    check(got, reference.linear(x, w), INT4_INT8, "int4 int8-method vs float activations")


@pytest.mark.parametrize("group", formats.INT4_GROUPS)
@pytest.mark.parametrize("symmetric", [True, False])
def test_int4_format_round_trip(group, symmetric):
    w = torch.randn(3, 10, 100)
    q = formats.quantize_int4_group(w, group, symmetric)
    assert q.shape == w.shape and q[1].shape == (10, 100)
    assert torch.equal(formats.unpack_int4(q.packed), formats.unpack_int4(formats.pack_int4(formats.unpack_int4(q.packed))))
    deq = q.dequantize()
    step = q.scale.repeat_interleave(group, -1)[..., :100]
    assert ((deq - w).abs() <= step / 2 + 1e-6).all()  # within half a quantization step
    # 4-bit grid: at most 16 distinct values per group
    assert formats.unpack_int4(q.packed).max() <= 15


def test_auto_backend_resolves_to_cpu_here():
    from engine.knobs import resolve_knobs

    assert resolve_knobs()["kernel_backend"] == "cpu"
    assert resolve_knobs({"kernel_backend": "reference"})["kernel_backend"] == "reference"


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    from hf_oracle import build_hf_model, hf_logits, save_checkpoint

    model = build_hf_model("v3_odd")
    path = save_checkpoint(model, tmp_path_factory.mktemp("v3_odd"))
    prompt = torch.randint(2, 300, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    return path, prompt, hf_logits(model, prompt)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_logits_with_cpu_backend_match_transformers(oracle, dtype):
    """The bounds of test_oracle_transformers: float32 1e-4; bf16 2e-2 at ≥ 90 % of positions, 5e-2 overall."""
    from engine import LLM
    from hf_oracle import rel_err

    path, prompt, ref = oracle
    llm = LLM(str(path), dtype=dtype, knobs={"kernel_backend": "cpu"}, progress=False)
    assert llm.model.ops.backend is cpu  # the cpu kernels behind the per-call tables (engine/kernel_tables.py)
    got = llm.logits(prompt)
    if dtype == "float32":
        assert rel_err(got, ref) < 1e-4
    else:
        per_pos = (got - ref).norm(dim=-1) / ref.norm(dim=-1)
        assert (per_pos < 2e-2).float().mean() >= 0.9, per_pos
        assert rel_err(got, ref) < 5e-2


@pytest.mark.parametrize("absorb", ["decode", "always"])
def test_engine_greedy_with_cpu_attention_matches_transformers(oracle, absorb):
    """Greedy decoding through the C++ attention (extend for the prompt, flash decoding with the fused
    cache write for each new token; "always": every prompt token as a decode row) == transformers."""
    from engine import LLM, SamplingParams
    from hf_oracle import build_hf_model, hf_greedy

    path, prompt, _ = oracle
    llm = LLM(str(path), dtype="float32", knobs={"kernel_backend": "cpu", "mla_absorb": absorb}, progress=False)
    assert llm.model.ops.backend is cpu and "mla_decode" in cpu.NATIVE_OPS
    out = llm.generate(prompt, SamplingParams(max_tokens=12, ignore_eos=True))[0]
    assert out.token_ids == hf_greedy(build_hf_model("v3_odd"), prompt, 12)


def test_probe_readers_return_a_duration_and_refuse_bad_arguments():
    """The probe's two readers (sequential; interleaved streams with prefetch) return a positive,
    finite duration for every stream count (no speed is asserted: that is the probe's job), and a
    bad stream count or prefetch distance is one clear error."""
    import math

    ext = cpu.extension()
    buf = torch.ones(1 << 16)
    durations = [ext.read_seconds(buf)] + [ext.read_seconds_streams(buf, s, p) for s in (1, 4, 16) for p in (0, 1024)]
    assert all(d > 0 and math.isfinite(d) for d in durations), durations
    for streams, ahead in ((0, 1024), (17, 1024), (4, -1)):
        with pytest.raises(RuntimeError, match="1..16 streams"):
            ext.read_seconds_streams(buf, streams, ahead)


@pytest.mark.parametrize("fmt", ["bf16", "int8", "fp8", "int4_g128", "int4_g64"])
def test_spread_tiles_equal_adjacent_tiles_bitwise(fmt):
    """cpu_tile_rows=spread only changes which rows a register tile reads together (rows a sweep's rows /
    R apart instead of adjacent): each row's sum is the same computation, so the outputs are bitwise
    equal, on sweeps that split into R equal parts (tiles of 4 and 8 rows, several token tails) and on
    those that do not (they keep adjacent tiles), in linear and fused MoE."""
    g = torch.Generator().manual_seed(len(fmt))
    for n, k, block in ((256, 512, 64), (72, 256, 16), (1000, 384, 64), (7, 128, 64), (130, 256, 32)):
        w = make_weight(torch.randn(n, k, generator=g) * 0.05, fmt)
        for t in (1, 3, 4, 7):
            x = torch.randn(t, k, generator=g)
            for rows in (4, 8):
                kn = {"cpu_micro_rows": rows, "cpu_linear_block_n": block, "cpu_gemm_min_tokens": 4096,
                      "cpu_bf16_gemm_min_tokens": 4096, "cpu_dot_gemm_min_tokens": 4096}
                a = cpu.linear(x, w, knobs={**kn, "cpu_tile_rows": "adjacent"})
                b = cpu.linear(x, w, knobs={**kn, "cpu_tile_rows": "spread"})
                assert torch.equal(a, b), (fmt, n, k, t, rows)
    x = torch.randn(5, 256, generator=g).bfloat16()
    w13 = make_weight(torch.randn(6, 2 * 192, 256, generator=g) * 0.05, fmt)
    w2 = make_weight(torch.randn(6, 256, 192, generator=g) * 0.05, fmt)
    tw, ids = torch.rand(5, 2, generator=g), torch.randint(0, 6, (5, 2), generator=g)
    for block in (16, 64, 128):
        kn = {"cpu_moe_block_n": block, "cpu_gemm_min_tokens": 4096, "cpu_bf16_gemm_min_tokens": 4096,
              "cpu_dot_gemm_min_tokens": 4096}
        assert torch.equal(cpu.fused_moe(x, w13, w2, tw, ids, knobs={**kn, "cpu_tile_rows": "adjacent"}),
                           cpu.fused_moe(x, w13, w2, tw, ids, knobs={**kn, "cpu_tile_rows": "spread"})), (fmt, block)


@pytest.mark.parametrize("fmt", ["f32", "bf16", "int8", "fp8", "int4_g128"])
def test_micro_order_tiles_equals_groups_bitwise(fmt):
    """cpu_micro_order only changes the order of a sweep's (token group, row tile) calls (tiles_next also
    where the second group prefetches): every output element is the same microkernel call on the same
    rows and tokens, so tiles, tiles_next and groups are bitwise equal, for token counts that leave every tail (4s, a pair, a single token), row counts off the tile,
    both tile heights, spread and adjacent tiles; in linear and fused MoE, float32 and bf16 rows."""
    g = torch.Generator().manual_seed(len(fmt) + 3)
    micro = {"cpu_gemm_min_tokens": 4096, "cpu_bf16_gemm_min_tokens": 4096, "cpu_dot_gemm_min_tokens": 4096}
    for n, k in ((130, 256), (64, 1000), (7, 128)):
        w = make_weight(torch.randn(n, k, generator=g) * 0.05, fmt)
        for t in (2, 5, 7, 12, 37):
            for dt in (torch.float32, torch.bfloat16):
                x = torch.randn(t, k, generator=g).to(dt)
                for rows, tiles in ((4, "spread"), (8, "adjacent")):
                    kn = {**micro, "cpu_micro_rows": rows, "cpu_tile_rows": tiles, "cpu_linear_block_n": 32}
                    a = cpu.linear(x, w, knobs={**kn, "cpu_micro_order": "groups"})
                    b = cpu.linear(x, w, knobs={**kn, "cpu_micro_order": "tiles"})
                    c = cpu.linear(x, w, knobs={**kn, "cpu_micro_order": "tiles_next"})
                    assert torch.equal(a, b) and torch.equal(a, c), (fmt, n, k, t, rows)
    e, d, i = 6, 256, 192
    w13 = make_weight(torch.randn(e, 2 * i, d, generator=g) * 0.05, fmt)
    w2 = make_weight(torch.randn(e, d, i, generator=g) * 0.05, fmt)
    for t in (9, 40):
        x = torch.randn(t, d, generator=g).bfloat16()
        tw, ids = torch.rand(t, 2, generator=g), torch.randint(0, e, (t, 2), generator=g)
        with cpu.recording() as rec:
            a = cpu.fused_moe(x, w13, w2, tw, ids, knobs={**micro, "cpu_micro_order": "groups"})
            b = cpu.fused_moe(x, w13, w2, tw, ids, knobs={**micro, "cpu_micro_order": "tiles"})
            c = cpu.fused_moe(x, w13, w2, tw, ids, knobs={**micro, "cpu_micro_order": "tiles_next"})
        assert torch.equal(a, b) and torch.equal(a, c), (fmt, t)
        assert [r["knobs"]["cpu_micro_order"] for r in rec] == ["groups", "tiles", "tiles_next"]


def _moe_outputs(fmt, g, e, t, knob_sets):
    """A fused MoE (D 256, I 192, top-2 of e experts, t bf16 tokens, weights from g) under each knob set."""
    d, i = 256, 192
    w13 = make_weight(torch.randn(e, 2 * i, d, generator=g) * 0.05, fmt)
    w2 = make_weight(torch.randn(e, d, i, generator=g) * 0.05, fmt)
    x = torch.randn(t, d, generator=g).bfloat16()
    tw, ids = torch.rand(t, 2, generator=g), torch.randint(0, e, (t, 2), generator=g)
    return [cpu.fused_moe(x, w13, w2, tw, ids, knobs=kn) for kn in knob_sets]


@pytest.mark.parametrize("fmt", ["f32", "bf16", "int8", "fp8", "int4_g128", "int4_g32"])
def test_prefetch_hint_changes_no_result(fmt):
    """cpu_prefetch_hint only chooses the software prefetch's instruction (or none): every microkernel
    (each format's default variant, 4 × 1/2/4 tiles with their tails) gives bitwise the same outputs under
    t0, t1, t2 and none, in linear and fused MoE, and the call record names the hint that ran."""
    g = torch.Generator().manual_seed(len(fmt) + 11)
    micro = {"cpu_gemm_min_tokens": 4096, "cpu_bf16_gemm_min_tokens": 4096, "cpu_dot_gemm_min_tokens": 4096,
             "cpu_amx_min_tokens": 4096}
    hints = ("t0", "t1", "t2", "none")
    for n, k in ((130, 256), (7, 1000)):
        w = make_weight(torch.randn(n, k, generator=g) * 0.05, fmt)
        for t in (1, 7):
            x = torch.randn(t, k, generator=g).bfloat16()
            with cpu.recording() as rec:
                out = [cpu.linear(x, w, knobs={**micro, "cpu_prefetch_hint": h, "cpu_prefetch_ahead": 256}) for h in hints]
            assert all(torch.equal(out[0], o) for o in out[1:]), (fmt, n, k, t)
            assert [r["knobs"]["cpu_prefetch_hint"] for r in rec] == list(hints)
            check(out[0].float(), reference.linear(x.float(), w), 3e-2, f"{fmt} {n}x{k} T={t}")
    out = _moe_outputs(fmt, g, 6, 9, [{**micro, "cpu_prefetch_hint": h} for h in hints])
    assert all(torch.equal(out[0], o) for o in out[1:]), fmt


@pytest.mark.parametrize("fmt", ["f32", "bf16", "int8", "fp8", "int4_g128"])
def test_prefill_prefetch_changes_no_result(fmt):
    """cpu_prefill_prefetch_hint / _ahead only choose the software prefetch of sweeps of several token
    groups: bitwise the same outputs under every value (same, t0, t1, t2, none; ahead 0 and 256), on
    one-group sweeps (T=1, 4) and several-group ones (T=7, 13: wide and narrow groups with their tails),
    in linear and fused MoE; the call record names the values that ran."""
    g = torch.Generator().manual_seed(len(fmt) + 23)
    micro = {"cpu_gemm_min_tokens": 4096, "cpu_bf16_gemm_min_tokens": 4096, "cpu_dot_gemm_min_tokens": 4096,
             "cpu_amx_min_tokens": 4096}
    cases = [("same", 0), ("t0", 0), ("t0", 256), ("t1", 0), ("t2", 256), ("none", 0)]
    w = make_weight(torch.randn(130, 256, generator=g) * 0.05, fmt)
    for t in (1, 4, 7, 13):
        x = torch.randn(t, 256, generator=g).bfloat16()
        with cpu.recording() as rec:
            out = [cpu.linear(x, w, knobs={**micro, "cpu_prefill_prefetch_hint": h, "cpu_prefill_prefetch_ahead": a})
                   for h, a in cases]
        assert all(torch.equal(out[0], o) for o in out[1:]), (fmt, t)
        assert [(r["knobs"]["cpu_prefill_prefetch_hint"], r["knobs"]["cpu_prefill_prefetch_ahead"]) for r in rec] == cases
        check(out[0].float(), reference.linear(x.float(), w), 3e-2, f"{fmt} T={t}")
    out = _moe_outputs(fmt, g, 4, 30, [{**micro, "cpu_prefill_prefetch_hint": h, "cpu_prefill_prefetch_ahead": a}
                                       for h, a in cases])
    assert all(torch.equal(out[0], o) for o in out[1:]), fmt


@pytest.mark.parametrize("k", [1, 2, 17, 31, 32, 33, 95, 1000])
def test_bf16_split_method_on_every_tile_shape_and_row_end(k):
    """cpu_bf16_method=split (two bf16 per 32-bit lane split by a shift and a mask, activations
    de-interleaved per 32) against the reference and the widen method: every rows × tokens tile, row
    lengths that end mid-pair and mid-chunk (the masked tail), token counts that leave pairs and
    singles; float32 activations within TIGHT (only the order of the additions differs)."""
    g = torch.Generator().manual_seed(k)
    w = cpu.prepare(formats.DenseWeight(torch.randn(37, k, generator=g).to(torch.bfloat16)))
    for t in (1, 2, 3, 7):
        x = torch.randn(t, k, generator=g)
        ref = reference.linear(x, w.orig)
        for rows in (4, 8):
            for tokens in (1, 2, 4):
                base = {"cpu_micro_rows": rows, "cpu_micro_tokens": tokens, "cpu_gemm_min_tokens": 64,
                        "cpu_bf16_isa": "avx512"}
                split = cpu.linear(x, w, knobs={**base, "cpu_bf16_method": "split"})
                widen = cpu.linear(x, w, knobs={**base, "cpu_bf16_method": "widen"})
                check(split, ref, TIGHT, f"split K={k} T={t} {rows}x{tokens}")
                check(split, widen, TIGHT, f"split vs widen K={k} T={t} {rows}x{tokens}")


@pytest.mark.parametrize("k", [1, 2, 15, 16, 17, 31, 32, 33, 95, 1000])
def test_bf16_split256_is_one_result_for_every_tile_and_k_block(k):
    """cpu_bf16_method=split256 (micro_bf16y: the split arithmetic on 256-bit registers, at most 8
    accumulators, the row groups of 4 x 4 / 8 x 2 / 8 x 4 tiles taking turns over K blocks): within TIGHT
    of the reference and of split, and the same bits for every rows x tokens tile, every cpu_k_block,
    every order and token count (each accumulator's operations do not depend on them); row lengths that
    end mid-pair and mid-chunk (the zero-padded last chunk); the call record names avx2."""
    g = torch.Generator().manual_seed(100 + k)
    w = cpu.prepare(formats.DenseWeight(torch.randn(37, k, generator=g).to(torch.bfloat16)))
    xs = torch.randn(7, k, generator=g)
    micro = {"cpu_gemm_min_tokens": 64, "cpu_bf16_isa": "avx512"}
    first = cpu.linear(xs, w, knobs={**micro, "cpu_bf16_method": "split256"})
    check(first, reference.linear(xs, w.orig), TIGHT, f"split256 K={k}")
    check(first, cpu.linear(xs, w, knobs={**micro, "cpu_bf16_method": "split"}), TIGHT, f"split256 vs split K={k}")
    for t in (1, 2, 3, 7):
        for rows in (4, 8):
            for tokens in (1, 2, 4):
                for kb in (64, 256, 2048):
                    knobs = {**micro, "cpu_micro_rows": rows, "cpu_micro_tokens": tokens, "cpu_k_block": kb,
                             "cpu_bf16_method": "split256",
                             "cpu_micro_order": ("groups", "tiles", "tiles_next")[(rows + tokens + kb) % 3]}
                    with cpu.recording() as rec:
                        y = cpu.linear(xs[:t], w, knobs=knobs)
                    assert rec[0]["isa"] == "avx2", rec
                    assert torch.equal(y, first[:t]), (k, t, rows, tokens, kb)


# ------------------------------------------------------------------ BF16 experts in the r16 layout

# (T, E, D, I, top-k, experts the router may pick): one block of 16 (I = 16), the smallest w2 (D = 32),
# odd token counts around the tile widths (1, 5, 13, 37 and 40 on few experts: many token groups), an
# expert without tokens, every token on one expert
R16_CASES = {
    "regular": (8, 8, 256, 128, 2, None),
    "one_block": (5, 4, 32, 16, 2, None),
    "odd_t13": (13, 6, 96, 48, 3, None),
    "t40_few_experts": (40, 3, 64, 32, 2, None),
    "empty_expert": (6, 9, 256, 96, 3, [0, 1, 2, 3, 5, 6, 7, 8]),
    "all_on_one": (37, 9, 64, 32, 1, [4]),
    "t1": (1, 9, 256, 96, 3, None),
}
BF16_NATIVE = "avx512_bf16" in cpu.features()
# BF16 and FP8 auto layouts without AVX512-BF16 (and without AMX): r16 on the AVX-512 build's float32 FMAs, rows on
# the AVX2 build's model of them
FLOAT_R16 = cpu._ext.BUILD == "avx512"
# the r16 sweep at every token count: on AMX CPUs r16 BF16 / INT8 weights take AMX's GEMM from cpu_amx_min_tokens
# (gemm_r16, tests/test_amx.py)
SWEEP = {"cpu_amx_min_tokens": 1 << 20}


def r16_moe(case: str, layout13: str = "r16", layout2: str = "r16"):
    t, e, d, i, k, pool = R16_CASES[case]
    w13, w2 = moe_weights(e, d, i, "bf16", seed=t + e)
    tw, ids = routing(t, e, k, seed=t, experts=pool)
    x = torch.randn(t, d, generator=torch.Generator().manual_seed(11))
    return (cpu.prepare(w13, layout=layout13), cpu.prepare(w2, layout=layout2), w13, w2, x, tw, ids)


def test_r16_pack_is_the_documented_layout_and_unpacks():
    w = torch.arange(2 * 32 * 6, dtype=torch.float32).view(2, 32, 6).to(torch.bfloat16)
    r = cpu.r16_pack(w)
    assert r.shape == w.shape and r.dtype == torch.bfloat16
    flat = r.view(torch.int32).view(2, -1)  # per expert: block b, pair p, row r at b·16·3 + p·16 + r
    pair = w.view(torch.int32).view(2, 32, 3)  # pair p of row n
    for e, n, p in ((0, 0, 0), (0, 17, 2), (1, 31, 1), (1, 5, 0)):
        assert flat[e, (n // 16) * 48 + p * 16 + n % 16] == pair[e, n, p]
    assert torch.equal(cpu.r16_unpack(r), w)
    assert cpu.r16_fits((4, 64, 2)) and not cpu.r16_fits((4, 48, 8)) and not cpu.r16_fits((4, 64, 7))
    assert cpu.r16_fits((48, 8)) and not cpu.r16_fits((40, 8)) and not cpu.r16_fits((48, 9))  # linears: 16s


@pytest.mark.parametrize("case", sorted(R16_CASES))
def test_r16_fused_moe_matches_the_reference_on_every_policy(case):
    p13, p2, w13, w2, x, tw, ids = r16_moe(case)
    assert p13.args[0] == p2.args[0] == cpu.R16_ID and isinstance(p13.orig, cpu.R16Weight)
    ref = reference.fused_moe(x, w13, w2, tw, ids)
    xb = x.to(torch.bfloat16)
    refb = reference.fused_moe(xb, w13, w2, tw, ids)
    # float32 activations: float32 FMAs on exact products (any CPU), as tight as the row-major path
    with cpu.recording() as rec:
        check(cpu.fused_moe(x, p13, p2, tw, ids), ref, TIGHT, f"r16 f32-act {case}")
    assert rec[-1]["isa"] == "avx512+r16" and rec[-1]["format"] == "bf16"
    # bf16 activations on float32 FMAs (cpu_bf16_isa=avx512), on vdpbf16ps's C++ model, and on the instruction
    check(cpu.fused_moe(xb, p13, p2, tw, ids, knobs={**SWEEP, "cpu_bf16_isa": "avx512"}), refb, BF16_MOE,
          f"r16 fma {case}")
    with cpu.emulate(["avx512_bf16"]), cpu.recording() as rec:
        model = cpu.fused_moe(xb, p13, p2, tw, ids, knobs={**SWEEP, "cpu_bf16_isa": "avx512bf16"})
    assert rec[-1]["isa"] == "avx512bf16-model+r16"
    check(model, refb, BF16_MOE, f"r16 dot model {case}")
    if BF16_NATIVE:
        with cpu.recording() as rec:
            native = cpu.fused_moe(xb, p13, p2, tw, ids, knobs={**SWEEP, "cpu_bf16_isa": "avx512bf16"})
        assert rec[-1]["isa"] == "avx512bf16+r16"
        assert torch.equal(native, model), "the model is exact: the instruction's result bit for bit"


def test_r16_native_dot_product_where_the_cpu_has_it():
    if not BF16_NATIVE:
        pytest.skip("this CPU lacks avx512_bf16: the r16 tiles ran on vdpbf16ps's C++ model only")
    p13, p2, w13, w2, x, tw, ids = r16_moe("odd_t13")
    xb = x.to(torch.bfloat16)
    check(cpu.fused_moe(xb, p13, p2, tw, ids, knobs={"cpu_bf16_isa": "avx512bf16"}),
          reference.fused_moe(xb, w13, w2, tw, ids), BF16_MOE, "r16 native")


@pytest.mark.parametrize("layouts", [("r16", "rows"), ("rows", "r16")])
def test_r16_one_stack_in_each_layout(layouts):
    p13, p2, w13, w2, x, tw, ids = r16_moe("odd_t13", *layouts)
    assert {p13.args[0], p2.args[0]} == {cpu.R16_ID, cpu.FORMAT_IDS["bf16"]}
    check(cpu.fused_moe(x, p13, p2, tw, ids), reference.fused_moe(x, w13, w2, tw, ids), TIGHT, f"mixed {layouts}")
    with cpu.recording() as rec:
        cpu.fused_moe(x.to(torch.bfloat16), p13, p2, tw, ids)
    assert rec[-1]["isa"].endswith("+r16")


R16_KNOBS = [(n, v) for n in ("cpu_r16_rows", "cpu_r16_int8_rows", "cpu_r16_int4_rows", "cpu_r16_fp8_rows",
                              "cpu_r16_prefill_rows", "cpu_r16_tokens", "cpu_r16_bf16_tokens", "cpu_r16_bf16_one_group",
                              "cpu_r16_next_prefetch", "cpu_r16_tile_blocks",
                              "cpu_prefill_prefetch_hint", "cpu_prefetch_hint", "cpu_moe_block_n", "cpu_moe_int4_tasks",
                              "cpu_r16_int4_prefetch_ahead")
             for v in knob_samples(n)]


def test_r16_knobs_change_no_result_bitwise():
    """Each output of an r16 tile sums its K pairs in one lane in order, whatever the tile's rows, tokens or
    prefetch: every value of every knob the sweep reads gives the same bits (each value also ran)."""
    for case in ("t40_few_experts", "all_on_one", "t1"):
        p13, p2, _, _, x, tw, ids = r16_moe(case)
        for xa, extra in ((x, {}), (x.to(torch.bfloat16), {"cpu_bf16_isa": "avx512bf16"})):
            with cpu.emulate(["avx512_bf16"]) if extra else contextlib.nullcontext():
                want = cpu.fused_moe(xa, p13, p2, tw, ids, knobs=extra)
                for name, value in R16_KNOBS:
                    with cpu.recording() as rec:
                        got = cpu.fused_moe(xa, p13, p2, tw, ids, knobs={**extra, name: value})
                    assert rec[-1]["knobs"][name] == value
                    assert torch.equal(got, want), (case, name, value)


def test_r16_bf16_one_group_is_bitwise_the_grouped_sweep():
    """cpu_r16_bf16_one_group: a BF16 r16 expert of 7..12 tokens in one token group gives the bits of groups of
    cpu_r16_bf16_tokens (each output sums its pairs in one lane in order), on every policy; the case has such
    experts (13 tokens, 6 experts, top-3)."""
    p13, p2, w13, w2, x, tw, ids = r16_moe("odd_t13")
    counts = torch.bincount(ids.flatten(), minlength=6)
    assert any(cpu.KNOB_DEFAULTS["cpu_r16_bf16_tokens"] < c <= 12 for c in counts.tolist()), counts
    for xa, extra in ((x, {}), (x.to(torch.bfloat16), {"cpu_bf16_isa": "avx512bf16"})):
        with cpu.emulate(["avx512_bf16"]) if extra else contextlib.nullcontext():
            grouped = cpu.fused_moe(xa, p13, p2, tw, ids, knobs={**extra, "cpu_r16_bf16_one_group": 0})
            for v in (7, 12):
                assert torch.equal(cpu.fused_moe(xa, p13, p2, tw, ids, knobs={**extra, "cpu_r16_bf16_one_group": v}),
                                   grouped), (extra, v)
    check(cpu.fused_moe(x, p13, p2, tw, ids), reference.fused_moe(x, w13, w2, tw, ids), TIGHT, "one group")


def test_r16_layout_resolution_and_prepare():
    w13, _ = moe_weights(4, 64, 32, "bf16")
    try:
        for value, mask, want in (("rows", {"avx512_bf16"}, cpu.FORMAT_IDS["bf16"]), ("r16", set(), cpu.R16_ID),
                                  ("auto", set(), cpu.R16_ID if FLOAT_R16 else cpu.FORMAT_IDS["bf16"])):
            cpu.configure({"cpu_bf16_expert_layout": value})
            with cpu.feature_mask(mask):
                assert cpu.prepare(w13).args[0] == want, (value, mask)
        cpu.configure({"cpu_bf16_expert_layout": "auto"})
        with cpu.feature_mask({"avx512_bf16"}):  # auto: r16 where AVX512-BF16 or the AVX-512 build runs
            assert cpu.bf16_expert_layout() == ("r16" if BF16_NATIVE or FLOAT_R16 else "rows")
        with cpu.feature_mask(set()):
            assert cpu.bf16_expert_layout() == ("r16" if FLOAT_R16 else "rows")
        with cpu.feature_mask({"avx512_bf16", "amx"}):
            if "amx" in cpu.features():
                assert cpu.bf16_expert_layout() == "r16"
    finally:
        cpu.configure({"cpu_bf16_expert_layout": cpu.KNOB_DEFAULTS["cpu_bf16_expert_layout"]})
    odd = formats.DenseWeight(torch.randn(4, 48, 64).to(torch.bfloat16))  # 48 rows: not whole 32s
    assert cpu.prepare(odd, layout="r16").args[0] == cpu.FORMAT_IDS["bf16"]
    lin = formats.DenseWeight(torch.randn(40, 64).to(torch.bfloat16))
    assert cpu.prepare(lin, layout="r16").args[0] == cpu.FORMAT_IDS["bf16"]  # 40 rows: not whole 16s
    with pytest.raises(ValueError, match="layout 'cols'"):
        cpu.prepare(w13, layout="cols")
    # a copy by default (the caller's weight stays row-major); prepare_weights repacks in its own storage
    src = w13.w.clone()
    p = cpu.prepare(w13, layout="r16")
    assert torch.equal(w13.w, src) and torch.equal(p.dequantize(), src.float()) and torch.equal(p[2].w, src[2])
    assert p.shape == w13.shape and p.nbytes == w13.nbytes
    try:
        cpu.configure({"cpu_bf16_expert_layout": "r16", "cpu_huge_pages": False})
        mine = formats.DenseWeight(src.clone())
        loaded = {"layers.0.experts.w13": mine}
        packed = cpu.prepare_weights(loaded)["layers.0.experts.w13"]
        assert packed.args[1].data_ptr() == mine.w.data_ptr() and torch.equal(packed.args[1], cpu.r16_pack(src))
        # the dict is consumed: a second engine on it (the tuner's shared load) gets the same wrapper, never
        # the r16 bytes read as rows and repacked again
        assert loaded["layers.0.experts.w13"] is packed
        assert cpu.prepare_weights(loaded)["layers.0.experts.w13"] is packed
        assert torch.equal(packed.dequantize(), src.float())
    finally:
        cpu.configure({k: cpu.KNOB_DEFAULTS[k] for k in ("cpu_bf16_expert_layout", "cpu_huge_pages")})


def test_r16_weights_refuse_bad_shapes_and_a_format_mix():
    p13, p2, *_ = r16_moe("regular")
    with pytest.raises(RuntimeError, match="whole blocks of 16 and an even K"):
        cpu._ext.linear(torch.randn(2, 255), cpu.R16_ID, torch.zeros(40, 255, dtype=torch.bfloat16), 40, 255,
                        cpu._EMPTY, cpu._EMPTY, 0, 1, cpu.make_knobs())
    i8 = cpu.prepare(formats.quantize_int8_channel(torch.randn(8, 256, 128)))
    assert not cpu.moe_formats_match(p13.args[0], i8.args[0]) and cpu.moe_formats_match(p13.args[0], 1)


@pytest.mark.parametrize("shape", [(1, 2 * 1408), (7, 2 * 5632), (3, 2 * 37), (2, 4, 2 * 16), (0, 2 * 8), (5, 2)])
def test_silu_and_mul_matches_the_reference(shape):
    """float32 within a few ulps of torch's SiLU (exp512's error); bfloat16 within one rounding step, and
    almost always the same bits; large |gate| saturates (−∞ side to −0, +∞ side to gate · up)."""
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(shape, generator=g) * 4
    if x.numel():
        x.view(-1)[:4] = torch.tensor([0.0, -0.0, 120.0, -120.0])[: x.numel()]
    got, ref = cpu.silu_and_mul(x), reference.silu_and_mul(x)
    assert got.shape == ref.shape and got.dtype == torch.float32
    assert torch.allclose(got, ref, rtol=2e-6, atol=1e-30), (got - ref).abs().max()
    xb = x.to(torch.bfloat16)
    gb, rb = cpu.silu_and_mul(xb), reference.silu_and_mul(xb)
    assert gb.dtype == torch.bfloat16 and gb.shape == rb.shape
    assert torch.allclose(gb.float(), rb.float(), rtol=2 ** -7, atol=1e-30)
    if rb.numel() >= 1000:
        assert (gb != rb).float().mean() < 0.01
    strided = torch.cat([x, x], -1)[..., : x.shape[-1]]  # a non-contiguous view: same values
    assert torch.equal(cpu.silu_and_mul(strided), got)
    assert torch.equal(cpu.silu_and_mul(x.to(torch.float16)), reference.silu_and_mul(x.to(torch.float16)))


# (T, N, K): one block, odd token counts around the tile widths, a long prompt (many token groups), short rows
R16_LINEAR = {"one_block": (3, 16, 64), "t1": (1, 256, 512), "t13": (13, 48, 1000), "t37": (37, 96, 130),
              "t300": (300, 64, 256), "k2": (5, 32, 2)}


@pytest.mark.parametrize("case", sorted(R16_LINEAR))
def test_r16_linear_matches_the_reference_on_every_policy(case):
    t, n, k = R16_LINEAR[case]
    g = torch.Generator().manual_seed(n + k)
    w = make_weight(torch.randn(n, k, generator=g) * 0.05, "bf16")
    p = cpu.prepare(w, layout="r16")
    assert p.args[0] == cpu.R16_ID and torch.equal(p.dequantize(), w.dequantize())
    x = torch.randn(t, k, generator=g)
    with cpu.recording() as rec:
        check(cpu.linear(x, p), reference.linear(x, w), TIGHT, f"r16 linear f32-act {case}")
    assert rec[-1]["isa"] == "avx512+r16"
    xb = x.to(torch.bfloat16)
    ref = reference.linear(xb, w)
    check(cpu.linear(xb, p, knobs={"cpu_bf16_isa": "avx512"}), ref, BF16_LINEAR, f"r16 linear fma {case}")
    with cpu.emulate(["avx512_bf16"]):
        model = cpu.linear(xb, p, knobs={"cpu_bf16_isa": "avx512bf16"})
    check(model, ref, BF16_LINEAR, f"r16 linear model {case}")
    if BF16_NATIVE:
        assert torch.equal(cpu.linear(xb, p, knobs={"cpu_bf16_isa": "avx512bf16"}), model)
    # every knob the r16 sweep reads, and the task size, give the same bits
    for name, value in R16_KNOBS + [("cpu_linear_block_n", 16), ("cpu_linear_block_n", 1)]:
        assert torch.equal(cpu.linear(x, p, knobs={name: value}), cpu.linear(x, p)), (case, name, value)


# (T, N, K): one block; K in whole and part 16-unit transposes (130: 65 pairs); more rows than one restored
# block (cpu_gemm_block_n 256); one token
R16_ONEDNN = {"one_block": (3, 16, 64), "k130": (5, 48, 130), "rows_600": (300, 608, 256), "t1": (1, 32, 2050)}


@pytest.mark.parametrize("case", sorted(R16_ONEDNN))
def test_r16_linear_on_onednn_from_the_knob(case):
    """cpu_r16_onednn_min_tokens: from that many bf16 tokens, torch's bf16 linear on the rows restored from r16
    (block by block): torch's own result on the row-major weight where one block holds every row, within
    bf16 rounding of the reference always; float32 activations and fewer tokens stay on the r16 tiles."""
    t, n, k = R16_ONEDNN[case]
    g = torch.Generator().manual_seed(n * k)
    w = make_weight(torch.randn(n, k, generator=g) * 0.05, "bf16")
    p = cpu.prepare(w, layout="r16")
    assert p.args[0] == cpu.R16_ID
    xb = torch.randn(t, k, generator=g).to(torch.bfloat16)
    on = {**SWEEP, "cpu_r16_onednn_min_tokens": t}  # AMX, where it runs, would come first
    with cpu.recording() as rec:
        got = cpu.linear(xb, p, knobs=on)
    assert rec[-1]["isa"] == "onednn+r16" and got.dtype == torch.bfloat16
    check(got, reference.linear(xb, w), BF16_LINEAR, f"r16 onednn {case}")
    whole = cpu.linear(xb, p, knobs={**on, "cpu_gemm_block_n": 4096})
    assert torch.equal(whole, torch.nn.functional.linear(xb, w.w)), case
    if n > 256:  # several restored blocks: the same outputs as one (each output's K sum is oneDNN's own)
        check(got, whole, BF16_LINEAR, f"r16 onednn blocks {case}")
    with cpu.recording() as rec:
        cpu.linear(xb, p, knobs={**SWEEP, "cpu_r16_onednn_min_tokens": t + 1})
        cpu.linear(xb.float(), p, knobs=on)
    assert [r["isa"].endswith("+r16") and not r["isa"].startswith("onednn") for r in rec] == [True, True]


def test_r16_linear_layout_resolution():
    w = make_weight(torch.randn(64, 64), "bf16")
    try:
        for value, mask, want in (("rows", {"avx512_bf16"}, cpu.FORMAT_IDS["bf16"]), ("r16", set(), cpu.R16_ID),
                                  ("auto", set(), cpu.R16_ID if FLOAT_R16 else cpu.FORMAT_IDS["bf16"])):
            cpu.configure({"cpu_bf16_linear_layout": value, "cpu_bf16_expert_layout": "rows"})
            with cpu.feature_mask(mask):
                assert cpu.prepare(w).args[0] == want, (value, mask)
        with cpu.feature_mask({"avx512_bf16"}):
            cpu.configure({"cpu_bf16_linear_layout": "auto"})
            assert cpu.bf16_linear_layout() == ("r16" if BF16_NATIVE or FLOAT_R16 else "rows")
            # the two knobs are apart: the experts' says nothing about linears
            assert cpu.bf16_expert_layout() == "rows"
    finally:
        cpu.configure({k: cpu.KNOB_DEFAULTS[k] for k in ("cpu_bf16_linear_layout", "cpu_bf16_expert_layout")})


def test_r16_auto_on_amx_takes_r16_except_for_fp8(monkeypatch):
    """Where AMX runs (its features stated here, so that every machine checks the choice): BF16, INT8 and INT4
    linears and expert stacks resolve auto to r16 (AMX's GEMM and the fused MoE's grouped path read BF16 / INT8
    r16 blocks in place as B tiles); FP8 to rows (its AMX GEMM expands row-major blocks as it packs them)."""
    monkeypatch.setattr(cpu, "features", lambda: {"avx512_vnni", "avx512_bf16", "amx"})
    names = [f"cpu_{f}_{k}_layout" for f in ("bf16", "int8", "int4", "fp8") for k in ("linear", "expert")]
    try:
        cpu.configure({n: "auto" for n in names})
        got = (cpu.bf16_linear_layout(), cpu.int8_linear_layout(), cpu.bf16_expert_layout(), cpu.int8_expert_layout(),
               cpu.int4_expert_layout(), cpu.int4_linear_layout(), cpu.fp8_linear_layout(), cpu.fp8_expert_layout())
        assert got == ("r16", "r16", "r16", "r16", "r16", "r16", "rows", "rows")
    finally:
        cpu.configure({n: cpu.KNOB_DEFAULTS[n] for n in names})


# ------------------------------------------------------------------ INT8 weights in the r16 layout

VNNI_NATIVE = "avx512_vnni" in cpu.features()
# rows forced onto the microkernels (no GEMM path), the row-major result each r16 policy must give bit for bit
ROWS_MICRO = {"cpu_dot_gemm_min_tokens": 1 << 20, "cpu_gemm_min_tokens": 1 << 20, "cpu_amx_min_tokens": 1 << 20}
# (int8_isa, features emulated, the r16 call's isa): vpdpbusd's model, vpmaddubsw (also where int8_isa asks for
# the int16 form, which r16 lacks), and the instruction where the CPU has it
INT8_R16_POLICIES = [("vnni", ["avx512_vnni"], "vnni-model+r16"), ("maddubs", [], "maddubs+r16"),
                     ("avx512", [], "maddubs+r16")] + ([("vnni", [], "vnni+r16")] if VNNI_NATIVE else [])


def int8_r16_moe(case: str, layout13: str = "r16", layout2: str = "r16"):
    t, e, d, i, k, pool = R16_CASES[case]
    w13, w2 = moe_weights(e, d, i, "int8", seed=t + e)
    tw, ids = routing(t, e, k, seed=t, experts=pool)
    x = torch.randn(t, d, generator=torch.Generator().manual_seed(11))
    return (cpu.prepare(w13, layout=layout13), cpu.prepare(w2, layout=layout2), w13, w2, x, tw, ids)


def test_int8_r16_pack_is_the_documented_layout_and_unpacks():
    w = torch.randint(-127, 128, (2, 32, 12), dtype=torch.int8, generator=torch.Generator().manual_seed(0))
    r = cpu.r16_pack(w)
    assert r.shape == w.shape and r.dtype == torch.int8
    flat = r.view(torch.int32).view(2, -1)  # per expert: block b, unit u, row r at b·16·3 + u·16 + r
    unit = w.view(torch.int32).view(2, 32, 3)  # unit u (4 int8) of row n
    for e, n, u in ((0, 0, 0), (0, 17, 2), (1, 31, 1), (1, 5, 0)):
        assert flat[e, (n // 16) * 48 + u * 16 + n % 16] == unit[e, n, u]
    assert torch.equal(cpu.r16_unpack(r), w)
    i8 = torch.int8
    assert cpu.r16_fits((4, 64, 4), i8) and not cpu.r16_fits((4, 64, 6), i8) and not cpu.r16_fits((4, 48, 8), i8)
    assert cpu.r16_fits((48, 8), i8) and not cpu.r16_fits((40, 8), i8) and not cpu.r16_fits((48, 10), i8)
    assert cpu.r16_fits((48, 10))  # bf16: pairs


@pytest.mark.parametrize("case", sorted(R16_CASES))
def test_int8_r16_fused_moe_equals_the_row_major_kernel_bitwise(case):
    """The integer sums are exact and the scales applied in micro_int8_dp's order, so every policy on r16
    gives the row-major microkernels' bits (and those match the w8a8 reference within TIGHT)."""
    p13, p2, w13, w2, x, tw, ids = int8_r16_moe(case)
    assert p13.args[0] == p2.args[0] == cpu.I8R16_ID and isinstance(p13.orig, cpu.Int8R16Weight)
    r13, r2 = cpu.prepare(w13, layout="rows"), cpu.prepare(w2, layout="rows")
    assert r13.args[0] == cpu.FORMAT_IDS["int8"]
    want = cpu.fused_moe(x, r13, r2, tw, ids, knobs=ROWS_MICRO)
    check(want, reference.fused_moe(x, w13, w2, tw, ids), TIGHT, f"rows {case}")
    for isa, emulated, used in INT8_R16_POLICIES:
        for xa in (x, x.to(torch.bfloat16)):
            with cpu.emulate(emulated), cpu.recording() as rec:
                got = cpu.fused_moe(xa, p13, p2, tw, ids, knobs={**SWEEP, "cpu_int8_isa": isa})
            assert rec[-1]["isa"] == used and rec[-1]["format"] == "int8", rec[-1]
            ref = want if xa.dtype == torch.float32 else cpu.fused_moe(xa, r13, r2, tw, ids, knobs=ROWS_MICRO)
            assert torch.equal(got, ref), (case, isa, emulated, xa.dtype)


@pytest.mark.parametrize("layouts", [("r16", "rows"), ("rows", "r16")])
def test_int8_r16_one_stack_in_each_layout(layouts):
    p13, p2, w13, w2, x, tw, ids = int8_r16_moe("odd_t13", *layouts)
    assert {p13.args[0], p2.args[0]} == {cpu.I8R16_ID, cpu.FORMAT_IDS["int8"]}
    with cpu.recording() as rec:
        got = cpu.fused_moe(x, p13, p2, tw, ids, knobs=ROWS_MICRO)
    assert rec[-1]["isa"].endswith("+r16")
    rows = cpu.fused_moe(x, cpu.prepare(w13, layout="rows"), cpu.prepare(w2, layout="rows"), tw, ids, knobs=ROWS_MICRO)
    assert torch.equal(got, rows)


def test_int8_r16_knobs_change_no_result_bitwise():
    for case in ("t40_few_experts", "all_on_one", "t1"):
        p13, p2, _, _, x, tw, ids = int8_r16_moe(case)
        want = cpu.fused_moe(x, p13, p2, tw, ids)
        for name, value in R16_KNOBS + [("cpu_dot_gemm_min_tokens", 1), ("cpu_gemm_min_tokens", 1)]:
            with cpu.recording() as rec:
                got = cpu.fused_moe(x, p13, p2, tw, ids, knobs={name: value})
            assert rec[-1]["knobs"][name] == value and "+r16" in rec[-1]["isa"]
            assert torch.equal(got, want), (case, name, value)


# (T, N, K): one block, odd token counts around the tile widths, a long prompt, the shortest rows (one unit)
INT8_R16_LINEAR = {"one_block": (3, 16, 64), "t1": (1, 256, 512), "t13": (13, 48, 1000), "t37": (37, 96, 132),
                   "t300": (300, 64, 256), "k4": (5, 32, 4)}


@pytest.mark.parametrize("case", sorted(INT8_R16_LINEAR))
def test_int8_r16_linear_equals_the_row_major_kernel_bitwise(case):
    t, n, k = INT8_R16_LINEAR[case]
    g = torch.Generator().manual_seed(n + k)
    w = make_weight(torch.randn(n, k, generator=g) * 0.05, "int8")
    p = cpu.prepare(w, layout="r16")
    assert p.args[0] == cpu.I8R16_ID and torch.equal(p.dequantize(), w.dequantize())
    x = torch.randn(t, k, generator=g)
    want = cpu.linear(x, cpu.prepare(w, layout="rows"), knobs=ROWS_MICRO)
    assert torch.equal(want, reference.linear(x, w))  # w8a8: exact sums, the reference's scaling order
    for isa, emulated, used in INT8_R16_POLICIES:
        with cpu.emulate(emulated), cpu.recording() as rec:
            got = cpu.linear(x, p, knobs={**SWEEP, "cpu_int8_isa": isa})
        assert rec[-1]["isa"] == used, rec[-1]
        assert torch.equal(got, want), (case, isa, emulated)
    for name, value in R16_KNOBS + [("cpu_linear_block_n", 16), ("cpu_linear_block_n", 1)]:
        assert torch.equal(cpu.linear(x, p, knobs={**SWEEP, name: value}), want), (case, name, value)
    # a call the kernels do not take (float16 rows) reaches the reference with the row-major weight: still w8a8
    xh = x.to(torch.float16)
    assert torch.equal(cpu.linear(xh, p), reference.linear(xh, w))


def test_int8_r16_layout_resolution_and_prepare():
    w13, _ = moe_weights(4, 64, 32, "int8")
    lin = make_weight(torch.randn(64, 64), "int8")
    names = ("cpu_int8_expert_layout", "cpu_int8_linear_layout", "cpu_huge_pages")
    try:
        for value, mask, want in (("rows", {"avx512_vnni"}, cpu.FORMAT_IDS["int8"]), ("r16", set(), cpu.I8R16_ID),
                                  ("auto", set(), cpu.FORMAT_IDS["int8"])):
            cpu.configure({"cpu_int8_expert_layout": value, "cpu_int8_linear_layout": value})
            with cpu.feature_mask(mask):
                assert cpu.prepare(w13).args[0] == want and cpu.prepare(lin).args[0] == want, (value, mask)
        cpu.configure({"cpu_int8_expert_layout": "auto", "cpu_int8_linear_layout": "rows"})
        with cpu.feature_mask({"avx512_vnni"}):  # auto: r16 where AVX512-VNNI runs and AMX does not
            assert cpu.int8_expert_layout() == ("r16" if VNNI_NATIVE else "rows")
            assert cpu.int8_linear_layout() == "rows"  # the two knobs are apart
            # and apart from BF16's (no AVX512-BF16 under this mask: the AVX-512 build's float32 r16)
            assert cpu.bf16_expert_layout() == ("r16" if FLOAT_R16 else "rows")
        with cpu.feature_mask({"avx512_vnni", "amx"}):
            if "amx" in cpu.features():
                assert cpu.int8_expert_layout() == "r16"
                cpu.configure({"cpu_int8_linear_layout": "auto"})
                assert cpu.int8_linear_layout() == "r16"
                cpu.configure({"cpu_int8_linear_layout": "rows"})
        # the engine's dict: repacked in the weight's own storage, the row sums taken before
        cpu.configure({"cpu_int8_expert_layout": "r16", "cpu_huge_pages": False})
        src = w13.w.clone()
        mine = formats.Int8ChannelWeight(src.clone(), w13.scale)
        loaded = {"layers.0.experts.w13": mine}
        packed = cpu.prepare_weights(loaded)["layers.0.experts.w13"]
        assert packed.args[1].data_ptr() == mine.w.data_ptr() and torch.equal(packed.args[1], cpu.r16_pack(src))
        assert torch.equal(packed.args[5], src.sum(-1, dtype=torch.int32))
        assert loaded["layers.0.experts.w13"] is packed and cpu.prepare_weights(loaded)["layers.0.experts.w13"] is packed
        assert torch.equal(packed[1].w, src[1]) and torch.equal(packed.dequantize(), w13.dequantize())
    finally:
        cpu.configure({k: cpu.KNOB_DEFAULTS[k] for k in names})
    odd = formats.quantize_int8_channel(torch.randn(4, 64, 66))  # K = 66: not whole units of 4
    assert cpu.prepare(odd, layout="r16").args[0] == cpu.FORMAT_IDS["int8"]
    assert cpu.prepare(make_weight(torch.randn(40, 64), "int8"), layout="r16").args[0] == cpu.FORMAT_IDS["int8"]


def test_int8_r16_refuses_bad_shapes_and_a_format_mix():
    with pytest.raises(RuntimeError, match="int8 r16 needs rows in whole blocks of 16, K a multiple of 4"):
        cpu._ext.linear(torch.randn(2, 66), cpu.I8R16_ID, torch.zeros(32, 66, dtype=torch.int8), 32, 66,
                        torch.ones(32), torch.zeros(32, dtype=torch.int32), 0, 1, cpu.make_knobs())
    p13, p2, *_ = int8_r16_moe("regular")
    b13, b2, *_ = r16_moe("regular")
    assert cpu.moe_formats_match(p13.args[0], cpu.FORMAT_IDS["int8"]) and not cpu.moe_formats_match(p13.args[0], b2.args[0])
    with pytest.raises(RuntimeError, match="different formats"):
        cpu._ext.fused_moe(torch.randn(2, 256), p13.args[0], p13.args[1], p13.args[4], p13.args[5], b2.args[0],
                           b2.args[1], b2.args[4], b2.args[5], 128, 0, 1, torch.ones(2, 2),
                           torch.zeros(2, 2, dtype=torch.long), cpu.make_knobs())


# ------------------------------------------------------------------ INT4 weights (groups of 128) in the r16 layout

# (int8_isa, features emulated, the r16 call's isa), as INT8_R16_POLICIES: INT4 r16 runs the int8 method always
INT4_R16_POLICIES = [("vnni", ["avx512_vnni"], "vnni-model+r16"), ("maddubs", [], "maddubs+r16"),
                     ("avx512", [], "maddubs+r16")] + ([("vnni", [], "vnni+r16")] if VNNI_NATIVE else [])
# the INT4 int8-method row-major microkernels, which r16 must match up to float32 summation order (per group
# products in another order): a few ulps of the result
INT4_ROWS = {**ROWS_MICRO, "cpu_int4_method": "int8"}
INT4_R16_VS_ROWS = 2e-6


def int4_r16_moe(case: str, symmetric: bool, layout13: str = "r16", layout2: str = "r16"):
    t, e, d, i, k, pool = R16_CASES[case]
    g = torch.Generator().manual_seed(t + e)
    w13 = formats.quantize_int4_group(torch.randn(e, 2 * i, d, generator=g) * 0.05, 128, symmetric)
    w2 = formats.quantize_int4_group(torch.randn(e, d, i, generator=g) * 0.05, 128, symmetric)
    tw, ids = routing(t, e, k, seed=t, experts=pool)
    x = torch.randn(t, d, generator=torch.Generator().manual_seed(11))
    return (cpu.prepare(w13, layout=layout13), cpu.prepare(w2, layout=layout2), w13, w2, x, tw, ids)


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("case", sorted(R16_CASES))
def test_int4_r16_fused_moe_matches_the_reference_and_the_row_major_kernel(case, symmetric):
    p13, p2, w13, w2, x, tw, ids = int4_r16_moe(case, symmetric)
    assert p13.args[0] == p2.args[0] == cpu.I4R16_ID and isinstance(p13.orig, cpu.Int4R16Weight)
    ref = reference.fused_moe(x, w13, w2, tw, ids)
    rows = cpu.fused_moe(x, cpu.prepare(w13, layout="rows"), cpu.prepare(w2, layout="rows"), tw, ids, knobs=INT4_ROWS)
    first = None
    for isa, emulated, used in INT4_R16_POLICIES:
        with cpu.emulate(emulated), cpu.recording() as rec:  # the microkernels' policies: every expert on them
            got = cpu.fused_moe(x, p13, p2, tw, ids, knobs={"cpu_int8_isa": isa, "cpu_int4_r16_amx_min_tokens": 4096})
        assert rec[-1]["isa"] == used and rec[-1]["format"] == "int4", rec[-1]
        check(got, ref, INT4_INT8_MOE, f"int4 r16 {case} {isa} {emulated}")
        check(got, rows, INT4_R16_VS_ROWS, f"int4 r16 vs rows {case} {isa}")
        first = got if first is None else first
        assert torch.equal(got, first), "exact integer sums per group: every policy gives the same bits"


def test_int4_r16_knobs_change_no_result_bitwise_and_one_stack_in_each_layout():
    """Each output sums its groups in order whatever the tile (a group's int32 sums are exact): every value of
    every knob the sweep reads gives the same bits; so does cpu_int4_method (the layout has one method)."""
    for case in ("t40_few_experts", "all_on_one", "t1"):
        p13, p2, _, _, x, tw, ids = int4_r16_moe(case, symmetric=False)
        want = cpu.fused_moe(x, p13, p2, tw, ids)
        for name, value in R16_KNOBS + [("cpu_int4_method", "float"), ("cpu_int4_gemm", "unpack")]:
            assert torch.equal(cpu.fused_moe(x, p13, p2, tw, ids, knobs={name: value}), want), (case, name, value)
    p13, p2, w13, w2, x, tw, ids = int4_r16_moe("odd_t13", True, "r16", "rows")
    assert (p13.args[0], p2.args[0]) == (cpu.I4R16_ID, cpu.FORMAT_IDS["int4"])
    check(cpu.fused_moe(x, p13, p2, tw, ids, knobs={"cpu_int4_method": "int8"}),
          reference.fused_moe(x, w13, w2, tw, ids), INT4_INT8_MOE, "int4 r16 | rows")

def test_int4_r16_symmetric_weights_read_no_zero_stream_and_give_its_bits():
    """Every zero point 8 (the quantizer's and the loader's symmetric INT4): prepare keeps no scale·zero products
    (6 % fewer bytes per weight, nbytes says so), and the tiles' 8·scale gives bitwise the stream's result, on every
    microkernel policy, through fused MoE and linear; one zero point off 8 keeps the stream."""
    for case in ("regular", "odd_t13", "t1", "empty_expert"):
        p13, p2, w13, w2, x, tw, ids = int4_r16_moe(case, symmetric=True)
        assert p13.orig.block_sz.numel() == 0 == p2.orig.block_sz.numel()
        assert p13.nbytes == p13.orig.packed.nbytes + p13.orig.block_scale.nbytes
        s13, s2 = with_zero_stream(p13), with_zero_stream(p2)
        assert s13.nbytes == p13.nbytes + 4 * p13.orig.scale.numel()  # the float32 scale·zero products
        for isa, emulated, _ in INT4_R16_POLICIES:
            kn = {"cpu_int8_isa": isa, "cpu_int4_r16_amx_min_tokens": 4096}
            with cpu.emulate(emulated):
                got = cpu.fused_moe(x, p13, p2, tw, ids, knobs=kn)
                assert torch.equal(got, cpu.fused_moe(x, s13, s2, tw, ids, knobs=kn)), (case, isa)
        check(got, reference.fused_moe(x, w13, w2, tw, ids), INT4_INT8_MOE, f"int4 r16 symmetric {case}")
    g = torch.Generator().manual_seed(5)
    w = formats.quantize_int4_group(torch.randn(48, 384, generator=g) * 0.05, 128)
    p, x = cpu.prepare(w, layout="r16"), torch.randn(7, 384, generator=g)
    assert torch.equal(cpu.linear(x, p), cpu.linear(x, with_zero_stream(p)))
    w.zero[3, 1] = 7.0  # one zero point off 8: the stream stays, and the result follows it
    q = cpu.prepare(w, layout="r16")
    assert q.orig.block_sz.numel() == q.orig.scale.numel()
    check(cpu.linear(x, q), reference.linear(x, w), INT4_INT8, "int4 r16 one zero point off 8")


# every row-major INT4 path: the microkernels per method and dot instruction (few tokens), the GEMM engines (every
# row on the GEMM path), each with the models it needs
INT4_ROWS_PATHS = ([({"cpu_int4_method": m, "cpu_int8_isa": isa}, emu) for m in ("int8", "int16", "float")
                    for isa, emu in (("vnni", ["avx512_vnni"]), ("maddubs", []), ("avx512", []))]
                   + [({"cpu_int4_gemm": gemm, "cpu_gemm_min_tokens": 1, "cpu_dot_gemm_min_tokens": 1,
                        "cpu_amx_min_tokens": 1 if gemm == "amx" else 4096}, emu)
                      for gemm, emu in (("unpack", []), ("vnni", ["avx512_vnni"]), ("maddubs", []),
                                        ("amx", ["amx", "avx512_vnni"]))])


def test_int4_rows_symmetric_weights_read_no_zero_points_and_give_their_bits():
    """Row-major INT4 with every zero point 8 (the quantizer's and the loader's symmetric weights): the kernels get
    no zero points (4 bytes fewer per group of a row; nbytes says so) and take 8, which gives bitwise the result with
    the zero points passed, on every microkernel method and dot instruction, every GEMM engine (on their models),
    linear and fused MoE; one zero point off 8 keeps them."""
    g = torch.Generator().manual_seed(9)
    for t, n, k, group in ((1, 48, 384, 128), (5, 37, 1000, 64), (3, 40, 256, 32), (40, 64, 512, 128), (70, 33, 384, 64)):
        w = formats.quantize_int4_group(torch.randn(n, k, generator=g) * 0.05, group)
        p = cpu.prepare(w, layout="rows")
        assert p.args[5].numel() == 0 and p.nbytes == w.packed.nbytes + w.scale.nbytes
        z = with_zero_points(p)
        assert z.args[5].numel() == w.zero.numel()
        x = torch.randn(t, k, generator=g)
        for knobs, emu in INT4_ROWS_PATHS:
            with cpu.emulate(emu):
                got = cpu.linear(x, p, knobs=knobs)
                assert torch.equal(got, cpu.linear(x, z, knobs=knobs)), (t, n, k, group, knobs)
        check(got, reference.linear(x, w), INT4_INT8, f"int4 rows symmetric t{t} n{n} k{k} g{group}")
    w.zero[3, 1] = 7.0  # one zero point off 8: they are passed, and the result follows them
    q = cpu.prepare(w, layout="rows")
    assert q.args[5].numel() == w.zero.numel() and q.nbytes == w.nbytes
    check(cpu.linear(x, q, knobs={"cpu_int4_method": "float"}), reference.linear(x, w), INT4_INT8, "one zero point off 8")
    for case in ("t1", "odd_t13"):
        p13, p2, w13, w2, x, tw, ids = int4_r16_moe(case, True, "rows", "rows")
        assert p13.args[5].numel() == 0 == p2.args[5].numel()
        for knobs, emu in (INT4_ROWS_PATHS[0], INT4_ROWS_PATHS[-2]):
            with cpu.emulate(emu):
                got = cpu.fused_moe(x, p13, p2, tw, ids, knobs=knobs)
                assert torch.equal(got, cpu.fused_moe(x, with_zero_points(p13), with_zero_points(p2), tw, ids,
                                                      knobs=knobs)), (case, knobs)
        check(got, reference.fused_moe(x, w13, w2, tw, ids), INT4_INT8_MOE, f"int4 rows symmetric moe {case}")


def test_int4_r16_bf16_block_scales_give_the_float32_bits():
    """Block scales that are all exact in bfloat16 (the quantizer rounds its symmetric scales so) are stored as
    bfloat16 (2 bytes fewer per 128 weights of a row; nbytes says so), and give bitwise the float32 ones' result on
    every microkernel policy and on the AMX GEMM (its model, and natively where it runs), fused MoE and linear; one
    scale that is not exact keeps them all float32."""
    for case in ("regular", "t1", "odd_t13"):
        p13, p2, w13, w2, x, tw, ids = int4_r16_moe(case, symmetric=True)
        assert p13.orig.block_scale.dtype == torch.bfloat16 == p2.orig.block_scale.dtype
        f13, f2 = with_float_scales(p13), with_float_scales(p2)
        assert f13.nbytes == p13.nbytes + p13.orig.block_scale.nbytes
        runs = [({"cpu_int8_isa": isa, "cpu_int4_r16_amx_min_tokens": 4096}, emu) for isa, emu, _ in INT4_R16_POLICIES]
        runs += [({"cpu_int4_gemm": "amx", "cpu_amx_min_tokens": 1, "cpu_int4_r16_amx_min_tokens": 1}, ["amx", "avx512_vnni"])]
        if "amx" in cpu.features():
            runs += [({"cpu_int4_gemm": "amx", "cpu_amx_min_tokens": 1, "cpu_int4_r16_amx_min_tokens": 1}, [])]
        for kn, emu in runs:
            with cpu.emulate(emu):
                got = cpu.fused_moe(x, p13, p2, tw, ids, knobs=kn)
                assert torch.equal(got, cpu.fused_moe(x, f13, f2, tw, ids, knobs=kn)), (case, kn, emu)
        check(got, reference.fused_moe(x, w13, w2, tw, ids), INT4_INT8_MOE, f"int4 r16 bf16 scales {case}")
    g = torch.Generator().manual_seed(6)
    w = formats.quantize_int4_group(torch.randn(48, 384, generator=g) * 0.05, 128)
    p, x = cpu.prepare(w, layout="r16"), torch.randn(7, 384, generator=g)
    assert torch.equal(cpu.linear(x, p), cpu.linear(x, with_float_scales(p)))
    w.scale[5, 2] = 0.0123456  # not exact in bfloat16: every block scale stays float32, and the result follows it
    q = cpu.prepare(w, layout="r16")
    assert q.orig.block_scale.dtype == torch.float32
    check(cpu.linear(x, q), reference.linear(x, w), INT4_INT8, "int4 r16 one float32 scale")


def test_int4_r16_moe_tasks_change_no_result_bitwise():
    """cpu_moe_int4_tasks only regroups INT4 r16 rows into longer tasks (each output row is one tile's, each down
    output sums the experts in order within its task): every value, on 1 and 2 threads, with cpu_moe_block_n 16 so
    that the tasks really change (an expert's 128 rows in 1..8 tasks, D's 256 in 1..16), gives the bits of
    cpu_moe_block_n rows per task, also where only one stack is r16 (each phase by its own stack's layout)."""
    threads = torch.get_num_threads()
    try:
        for case, layouts in (("regular", ("r16", "r16")), ("t1", ("r16", "r16")), ("empty_expert", ("r16", "r16")),
                              ("regular", ("r16", "rows")), ("regular", ("rows", "r16"))):
            p13, p2, w13, w2, x, tw, ids = int4_r16_moe(case, False, *layouts)
            want = cpu.fused_moe(x, p13, p2, tw, ids, knobs={"cpu_moe_int4_tasks": 0})
            check(want, reference.fused_moe(x, w13, w2, tw, ids), INT4_INT8_MOE, case)
            for n in (1, 2):
                torch.set_num_threads(n)
                for value in knob_samples("cpu_moe_int4_tasks"):
                    for block in (16, 128):
                        got = cpu.fused_moe(x, p13, p2, tw, ids,
                                            knobs={"cpu_moe_int4_tasks": value, "cpu_moe_block_n": block})
                        assert torch.equal(got, want), (case, layouts, n, value, block)
    finally:
        torch.set_num_threads(threads)



INT4_R16_LINEAR = {"one_block": (3, 16, 128), "t1": (1, 256, 512), "t13": (13, 48, 1000), "t37": (37, 96, 130),
                   "t300": (300, 64, 256)}


@pytest.mark.parametrize("case", sorted(INT4_R16_LINEAR))
def test_int4_r16_linear_matches_the_reference_and_the_row_major_kernel(case):
    t, n, k = INT4_R16_LINEAR[case]
    g = torch.Generator().manual_seed(n + k)
    w = formats.quantize_int4_group(torch.randn(n, k, generator=g) * 0.05, 128, symmetric=n % 32 == 0)
    p = cpu.prepare(w, layout="r16")
    assert p.args[0] == cpu.I4R16_ID and torch.equal(p.dequantize(), w.dequantize()) and p.shape == w.shape
    x = torch.randn(t, k, generator=g)
    ref = reference.linear(x, w)
    rows = cpu.linear(x, cpu.prepare(w, layout="rows"), knobs=INT4_ROWS)
    for isa, emulated, used in INT4_R16_POLICIES:
        with cpu.emulate(emulated), cpu.recording() as rec:  # the microkernels' policies (no AMX GEMM from 32 rows)
            got = cpu.linear(x, p, knobs={"cpu_int8_isa": isa, "cpu_int4_r16_amx_min_tokens": 4096})
        assert rec[-1]["isa"] == used, rec[-1]
        check(got, ref, INT4_INT8, f"int4 r16 linear {case} {isa}")
        check(got, rows, INT4_R16_VS_ROWS, f"int4 r16 linear vs rows {case} {isa}")
    for name, value in R16_KNOBS + [("cpu_linear_block_n", 16)]:
        assert torch.equal(cpu.linear(x, p, knobs={name: value}), cpu.linear(x, p)), (case, name, value)
    xh = x.to(torch.float16)  # not the kernels' dtype: the reference on the row-major weight
    assert torch.equal(cpu.linear(xh, p), reference.linear(xh, w))


def test_int4_group_values_in_huge_pages_where_they_fill_one(monkeypatch):
    """An INT4 weight's per-group values that the kernels read (rows: the scales, and the zero points where passed;
    r16: the block scales and scale·zero products) go to huge-page storage from HUGE_MIN_BYTES (2 MiB; 64 KiB here, so
    that small weights show it), as the weight bytes do; the result is bitwise that of ordinary pages
    (cpu_huge_pages=false), and smaller ones stay where they are."""
    monkeypatch.setattr(cpu, "HUGE_MIN_BYTES", 64 << 10)
    g = torch.Generator().manual_seed(3)
    w13 = {sym: formats.quantize_int4_group(torch.randn(2, 4096, 1024, generator=g) * 0.05, 128, sym)  # scales 256 KiB
           for sym in (True, False)}
    w2 = formats.quantize_int4_group(torch.randn(2, 1024, 2048, generator=g) * 0.05, 128)
    small = formats.quantize_int4_group(torch.randn(64, 1024, generator=g) * 0.05, 128)  # scales 2 KiB
    x, (tw, ids) = torch.randn(3, 1024, generator=g), routing(3, 2, 1, seed=2)
    try:
        for sym, w in w13.items():
            for layout in ("rows", "r16"):
                got = {}
                for huge in (True, False):
                    cpu.configure({"cpu_huge_pages": huge})
                    p = cpu.prepare(w, layout=layout)
                    passed = [a for a in p.args[4:6] if a.numel()]
                    assert len(passed) == (1 if sym else 2), (layout, len(passed))
                    assert all((a.data_ptr() % (2 << 20) == 0) == huge for a in passed), (huge, layout)
                    got[huge] = cpu.fused_moe(x, p, cpu.prepare(w2, layout=layout), tw, ids)
                assert torch.equal(got[True], got[False]), (sym, layout)
                check(got[True], reference.fused_moe(x, w, w2, tw, ids), INT4_INT8_MOE, f"int4 {layout} sym={sym}")
        cpu.configure({"cpu_huge_pages": True})
        assert cpu.prepare(small).args[4].data_ptr() == small.scale.data_ptr()  # below one huge page: kept
    finally:
        cpu.configure({"cpu_huge_pages": cpu.KNOB_DEFAULTS["cpu_huge_pages"]})


def test_int4_r16_layout_resolution_prepare_and_refusals():
    w13 = formats.quantize_int4_group(torch.randn(4, 64, 256) * 0.05, 128)
    lin = formats.quantize_int4_group(torch.randn(64, 256) * 0.05, 128)
    names = ("cpu_int4_expert_layout", "cpu_int4_linear_layout", "cpu_huge_pages")
    assert cpu.KNOB_DEFAULTS["cpu_int4_linear_layout"] == "rows"  # measured slower as r16 (the knob's help)
    try:
        for value, mask, want in (("rows", {"avx512_vnni"}, cpu.FORMAT_IDS["int4"]), ("r16", set(), cpu.I4R16_ID),
                                  ("auto", set(), cpu.FORMAT_IDS["int4"])):
            cpu.configure({"cpu_int4_expert_layout": value, "cpu_int4_linear_layout": value})
            with cpu.feature_mask(mask):
                assert cpu.prepare(w13).args[0] == want and cpu.prepare(lin).args[0] == want, (value, mask)
        cpu.configure({"cpu_int4_expert_layout": "auto"})
        with cpu.feature_mask({"avx512_vnni", "amx"}):  # no AMX form of INT4: r16 wherever VNNI runs
            assert cpu.int4_expert_layout() == ("r16" if VNNI_NATIVE else "rows")
        cpu.configure({"cpu_int4_expert_layout": "r16", "cpu_huge_pages": False})
        mine = formats.Int4GroupWeight(w13.packed.clone(), w13.scale, w13.zero, w13.k, w13.group)
        loaded = {"layers.0.experts.w13": mine}
        packed = cpu.prepare_weights(loaded)["layers.0.experts.w13"]
        assert packed.args[1].data_ptr() == mine.packed.data_ptr()
        assert torch.equal(packed.args[1], cpu.r16_pack(w13.packed)) and loaded["layers.0.experts.w13"] is packed
        assert torch.equal(packed[3].packed, w13.packed[3]) and torch.equal(packed.dequantize(), w13.dequantize())
        # the block scales: group g of a block's row r at g·16 + r
        bs = packed.args[4].view(4, 64 // 16, -1)
        assert bs[1, 2, 1 * 16 + 5] == w13.scale[1, 2 * 16 + 5, 1]
    finally:
        cpu.configure({k: cpu.KNOB_DEFAULTS[k] for k in names})
    for group in (32, 64):  # the tiles take groups of 128 only
        other = formats.quantize_int4_group(torch.randn(4, 64, 256), group)
        assert cpu.prepare(other, layout="r16").args[0] == cpu.FORMAT_IDS["int4"]
    with pytest.raises(RuntimeError, match="int4 r16 needs groups of 128"):
        cpu._ext.linear(torch.randn(2, 256), cpu.I4R16_ID, torch.zeros(32, 128, dtype=torch.uint8), 32, 256,
                        torch.ones(32, 4), torch.zeros(32, 4), 64, 1, cpu.make_knobs())
    b13, *_ = r16_moe("regular")
    assert not cpu.moe_formats_match(cpu.I4R16_ID, cpu.I8R16_ID) and not cpu.moe_formats_match(cpu.I4R16_ID, b13.args[0])


# ------------------------------------------------------------------ FP8 weights in the r16 layout


def fp8_r16_moe(case: str, layout13: str = "r16", layout2: str = "r16"):
    t, e, d, i, k, pool = R16_CASES[case]
    w13, w2 = moe_weights(e, d, i, "fp8", seed=t + e)
    tw, ids = routing(t, e, k, seed=t, experts=pool)
    x = torch.randn(t, d, generator=torch.Generator().manual_seed(11))
    return (cpu.prepare(w13, layout=layout13), cpu.prepare(w2, layout=layout2), w13, w2, x, tw, ids)


@pytest.mark.parametrize("case", sorted(R16_CASES))
def test_fp8_r16_fused_moe_matches_the_reference_on_every_policy(case):
    p13, p2, w13, w2, x, tw, ids = fp8_r16_moe(case)
    assert p13.args[0] == p2.args[0] == cpu.F8R16_ID and isinstance(p13.orig, cpu.Fp8R16Weight)
    with cpu.recording() as rec:  # float32 activations: float32 FMAs on the exact values
        check(cpu.fused_moe(x, p13, p2, tw, ids), reference.fused_moe(x, w13, w2, tw, ids), TIGHT, f"fp8 r16 f32 {case}")
    assert rec[-1]["isa"] == "avx512+r16" and rec[-1]["format"] == "fp8"
    xb = x.to(torch.bfloat16)
    refb = reference.fused_moe(xb, w13, w2, tw, ids)
    check(cpu.fused_moe(xb, p13, p2, tw, ids, knobs={"cpu_bf16_isa": "avx512"}), refb, BF16_MOE, f"fp8 r16 fma {case}")
    with cpu.emulate(["avx512_bf16"]), cpu.recording() as rec:
        model = cpu.fused_moe(xb, p13, p2, tw, ids, knobs={"cpu_bf16_isa": "avx512bf16"})
    assert rec[-1]["isa"] == "avx512bf16-model+r16"
    check(model, refb, BF16_MOE, f"fp8 r16 dot model {case}")
    if BF16_NATIVE:
        with cpu.recording() as rec:
            native = cpu.fused_moe(xb, p13, p2, tw, ids, knobs={"cpu_bf16_isa": "avx512bf16"})
        assert rec[-1]["isa"] == "avx512bf16+r16" and torch.equal(native, model)
    # every r16 knob value, either activation dtype: the same bits (a group's sums in one order)
    if case in ("t40_few_experts", "all_on_one", "t1"):
        for xa, extra in ((x, {}), (xb, {"cpu_bf16_isa": "avx512bf16"})):
            with cpu.emulate(["avx512_bf16"]) if extra else contextlib.nullcontext():
                want = cpu.fused_moe(xa, p13, p2, tw, ids, knobs=extra)
                for name, value in R16_KNOBS:
                    assert torch.equal(cpu.fused_moe(xa, p13, p2, tw, ids, knobs={**extra, name: value}), want), (name, value)


@pytest.mark.parametrize("case", ["t1", "t13", "t300"])
def test_fp8_r16_linear_and_one_stack_in_each_layout(case):
    t, n, k = {"t1": (1, 256, 512), "t13": (13, 48, 1000), "t300": (300, 64, 256)}[case]
    g = torch.Generator().manual_seed(n + k)
    w = make_weight(torch.randn(n, k, generator=g) * 0.05, "fp8")
    p = cpu.prepare(w, layout="r16")
    assert p.args[0] == cpu.F8R16_ID and torch.equal(p.dequantize(), w.dequantize())
    x = torch.randn(t, k, generator=g)
    check(cpu.linear(x, p), reference.linear(x, w), TIGHT, f"fp8 r16 linear {case}")
    xb = x.to(torch.bfloat16)
    with cpu.emulate(["avx512_bf16"]):
        check(cpu.linear(xb, p, knobs={"cpu_bf16_isa": "avx512bf16"}), reference.linear(xb, w), BF16_LINEAR, case)
    assert torch.equal(cpu.linear(x.to(torch.float16), p), reference.linear(x.to(torch.float16), w))
    p13, p2, w13, w2, xm, tw, ids = fp8_r16_moe("odd_t13", "rows", "r16")
    assert (p13.args[0], p2.args[0]) == (cpu.FORMAT_IDS["fp8"], cpu.F8R16_ID)
    check(cpu.fused_moe(xm, p13, p2, tw, ids), reference.fused_moe(xm, w13, w2, tw, ids), TIGHT, "fp8 rows | r16")


def test_fp8_r16_layout_resolution_and_refusals():
    w13, _ = moe_weights(4, 64, 32, "fp8")
    names = ("cpu_fp8_expert_layout", "cpu_fp8_linear_layout")
    # experts: r16 where AVX512-BF16 runs (auto); linears: rows by default (the GEMM path wins at prefill)
    assert cpu.KNOB_DEFAULTS["cpu_fp8_expert_layout"] == "auto" and cpu.KNOB_DEFAULTS["cpu_fp8_linear_layout"] == "rows"
    try:
        cpu.configure({"cpu_fp8_expert_layout": "auto"})
        with cpu.feature_mask({"avx512_bf16"}):
            assert cpu.fp8_expert_layout() == ("r16" if BF16_NATIVE or FLOAT_R16 else "rows")
            assert cpu.prepare(w13).args[0] == (cpu.F8R16_ID if BF16_NATIVE or FLOAT_R16 else cpu.FORMAT_IDS["fp8"])
        with cpu.feature_mask(set()):  # without AVX512-BF16: r16 on the AVX-512 build's float32 FMAs
            want = cpu.F8R16_ID if FLOAT_R16 else cpu.FORMAT_IDS["fp8"]
            assert cpu.fp8_expert_layout() == ("r16" if FLOAT_R16 else "rows") and cpu.prepare(w13).args[0] == want
        with cpu.feature_mask({"avx512_bf16", "amx"}):
            if "amx" in cpu.features():
                assert cpu.fp8_expert_layout() == "rows"
    finally:
        cpu.configure({n: cpu.KNOB_DEFAULTS[n] for n in names})
    odd = formats.quantize_fp8_block(torch.randn(64, 256), block=(8, 128))  # scale blocks of 8 rows
    assert cpu.prepare(odd, layout="r16").args[0] == cpu.FORMAT_IDS["fp8"]
    with pytest.raises(RuntimeError, match="fp8 r16 needs scale blocks of whole 16-row blocks"):
        cpu._ext.linear(torch.randn(2, 256), cpu.F8R16_ID, torch.zeros(32, 256, dtype=torch.uint8), 32, 256,
                        torch.ones(4, 2), cpu._EMPTY, 128, 8, cpu.make_knobs())
    assert not cpu.moe_formats_match(cpu.F8R16_ID, cpu.R16_ID) and cpu.moe_formats_match(cpu.F8R16_ID, cpu.FORMAT_IDS["fp8"])


# (T, N, K): one token; a part task (cpu_linear_block_n 64: 112 = 64 + 48); tokens over several tasks and groups
BF16_OUT = {"t1": (1, 112, 256), "t7": (7, 64, 384), "t70": (70, 208, 256)}


@pytest.mark.parametrize("layout", ["rows", "r16"])
@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4_g128", "int4_g128_asym", "fp8"])
@pytest.mark.parametrize("case", sorted(BF16_OUT))
def test_linear_on_bf16_rows_rounds_as_the_float32_path(case, fmt, layout):
    """bf16 rows in, bf16 rows out: the microkernel sweep rounds each task's float32 outputs to bf16 from a scratch
    in cache (gemv_rows_bf16): the same bits at every task size, and the float32 path's [T, N] output rounded
    afterwards where that path multiplies the same activation values (not BF16 / FP8 r16 weights, whose float32
    rows may run the FMA tiles on float32 activations)."""
    t, n, k = BF16_OUT[case]
    g = torch.Generator().manual_seed(t * n + k)
    w = make_weight(torch.randn(n, k, generator=g) * 0.05, fmt)
    p = cpu.prepare(w, layout=layout)
    xb = torch.randn(t, k, generator=g).to(torch.bfloat16)
    same_acts = layout == "rows" or fmt.startswith("int")
    first = None
    for knobs in ({}, {"cpu_linear_block_n": 16}, {"cpu_linear_block_n": 1024}):
        knobs = {**knobs, "cpu_gemm_min_tokens": 4096, "cpu_dot_gemm_min_tokens": 4096, "cpu_bf16_gemm_min_tokens": 4096, "cpu_amx_min_tokens": 4096}
        got = cpu.linear(xb, p, knobs=knobs)
        assert got.dtype == torch.bfloat16 and got.shape == (t, n)
        first = got if first is None else first
        assert torch.equal(got, first), (case, fmt, layout, knobs)
        if same_acts:
            assert torch.equal(got, cpu.linear(xb.float(), p, knobs=knobs).to(torch.bfloat16)), (case, fmt, layout, knobs)
    check(got, reference.linear(xb, w), INT4_INT8 if fmt.startswith("int4") else BF16_LINEAR, f"bf16 out {case} {fmt} {layout}")
