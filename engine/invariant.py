"""Batch-invariant execution (knob `batch_invariant`): every matmul-bearing op one token row at a time.

Why it is needed: torch's CPU float32 GEMM rounds a row differently depending on how many rows
are multiplied together (one row takes a GEMV path, two or more take GEMM kernels whose K blocking
depends on M), so in a batched step a sequence's logits change in the last bits with its batch
mates. Run row by row, every op sees, for a given token, the same shapes whatever it is batched
with, and its results are bitwise those of the token run alone. The row-wise ops below cover every
op whose result for one token depends on the other rows' count (linear, head_linear, fused_moe,
extend_attention, mla_decode, paged_decode, paged_extend); the rest (norms, rope, SiLU, routing) are row-local already.
"""
from __future__ import annotations

import torch

from kernels.reference import write_cache


def _by_row(fn, x: torch.Tensor, *rowwise: torch.Tensor) -> torch.Tensor:
    """fn applied to row i of x (and of each tensor in `rowwise`), results concatenated on dim 0."""
    if x.shape[0] <= 1:
        return fn(x, *rowwise)
    return torch.cat([fn(x[i:i + 1], *(t[i:i + 1] for t in rowwise)) for i in range(x.shape[0])])


class RowwiseOps:
    """A kernel backend wrapper: the same ops, each token row computed on its own."""

    def __init__(self, ops):
        self._ops = ops

    def __getattr__(self, name: str):
        return getattr(self._ops, name)

    def linear(self, x: torch.Tensor, weight) -> torch.Tensor:
        return _by_row(lambda r: self._ops.linear(r, weight), x)

    def head_linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return _by_row(lambda r: self._ops.head_linear(r, w), x)

    def fused_moe(self, x, w13, w2, topk_weights, topk_ids) -> torch.Tensor:
        return _by_row(lambda r, tw, ti: self._ops.fused_moe(r, w13, w2, tw, ti), x, topk_weights, topk_ids)

    def extend_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """Query i (of T new) attends keys 0 .. S - T + i: one call per query with exactly those keys."""
        t, s = q.shape[0], k.shape[0]
        return torch.cat([self._ops.extend_attention(q[i:i + 1], k[:s - t + i + 1], v[:s - t + i + 1], scale)
                          for i in range(t)])

    def mla_decode(self, q_lat, q_pe, kv_cache, block_tables, seq_lens, scale, new_rows=None,
                   slots=None) -> torch.Tensor:
        if new_rows is not None:  # the whole step's rows first, as the fused write does
            write_cache(kv_cache, slots, new_rows)
        return _by_row(lambda ql, qp, bt, sl: self._ops.mla_decode(ql, qp, kv_cache, bt, sl, scale),
                       q_lat, q_pe, block_tables, seq_lens)

    def paged_decode(self, q, k_cache, v_cache, block_tables, seq_lens, scale) -> torch.Tensor:
        return _by_row(lambda qr, bt, sl: self._ops.paged_decode(qr, k_cache, v_cache, bt, sl, scale),
                       q, block_tables, seq_lens)

    def paged_extend(self, q, k_cache, v_cache, block_table, kv_len, scale) -> torch.Tensor:
        """Query i (of T new) attends keys 0 .. kv_len - T + i, one call each (as extend_attention)."""
        t = q.shape[0]
        return torch.cat([self._ops.paged_extend(q[i:i + 1], k_cache, v_cache, block_table, kv_len - t + i + 1, scale)
                          for i in range(t)])
