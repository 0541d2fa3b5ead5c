"""Kernel suite: each op × weight format of the "cpu" backend on real layer shapes, side by side
with torch on the same math, as fractions of the machine's measured limits (tuner.probe).

    moetune bench kernels [--op fused_moe|linear|mla_decode|paged_decode|extend] [--format bf16|int8|fp8|int4]
                          [--tokens N ...] [--context N ...] [--prefix N ...] [--shapes small|v3|all]
                          [--repeats 10] [--experts-v3 32] [--json]

Shapes: the `small` preset's (D=2048, I=1408, E=64, top-6; dense gate_up [11264, 2048], LM head
[32000, 2048]) and DeepSeek-V3's (D=7168, I=2048, top-8, --experts-v3 of its 256 experts;
o_proj [7168, 16384]). Weights are random values made directly in each format (no quantizer run).
For fused MoE every repeat routes to other experts (a cycle of 8 routings), so weights come from
DRAM as in decode, and the bytes counted are those of the experts each call touches. A linear case
below 64 tokens cycles through copies of its weight (ours and torch's each) that together exceed twice the last-level
cache and POOL_BYTES, for the same reason (a 300 MiB L3 would otherwise hold a 46 MB weight).

Attention (default ops: fused_moe and linear only; the format is the cache's, bf16):
- mla_decode: B = --tokens sequences (default 1, 4, 16) of --context keys each (default 512, 2048,
  8192) over a paged latent cache (small: H=16, R=512, P=64; v3: H=128), block size 64, blocks in
  shuffled order. Every call reads another region of a ≥ 256 MB block pool (ours the even ones,
  torch's the odd ones), so the cache comes from DRAM as in a real model (one cache per layer).
  torch = kernels.reference.mla_decode on the same cache. bytes = Σ lens · (R+P) · 2;
  flops = Σ lens · H · (2(R+P) + 2R).
- paged_decode (MHA/GQA decode): the same sequences, contexts and pool over a paged K and V cache
  [blocks, 64, Hkv, d] of the GQA presets' shapes (small: Qwen3-MoE's 32 query / 4 KV heads of 128 dims,
  the `small-llama` preset's 32 / 8 of 64, Qwen2-MoE's MHA 16 / 16 of 128; v3: Qwen3-235B's 64 / 4 of
  128). torch = kernels.reference.paged_decode. bytes = Σ lens · Hkv · 2d · 2; flops = Σ lens · H · 4d.
- extend: T = --tokens new tokens (default 512, 2048, 8192) after --prefix cached keys (default 0,
  a fresh prompt, and 1024, a chunk after a cached prefix), the naive MLA form (small: H=16, v3:
  H=128; Dk=192, Dv=128; bf16 q/k/v). torch = F.scaled_dot_product_attention in [1, H, T, D]
  layout, is_causal without a prefix, a boolean mask with one; V zero-padded to Dk beforehand, as
  torch's CPU flash kernel needs Dk = Dv (else its math path materializes the T × S scores:
  ≈ 10 GB at 8K). flops = 2 · H · (Dk + Dv) · the causal (query, key) pairs T · prefix + T(T+1)/2;
  bytes = q, k, v read and the output written once.
Rows carry `context`: the keys per sequence (mla_decode, paged_decode) or prefix + T (extend); None otherwise.

Printed first: the ISA variants of the cpu kernels (cpu_int8_isa, cpu_bf16_isa) that run natively
here and those that exist only as C++ models (tests); each row's `isa` is what its case ran (the
call record of its first warm-up: avx512, vnni, avx512bf16, amx, blas, "+"-joined). Choose a variant
with --knob cpu_int8_isa=avx512 and the like.

Each case: 2 warm-ups, then `repeats` rounds alternating ours and torch's (F.linear per expert on
weights dequantized to bfloat16 beforehand, bf16 activations); median and p10/p90 of each.
gbps = bytes touched / median; fraction_of_read_bw = gbps / the probe's read bandwidth; GFLOP/s
and fraction_of_peak_flops against the probe's peak of the instruction the case ran (`peak`: VNNI,
AVX512-BF16 dot, AMX, else FP32 FMA). The weight ops (fused_moe, linear) also time, in each round, the
fastest of three read methods (the probe's best, sequential, the kernels' pattern) over the same bytes
from DRAM (PairedRead): paired_read_gbps (its median) and
fraction_of_paired_read = gbps / paired_read_gbps, the kernel against the memory as fast as it runs in
those same rounds (on a shared VM the bandwidth drifts by up to 2x between minutes). Rows go to the
Parquet store (results.store, suite "kernels").
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from kernels import formats

FORMATS = ("bf16", "int8", "fp8", "int4")
OPS = ("fused_moe", "linear", "mla_decode", "paged_decode", "extend")
DEFAULT_OPS = ("fused_moe", "linear")
WEIGHT_TOKENS = (1, 2, 4, 8, 16, 64, 512)
TOKENS = {"fused_moe": WEIGHT_TOKENS, "linear": WEIGHT_TOKENS, "mla_decode": (1, 4, 16), "paged_decode": (1, 4, 16),
          "extend": (512, 2048, 8192)}
CONTEXTS = (512, 2048, 8192)  # mla_decode, paged_decode: keys per sequence
PREFIXES = (0, 1024)  # extend: cached keys before the new tokens
ROUTINGS = 8
INT4_GROUP = 128
CACHE_BLOCK = 64
POOL_BYTES = 256 << 20  # mla_decode: the block pool each call reads another region of


@dataclass(frozen=True)
class MoeShape:
    name: str
    d: int
    i: int
    e: int
    k: int


@dataclass(frozen=True)
class LinearShape:
    name: str
    n: int
    k: int


@dataclass(frozen=True)
class AttnShape:
    name: str
    h: int
    dk: int  # mla_decode: the cache row R + P; extend, paged_decode: the q/k head dim
    dv: int  # mla_decode: R (the latent, V); extend, paged_decode: the v head dim
    hkv: int = 1  # paged_decode: KV heads


def moe_shapes(which: str, experts_v3: int) -> list[MoeShape]:
    shapes = {"small": [MoeShape("small.moe", 2048, 1408, 64, 6)],
              "v3": [MoeShape("v3.moe", 7168, 2048, experts_v3, 8)]}
    return shapes["small"] + shapes["v3"] if which == "all" else shapes[which]


def linear_shapes(which: str) -> list[LinearShape]:
    shapes = {"small": [LinearShape("small.ffn_gate_up", 11264, 2048), LinearShape("small.lm_head", 32000, 2048)],
              "v3": [LinearShape("v3.o_proj", 7168, 16384)]}
    return shapes["small"] + shapes["v3"] if which == "all" else shapes[which]


def attn_shapes(op: str, which: str) -> list[AttnShape]:
    """mla_decode: the absorbed form over the latent cache; extend: the naive MLA form; paged_decode: GQA/MHA."""
    if op == "paged_decode":
        shapes = {"small": [AttnShape("qwen3moe.gqa", 32, 128, 128, 4), AttnShape("llama.gqa", 32, 64, 64, 8),
                            AttnShape("qwen2moe.mha", 16, 128, 128, 16)],
                  "v3": [AttnShape("qwen3-235b.gqa", 64, 128, 128, 4)]}
        return shapes["small"] + shapes["v3"] if which == "all" else shapes[which]
    dk, dv = (576, 512) if op == "mla_decode" else (192, 128)
    form = "mla" if op == "mla_decode" else "attn_naive"
    shapes = {"small": [AttnShape(f"small.{form}", 16, dk, dv)], "v3": [AttnShape(f"v3.{form}", 128, dk, dv)]}
    return shapes["small"] + shapes["v3"] if which == "all" else shapes[which]


def shapes_of(op: str, which: str, experts_v3: int) -> list:
    if op == "fused_moe":
        return moe_shapes(which, experts_v3)
    return linear_shapes(which) if op == "linear" else attn_shapes(op, which)


# ---------------------------------------------------------------- random weights in each format


def random_weight(shape: tuple[int, ...], fmt: str, g: torch.Generator):
    """A weight of logical shape [..., N, K] with random values stored directly in `fmt`."""
    *lead, n, k = shape
    if fmt == "bf16":
        return formats.DenseWeight((torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16))
    if fmt == "int8":
        w = torch.randint(-127, 128, shape, generator=g, dtype=torch.int8)
        return formats.Int8ChannelWeight(w, torch.rand(*lead, n, generator=g) * 1e-3 + 1e-4)
    if fmt == "fp8":
        mag = torch.randint(0, 0x7F, shape, generator=g, dtype=torch.uint8)  # 0x7F would be NaN
        sign = torch.randint(0, 2, shape, generator=g, dtype=torch.uint8) << 7
        scale = torch.rand(*lead, -(-n // 128), -(-k // 128), generator=g) * 1e-3 + 1e-4
        return formats.Fp8BlockWeight((mag | sign).view(torch.float8_e4m3fn), scale, (128, 128))
    kp = -(-k // INT4_GROUP) * INT4_GROUP
    packed = torch.randint(0, 256, (*lead, n, kp // 2), generator=g, dtype=torch.uint8)
    # exact in bfloat16, as the quantizer's symmetric scales are (the r16 tiles then read them in half the bytes)
    scale = (torch.rand(*lead, n, kp // INT4_GROUP, generator=g) * 1e-2).bfloat16().float()
    return formats.Int4GroupWeight(packed, scale, torch.full_like(scale, 8.0), k, INT4_GROUP)


def random_routes(t: int, e: int, k: int, g: torch.Generator, n: int = ROUTINGS) -> list[tuple]:
    """n routings of t tokens: softmax weights [t, k] and k distinct experts of e per token."""
    return [(torch.softmax(torch.randn(t, k, generator=g), -1),
             torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])) for _ in range(n)]


def expert_bytes(w13, w2) -> float:
    return (w13.nbytes + w2.nbytes) / w13.shape[0]


# ---------------------------------------------------------------- timing


def _time(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


_LAST_ISA: list[str] = []  # the instruction variants our first warm-up call ran (kernels.cpu's call record)


def alternate(ours, theirs, repeats: int, read=None) -> tuple[list[float], ...]:
    """2 warm-ups each, then `repeats` rounds of (ours, theirs[, read]); each call gets the round index.
    The first warm-up of ours runs under kernels.cpu.recording(): its variants go to _LAST_ISA.
    `read` (r → seconds, its own clock): the paired read of the same bytes (PairedRead), a third list."""
    import kernels.cpu as cpu

    with cpu.recording() as rec:
        ours(0)
    _LAST_ISA[:] = [rec[-1]["isa"] if rec else "reference"]
    for r in range(2):
        if r:
            ours(r)
        theirs(r)
    a, b, c = [], [], []
    for r in range(repeats):
        a.append(_time(lambda: ours(r)))
        b.append(_time(lambda: theirs(r)))
        if read is not None:
            c.append(read(r))
    return (a, b, c) if read is not None else (a, b)


PAIRED_READ_BYTES = 1 << 30


class PairedRead:
    """A read of the bytes a case's call reads (at most a third of the buffer: a larger call is compared
    with the rate of a 341 MiB read), timed in the same rounds as the case: the memory limit as the
    machine runs at that moment. A shared VM's bandwidth drifts by up to 2x between minutes here, so a
    kernel's fraction of the probe's best-ever read mixes its speed with the drift; its fraction of this
    read does not. Each round reads another slice of a 1 GiB buffer (allocated once, touched), so no
    slice is still in the last-level cache, once by each of `methods` (the probe's best, sequential, and
    the kernels' own pattern), and keeps the fastest: which way of reading is fastest changes with the
    neighbours' load (Zen 5, session 18: the probe's best, 8 non-temporal streams, later read at half the
    rate of a sequential read, and the kernels "beat" a read of that one way by up to 2x)."""

    _buf: torch.Tensor | None = None

    def __init__(self, nbytes: float):
        import kernels.cpu as cpu
        from tuner.probe import probe

        if PairedRead._buf is None or PairedRead._buf.numel() != PAIRED_READ_BYTES // 4:
            PairedRead._buf = torch.ones(PAIRED_READ_BYTES // 4, dtype=torch.float32)
        best = probe().get("read_method", "sequential")
        self.methods = list(dict.fromkeys([best, "sequential", "4 streams, prefetch 1024 B (kernels' pattern)"]))
        self.ext = cpu.extension()
        self.n = max(64 * 16, min(int(nbytes) // 4, PairedRead._buf.numel() // 3) // 1024 * 1024)  # floats
        self.slices = max(1, PairedRead._buf.numel() // self.n)
        self.nbytes = self.n * 4

    def offset(self, r: int) -> int:
        """Round r's slice: the buffer's slices in turn (floats from its start)."""
        return (r % self.slices) * self.n

    def __call__(self, r: int) -> float:
        """Seconds of round r's read: the fastest of `methods`, each over a slice of its own."""
        from tuner.probe import read_once

        n = len(self.methods)
        return min(read_once(self.ext, PairedRead._buf[self.offset(r * n + i):self.offset(r * n + i) + self.n], m)
                   for i, m in enumerate(self.methods))


