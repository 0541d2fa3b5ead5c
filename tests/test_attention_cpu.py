"""The "cpu" backend's attention (kernels/cpu/csrc/attention.cpp) against kernels.reference.

Ops: mla_decode (with and without the step's new rows), paged_decode (GQA 8/2, 6/3, 22/2, MHA 4/4; the packed
register form's 32/4, 12/4, 10/2, 56/8, MHA 8/8, under every register form and prefetch level),
extend_attention, paged_extend, chunked prefill. Shapes in groups: regular (the small preset:
H=16, R=512, P=64; the naive MLA extend form Dk=192, Dv=128), odd (6 and 22 heads, contexts 1, 7,
129, 300, head dims 24/20, block sizes 4 and 16) and corner (lengths [1, 129, 7], T=1 extends,
T=S with no prefix, a one-key prefix, block size 1, the engine's strided K/V views). Every paged
cache has its blocks out of order with holes between them, and every slot no sequence owns is NaN
(tests/attn_cases.py), so a stray read poisons the result. Caches float32 and bfloat16, queries
float32 or bfloat16; every value sampled from each cpu_attn_* knob's catalogue range (extremes
included) must give the same answer.

Tolerances, ‖got − ref‖ / ‖ref‖:
- float32 output (float32 queries, float32 or bfloat16 cache): 2e-5. Both sides compute in float32
  on the same (exactly widened) cache values; only the summation order and the online softmax's
  rescaling differ: measured ≤ 8.4e-7 over every case here (up to 8192 keys), so 2e-5 leaves
  room for longer contexts while any real mistake (a lost key, a wrong head) is orders above it.
- bfloat16 output (bf16 queries): 1e-2; both round the same float32 result to bf16, so they
  differ only where the two float32 values straddle a rounding boundary (measured ≤ 6e-5).
- the cache after mla_decode with new rows: bitwise equal to the reference's (index op).
- the BF16 dot form (cpu_attn_isa=avx512bf16: vdpbf16ps, or its C++ model on a CPU without it) and the
  AMX form (cpu_attn_isa=amx: TDPBF16PS tiles, or their C++ model), bf16 cache and queries: 1e-2, as any
  bf16 output. The QK products are exact (bf16 × bf16) and summed in
  float32 in pairs; the probabilities are rounded to bf16 before the PV product (relative error
  ≤ 2^-9 each), which leaves the output within 2.6e-3 of the reference over every case here (the
  float32 form: 4.6e-5 on the same bf16 inputs).
"""
import zlib
from functools import lru_cache

import pytest
import torch

from kernels import reference
from kernels.cpu_build import missing_isa

if missing_isa():
    pytest.skip(f"this CPU lacks {missing_isa()}: the cpu backend cannot run here", allow_module_level=True)

import kernels.cpu as cpu  # noqa: E402  (compiles the extension on first use)
from attn_cases import block_tables, nan_cache, paged, same_bits, slots, store  # noqa: E402
from engine.knobs import CATALOGUE  # noqa: E402
from test_kernels_cpu import check, knob_samples  # noqa: E402

TIGHT, BF16, DOT = 2e-5, 1e-2, 1e-2
F32, BF = torch.float32, torch.bfloat16
DTYPES = [(F32, F32), (BF, F32), (BF, BF)]  # (cache or K/V, query)
DTYPE_IDS = ["f32", "bf16cache", "bf16"]


def tol(q_dtype: torch.dtype) -> float:
    return TIGHT if q_dtype == F32 else BF16


