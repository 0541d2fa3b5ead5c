"""The reference backend: every op in plain, readable torch, float32 inside.

It is the oracle for every other backend (tests and the tuner's verify step) and the engine's
default backend until faster kernels exist. Shape legend: T tokens, D hidden, H heads, E experts,
K experts per token, I expert intermediate, R kv_lora_rank, P rope dims, B sequences.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.formats import DenseWeight, Fp8BlockWeight, INT8_MAX, Int8ChannelWeight, Weight

# ---------------------------------------------------------------- elementwise / norms


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim: weight · (x / rms(x)); x [..., D], weight [D]; out in x.dtype."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight.to(x.dtype) * normed.to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """residual += x, then RMSNorm of the sum. Returns (normed, new_residual), both x.dtype."""
    summed = residual + x
    return rms_norm(summed, weight, eps), summed


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] → SiLU(gate) · up, [T, I]; the first half of the last dim is the gate."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(gate_up.dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """Rotary embedding. x [T, H, P]; cos, sin [T, P/2] (one angle per rotated pair).

    interleave=True: pairs are (x[2i], x[2i+1]) as DeepSeek's released weights are laid out; the
    result is written de-interleaved ([rotated evens | rotated odds]), the same layout for q and k,
    so every q·k product equals the complex-multiplication form. interleave=False: pairs are
    (x[i], x[i + P/2]) (rotate-half).
    """
    xf = x.float()
    if interleave:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
    else:
        x1, x2 = xf.chunk(2, dim=-1)
    c, s = cos.float().unsqueeze(1), sin.float().unsqueeze(1)
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)


# ---------------------------------------------------------------- linear


def quantize_activation_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-token int8: x [T, K] → (q int8 [T, K], scale float32 [T]); x ≈ q · scale."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / INT8_MAX, torch.ones_like(amax))
    q = torch.round(xf / scale.unsqueeze(-1)).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def linear(x: torch.Tensor, weight: Weight) -> torch.Tensor:
    """y = x · Wᵀ. x [T, K] (any float dtype), weight [N, K] in any format → [T, N] in x.dtype.

    Dense, FP8-block and INT4-group: weight dequantized to float32 (weight-only quantization).
    INT8-channel (w8a8): x quantized per token to int8, integer products summed exactly (float64
    holds every partial sum of int8·int8 for K < 2^37), then scaled by x_scale · w_scale.
    """
    if isinstance(weight, Int8ChannelWeight):
        q, xs = quantize_activation_int8(x)
        acc = q.double() @ weight.w.double().T
        return (acc.float() * xs.unsqueeze(-1) * weight.scale).to(x.dtype)
    return (x.float() @ weight.dequantize(torch.float32).T).to(x.dtype)


def head_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Per-head linear: out[t, h] = w[h] · x[t, h]. x [T, H, A], w [H, B, A] → [T, H, B] in x.dtype."""
    return torch.einsum("tha,hba->thb", x.float(), w.float()).to(x.dtype)


# ---------------------------------------------------------------- MoE