def summary(samples: list[float]) -> dict:
    q = statistics.quantiles(samples, n=10) if len(samples) > 1 else [samples[0]] * 9
    return {"median_s": statistics.median(samples), "p10_s": q[0], "p90_s": q[-1]}


# ---------------------------------------------------------------- cases


def bench_moe(shape: MoeShape, fmt: str, t: int, repeats: int, g: torch.Generator) -> dict:
    import kernels.cpu as cpu

    w13 = random_weight((shape.e, 2 * shape.i, shape.d), fmt, g)
    w2 = random_weight((shape.e, shape.d, shape.i), fmt, g)
    p13, p2 = cpu.prepare(w13), cpu.prepare(w2)
    w13, w2 = getattr(p13, "orig", w13), getattr(p2, "orig", w2)  # the prepared copies: the originals are freed
    x = (torch.randn(t, shape.d, generator=g)).to(torch.bfloat16)
    routes = random_routes(t, shape.e, shape.k, g)
    touched = statistics.mean(len(ids.unique()) for _, ids in routes)
    deq: dict[int, tuple] = {}

    def torch_moe(r: int) -> torch.Tensor:
        tw, ids = routes[r % ROUTINGS]
        out = torch.zeros(t, shape.d, dtype=torch.float32)
        for e in ids.unique().tolist():
            if e not in deq:
                deq[e] = (w13[e].dequantize(torch.bfloat16), w2[e].dequantize(torch.bfloat16))
            tok, slot = (ids == e).nonzero(as_tuple=True)
            gu = F.linear(x[tok], deq[e][0])
            h = F.silu(gu[:, :shape.i]) * gu[:, shape.i:]
            out.index_add_(0, tok, F.linear(h, deq[e][1]).float() * tw[tok, slot, None])
        return out.to(torch.bfloat16)

    for e in range(shape.e):  # dequantize outside the timed region
        deq[e] = (w13[e].dequantize(torch.bfloat16), w2[e].dequantize(torch.bfloat16))
    nbytes = touched * expert_bytes(w13, w2)
    read = PairedRead(nbytes)
    ours, theirs, reads = alternate(lambda r: cpu.fused_moe(x, p13, p2, *routes[r % ROUTINGS]), torch_moe, repeats,
                                    read)
    flops = 2 * t * shape.k * 3 * shape.i * shape.d
    return _row("fused_moe", fmt, t, f"{shape.name} D={shape.d} I={shape.i} E={shape.e} top-{shape.k}",
                ours, theirs, nbytes, flops, paired=(read, reads))


