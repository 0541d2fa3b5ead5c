"""GQA attention over a paged K/V cache, shared by the Qwen3-MoE, Qwen2-MoE and Llama families.

Shape legend: T new tokens, H query heads, G = Hkv KV heads (H a multiple of G), d head_dim.
Per layer: q/k/v projections (`project_qkv`, which a family may extend: biases, q/k norms), rope
in rotate-half form on q and k, the new K/V stored per KV head in the cache, then attention:
a decode step is one `paged_decode` over every sequence, a step with prompt tokens one
`paged_extend` per sequence (its new tokens over its whole paged prefix).
"""
from __future__ import annotations

import torch

from engine.cache import HeadKVCache
from engine.models.base import Batch, Decoder


class GqaDecoder(Decoder):
    def make_cache(self, num_tokens: int, block_size: int, device) -> HeadKVCache:
        c = self.cfg
        return HeadKVCache(c.num_hidden_layers, num_tokens, block_size, c.num_key_value_heads, c.head_dim,
                           c.head_dim, self.dtype, device)

    def attention_sites(self) -> list[tuple[str, tuple]]:
        c = self.cfg
        key = (c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.head_dim)
        return [("paged_decode", key), ("paged_extend", key)]

    def project_qkv(self, i: int, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[T, D] → q [T, H, d], k [T, G, d], v [T, G, d] (before rope)."""
        o, c, p = self.ops, self.cfg, f"layers.{i}."
        t = h.shape[0]
        q = o.linear(h, self.w[p + "q_proj"]).view(t, c.num_attention_heads, c.head_dim)
        k = o.linear(h, self.w[p + "k_proj"]).view(t, c.num_key_value_heads, c.head_dim)
        v = o.linear(h, self.w[p + "v_proj"]).view(t, c.num_key_value_heads, c.head_dim)
        return q, k, v

    def attention(self, i, h, cos, sin, batch: Batch, cache: HeadKVCache) -> torch.Tensor:
        o, c = self.ops, self.cfg
        q, k, v = self.project_qkv(i, h)
        q = o.rope(q, cos, sin, c.rope_interleave)
        k = o.rope(k, cos, sin, c.rope_interleave)
        cache.write(i, batch.slots, k, v)
        if batch.is_decode:
            tables, lens = batch.decode_rows(q.device)
            out = o.paged_decode(q, cache.k[i], cache.v[i], tables, lens, self.scale)
        else:
            tables, outs, start = batch.tables().to(q.device), [], 0
            for b, (n, kv_len) in enumerate(zip(batch.new_lens, batch.seq_lens)):
                outs.append(o.paged_extend(q[start:start + n], cache.k[i], cache.v[i], tables[b], kv_len,
                                           self.scale))
                start += n
            out = torch.cat(outs)
        return o.linear(out.reshape(h.shape[0], -1), self.w[f"layers.{i}.o_proj"])