def grouped_topk(
    logits: torch.Tensor,
    bias: torch.Tensor | None,
    top_k: int,
    n_group: int,
    topk_group: int,
    scoring: str,
    renormalize: bool,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek routing. logits [T, E] → (weights float32 [T, K], ids int64 [T, K]).

    1. scores = sigmoid or softmax of the logits.
    2. choice = scores + bias (the aux-loss-free correction bias; selection only).
    3. With n_group > 1, keep the topk_group best groups, a group scored by the sum of its top-2
       choices (with a bias) or by its best choice (without); the rest are excluded.
    4. The top_k choices among the kept experts; their weights are the unbiased scores,
       renormalized to sum 1 if asked, times `scaling`.
    """
    t, e = logits.shape
    scores = logits.float().sigmoid() if scoring == "sigmoid" else logits.float().softmax(dim=-1)
    choice = scores if bias is None else scores + bias.float()
    if n_group > 1:
        grouped = choice.view(t, n_group, e // n_group)
        group_score = grouped.topk(2, dim=-1)[0].sum(-1) if bias is not None else grouped.amax(-1)
        keep = group_score.topk(topk_group, dim=-1)[1]
        group_mask = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, keep, True)
        choice = grouped.masked_fill(~group_mask.unsqueeze(-1), float("-inf")).view(t, e)
    ids = choice.topk(top_k, dim=-1)[1]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling, ids


def fused_moe(
    x: torch.Tensor,
    w13: Weight,
    w2: Weight,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """Σ_k w_k · down_e(SiLU(gate_e · x) ⊙ up_e · x) over each token's K experts.

    x [T, D]; w13 [E, 2I, D] (gate rows then up rows); w2 [E, D, I]; topk_weights [T, K] float32;
    topk_ids [T, K] int → [T, D] in x.dtype, accumulated in float32.
    """
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    flat_ids = topk_ids.reshape(-1)
    for e in flat_ids.unique().tolist():
        token, slot = (topk_ids == e).nonzero(as_tuple=True)
        h = silu_and_mul(linear(x[token], w13[e]).float())
        y = linear(h, w2[e]).float()
        out.index_add_(0, token, y * topk_weights[token, slot].unsqueeze(-1))
    return out.to(x.dtype)


# ---------------------------------------------------------------- attention


def extend_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of T new tokens over S = prefix + T keys (the last T keys are the new ones).

    q [T, H, Dk], k [S, Hkv, Dk], v [S, Hkv, Dv] → [T, H, Dv] in q.dtype; scores and softmax in float32.
    H is a multiple of Hkv (MHA: equal; GQA: query head h reads key/value head h // (H / Hkv)).
    Query i (0-based among the new) sees keys 0 .. prefix + i.
    """
    t, s = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    kf, vf = k.float().repeat_interleave(group, dim=1), v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("thd,shd->hts", q.float(), kf) * scale
    keys = torch.arange(s, device=q.device)
    visible = keys.unsqueeze(0) <= (torch.arange(t, device=q.device) + (s - t)).unsqueeze(1)
    probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
    return torch.einsum("hts,shd->thd", probs, vf).to(q.dtype)


def gather_paged(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` rows of one sequence: cache [NB, BS, C], block_table [MB] → [length, C]."""
    bs = cache.shape[1]
    n_blocks = -(-length // bs)
    return cache[block_table[:n_blocks].long()].reshape(-1, cache.shape[-1])[:length]


def write_cache(kv_cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """kv_cache [NB, BS, C] (in place): the rows [T, C] stored at flat slots [T] (block · BS + offset)."""
    kv_cache.view(-1, kv_cache.shape[-1])[slots.long()] = rows.to(kv_cache.dtype)


def mla_decode(
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    new_rows: torch.Tensor | None = None,
    slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """Weight-absorbed MLA attention of one query row per entry over the paged latent cache.

    q_lat [B, H, R] (q_nope absorbed through W_UK), q_pe [B, H, P] (roped);
    kv_cache [NB, BS, R + P]: per token the normalized latent c (both K and V) then the roped k_pe;
    block_tables [B, MB] int (block ids, in order); seq_lens [B] int (keys visible to each query).
    new_rows [T, R + P] / slots [T]: when given, these rows are first written into the cache (the
    step's new tokens), so the call both stores and attends.
    Returns the attention-weighted latent [B, H, R] in q_lat.dtype (W_UV is applied by the caller).
    """
    if new_rows is not None:
        write_cache(kv_cache, slots, new_rows)
    r = q_lat.shape[-1]
    out = torch.empty(q_lat.shape, dtype=torch.float32, device=q_lat.device)
    for b in range(q_lat.shape[0]):
        kv = gather_paged(kv_cache, block_tables[b], int(seq_lens[b])).float()  # [S, R + P]
        scores = (q_lat[b].float() @ kv[:, :r].T + q_pe[b].float() @ kv[:, r:].T) * scale  # [H, S]
        out[b] = scores.softmax(dim=-1) @ kv[:, :r]
    return out.to(q_lat.dtype)


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """MHA/GQA decode over a paged cache: one query row per entry.

    q [B, H, Dk]; k_cache [NB, BS, Hkv, Dk], v_cache [NB, BS, Hkv, Dv]; block_tables [B, MB];
    seq_lens [B] → [B, H, Dv] in q.dtype (query head h reads kv head h // (H / Hkv)).
    """
    outs = []
    for b in range(q.shape[0]):
        n = int(seq_lens[b])
        k = gather_paged(k_cache.flatten(2), block_tables[b], n).view(n, *k_cache.shape[2:])
        v = gather_paged(v_cache.flatten(2), block_tables[b], n).view(n, *v_cache.shape[2:])
        outs.append(extend_attention(q[b:b + 1], k, v, scale))
    return torch.cat(outs)


def paged_extend(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    kv_len: int,
    scale: float,
) -> torch.Tensor:
    """extend_attention of one sequence whose S = kv_len keys (prefix + the T new) sit in a paged
    cache: q [T, H, Dk]; k_cache [NB, BS, Hkv, Dk], v_cache [NB, BS, Hkv, Dv]; block_table [MB]."""
    k = gather_paged(k_cache.flatten(2), block_table, kv_len).view(kv_len, *k_cache.shape[2:])
    v = gather_paged(v_cache.flatten(2), block_table, kv_len).view(kv_len, *v_cache.shape[2:])
    return extend_attention(q, k, v, scale)
