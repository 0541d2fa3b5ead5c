"""Kernel-tier adapters for the "cpu" backend (kernels/cpu): linear and fused MoE with their tile
knobs, MLA decode and extend attention with the cpu_attn_* knobs; on a GQA model's own shapes
(`model_ops`) the MHA/GQA paged decode and extend too.

Registered by `register_cpu_ops()` (called from tuner.kernel_tier.kernel_ops) only when the
backend imports on this machine and its knobs (kernels.cpu.KNOB_DEFAULTS) are in the catalogue.
Shapes are the `small` preset's (D = 2048, I = 1408, top-6) with 8 experts, so one configuration
is checked and timed in seconds; the verify step compares with kernels.reference on the same
quantized weights. The timed calls cycle through copies of the weights (linear), other routings and,
where the stacks are small, copies of them (fused MoE), or copies of the caches (decode attention),
≥ 2 × the last-level cache in all, so each call reads them from DRAM as in a model's step.
Attention: the small preset's too (H = 16; MLA decode over a bf16 latent cache R = 512, P = 64 in
shuffled blocks of 64; extend in the naive MLA form Dk = 192, Dv = 128, no prefix), bf16 queries.

The ISA knobs (cpu_int8_isa, cpu_bf16_isa) are searched over the variants that run natively here
("auto" and those cpu.runnable_choices names): the ops' catalogue narrows their choices, so no trial
asks for an instruction the CPU lacks (it would only measure the fallback again).
"""
from __future__ import annotations

import dataclasses

import torch

from engine.knobs import CATALOGUE
from tuner.kernel_tier import KernelOp, register_kernel_op

D, I, E, TOPK, N_LINEAR = 2048, 1408, 8, 6, 2048
FORMATS = ("bf16", "int8", "fp8", "int4")
BUCKETS = ({"tokens": 1}, {"tokens": 16}, {"tokens": 128})
HEADS, R, P, BLOCK, DK, DV = 16, 512, 64, 64, 192, 128
MLA_BUCKETS = ({"batch": 1, "context": 2048}, {"batch": 16, "context": 2048})
EXTEND_BUCKETS = ({"tokens": 512}, {"tokens": 2048})
DECODE_KNOBS = ("cpu_attn_head_fold", "cpu_attn_kv_splits", "cpu_attn_decode_kv_block", "cpu_attn_blas_rows",
                "cpu_attn_blas_kv_block")  # blas_rows also decides the extend form; searched here
EXTEND_KNOBS = ("cpu_attn_extend_q_block", "cpu_attn_extend_kv_block")


def quantized(w: torch.Tensor, fmt: str):
    """A float32 weight [..., N, K] in `fmt` (kernels.formats)."""
    from kernels import formats

    if fmt in ("bf16", "f32"):
        return formats.DenseWeight(w.to(torch.bfloat16 if fmt == "bf16" else torch.float32))
    return {"int8": formats.quantize_int8_channel, "fp8": formats.quantize_fp8_block,
            "int4": formats.quantize_int4_group}[fmt](w)


def _linear_inputs(bucket: dict, fmt: str) -> tuple:
    import kernels.cpu as cpu

    n, k = bucket.get("n", N_LINEAR), bucket.get("k", D)
    g = torch.Generator().manual_seed(bucket["tokens"])
    w = quantized(torch.randn(n, k, generator=g) * 0.02, fmt)
    return torch.randn(bucket["tokens"], k, generator=g).to(_act_dtype(fmt)), cpu.prepare(w), w


def _moe_inputs(bucket: dict, fmt: str) -> tuple:
    import kernels.cpu as cpu

    t, e, i, d, topk = (bucket.get(f, v) for f, v in
                        (("tokens", 1), ("experts", E), ("inter", I), ("hidden", D), ("topk", TOPK)))
    g = torch.Generator().manual_seed(t)
    w13 = quantized(torch.randn(e, 2 * i, d, generator=g) * 0.02, fmt)
    w2 = quantized(torch.randn(e, d, i, generator=g) * 0.02, fmt)
    ids = torch.stack([torch.randperm(e, generator=g)[:topk] for _ in range(t)])
    weights = torch.softmax(torch.randn(t, topk, generator=g), -1)
    x = torch.randn(t, d, generator=g).to(_act_dtype(fmt))
    return x, cpu.prepare(w13), cpu.prepare(w2), weights, ids, w13, w2