def last_level_cache_bytes() -> int:
    """The largest CPU cache of CPU 0 (sysfs), 32 MiB where sysfs does not say."""
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            v = f.read_text().strip().upper()
            sizes.append(int(v[:-1]) << {"K": 10, "M": 20, "G": 30}[v[-1]] if v[-1] in "KMG" else int(v))
        except (OSError, ValueError):
            continue
    return max(sizes, default=32 << 20)


def weight_copies(nbytes: int) -> int:
    """Distinct copies of a weight that a linear case cycles through, so that each call streams its
    weight from DRAM (as in decode, where every layer's weights are read once per token) rather than
    from a last-level cache that can hold it (300 MiB on some server CPUs): together ≥ 2 × the LLC
    and ≥ POOL_BYTES; one copy where one already exceeds that."""
    return max(1, -(-max(2 * last_level_cache_bytes(), POOL_BYTES) // max(1, nbytes)))


def bench_linear(shape: LinearShape, fmt: str, t: int, repeats: int, g: torch.Generator) -> dict:
    import kernels.cpu as cpu

    ours_w, theirs_w = [], []
    # memory-bound token counts cycle through copies (ours and torch's each their own); from 64 tokens
    # the case is compute-bound and one copy serves
    for _ in range(weight_copies(weight_nbytes(shape, fmt)) if t < 64 else 1):
        w = random_weight((shape.n, shape.k), fmt, g)
        p = cpu.prepare(w)
        w = getattr(p, "orig", w)
        ours_w.append(p)
        theirs_w.append(w.dequantize(torch.bfloat16))
    x = torch.randn(t, shape.k, generator=g).to(torch.bfloat16)
    n = len(ours_w)
    read = PairedRead(w.nbytes)
    ours, theirs, reads = alternate(lambda r: cpu.linear(x, ours_w[r % n]), lambda r: F.linear(x, theirs_w[r % n]),
                                    repeats, read)
    return _row("linear", fmt, t, f"{shape.name} [{shape.n}, {shape.k}]", ours, theirs, w.nbytes,
                2 * t * shape.n * shape.k, paired=(read, reads))


def weight_nbytes(shape: LinearShape, fmt: str) -> int:
    """Bytes of an [n, k] weight in this format (scales aside): the copies' sizing."""
    return int(shape.n * shape.k * {"bf16": 2, "int8": 1, "fp8": 1, "int4": 0.5}[fmt])


def bf16_randn(g: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.empty(shape, dtype=torch.bfloat16).normal_(generator=g)


def block_regions(g: torch.Generator, b: int, context: int, n_blocks: int):
    """n_blocks cache blocks in shuffled order, cut into as many disjoint regions (block tables [b, blocks per
    sequence]) as they hold, and the sequence lengths: consecutive calls on other regions read the cache from
    DRAM."""
    per_seq = -(-context // CACHE_BLOCK)
    need = b * per_seq
    order = torch.randperm(n_blocks, generator=g).to(torch.int32)
    regions = [order[i * need:(i + 1) * need].view(b, per_seq) for i in range(n_blocks // need)]
    return regions, torch.full((b,), context, dtype=torch.int32)


def paged_latent_cache(g: torch.Generator, b: int, context: int, dk: int, n_blocks: int):
    """A bf16 latent cache of n_blocks blocks of CACHE_BLOCK rows [dk], and block_regions over it."""
    cache = bf16_randn(g, n_blocks, CACHE_BLOCK, dk)
    return (cache, *block_regions(g, b, context, n_blocks))


def bench_mla_decode(shape: AttnShape, b: int, context: int, repeats: int, g: torch.Generator) -> dict:
    import kernels.cpu as cpu
    from kernels import reference

    need = b * -(-context // CACHE_BLOCK)
    cache, regions, lens = paged_latent_cache(g, b, context, shape.dk,
                                              max(2 * need, POOL_BYTES // (CACHE_BLOCK * shape.dk * 2)))
    q_lat, q_pe = bf16_randn(g, b, shape.h, shape.dv), bf16_randn(g, b, shape.h, shape.dk - shape.dv)
    scale = 192 ** -0.5

    def call(fn, region: int):
        return fn(q_lat, q_pe, cache, regions[region % len(regions)], lens, scale)

    ours, theirs = alternate(lambda r: call(cpu.mla_decode, 2 * r), lambda r: call(reference.mla_decode, 2 * r + 1),
                             repeats)
    keys = b * context
    return _row("mla_decode", "bf16", b, f"{shape.name} H={shape.h} R={shape.dv} P={shape.dk - shape.dv} "
                f"ctx={context} bs={CACHE_BLOCK}", ours, theirs, keys * shape.dk * 2,
                keys * shape.h * (2 * shape.dk + 2 * shape.dv), context=context)


def bench_paged_decode(shape: AttnShape, b: int, context: int, repeats: int, g: torch.Generator) -> dict:
    import kernels.cpu as cpu
    from kernels import reference

    need = b * -(-context // CACHE_BLOCK)
    n_blocks = max(2 * need, POOL_BYTES // (CACHE_BLOCK * shape.hkv * (shape.dk + shape.dv) * 2))
    regions, lens = block_regions(g, b, context, n_blocks)
    k_cache = bf16_randn(g, n_blocks, CACHE_BLOCK, shape.hkv, shape.dk)
    v_cache = bf16_randn(g, n_blocks, CACHE_BLOCK, shape.hkv, shape.dv)
    q = bf16_randn(g, b, shape.h, shape.dk)
    scale = shape.dk ** -0.5

    def call(fn, region: int):
        return fn(q, k_cache, v_cache, regions[region % len(regions)], lens, scale)

    ours, theirs = alternate(lambda r: call(cpu.paged_decode, 2 * r), lambda r: call(reference.paged_decode, 2 * r + 1),
                             repeats)
    keys = b * context
    return _row("paged_decode", "bf16", b, f"{shape.name} H={shape.h} Hkv={shape.hkv} d={shape.dk} ctx={context} "
                f"bs={CACHE_BLOCK}", ours, theirs, keys * shape.hkv * (shape.dk + shape.dv) * 2,
                keys * shape.h * (2 * shape.dk + 2 * shape.dv), context=context)


def bench_extend(shape: AttnShape, t: int, prefix: int, repeats: int, g: torch.Generator) -> dict:
    import kernels.cpu as cpu

    s, h, dk, dv = prefix + t, shape.h, shape.dk, shape.dv
    q, k, v = bf16_randn(g, t, h, dk), bf16_randn(g, s, h, dk), bf16_randn(g, s, h, dv)
    qt, kt = (x.transpose(0, 1).unsqueeze(0).contiguous() for x in (q, k))  # [1, H, T|S, Dk]
    vt = F.pad(v, (0, dk - dv)).transpose(0, 1).unsqueeze(0).contiguous()  # Dk = Dv: torch's flash kernel
    mask = None if prefix == 0 else torch.arange(s) <= torch.arange(t).unsqueeze(1) + prefix
    scale = dk ** -0.5

    def sdpa(r: int) -> torch.Tensor:
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, is_causal=mask is None, scale=scale)
        return out[..., :dv]

    ours, theirs = alternate(lambda r: cpu.extend_attention(q, k, v, scale), sdpa, repeats)
    pairs = t * prefix + t * (t + 1) // 2
    return _row("extend", "bf16", t, f"{shape.name} H={h} Dk={dk} Dv={dv} prefix={prefix}", ours, theirs,
                2 * (q.numel() + k.numel() + v.numel() + t * h * dv), 2 * h * (dk + dv) * pairs, context=s)


def _peak_key(isa: str, fmt: str, limits: dict) -> str:
    """The probe's peak of the instruction a case ran (FP32 FMA where the probe has no other). oneDNN (torch's
    bf16 linear) picks its own: AMX BF16 where the probe found AMX, else the AVX512-BF16 dot product."""
    used = isa.split("+")
    onednn = "onednn" in used and (limits.get("amx_bf16_gflops") or limits.get("bf16_dot_gflops"))
    key = ("amx_int8_gops" if fmt == "int8" else "amx_bf16_gflops") if "amx" in used else \
        "vnni_int8_gops" if "vnni" in used else "bf16_dot_gflops" if "avx512bf16" in used else \
        ("amx_bf16_gflops" if limits.get("amx_bf16_gflops") else "bf16_dot_gflops") if onednn else "fp32_fma_gflops"
    return key if limits.get(key) else "fp32_fma_gflops"


def _row(op, fmt, t, shape, ours, theirs, nbytes, flops, context: int | None = None, paired=None) -> dict:
    from tuner.probe import probe

    limits = probe()
    s = summary(ours)
    gbps = nbytes / s["median_s"] / 1e9
    byte_key = "weight_bytes" if context is None else "bytes"  # attention: cache / activation bytes
    row = {"op": op, "format": fmt, "tokens": t, "shape": shape, "context": context, "isa": "".join(_LAST_ISA[-1:]),
           **s, "gbps": gbps,
           "fraction_of_read_bw": gbps / limits["read_gbps"], "torch_median_s": statistics.median(theirs),
           "speedup_vs_torch": statistics.median(theirs) / s["median_s"],
           "gflops": flops / s["median_s"] / 1e9, byte_key: nbytes, "samples": ours, "torch_samples": theirs}
    row["peak"] = _peak_key(row["isa"], fmt, limits)
    row["fraction_of_peak_flops"] = row["gflops"] / limits[row["peak"]]
    if paired is not None:  # the paired read: its median GB/s, and ours as a fraction of it
        read, reads = paired
        row["paired_read_gbps"] = read.nbytes / statistics.median(reads) / 1e9
        row["fraction_of_paired_read"] = gbps / row["paired_read_gbps"]
        row["paired_read_samples"] = reads
    return row


# ---------------------------------------------------------------- the run


def cases(ops, fmts, tokens, which: str, experts_v3: int, contexts=CONTEXTS, prefixes=PREFIXES):
    """(op, shape, format, tokens, context): context is mla_decode's keys per sequence, extend's
    prefix, None for the weight ops; the attention ops run on a bf16 cache whatever `fmts` says."""
    extra = {"mla_decode": contexts, "paged_decode": contexts, "extend": prefixes}
    for op in ops:
        for shape in shapes_of(op, which, experts_v3):
            for fmt in (fmts if op not in extra else ["bf16"]):
                for t in tokens or TOKENS[op]:
                    for ctx in extra.get(op, [None]):
                        yield op, shape, fmt, t, ctx


def bench_case(op, shape, fmt, t, ctx, repeats: int, g: torch.Generator) -> dict:
    if op == "mla_decode":
        return bench_mla_decode(shape, t, ctx, repeats, g)
    if op == "paged_decode":
        return bench_paged_decode(shape, t, ctx, repeats, g)
    if op == "extend":
        return bench_extend(shape, t, ctx, repeats, g)
    return (bench_moe if op == "fused_moe" else bench_linear)(shape, fmt, t, repeats, g)


def run(ops, fmts, tokens=None, which="small", experts_v3=32, repeats=10, store=True, out=sys.stdout,
        as_json=False, contexts=CONTEXTS, prefixes=PREFIXES):
    """Every case of `cases` (tokens None: each op's default TOKENS) → its rows, printed and stored."""
    import kernels.cpu as cpu
    from tqdm import tqdm

    todo = list(cases(ops, fmts, tokens, which, experts_v3, contexts, prefixes))
    if not as_json:
        from tuner.probe import variants_line

        print(f"ISA variants: {variants_line(cpu.isa_variants())}; the isa column: what each case ran", file=out)
    rows = []
    g = torch.Generator().manual_seed(0)
    for case in tqdm(todo, desc="kernel suite", leave=False, disable=as_json):
        row = bench_case(*case, repeats, g)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if not k.endswith("samples")}) if as_json else _line(row),
              file=out, flush=True)
    over = stale_limits(rows)
    if over and not as_json:
        print(over, file=out)
    if store:
        _store(rows, dict(cpu._knobs))
    return rows


def stale_limits(rows: list[dict], slack: float = 1.05) -> str | None:
    """A note when a case ran above the probe's limit that its fraction is taken of (a weight held in
    a large last-level cache, or a probe measured while the host was slower): None otherwise."""
    worst = max(((r.get("fraction_of_read_bw") or 0.0, "read bandwidth") for r in rows), default=(0.0, ""))
    worst = max(worst, max(((r.get("fraction_of_peak_flops") or 0.0, f"{r.get('peak')} peak") for r in rows),
                           default=(0.0, "")))
    if worst[0] <= slack:
        return None
    return (f"note: a case ran at {worst[0]:.0%} of the probe's {worst[1]}: the probe's figures are below what "
            "this machine does now; measure them again (python -m tuner.probe --refresh) before reading "
            "fractions")


def _line(r: dict) -> str:
    return (f"{r['op']:10s} {r['format']:5s} T={r['tokens']:<4d} {r['shape']:42s} {r['isa']:10s} {r['median_s'] * 1e3:9.3f} ms "
            f"[{r['p10_s'] * 1e3:.3f}–{r['p90_s'] * 1e3:.3f}] {r['gbps']:6.2f} GB/s "
            f"{r['fraction_of_read_bw'] * 100:5.1f}% bw {r['gflops']:7.1f} GFLOP/s  torch {r['torch_median_s'] * 1e3:9.3f} ms "
            f"(×{r['speedup_vs_torch']:.2f})"
            + (f"  paired read {r['paired_read_gbps']:.1f} GB/s: {r['fraction_of_paired_read'] * 100:.1f}% of it"
               if "paired_read_gbps" in r else ""))


def _store(rows: list[dict], knobs: dict) -> None:
    from results.store import append_rows

    append_rows([{"model": r["shape"].split(" ")[0].split(".")[0], "format": r["format"],
                  "workload": {"op": r["op"], "shape": r["shape"], "tokens": r["tokens"],
                               **({} if r["context"] is None else {"context": r["context"]})},
                  "knobs": knobs, "metric": "kernel_seconds", "unit": "s", "direction": "minimize",
                  "samples": r["samples"],
                  "extra": {k: r[k] for k in ("gbps", "fraction_of_read_bw", "paired_read_gbps", "fraction_of_paired_read",
                                              "paired_read_samples", "torch_median_s", "speedup_vs_torch",
                                              "gflops", "fraction_of_peak_flops", "weight_bytes", "bytes", "isa", "peak")
                            if k in r}}
                 for r in rows], suite="kernels")


# ---------------------------------------------------------------- CLI


def add_parser(sub) -> None:
    """`moetune bench kernels ...` (moetune_cli calls this)."""
    b = sub.add_parser("bench", help="benchmark suites")
    bs = b.add_subparsers(dest="suite", required=True)
    k = bs.add_parser("kernels", help="the cpu kernels vs torch, as fractions of this machine's limits")
    k.add_argument("--op", action="append", choices=list(OPS),
                   help=f"(repeatable; default {' and '.join(DEFAULT_OPS)})")
    k.add_argument("--format", action="append", choices=list(FORMATS),
                   help="weight format (repeatable; default all); attention ops: a bf16 cache")
    k.add_argument("--tokens", action="append", type=int,
                   help="tokens; mla_decode, paged_decode: sequences; extend: new tokens (repeatable; default per op: "
                        + ", ".join(f"{op} {list(v)}" for op, v in TOKENS.items()) + ")")
    k.add_argument("--context", action="append", type=int,
                   help=f"mla_decode, paged_decode: keys per sequence (repeatable; default {list(CONTEXTS)})")
    k.add_argument("--prefix", action="append", type=int,
                   help=f"extend: cached keys before the new tokens (repeatable; default {list(PREFIXES)})")
    k.add_argument("--shapes", default="small", choices=["small", "v3", "all"])
    k.add_argument("--experts-v3", type=int, default=32, help="DeepSeek-V3 experts allocated (of 256)")
    k.add_argument("--repeats", type=int, default=10)
    k.add_argument("--knob", action="append", metavar="NAME=VALUE", help="override a cpu_* knob")
    k.add_argument("--no-store", action="store_true", help="do not append the rows to the result store")
    k.add_argument("--json", action="store_true", help="one JSON object per line")
    k.set_defaults(func=run_cli)


def run_cli(args) -> int:
    from engine.errors import MoetuneError
    from engine.knobs import resolve_knobs

    if args.repeats < 1 or any(t < 1 for t in (args.tokens or []) + (args.context or [])):
        raise MoetuneError("--repeats, --tokens and --context must be ≥ 1")
    if any(p < 0 for p in args.prefix or []):
        raise MoetuneError("--prefix must be ≥ 0")
    overrides = dict(kv.split("=", 1) for kv in args.knob or [])
    knobs = resolve_knobs(overrides)
    if knobs["kernel_backend"] != "cpu" and "kernel_backend" not in overrides:
        raise MoetuneError("the cpu kernels cannot run on this machine (see the warning above)")
    import kernels.cpu as cpu

    cpu.configure(knobs)
    torch.set_num_threads(knobs["threads"])
    run(args.op or list(DEFAULT_OPS), args.format or list(FORMATS), args.tokens, args.shapes, args.experts_v3,
        args.repeats, store=not args.no_store, as_json=args.json, contexts=args.context or CONTEXTS,
        prefixes=args.prefix or PREFIXES)
    return 0
