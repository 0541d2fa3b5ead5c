"""DeepSeek-V2/V3 (MLA + DeepSeekMoE): the forward pass, every op called through a kernel backend.

Shape legend: T new tokens in the batch, D hidden, H heads, N qk_nope, P qk_rope, V v_head,
R kv_lora_rank, E routed experts, K experts per token.

MLA has two forms that must agree:
- naive: expand every cached latent through kv_b_proj into per-head K (nope) and V, then attend;
- absorbed: fold W_UK into the query and W_UV after the attention, so queries attend the latent
  cache directly (one shared K=V of width R, plus the rope key) — the decode form.
"""
from __future__ import annotations

import torch

from engine.cache import LatentKVCache
from engine.config import ModelConfig
from engine.models.base import Batch, Decoder


class DeepseekV3(Decoder):
    def __init__(self, cfg: ModelConfig, weights: dict, ops, dtype: torch.dtype, absorb: str = "decode"):
        super().__init__(cfg, weights, ops, dtype)
        self.absorb = absorb
        self.w_uk, self.w_uv = {}, {}
        for i in range(cfg.num_hidden_layers):
            self.w_uk[i], self.w_uv[i] = self._absorbed_weights(i)

    def make_cache(self, num_tokens: int, block_size: int, device) -> LatentKVCache:
        c = self.cfg
        return LatentKVCache(c.num_hidden_layers, num_tokens, block_size, c.kv_lora_rank + c.qk_rope_head_dim,
                             self.dtype, device)

    def attention_sites(self) -> list[tuple[str, tuple]]:
        c = self.cfg
        return [("mla_decode", (c.num_attention_heads, c.kv_lora_rank, c.qk_rope_head_dim)),
                ("extend_attention", (c.num_attention_heads, c.qk_head_dim, c.v_head_dim))]

    # ------------------------------------------------------------ weights for absorption

    def _absorbed_weights(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj split per head: W_UKᵀ [H, R, N] (q_nope → latent) and W_UV [H, V, R]."""
        c = self.cfg
        kv_b = self.w[f"layers.{i}.kv_b_proj"].dequantize(torch.float32)
        kv_b = kv_b.view(c.num_attention_heads, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)
        w_uk, w_uv = kv_b.split([c.qk_nope_head_dim, c.v_head_dim], dim=1)
        return w_uk.transpose(1, 2).contiguous().to(self.dtype), w_uv.contiguous().to(self.dtype)

    # ------------------------------------------------------------ attention (MLA)

    def _query(self, p: str, h: torch.Tensor) -> torch.Tensor:
        """[T, D] → q [T, H, N + P]."""
        o, c = self.ops, self.cfg
        if c.q_lora_rank is None:
            q = o.linear(h, self.w[p + "q_proj"])
        else:
            qa = o.rms_norm(o.linear(h, self.w[p + "q_a_proj"]), self.w[p + "q_a_norm"], c.rms_norm_eps)
            q = o.linear(qa, self.w[p + "q_b_proj"])
        return q.view(h.shape[0], c.num_attention_heads, c.qk_head_dim)

    def attention(self, i, h, cos, sin, batch: Batch, cache: LatentKVCache) -> torch.Tensor:
        o, c, p = self.ops, self.cfg, f"layers.{i}."
        q_nope, q_pe = self._query(p, h).split([c.qk_nope_head_dim, c.qk_rope_head_dim], dim=-1)
        q_pe = o.rope(q_pe, cos, sin, c.rope_interleave)
        latent, k_pe = o.linear(h, self.w[p + "kv_a_proj"]).split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
        latent = o.rms_norm(latent, self.w[p + "kv_a_norm"], c.rms_norm_eps)
        k_pe = o.rope(k_pe.unsqueeze(1), cos, sin, c.rope_interleave).squeeze(1)
        new_rows = torch.cat([latent, k_pe], dim=-1)
        absorbed = self.absorb == "always" or (self.absorb == "decode" and batch.is_decode)
        if absorbed:  # the kernel stores the new rows itself (fused cache write), then attends
            out = self._attend_absorbed(i, q_nope, q_pe, batch, cache, new_rows)
        else:
            cache.write(i, batch.slots, new_rows)
            out = self._attend_naive(i, q_nope, q_pe, batch, cache)
        return o.linear(out.reshape(h.shape[0], -1), self.w[p + "o_proj"])

    def _attend_absorbed(self, i, q_nope, q_pe, batch: Batch, cache: LatentKVCache, new_rows) -> torch.Tensor:
        """Every new token is one decode query; a prompt's token t sees keys 0..pos(t) (causal)."""
        o = self.ops
        q_lat = o.head_linear(q_nope, self.w_uk[i])  # [T, H, R]
        tables, lens = batch.decode_rows(q_lat.device)
        out_lat = o.mla_decode(q_lat, q_pe, cache.layers[i], tables, lens, self.scale, new_rows,
                               batch.slots.to(q_lat.device))
        return o.head_linear(out_lat, self.w_uv[i])  # [T, H, V]

    def _attend_naive(self, i, q_nope, q_pe, batch: Batch, cache: LatentKVCache) -> torch.Tensor:
        """Per sequence: expand its whole cached latent to K/V and attend causally."""
        o, c, p = self.ops, self.cfg, f"layers.{i}."
        q = torch.cat([q_nope, q_pe], dim=-1)
        outs, start = [], 0
        for s, n in zip(batch.seqs, batch.new_lens):
            rows = cache.rows(i, s)  # [S, R + P]
            latent, k_pe = rows.split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
            kv = o.linear(latent, self.w[p + "kv_b_proj"]).view(-1, c.num_attention_heads,
                                                               c.qk_nope_head_dim + c.v_head_dim)
            k_nope, v = kv.split([c.qk_nope_head_dim, c.v_head_dim], dim=-1)
            k = torch.cat([k_nope, k_pe.unsqueeze(1).expand(-1, c.num_attention_heads, -1)], dim=-1)
            outs.append(o.extend_attention(q[start:start + n], k, v, self.scale))
            start += n
        return torch.cat(outs)