def gen(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def randn(g, *shape, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=g) * scale


# ------------------------------------------------------------------ MLA decode

MLA_CASES = {  # name → (lens, H, R, P, BS)
    "regular_b1_2048": ([2048], 16, 512, 64, 64),
    "regular_b2_8192": ([8192, 5000], 16, 512, 64, 64),
    "regular_b4": ([512, 300, 1024, 64], 16, 512, 64, 64),
    "regular_v3_heads": ([257, 3], 128, 512, 64, 64),
    "regular_v3_b1": ([512], 128, 512, 64, 64),
    "odd_h6": ([1, 7, 129, 300], 6, 512, 64, 16),
    "odd_h22_r20_p4": ([300, 7, 129], 22, 20, 4, 16),
    "odd_bs4": ([7, 129], 22, 512, 64, 4),
    "corner_lens": ([1, 129, 7], 16, 512, 64, 64),
    "corner_one_key_one_head": ([1], 1, 512, 64, 64),
    "corner_bs1": ([5, 1, 33], 3, 32, 8, 1),
}


def mla_inputs(case: str, cache_dtype, q_dtype):
    lens, h, r, p, bs = MLA_CASES[case]
    g = gen("mla", case)
    cache, bt = paged([randn(g, n, r + p) for n in lens], bs, cache_dtype, g)
    q_lat, q_pe = randn(g, len(lens), h, r).to(q_dtype), randn(g, len(lens), h, p).to(q_dtype)
    return q_lat, q_pe, cache, bt, torch.tensor(lens, dtype=torch.int32), (r + p) ** -0.5


@pytest.mark.parametrize("cache_dtype,q_dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case", sorted(MLA_CASES))
def test_mla_decode(case, cache_dtype, q_dtype):
    args = mla_inputs(case, cache_dtype, q_dtype)
    check(cpu.mla_decode(*args), reference.mla_decode(*args), tol(q_dtype), f"mla_decode {case}")


NEW_ROWS_CASES = {  # name → (lens after the step, new tokens of each sequence)
    "decode_b3": ([1, 129, 7], [1, 1, 1]),
    "decode_b1_block_edge": ([65], [1]),
    "prefill_absorbed": ([70], [7]),  # one sequence's 7 new tokens, one query each (causal)
}


@pytest.mark.parametrize("rows_dtype", [F32, BF], ids=["rows_f32", "rows_bf16"])
@pytest.mark.parametrize("cache_dtype", [F32, BF], ids=["cache_f32", "cache_bf16"])
@pytest.mark.parametrize("case", sorted(NEW_ROWS_CASES))
def test_mla_decode_writes_new_rows(case, cache_dtype, rows_dtype):
    """The step's rows are stored (bitwise as the reference stores them) and attended to."""
    lens, new = NEW_ROWS_CASES[case]
    h, r, p, bs = 16, 512, 64, 64
    g = gen("mla_rows", case)
    seqs = [randn(g, n, r + p) for n in lens]
    nb, bt = block_tables(lens, bs, g)
    cache = nan_cache(nb, bs, (r + p,), cache_dtype)
    queries, lens_q, where, rows = [], [], [], []
    for b, (n, k) in enumerate(zip(lens, new)):
        store(cache, bt[b], seqs[b][:n - k])
        where.append(slots(bt[b], range(n - k, n), bs))
        rows.append(seqs[b][n - k:])
        queries += [b] * k
        lens_q += list(range(n - k + 1, n + 1))
    tables, seq_lens = bt[queries], torch.tensor(lens_q, dtype=torch.int32)
    q_lat, q_pe = randn(g, len(queries), h, r), randn(g, len(queries), h, p)
    new_rows, new_slots = torch.cat(rows).to(rows_dtype), torch.cat(where)
    ref_cache, cpu_cache = cache.clone(), cache.clone()
    want = reference.mla_decode(q_lat, q_pe, ref_cache, tables, seq_lens, 0.04, new_rows, new_slots)
    got = cpu.mla_decode(q_lat, q_pe, cpu_cache, tables, seq_lens, 0.04, new_rows, new_slots)
    assert same_bits(cpu_cache, ref_cache), "the cache after the step differs from the reference's"
    check(got, want, TIGHT, f"mla_decode with new rows {case}")


# ------------------------------------------------------------------ MHA / GQA paged decode

DECODE_CASES = {  # name → (lens, H, Hkv, Dk, Dv, BS)
    "regular_gqa_8_2": ([300, 1, 129], 8, 2, 128, 128, 16),
    "regular_mha_4": ([129, 7, 1], 4, 4, 64, 64, 64),
    "odd_gqa_6_3": ([7, 300], 6, 3, 24, 20, 16),
    "odd_gqa_22_2": ([300, 129], 22, 2, 24, 20, 4),
    "corner_lens": ([1, 129, 7], 8, 2, 192, 128, 64),
    "corner_bs1": ([5, 1], 4, 2, 24, 20, 1),
    # the packed form's shapes (auto takes it for ≤ 8 rows per KV head): Qwen3-MoE's 32 / 4 (2 KV heads per task,
    # 16 lanes), 4 KV heads of 3 rows (12 lanes, dims with a chunk tail), 2 of 5 (10 lanes, block size 4), 8 KV heads
    # of 7 rows (P = 2 of 8), MHA (4 heads of one row each per task)
    "regular_qwen3_32_4": ([2048, 300], 32, 4, 128, 128, 16),
    "odd_gqa_12_4": ([7, 129, 300], 12, 4, 72, 40, 16),
    "odd_gqa_10_2": ([300, 1, 33], 10, 2, 24, 20, 4),
    "odd_gqa_56_8": ([1, 129], 56, 8, 64, 64, 16),
    "corner_mha_8_one_key": ([1], 8, 8, 16, 16, 1),
}


def decode_inputs(case: str, cache_dtype, q_dtype):
    lens, h, hkv, dk, dv, bs = DECODE_CASES[case]
    g = gen("decode", case)
    k_cache, bt = paged([randn(g, n, hkv, dk) for n in lens], bs, cache_dtype, g)
    v_cache, _ = paged([randn(g, n, hkv, dv) for n in lens], bs, cache_dtype, g, (k_cache.shape[0], bt))
    q = randn(g, len(lens), h, dk).to(q_dtype)
    return q, k_cache, v_cache, bt, torch.tensor(lens, dtype=torch.int32), dk ** -0.5


@pytest.mark.parametrize("cache_dtype,q_dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case", sorted(DECODE_CASES))
def test_paged_decode(case, cache_dtype, q_dtype):
    args = decode_inputs(case, cache_dtype, q_dtype)
    check(cpu.paged_decode(*args), reference.paged_decode(*args), tol(q_dtype), f"paged_decode {case}")


PACKED_CASES = ["regular_gqa_8_2", "regular_mha_4", "odd_gqa_6_3", "odd_gqa_12_4", "odd_gqa_10_2", "odd_gqa_56_8",
                "corner_bs1", "corner_mha_8_one_key"]


@pytest.mark.parametrize("cache_dtype", [F32, BF], ids=["cache_f32", "cache_bf16"])
@pytest.mark.parametrize("case", PACKED_CASES)
def test_paged_decode_every_register_form_and_prefetch(case, cache_dtype):
    """cpu_attn_f32_form (the packed form where a KV head has ≤ 8 rows and P divides the KV heads; 6 / 3 packs
    nothing) × cpu_attn_prefetch, with one key split and with several (the splits' partial outputs in head order)."""
    args = decode_inputs(case, cache_dtype, F32)
    want = reference.paged_decode(*args)
    for form in ("transpose", "lanes", "packed", "auto"):
        for pf in ("none", "t0", "t1", "t2"):
            for splits in (1, 8):
                knobs = {"cpu_attn_f32_form": form, "cpu_attn_prefetch": pf, "cpu_attn_kv_splits": splits,
                         "cpu_attn_decode_kv_block": 16}
                check(cpu.paged_decode(*args, knobs=knobs), want, TIGHT, f"paged_decode {case} {knobs}")


# ------------------------------------------------------------------ extend (prefill)

EXTEND_CASES = {  # name → (T new tokens, prefix, H, Hkv, Dk, Dv)
    "regular_mla_naive": (300, 0, 16, 16, 192, 128),
    "regular_mla_naive_prefix": (129, 300, 16, 16, 192, 128),
    "regular_gqa_8_2": (64, 100, 8, 2, 128, 128),
    "odd_h6": (7, 129, 6, 3, 24, 20),
    "odd_h22": (129, 7, 22, 22, 24, 20),
    "corner_t1": (1, 300, 16, 16, 192, 128),
    "corner_t1_alone": (1, 0, 6, 6, 24, 20),
    "corner_no_prefix": (37, 0, 4, 2, 24, 20),
    "corner_prefix_1": (129, 1, 8, 2, 64, 64),
}


def extend_inputs(case: str, kv_dtype, q_dtype):
    t, prefix, h, hkv, dk, dv = EXTEND_CASES[case]
    g = gen("extend", case)
    q = randn(g, t, h, dk).to(q_dtype)
    k, v = randn(g, prefix + t, hkv, dk).to(kv_dtype), randn(g, prefix + t, hkv, dv).to(kv_dtype)
    return q, k, v, dk ** -0.5


@pytest.mark.parametrize("kv_dtype,q_dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case", sorted(EXTEND_CASES))
def test_extend_attention(case, kv_dtype, q_dtype):
    args = extend_inputs(case, kv_dtype, q_dtype)
    check(cpu.extend_attention(*args), reference.extend_attention(*args), tol(q_dtype), f"extend {case}")


@pytest.mark.parametrize("dtype", [F32, BF], ids=["f32", "bf16"])
def test_extend_attention_on_the_engines_views(dtype):
    """The naive MLA path's inputs: K = [k_nope | k_pe broadcast over heads], V a strided view."""
    t, prefix, h, nope, pe, dv = 65, 70, 16, 128, 64, 128
    g = gen("views")
    kv = randn(g, prefix + t, h, nope + dv).to(dtype)
    k_pe = randn(g, prefix + t, pe).to(dtype)
    k_nope, v = kv.split([nope, dv], dim=-1)
    k = torch.cat([k_nope, k_pe.unsqueeze(1).expand(-1, h, -1)], dim=-1)
    q = randn(g, t, h, nope + pe).to(dtype)
    assert not v.is_contiguous()
    check(cpu.extend_attention(q, k, v, 0.07), reference.extend_attention(q, k, v, 0.07), tol(dtype), "views")


PAGED_EXTEND_BS = {"regular_mla_naive_prefix": 64, "regular_gqa_8_2": 16, "odd_h6": 4, "corner_t1": 16,
                   "corner_no_prefix": 16, "corner_prefix_1": 1}


def paged_extend_inputs(case: str, cache_dtype, q_dtype):
    q, k, v, scale = extend_inputs(case, cache_dtype, q_dtype)
    g = gen("paged_extend", case)
    k_cache, bt = paged([k], PAGED_EXTEND_BS[case], cache_dtype, g)
    v_cache, _ = paged([v], PAGED_EXTEND_BS[case], cache_dtype, g, (k_cache.shape[0], bt))
    return (q, k_cache, v_cache, bt[0], k.shape[0], scale), (q, k, v, scale)


@pytest.mark.parametrize("cache_dtype,q_dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case", sorted(PAGED_EXTEND_BS))
def test_paged_extend(case, cache_dtype, q_dtype):
    args, dense = paged_extend_inputs(case, cache_dtype, q_dtype)
    got = cpu.paged_extend(*args)
    check(got, reference.paged_extend(*args), tol(q_dtype), f"paged_extend {case}")
    check(got, reference.extend_attention(*dense), tol(q_dtype), f"paged_extend {case} vs dense")


@pytest.mark.parametrize("cache_dtype", [F32, BF], ids=["f32", "bf16"])
@pytest.mark.parametrize("h,hkv,dk,dv,bs", [(16, 16, 192, 128, 64), (6, 3, 24, 20, 16)])
def test_chunked_prefill_equals_one_extend(h, hkv, dk, dv, bs, cache_dtype):
    """300 tokens as chunks of 128 + 100 + 72, each chunk's keys written just before it attends
    (later positions still NaN) = one paged_extend over all 300 = extend_attention."""
    g = gen("chunks", h, dk)
    q, k, v = randn(g, 300, h, dk), randn(g, 300, hkv, dk).to(cache_dtype), randn(g, 300, hkv, dv).to(cache_dtype)
    nb, bt = block_tables([300], bs, g)
    k_cache, v_cache = nan_cache(nb, bs, (hkv, dk), cache_dtype), nan_cache(nb, bs, (hkv, dv), cache_dtype)
    outs, start = [], 0
    for n in (128, 100, 72):
        store(k_cache, bt[0], k[start:start + n], start)
        store(v_cache, bt[0], v[start:start + n], start)
        outs.append(cpu.paged_extend(q[start:start + n], k_cache, v_cache, bt[0], start + n, dk ** -0.5))
        start += n
    chunked = torch.cat(outs)
    check(chunked, cpu.paged_extend(q, k_cache, v_cache, bt[0], 300, dk ** -0.5), TIGHT, "chunked vs one call")
    check(chunked, reference.extend_attention(q, k, v, dk ** -0.5), TIGHT, "chunked vs reference")


# ------------------------------------------------------------------ knobs: every value, same answer


def attn_knob_values(name: str) -> list:
    """The catalogue samples (low, default, middle, high), plus 3 and 5 where any integer is allowed;
    every choice of a choice knob."""
    k = CATALOGUE[name]
    if k.choices is not None:
        return list(k.choices)
    odd = () if k.pow2 else (3, 5)
    return sorted(set(knob_samples(name)) | {v for v in odd if k.low <= v <= k.high})


ATTN_KNOB_CASES = [(n, v) for n in cpu.ATTN_KNOBS for v in attn_knob_values(n)]


@lru_cache(maxsize=None)
def knob_inputs(cache_dtype: torch.dtype) -> list[tuple]:
    """(op, args, reference answer) for each op, made once per cache dtype."""
    g = gen("knobs", str(cache_dtype))
    lens, bs = [1, 129, 300, 7], 16
    mla_cache, bt = paged([randn(g, n, 576) for n in lens], bs, cache_dtype, g)
    mla = (randn(g, 4, 22, 512), randn(g, 4, 22, 64), mla_cache, bt, torch.tensor(lens, dtype=torch.int32), 0.04)
    decode = decode_inputs("odd_gqa_6_3", cache_dtype, F32)
    extend = extend_inputs("regular_gqa_8_2", cache_dtype, F32)
    paged_ext, _ = paged_extend_inputs("regular_mla_naive_prefix", cache_dtype, F32)
    return [("mla_decode", mla, reference.mla_decode(*mla)),
            ("paged_decode", decode, reference.paged_decode(*decode)),
            ("extend_attention", extend, reference.extend_attention(*extend)),
            ("paged_extend", paged_ext, reference.paged_extend(*paged_ext))]


@pytest.mark.parametrize("name,value", ATTN_KNOB_CASES, ids=[f"{n}={v}" for n, v in ATTN_KNOB_CASES])
def test_every_attention_knob_value_gives_the_same_answer(name, value):
    for cache_dtype in (F32, BF):
        for op, args, want in knob_inputs(cache_dtype):
            got = getattr(cpu, op)(*args, knobs={name: value})
            # the BF16 dot form asked for by name rounds the float32 queries (where the CPU has it)
            bound = DOT if (name, value) in (("cpu_attn_isa", "avx512bf16"), ("cpu_attn_isa", "amx")) else TIGHT
            check(got, want, bound, f"{op} cache {cache_dtype} {name}={value}")


@pytest.mark.parametrize("extreme", ["low", "high"])
def test_every_attention_knob_at_its_extreme_together(extreme):
    knobs = {n: getattr(CATALOGUE[n], extreme) for n in cpu.ATTN_KNOBS if CATALOGUE[n].choices is None}
    for op, args, want in knob_inputs(BF):
        check(getattr(cpu, op)(*args, knobs=knobs), want, TIGHT, f"{op} {knobs}")


def test_attention_knobs_mirror_the_catalogue():
    for name in cpu.ATTN_KNOBS:
        assert CATALOGUE[name].default == cpu.KNOB_DEFAULTS[name] and CATALOGUE[name].component == "kernels/cpu"


# ------------------------------------------------------------------ the BF16 dot form (cpu_attn_isa)

DOT_KNOBS = {"cpu_attn_isa": "avx512bf16"}


def on_dot(fn, *args, native: bool = False, knobs=None):
    """fn(*args) with the dot form asked for, on vdpbf16ps's C++ model (native: on the instruction);
    returns (output, the variant the call record names)."""
    with cpu.emulate([] if native else ["avx512_bf16"]), cpu.recording() as rec:
        out = fn(*args, knobs={**DOT_KNOBS, **(knobs or {})})
    return out, rec[-1]["isa"]


DOT_WANT = "avx512bf16-model"


DOT_CASES = ([("mla_decode", c) for c in sorted(MLA_CASES)] + [("paged_decode", c) for c in sorted(DECODE_CASES)]
             + [("extend_attention", c) for c in sorted(EXTEND_CASES)]
             + [("paged_extend", c) for c in sorted(PAGED_EXTEND_BS)])


def dot_inputs(op: str, case: str) -> tuple:
    """The op's inputs of the conformance case with a bf16 cache and bf16 queries."""
    if op == "mla_decode":
        return mla_inputs(case, BF, BF)
    if op == "paged_decode":
        return decode_inputs(case, BF, BF)
    if op == "extend_attention":
        return extend_inputs(case, BF, BF)
    return paged_extend_inputs(case, BF, BF)[0]


@pytest.mark.parametrize("op,case", DOT_CASES, ids=[f"{o}-{c}" for o, c in DOT_CASES])
def test_bf16_dot_form(op, case):
    args = dot_inputs(op, case)
    got, isa = on_dot(getattr(cpu, op), *args)
    assert isa == DOT_WANT
    check(got, getattr(reference, op)(*args), DOT, f"{op} dot {case}")


@pytest.mark.parametrize("knobs", [{"cpu_attn_head_fold": 1, "cpu_attn_kv_splits": 1},
                                   {"cpu_attn_head_fold": 5, "cpu_attn_decode_kv_block": 16},
                                   {"cpu_attn_kv_splits": 64, "cpu_attn_decode_kv_block": 1024},
                                   {"cpu_attn_blas_rows": 1}],
                         ids=["fold1", "fold5_kvb16", "splits64_kvb1024", "blas_rows1"])
def test_bf16_dot_under_the_other_attention_knobs(knobs):
    """Folded rows 1 .. 22 (register groups of 16 and a remainder), one key per block up to whole
    contexts, and the sgemm threshold (the dot form replaces the sgemm form)."""
    args = mla_inputs("odd_h22_r20_p4", BF, BF)
    got, isa = on_dot(cpu.mla_decode, *args, knobs=knobs)
    assert isa == DOT_WANT
    check(got, reference.mla_decode(*args), DOT, f"mla_decode dot {knobs}")


def test_kv_splits_never_exceed_what_the_threads_need():
    """A sequence's keys are split only while there are fewer (sequence, KV head, head block) tasks
    than threads: with 2 threads, one sequence runs in 2 pieces whatever the cap above 2 (bitwise
    equal), a batch of 4 in one piece each (any cap gives the same bits); a cap of 1 still holds."""
    args1 = mla_inputs("regular_b1_2048", BF, F32)
    args4 = mla_inputs("regular_b4", BF, F32)
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        run = lambda args, s: cpu.mla_decode(*args, knobs={"cpu_attn_kv_splits": s})  # noqa: E731
        assert same_bits(run(args1, 2), run(args1, 8)) and same_bits(run(args1, 2), run(args1, 64))
        assert not same_bits(run(args1, 1), run(args1, 2))  # one piece: a different summation order
        assert same_bits(run(args4, 1), run(args4, 8)) and same_bits(run(args4, 1), run(args4, 64))
        check(run(args1, 64), reference.mla_decode(*args1), tol(F32), "mla_decode, splits capped")
    finally:
        torch.set_num_threads(old)


def test_one_sequence_splits_its_heads_before_its_keys():
    """Fewer (sequence, KV head, head block) tasks than threads: the head blocks are halved (not below one
    register group of 16 heads) before a sequence's keys are split. With 2 threads one sequence of
    DeepSeek-V3's 128 heads runs as two 64-head blocks of one key piece each: the same bits as asking for
    64-head blocks, and as forbidding key splits; within the bound of the reference."""
    args = mla_inputs("regular_v3_b1", BF, F32)
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        run = lambda **kn: cpu.mla_decode(*args, knobs=kn)  # noqa: E731
        got = run(cpu_attn_head_fold=128)
        assert same_bits(got, run(cpu_attn_head_fold=64))
        assert same_bits(got, run(cpu_attn_head_fold=128, cpu_attn_kv_splits=1))
        check(got, reference.mla_decode(*args), tol(F32), "mla_decode, one sequence, head blocks halved")
    finally:
        torch.set_num_threads(old)


def test_bf16_dot_auto_takes_only_bf16_queries_and_a_bf16_cache():
    """auto: the dot form where the queries are bf16 values already (nothing rounded that the model did
    not round); float32 queries, a float32 cache or an odd key length keep the float32 FMAs, even when
    the dot form is asked for by name (cache, odd length)."""
    def isa(args, value, fn=cpu.paged_decode):
        with cpu.emulate(["avx512_bf16"]), cpu.recording() as rec:
            fn(*args, knobs={"cpu_attn_isa": value})
        return rec[-1]["isa"]

    with cpu.feature_mask(cpu.features() - {"amx"}):  # (auto prefers AMX: its own test below)
        assert isa(decode_inputs("regular_mha_4", BF, BF), "auto") == DOT_WANT
    assert isa(decode_inputs("regular_mha_4", BF, F32), "auto") == "avx512"
    assert isa(decode_inputs("regular_mha_4", BF, F32), "avx512bf16") == DOT_WANT
    assert isa(decode_inputs("regular_mha_4", F32, BF), "avx512bf16") == "avx512"
    assert isa(decode_inputs("regular_mha_4", BF, BF), "avx512") == "avx512"
    g = gen("odd_dk")
    k_cache, bt = paged([randn(g, 9, 1, 7)], 4, BF, g)
    v_cache, _ = paged([randn(g, 9, 1, 5)], 4, BF, g, (k_cache.shape[0], bt))
    odd = (randn(g, 1, 2, 7).to(BF), k_cache, v_cache, bt, torch.tensor([9], dtype=torch.int32), 0.3)
    assert isa(odd, "avx512bf16") == "avx512"
    check(cpu.paged_decode(*odd, knobs={"cpu_attn_isa": "avx512bf16"}), reference.paged_decode(*odd), DOT, "odd Dk")


def test_bf16_dot_without_the_feature_runs_avx512():
    """Asked for by name on a CPU (or feature mask) without AVX512-BF16 and not emulated: float32 FMAs."""
    args = decode_inputs("regular_mha_4", BF, BF)
    with cpu.feature_mask(set()), cpu.recording() as rec:
        got = cpu.paged_decode(*args, knobs=DOT_KNOBS)
    assert rec[-1]["isa"] == "avx512"
    check(got, reference.paged_decode(*args), BF16, "masked")


@pytest.mark.skipif("avx512_bf16" not in cpu.features(), reason="this CPU lacks avx512_bf16: its dot form runs "
                    "only on the instruction's C++ model here (the tests above)")
@pytest.mark.parametrize("case", ["regular_b4", "regular_v3_heads", "odd_h22_r20_p4"])
def test_native_bf16_dot_mla_decode_equals_its_model(case):
    """vdpbf16ps itself: the same answer as the model (the model under DAZ/FTZ has the instruction's
    rounding and denormal rules; only the order of the pair's two products may differ), and the reference."""
    args = mla_inputs(case, BF, BF)
    native, isa = on_dot(cpu.mla_decode, *args, native=True)
    assert isa == "avx512bf16"
    model, _ = on_dot(cpu.mla_decode, *args)
    check(native, model, 1e-5, f"native vs model {case}")
    check(native, reference.mla_decode(*args), DOT, f"native {case}")


# ------------------------------------------------------------------ the AMX form (cpu_attn_isa=amx)

AMX_KNOBS = {"cpu_attn_isa": "amx"}


def on_amx(fn, *args, native: bool = False, knobs=None):
    """fn(*args) with the AMX form asked for, on the tiles' C++ model (native: on the tiles); returns
    (output, the variant the call record names)."""
    with cpu.emulate([] if native else ["amx"]), cpu.recording() as rec:
        out = fn(*args, knobs={**AMX_KNOBS, **(knobs or {})})
    return out, rec[-1]["isa"]


def amx_shape(op: str, case: str) -> bool:
    """Key dims a multiple of 32 and value dims of 16: the AMX form's shapes (others take the dot form)."""
    args = dot_inputs(op, case)
    if op == "mla_decode":
        return (args[0].shape[-1] + args[1].shape[-1]) % 32 == 0 and args[0].shape[-1] % 16 == 0
    return args[1].shape[-1] % 32 == 0 and args[2].shape[-1] % 16 == 0


@pytest.mark.parametrize("op,case", DOT_CASES, ids=[f"{o}-{c}" for o, c in DOT_CASES])
def test_amx_form(op, case):
    """Every conformance case on the tiles' model: the AMX form where the dims allow, else the dot form
    (its model here too where the CPU lacks AVX512-BF16, the instruction where it has it)."""
    args = dot_inputs(op, case)
    got, isa = on_amx(getattr(cpu, op), *args)
    assert isa == "amx-model" if amx_shape(op, case) else isa in ("avx512bf16", "avx512")
    check(got, getattr(reference, op)(*args), DOT, f"{op} amx {case}")


# (lens, heads, R, P, block size): 16-key tiles in place (block sizes 16, 64) or copied (1, 4, and across
# blocks out of order), row groups of 16 with remainders (1, 5, 17, 40 heads), the lazy max's moves
AMX_MLA = {"bs1_h17": ([33, 5, 1], 17, 64, 32, 1), "bs4_h5": ([70, 129], 5, 64, 32, 4),
           "bs16_h40": ([300, 16, 31], 40, 128, 32, 16), "bs64_h1": ([257, 64], 1, 64, 32, 64),
           "b1_bs16_h16": ([140], 16, 512, 64, 16)}


def amx_mla_inputs(case: str, rising: float = 0.0):
    lens, h, r, p, bs = AMX_MLA[case]
    g = gen("amx_mla", case)
    seqs = [randn(g, n, r + p) for n in lens]
    if rising:  # scores grow by about `rising` per key along the sequence: the running max keeps moving
        for s in seqs:
            s[:, 0] = torch.arange(s.shape[0]) * rising
    cache, bt = paged(seqs, bs, BF, g)
    q_lat, q_pe = randn(g, len(lens), h, r).to(BF), randn(g, len(lens), h, p).to(BF)
    if rising:
        q_lat[..., 0] = 1.0
    return q_lat, q_pe, cache, bt, torch.tensor(lens, dtype=torch.int32), 1.0


@pytest.mark.parametrize("knobs", [{}, {"cpu_attn_head_fold": 1, "cpu_attn_kv_splits": 1},
                                   {"cpu_attn_head_fold": 5, "cpu_attn_blas_kv_block": 16},
                                   {"cpu_attn_kv_splits": 64, "cpu_attn_blas_kv_block": 4096}],
                         ids=["defaults", "fold1", "fold5_kvb16", "splits64_kvb4096"])
@pytest.mark.parametrize("case", sorted(AMX_MLA))
def test_amx_mla_decode_tiles_rows_and_blocks(case, knobs):
    args = amx_mla_inputs(case)
    got, isa = on_amx(cpu.mla_decode, *args, knobs=knobs)
    assert isa == "amx-model"
    check(got, reference.mla_decode(*args), DOT, f"mla_decode amx {case} {knobs}")


@pytest.mark.parametrize("rising", [0.5, -0.5, 20.0], ids=["rising", "falling", "steep"])
def test_amx_lazy_max_moves_and_rescales(rising):
    """Scores that rise along the keys move the running max by more than kLazyMax again and again (every
    output row rescaled, from one block to the next and within the first), falling ones never after the first
    block; steep ones leave one key with almost all the weight. All equal the reference."""
    for case in ("bs16_h40", "bs4_h5"):
        args = amx_mla_inputs(case, rising)
        for kvb in (16, 256):
            got, _ = on_amx(cpu.mla_decode, *args, knobs={"cpu_attn_blas_kv_block": kvb})
            check(got, reference.mla_decode(*args), DOT, f"mla_decode amx {case} rising {rising} kvb {kvb}")


def test_amx_auto_and_fallbacks():
    """auto takes AMX (where it runs: here its model) for bf16 queries and a bf16 cache of AMX's dims; float32
    queries keep the FMAs; dims off AMX's multiples take the dot form; asked for by name where AMX is masked
    off and not modelled, the dot form's rule; masked entirely, float32 FMAs."""
    def isa(args, value="auto", fn=cpu.paged_decode):
        with cpu.recording() as rec:
            fn(*args, knobs={"cpu_attn_isa": value})
        return rec[-1]["isa"]

    bf = decode_inputs("regular_gqa_8_2", BF, BF)
    with cpu.emulate(["amx", "avx512_bf16"]):
        assert isa(bf) == "amx-model"
        assert isa(decode_inputs("regular_gqa_8_2", BF, F32)) == "avx512"
        assert isa(decode_inputs("odd_gqa_6_3", BF, BF)) == DOT_WANT
        assert isa(bf, "avx512bf16") == DOT_WANT
        assert isa(extend_inputs("regular_gqa_8_2", BF, BF), fn=cpu.extend_attention) == "amx-model"
    with cpu.emulate(["avx512_bf16"]), cpu.feature_mask(cpu.features() - {"amx"}):
        assert isa(bf, "amx") == DOT_WANT
    with cpu.feature_mask(set()):
        got = cpu.paged_decode(*bf, knobs=AMX_KNOBS)
        assert isa(bf, "amx") == "avx512"
    check(got, reference.paged_decode(*bf), BF16, "amx masked off")


@pytest.mark.skipif("amx" not in cpu.features(), reason="this CPU lacks AMX (or Linux refuses its tile state): "
                    "the AMX form runs only on the tiles' C++ model here (the tests above)")
@pytest.mark.parametrize("op,case", [("mla_decode", "regular_v3_heads"), ("mla_decode", "regular_b4"),
                                     ("paged_decode", "regular_gqa_8_2"), ("extend_attention", "regular_gqa_8_2"),
                                     ("paged_extend", "regular_mla_naive_prefix")])
def test_native_amx_attention_equals_its_model(op, case):
    """TDPBF16PS itself: the model's answer up to the order of the float32 sums within a tile (and the
    instruction's denormal rule), and the reference's within the bf16 bound. The queries hold bf16 values
    in float32 tensors, so the outputs are float32. Bound 1e-4: another order of a score's sum can flip a
    probability's bf16 rounding before PV (2^-9 of it), measured ≤ 1.5e-5 here, while one lost key or
    tile is orders above."""
    args = tuple(a.float() if i < (2 if op == "mla_decode" else 1) else a for i, a in enumerate(dot_inputs(op, case)))
    native, isa = on_amx(getattr(cpu, op), *args, native=True)
    assert isa == "amx"
    model, _ = on_amx(getattr(cpu, op), *args)
    check(native, model, 1e-4, f"native vs model {op} {case}")
    check(native, getattr(reference, op)(*args), DOT, f"native amx {op} {case}")


def test_amx_one_sequence_splits_its_keys_in_whole_tiles():
    """One sequence of 16 heads on 2 threads: one head block, so the AMX form cuts the keys into 2 pieces of
    whole 16-key tiles (≥ 32 keys, however long its blocks): both within the bound, and not the bits of one
    piece (the split happened); 20 keys stay one piece (the same bits as forbidding splits)."""
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        args = amx_mla_inputs("b1_bs16_h16")
        one, _ = on_amx(cpu.mla_decode, *args, knobs={"cpu_attn_kv_splits": 1})
        two, _ = on_amx(cpu.mla_decode, *args, knobs={"cpu_attn_kv_splits": 8})
        want = reference.mla_decode(*args)
        check(one, want, DOT, "one piece")
        check(two, want, DOT, "two pieces")
        assert not same_bits(one.float(), two.float())
        short = args[:4] + (torch.tensor([20], dtype=torch.int32),) + args[5:]
        a, _ = on_amx(cpu.mla_decode, *short, knobs={"cpu_attn_kv_splits": 1})
        b, _ = on_amx(cpu.mla_decode, *short, knobs={"cpu_attn_kv_splits": 8})
        assert same_bits(a, b)
        check(b, reference.mla_decode(*short), DOT, "20 keys")
    finally:
        torch.set_num_threads(old)
