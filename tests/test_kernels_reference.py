"""The reference ops against independent formulations, on regular, odd and corner shapes.

Every later backend (kernels/cpu, kernels/cuda) is tested against these references; here the
references themselves are checked against the plainest form of the same math.
Tolerance: float32 ops 1e-5 relative unless stated; index ops exact.
"""
import itertools

import pytest
import torch
import torch.nn.functional as F

from attn_cases import block_tables, paged, same_bits, slots
from kernels import get_backend
from kernels.formats import DenseWeight, Fp8BlockWeight, Int8ChannelWeight, quantize_fp8_block, quantize_int8_channel

ref = get_backend("reference")
g = torch.Generator().manual_seed(0)


def rnd(*shape, scale=1.0):
    return torch.randn(*shape, generator=g) * scale


def close(a, b, tol=1e-5):
    err = float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))
    assert err < tol, f"relative error {err:.3e} ≥ {tol}"


# ---------------------------------------------------------------- formats


@pytest.mark.parametrize("n,k", [(128, 128), (256, 384), (33, 7), (1, 1), (130, 257)])
def test_fp8_block_quantization_is_close_and_idempotent(n, k):
    w = rnd(n, k)
    q = quantize_fp8_block(w)
    assert q.w.dtype == torch.float8_e4m3fn and q.scale_inv.shape == (-(-n // 128), -(-k // 128))
    close(q.dequantize(), w, tol=0.05)  # e4m3 keeps 3 mantissa bits: ≤ 1/16 relative per element
    again = quantize_fp8_block(q.dequantize())
    assert torch.equal(again.dequantize(), q.dequantize())


@pytest.mark.parametrize("n,k", [(64, 64), (7, 300), (1, 1)])
def test_int8_channel_quantization_is_close_and_idempotent(n, k):
    w = rnd(n, k)
    q = quantize_int8_channel(w)
    assert q.scale.shape == (n,)
    assert float((q.dequantize() - w).abs().max()) <= float(q.scale.max()) / 2 + 1e-6
    assert torch.equal(quantize_int8_channel(q.dequantize()).w, q.w)


def test_stacked_formats_index_per_expert():
    w = rnd(3, 40, 130)
    for q in (quantize_fp8_block(w), quantize_int8_channel(w), DenseWeight(w)):
        for e in range(3):
            close(q[e].dequantize(), q.dequantize()[e], tol=1e-7)


# ---------------------------------------------------------------- linear


@pytest.mark.parametrize("t,n,k", [(1, 16, 16), (5, 33, 129), (64, 128, 256), (0, 8, 8)])
def test_linear_dense_and_fp8(t, n, k):
    x, w = rnd(t, k), rnd(n, k)
    assert ref.linear(x, DenseWeight(w)).shape == (t, n)
    if t:
        close(ref.linear(x, DenseWeight(w)), x @ w.T)
        q = quantize_fp8_block(w)
        close(ref.linear(x, q), x @ q.dequantize().T)


@pytest.mark.parametrize("t,n,k", [(1, 16, 16), (5, 33, 129), (3, 8, 4096)])
def test_linear_int8_is_exact_integer_arithmetic(t, n, k):
    x, q = rnd(t, k), quantize_int8_channel(rnd(n, k))
    xq, xs = ref.quantize_activation_int8(x)
    exact = (xq.long() @ q.w.long().T).double() * xs.double().unsqueeze(-1) * q.scale.double()
    close(ref.linear(x, q), exact, tol=1e-6)
    close(ref.linear(x, q), x @ q.dequantize().T, tol=2e-2)  # activation rounding only


def test_head_linear():
    x, w = rnd(5, 3, 7), rnd(3, 4, 7)
    close(ref.head_linear(x, w), torch.stack([x[:, h] @ w[h].T for h in range(3)], dim=1))


# ---------------------------------------------------------------- small ops


@pytest.mark.parametrize("shape", [(1, 8), (5, 64), (3, 2, 7)])
def test_rms_norm_and_residual(shape):
    x, r, w = rnd(*shape), rnd(*shape), rnd(shape[-1])
    close(ref.rms_norm(x, w, 1e-6), w * x / (x.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt())
    normed, summed = ref.add_rms_norm(x, r, w, 1e-6)
    close(summed, x + r)
    close(normed, ref.rms_norm(x + r, w, 1e-6))


def test_silu_and_mul():
    x = rnd(4, 10)
    close(ref.silu_and_mul(x), F.silu(x[:, :5]) * x[:, 5:])


@pytest.mark.parametrize("p", [2, 8, 64])
def test_rope_interleaved_equals_complex_rotation(p):
    t, h = 6, 3
    q, k = rnd(t, h, p), rnd(t, h, p)
    ang = rnd(t, p // 2)
    cos, sin = ang.cos(), ang.sin()
    rot = torch.polar(torch.ones_like(ang), ang).unsqueeze(1)
    qc = torch.view_as_complex(q.reshape(t, h, -1, 2)) * rot
    kc = torch.view_as_complex(k.reshape(t, h, -1, 2)) * rot
    want = (qc.unsqueeze(1) * kc.conj().unsqueeze(0)).real.sum(-1)  # q_i · k_j for all pairs
    qr, kr = ref.rope(q, cos, sin, True), ref.rope(k, cos, sin, True)
    close(torch.einsum("ihp,jhp->ijh", qr, kr), want)
    # rotate-half layout: pairs (x[i], x[i + P/2])
    half = ref.rope(q, cos, sin, False)
    x1, x2 = q.chunk(2, -1)
    close(half, torch.cat([x1 * cos.unsqueeze(1) - x2 * sin.unsqueeze(1), x2 * cos.unsqueeze(1) + x1 * sin.unsqueeze(1)], -1))


# ---------------------------------------------------------------- routing and MoE


def brute_force_topk(logits, bias, k, n_group, topk_group, scoring, renorm, scaling):
    """Per token: enumerate every allowed group set, the plainest statement of the rule."""
    scores = logits.sigmoid() if scoring == "sigmoid" else logits.softmax(-1)
    choice = scores + (bias if bias is not None else 0)
    e = logits.shape[1]
    ids, weights = [], []
    for t in range(logits.shape[0]):
        groups = choice[t].view(n_group, -1)
        gscore = [sorted(gr.tolist())[-2:] for gr in groups]
        gscore = [sum(s) if bias is not None else s[-1] for s in gscore] if n_group > 1 else [0.0]
        best = sorted(range(n_group), key=lambda i: -gscore[i])[:topk_group] if n_group > 1 else [0]
        allowed = [x for x in range(e) if x // (e // n_group) in best]
        top = sorted(allowed, key=lambda x: -float(choice[t, x]))[:k]
        w = scores[t, top]
        w = w / w.sum() if renorm else w
        ids.append(top)
        weights.append((w * scaling).tolist())
    return torch.tensor(weights), torch.tensor(ids)


CASES = [  # (T, E, K, n_group, topk_group, scoring, bias, renorm)
    (7, 8, 2, 4, 2, "sigmoid", True, True),
    (5, 64, 6, 8, 4, "sigmoid", True, True),
    (3, 6, 3, 3, 2, "sigmoid", True, False),
    (4, 16, 4, 1, 1, "softmax", False, False),
    (4, 16, 3, 4, 2, "softmax", False, True),
    (1, 9, 1, 3, 1, "sigmoid", True, True),
]


@pytest.mark.parametrize("t,e,k,ng,tg,scoring,with_bias,renorm", CASES)
def test_grouped_topk_matches_brute_force(t, e, k, ng, tg, scoring, with_bias, renorm):
    logits = rnd(t, e)
    bias = rnd(e, scale=0.1) if with_bias else None
    w, ids = ref.grouped_topk(logits, bias, k, ng, tg, scoring, renorm, 2.5)
    bw, bids = brute_force_topk(logits, bias, k, ng, tg, scoring, renorm, 2.5)
    order, border = ids.sort(-1), bids.sort(-1)
    assert torch.equal(order.values, border.values)  # index op: exact
    close(w.gather(1, order.indices), bw.gather(1, border.indices), tol=1e-6)


@pytest.mark.parametrize("t,e,k,d,i,fmt", [
    (1, 8, 2, 16, 8, "dense"), (9, 6, 3, 24, 12, "dense"), (33, 16, 4, 64, 128, "fp8"),
    (5, 4, 1, 40, 24, "int8"), (0, 4, 2, 8, 8, "dense"),
])
def test_fused_moe_matches_per_token_loop(t, e, k, d, i, fmt):
    x = rnd(t, d)
    w13, w2 = rnd(e, 2 * i, d, scale=0.1), rnd(e, d, i, scale=0.1)
    make = {"dense": DenseWeight, "fp8": quantize_fp8_block, "int8": quantize_int8_channel}[fmt]
    q13, q2 = make(w13), make(w2)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]) if t else torch.zeros(0, k, dtype=torch.long)
    ids[ids == e - 1] = 0  # expert e-1 gets no tokens
    wts = torch.rand(t, k, generator=g)
    got = ref.fused_moe(x, q13, q2, wts, ids)
    assert got.shape == (t, d)
    want = torch.zeros(t, d)
    for tok, slot in itertools.product(range(t), range(k)):
        ex = int(ids[tok, slot])
        h = ref.linear(x[tok:tok + 1], q13[ex])
        want[tok] += wts[tok, slot] * ref.linear(ref.silu_and_mul(h), q2[ex])[0]
    if t:
        close(got, want, tol=1e-5)


# ---------------------------------------------------------------- attention


@pytest.mark.parametrize("t,s,h", [(1, 1, 1), (7, 7, 6), (5, 12, 22), (16, 129, 3)])
def test_extend_attention_matches_sdpa(t, s, h):
    q, k, v = rnd(t, h, 24), rnd(s, h, 24), rnd(s, h, 16)
    mask = torch.arange(s).unsqueeze(0) <= torch.arange(t).unsqueeze(1) + (s - t)
    want = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                          attn_mask=mask, scale=0.3).transpose(0, 1)
    close(ref.extend_attention(q, k, v, 0.3), want)


@pytest.mark.parametrize("lens,h,bs", [([1], 6, 4), ([7, 129], 22, 16), ([5, 1, 33], 3, 1), ([64], 1, 64)])
def test_mla_decode_over_paged_cache_with_holes(lens, h, bs):
    r, p = 32, 8
    nblocks = sum(-(-n // bs) for n in lens) * 2 + 3  # room for holes
    cache = torch.full((nblocks, bs, r + p), float("nan"))  # unused slots poison any stray read
    free = torch.randperm(nblocks, generator=g).tolist()  # out-of-order blocks, holes between
    tables, rows = [], []
    for n in lens:
        blocks = [free.pop() for _ in range(-(-n // bs))]
        seq = rnd(n, r + p)
        for j in range(n):
            cache[blocks[j // bs], j % bs] = seq[j]
        tables.append(blocks)
        rows.append(seq)
    width = max(len(b) for b in tables)
    bt = torch.tensor([b + [free[0]] * (width - len(b)) for b in tables], dtype=torch.int32)
    q_lat, q_pe = rnd(len(lens), h, r), rnd(len(lens), h, p)
    got = ref.mla_decode(q_lat, q_pe, cache, bt, torch.tensor(lens, dtype=torch.int32), 0.2)
    for b, seq in enumerate(rows):
        scores = (q_lat[b] @ seq[:, :r].T + q_pe[b] @ seq[:, r:].T) * 0.2
        close(got[b], scores.softmax(-1) @ seq[:, :r])


# ---------------------------------------------------------------- attention: GQA and the paged forms
# Paged caches from tests/attn_cases.py: blocks out of order, holes, every unowned slot NaN.


def sdpa(q, k, v, scale, mask=None):
    """torch's SDPA on [T, H, D] tensors, K/V heads shared by groups of query heads (GQA)."""
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         attn_mask=mask, scale=scale, enable_gqa=True)
    return out.transpose(0, 1)


@pytest.mark.parametrize("t,s,h,hkv", [(1, 1, 2, 1), (7, 7, 8, 2), (5, 12, 6, 3), (16, 129, 22, 2), (3, 40, 4, 4)])
def test_extend_attention_gqa_matches_sdpa(t, s, h, hkv):
    q, k, v = rnd(t, h, 24), rnd(s, hkv, 24), rnd(s, hkv, 20)
    mask = torch.arange(s).unsqueeze(0) <= torch.arange(t).unsqueeze(1) + (s - t)
    close(ref.extend_attention(q, k, v, 0.3), sdpa(q, k, v, 0.3, mask))


@pytest.mark.parametrize("lens,h,hkv,bs", [([1], 2, 1, 4), ([7, 129, 1], 8, 2, 16), ([300, 5], 6, 3, 1)])
def test_paged_decode_matches_sdpa_per_sequence(lens, h, hkv, bs):
    seqs_k, seqs_v = [rnd(n, hkv, 24) for n in lens], [rnd(n, hkv, 20) for n in lens]
    k_cache, bt = paged(seqs_k, bs, torch.float32, g)
    v_cache, _ = paged(seqs_v, bs, torch.float32, g, (k_cache.shape[0], bt))
    q = rnd(len(lens), h, 24)
    got = ref.paged_decode(q, k_cache, v_cache, bt, torch.tensor(lens, dtype=torch.int32), 0.2)
    for b, (k, v) in enumerate(zip(seqs_k, seqs_v)):
        close(got[b:b + 1], sdpa(q[b:b + 1], k, v, 0.2))


@pytest.mark.parametrize("t,prefix,bs", [(1, 0, 4), (7, 129, 16), (33, 1, 1), (20, 0, 64)])
def test_paged_extend_matches_extend_attention_on_dense_keys(t, prefix, bs):
    q, k, v = rnd(t, 6, 24), rnd(prefix + t, 3, 24), rnd(prefix + t, 3, 20)
    k_cache, bt = paged([k], bs, torch.float32, g)
    v_cache, _ = paged([v], bs, torch.float32, g, (k_cache.shape[0], bt))
    got = ref.paged_extend(q, k_cache, v_cache, bt[0], prefix + t, 0.3)
    assert torch.equal(got, ref.extend_attention(q, k, v, 0.3))


def test_write_cache_then_gather_paged_round_trips():
    lens, bs = [5, 17], 4
    nb, bt = block_tables(lens, bs, g)
    cache = torch.full((nb, bs, 9), float("nan"), dtype=torch.bfloat16)
    rows = [rnd(n, 9) for n in lens]
    for table, seq in zip(bt, rows):
        ref.write_cache(cache, slots(table, range(seq.shape[0]), bs), seq)
    for table, seq in zip(bt, rows):
        assert torch.equal(ref.gather_paged(cache, table, seq.shape[0]), seq.to(torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mla_decode_with_new_rows_equals_writing_first(dtype):
    lens, bs, r, p = [3, 65], 16, 32, 8
    cache, bt = paged([rnd(n - 1, r + p) for n in lens], bs, dtype, g, block_tables(lens, bs, g))
    new_rows = rnd(len(lens), r + p)
    where = torch.cat([slots(table, [n - 1], bs) for table, n in zip(bt, lens)])
    q_lat, q_pe, seq_lens = rnd(len(lens), 4, r), rnd(len(lens), 4, p), torch.tensor(lens, dtype=torch.int32)
    written = cache.clone()
    ref.write_cache(written, where, new_rows)
    want = ref.mla_decode(q_lat, q_pe, written, bt, seq_lens, 0.2)
    got = ref.mla_decode(q_lat, q_pe, cache, bt, seq_lens, 0.2, new_rows, where)
    assert same_bits(cache, written) and torch.equal(got, want)