def _act_dtype(fmt: str) -> torch.dtype:
    return torch.float32 if fmt == "f32" else torch.bfloat16


BITS = {"f32": 32, "bf16": 16, "int8": 8, "fp8": 8, "int4": 4}


def _linear_work(bucket: dict, fmt: str) -> dict:
    n, k = bucket.get("n", N_LINEAR), bucket.get("k", D)
    return {"bytes": n * k * BITS[fmt] // 8, "flops": 2 * bucket["tokens"] * n * k}


def _moe_work(bucket: dict, fmt: str) -> dict:
    e, i, d, topk = (bucket.get(f, v) for f, v in (("experts", E), ("inter", I), ("hidden", D), ("topk", TOPK)))
    touched = min(e, bucket["tokens"] * topk)
    return {"bytes": touched * 3 * i * d * BITS[fmt] // 8, "flops": 2 * bucket["tokens"] * topk * 3 * i * d}


def _mla_inputs(bucket: dict, fmt: str) -> tuple:
    b, context = bucket["batch"], bucket["context"]
    heads, r, p = bucket.get("heads", HEADS), bucket.get("rank", R), bucket.get("rope", P)
    g = torch.Generator().manual_seed(b * context)
    per_seq = -(-context // BLOCK)
    cache = torch.randn(b * per_seq, BLOCK, r + p, generator=g).to(_act_dtype(fmt))
    tables = torch.randperm(b * per_seq, generator=g).to(torch.int32).view(b, per_seq)
    lens = torch.full((b,), context, dtype=torch.int32)
    q_lat, q_pe = (torch.randn(b, heads, n, generator=g).to(_act_dtype(fmt)) for n in (r, p))
    return q_lat, q_pe, cache, tables, lens, (p + 128) ** -0.5


def _mla_work(bucket: dict, fmt: str) -> dict:
    heads, r, p = bucket.get("heads", HEADS), bucket.get("rank", R), bucket.get("rope", P)
    keys = bucket["batch"] * bucket["context"]
    return {"bytes": keys * (r + p) * BITS[fmt] // 8, "flops": keys * heads * (2 * (r + p) + 2 * r)}


def _extend_inputs(bucket: dict, fmt: str) -> tuple:
    t = bucket["tokens"]
    heads, dk, dv = bucket.get("heads", HEADS), bucket.get("dk", DK), bucket.get("dv", DV)
    g = torch.Generator().manual_seed(t)
    q, k, v = (torch.randn(t, heads, d, generator=g).to(_act_dtype(fmt)) for d in (dk, dk, dv))
    return q, k, v, dk ** -0.5


def _extend_work(bucket: dict, fmt: str) -> dict:
    t = bucket["tokens"]
    heads, dk, dv = bucket.get("heads", HEADS), bucket.get("dk", DK), bucket.get("dv", DV)
    return {"bytes": BITS[fmt] // 8 * t * heads * (2 * dk + 2 * dv), "flops": heads * (dk + dv) * t * (t + 1)}


def _gqa_dims(bucket: dict) -> tuple[int, int, int, int]:
    return tuple(bucket.get(f, v) for f, v in (("heads", HEADS), ("kv_heads", HEADS // 4), ("dk", 128), ("dv", 128)))


def _paged_cache(keys: list[int], dims: tuple, fmt: str, g: torch.Generator) -> tuple:
    """K and V caches [NB, BLOCK, Hkv, d] holding `keys[i]` tokens for sequence i in shuffled
    blocks, and the block tables [B, max blocks] int32."""
    _, hkv, dk, dv = dims
    per_seq = [-(-n // BLOCK) for n in keys]
    nb = sum(per_seq)
    k, v = (torch.randn(nb, BLOCK, hkv, d, generator=g).to(_act_dtype(fmt)) for d in (dk, dv))
    order = torch.randperm(nb, generator=g).to(torch.int32)
    tables = torch.zeros(len(keys), max(per_seq), dtype=torch.int32)
    start = 0
    for i, n in enumerate(per_seq):
        tables[i, :n] = order[start:start + n]
        start += n
    return k, v, tables


def _paged_decode_inputs(bucket: dict, fmt: str) -> tuple:
    b, context, dims = bucket["batch"], bucket["context"], _gqa_dims(bucket)
    g = torch.Generator().manual_seed(b * context)
    k, v, tables = _paged_cache([context] * b, dims, fmt, g)
    q = torch.randn(b, dims[0], dims[2], generator=g).to(_act_dtype(fmt))
    return q, k, v, tables, torch.full((b,), context, dtype=torch.int32), dims[2] ** -0.5


def _paged_extend_inputs(bucket: dict, fmt: str) -> tuple:
    t, dims = bucket["tokens"], _gqa_dims(bucket)
    g = torch.Generator().manual_seed(t)
    k, v, tables = _paged_cache([t], dims, fmt, g)
    q = torch.randn(t, dims[0], dims[2], generator=g).to(_act_dtype(fmt))
    return q, k, v, tables[0], t, dims[2] ** -0.5


def _paged_decode_work(bucket: dict, fmt: str) -> dict:
    h, hkv, dk, dv = _gqa_dims(bucket)
    keys = bucket["batch"] * bucket["context"]
    return {"bytes": keys * hkv * (dk + dv) * BITS[fmt] // 8, "flops": 2 * keys * h * (dk + dv)}


def _paged_extend_work(bucket: dict, fmt: str) -> dict:
    t, (h, hkv, dk, dv) = bucket["tokens"], _gqa_dims(bucket)
    return {"bytes": BITS[fmt] // 8 * t * (h * (dk + dv) + hkv * (dk + dv)), "flops": h * (dk + dv) * t * (t + 1)}


# ------------------------------------------------------------------ cold weights: what the timed calls cycle through

MAX_COPIES = 512  # copies of one small weight at most (a 0.5 MB router would take ~1000 for 2 × a 260 MB L3)


def _copy(t):
    """A copy of a weight's or cache's tensor, in the storage prepare() gives weights (huge pages from
    2 MiB); anything else as it is."""
    import kernels.cpu as cpu

    if not isinstance(t, torch.Tensor):
        return t
    out = cpu.weight_empty(t.shape, t.dtype) if t.is_contiguous() else torch.empty_strided(t.shape, t.stride(), dtype=t.dtype)
    return out.copy_(t)


def _weight_copy(w):
    """A prepared weight (kernels.cpu.Packed) with its tensors copied, or a tensor's copy."""
    import kernels.cpu as cpu

    return dataclasses.replace(w, args=tuple(_copy(a) for a in w.args)) if isinstance(w, cpu.Packed) else _copy(w)


def _copies(nbytes: int, cap: int = MAX_COPIES) -> int:
    """How many copies of `nbytes` a cycle needs to stream ≥ 2 × the last-level cache (suites.kernels'
    rule for its linear cases), at most `cap`."""
    from suites.kernels import weight_copies

    return max(1, min(cap, weight_copies(int(nbytes))))


_last_copies: list = [None, []]  # (the weight's layout, its copies): the last linear's, kept for the next study


def _linear_rotate(a: tuple) -> list[tuple]:
    """Copies of the weight; a study of the same weight layout as the one before (the next token bucket)
    reuses that one's copies: equal in every timing respect, and the copying (~1 s for 2 × a 260 MB L3)
    done once per shape instead of once per bucket."""
    import kernels.cpu as cpu

    w = a[1]
    parts = w.args if isinstance(w, cpu.Packed) else (w,)
    key = tuple((t.shape, t.dtype, t.stride()) if isinstance(t, torch.Tensor) else t for t in parts)
    if _last_copies[0] != key:
        _last_copies[:] = [None, []]  # the previous copies freed before the new ones are made
        _last_copies[:] = [key, [_weight_copy(w) for _ in range(_copies(w.nbytes) - 1)]]
    return [a] + [(a[0], c, a[2]) for c in _last_copies[1]]


def release_copies() -> None:
    """Free the last linear's copies (kept for the next study of its layout): the kernel tier is done."""
    _last_copies[:] = [None, []]


def _moe_rotate(a: tuple) -> list[tuple]:
    """Other routings (suites.kernels.ROUTINGS of them: one call's experts are another's only by chance),
    and copies of the expert stacks where they are too small for routings alone to leave the cache."""
    from suites.kernels import ROUTINGS, random_routes

    x, w13, w2, _, ids, r13, r2 = a
    stacks = [(w13, w2)] + [(_weight_copy(w13), _weight_copy(w2)) for _ in range(_copies(w13.nbytes + w2.nbytes, 8) - 1)]
    routes = random_routes(ids.shape[0], w13.shape[0], ids.shape[1], torch.Generator().manual_seed(ids.shape[0]),
                           n=ROUTINGS)
    return [a] + [(x, *stacks[i % len(stacks)], *routes[(i - 1) % len(routes)], r13, r2)
                  for i in range(1, max(len(stacks), len(routes) + 1))]


def _cache_rotate(*at: int):
    """Copies of the attention caches at positions `at` of the arguments (decode reads every layer's)."""
    def rotate(a: tuple) -> list[tuple]:
        n = _copies(sum(a[i].nbytes for i in at), 64)
        return [a] + [tuple(_copy(v) if i in at else v for i, v in enumerate(a)) for _ in range(n - 1)]
    return rotate


def _registered(names) -> dict[str, tuple[str, ...]]:
    """Each kernel-tier op's knobs: the backend's declaration of what each op reads (OP_KNOBS)."""
    from kernels.cpu_knobs import OP_KNOBS

    return {"linear": OP_KNOBS["linear"], "fused_moe": OP_KNOBS["fused_moe"],
            "cpu_mla_decode": OP_KNOBS["mla_decode"],
            "cpu_extend_attention": tuple(n for n in OP_KNOBS["extend_attention"] if n in EXTEND_KNOBS),
            "cpu_paged_decode": OP_KNOBS["paged_decode"],
            "cpu_paged_extend": tuple(n for n in OP_KNOBS["paged_extend"] if n in EXTEND_KNOBS)}


def _make_op(name: str, knobs: tuple, formats: tuple, buckets: tuple) -> KernelOp:
    import kernels.cpu as cpu
    from kernels import reference

    if name == "linear":
        return KernelOp("linear", knobs, formats, buckets, _linear_inputs,
                        run=lambda a, **k: cpu.linear(a[0], a[1], knobs=k),
                        reference=lambda a: reference.linear(a[0], a[2]), atol=5e-2, rtol=3e-2, work=_linear_work,
                        catalogue=runnable_catalogue(cpu), rotate=_linear_rotate)
    if name == "fused_moe":
        return KernelOp("fused_moe", knobs, formats, buckets, _moe_inputs,
                        run=lambda a, **k: cpu.fused_moe(*a[:5], knobs=k),
                        reference=lambda a: reference.fused_moe(a[0], a[5], a[6], a[3], a[4]), atol=5e-2,
                        rtol=3e-2, work=_moe_work, catalogue=runnable_catalogue(cpu), rotate=_moe_rotate)
    if name == "cpu_mla_decode":
        return KernelOp("cpu_mla_decode", knobs, formats, buckets, _mla_inputs,
                        run=lambda a, **k: cpu.mla_decode(*a, knobs=k), reference=lambda a: reference.mla_decode(*a),
                        atol=1e-2, rtol=1e-2, work=_mla_work, rotate=_cache_rotate(2))
    if name == "cpu_paged_decode":
        return KernelOp("cpu_paged_decode", knobs, formats, buckets, _paged_decode_inputs,
                        run=lambda a, **k: cpu.paged_decode(*a, knobs=k),
                        reference=lambda a: reference.paged_decode(*a), atol=1e-2, rtol=1e-2, work=_paged_decode_work,
                        rotate=_cache_rotate(1, 2))
    if name == "cpu_paged_extend":
        return KernelOp("cpu_paged_extend", knobs, formats, buckets, _paged_extend_inputs,
                        run=lambda a, **k: cpu.paged_extend(*a, knobs=k),
                        reference=lambda a: reference.paged_extend(*a), atol=1e-2, rtol=1e-2, work=_paged_extend_work)
    return KernelOp("cpu_extend_attention", knobs, formats, buckets, _extend_inputs,
                    run=lambda a, **k: cpu.extend_attention(*a, knobs=k),
                    reference=lambda a: reference.extend_attention(*a), atol=1e-2, rtol=1e-2, work=_extend_work)


def runnable_catalogue(cpu) -> dict:
    """The catalogue with each ISA knob's choices narrowed to the variants this machine runs."""
    cat = dict(CATALOGUE)
    for name in cpu.ISA_KNOBS:
        if name in cat:
            cat[name] = dataclasses.replace(cat[name], choices=cpu.runnable_choices(name))
    return cat


def register_cpu_ops() -> bool:
    """Register linear, fused_moe, cpu_mla_decode and cpu_extend_attention (the `small` preset's
    shapes, 8 experts) when the cpu backend runs here; False (and nothing) otherwise."""
    try:
        import kernels.cpu  # noqa: F401
    except ImportError:
        return False
    knobs = _registered(CATALOGUE)
    register_kernel_op(_make_op("linear", knobs["linear"], FORMATS, BUCKETS))
    register_kernel_op(_make_op("fused_moe", knobs["fused_moe"], FORMATS, BUCKETS))
    register_kernel_op(_make_op("cpu_mla_decode", knobs["cpu_mla_decode"], ("bf16",), MLA_BUCKETS))
    register_kernel_op(_make_op("cpu_extend_attention", knobs["cpu_extend_attention"], ("bf16",), EXTEND_BUCKETS))
    return True


# The model's own shapes: token buckets that decode and prefill use; attention by batch × context.
TOKEN_BUCKETS = (1, 4, 16, 64, 512)
HEAD_BUCKETS = (1, 4, 16)  # the LM head sees one row per sequence
MLA_MODEL_BUCKETS = ((1, 128), (1, 2048), (4, 2048), (1, 8192))
EXTEND_MODEL_BUCKETS = (16, 128, 512)


def model_ops(sites, token_buckets=TOKEN_BUCKETS, ops=None, formats=None) -> list[KernelOp]:
    """Kernel-tier ops on a loaded model's own call sites (`LLM.kernel_plan`): one op per (op,
    format), its buckets every distinct shape × the token buckets (MLA decode: batch × context),
    so the tables it yields match the sites by shape (engine/kernel_tables.py)."""
    from engine.kernel_tables import BACKEND_TO_TABLE

    knobs = _registered(CATALOGUE)
    groups: dict[tuple, list] = {}
    for site in sites:
        name = BACKEND_TO_TABLE[site.op]
        if (ops and name not in ops) or (formats and site.format not in formats):
            continue
        shape = dict(site.shape)
        if name in ("cpu_mla_decode", "cpu_paged_decode"):
            buckets = [{**shape, "batch": b, "context": c} for b, c in MLA_MODEL_BUCKETS]
        elif name in ("cpu_extend_attention", "cpu_paged_extend"):
            buckets = [{**shape, "tokens": t} for t in EXTEND_MODEL_BUCKETS]
        else:
            tokens = [t for t in token_buckets if t <= max(HEAD_BUCKETS)] if "lm_head" in site.names else token_buckets
            buckets = [{**shape, "tokens": t} for t in tokens]
        groups.setdefault((name, site.format), []).extend(buckets)
    return [_make_op(name, knobs[name], (fmt,), tuple(buckets)) for (name, fmt), buckets in groups.items()]
