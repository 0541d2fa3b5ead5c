"""DeepSeek-V2/V3 (MLA + DeepSeekMoE): the forward pass, every op called through a kernel backend.

Shape legend: T new tokens in the batch, D hidden, H heads, N qk_nope, P qk_rope, V v_head,
R kv_lora_rank, E routed experts, K experts per token.

MLA has two forms that must agree:
- naive: expand every cached latent through kv_b_proj into per-head K (nope) and V, then attend;
- absorbed: fold W_UK into the query and W_UV after the attention, so queries attend the latent
  cache directly (one shared K=V of width R, plus the rope key) — the decode form.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from engine.cache import LatentKVCache, SeqCache
from engine.config import ModelConfig
from engine.rope import RotaryAngles
from kernels.formats import DenseWeight


@dataclass
class Batch:
    """New tokens of several sequences, concatenated in sequence order.

    token_ids, positions, slots: [T]; seqs[i] holds seq_lens[i] tokens after this step (its new
    ones are the last new_lens[i]). block_tables: the seqs' block tables after this step [B, max
    blocks] int32 (built from seqs when not given); the per-token attention metadata is built from
    it once per step (`decode_rows`), not once per layer.
    """

    token_ids: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    seqs: list[SeqCache]
    new_lens: list[int]
    block_tables: torch.Tensor | None = None
    _memo: dict = field(default_factory=dict, repr=False)

    @property
    def is_decode(self) -> bool:
        if "is_decode" not in self._memo:
            self._memo["is_decode"] = all(n == 1 for n in self.new_lens)
        return self._memo["is_decode"]

    @property
    def seq_lens(self) -> list[int]:
        return [s.num_tokens for s in self.seqs]

    def last_token_index(self) -> torch.Tensor:
        return torch.tensor(self.new_lens).cumsum(0) - 1

    def decode_rows(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Every new token as one decode query: its sequence's block table [T, max blocks] int32
        and the keys it sees [T] int32 (causal: position + 1), on `device`; built once per step."""
        key = ("decode_rows", str(device))
        if key not in self._memo:
            tables = self.block_tables if self.block_tables is not None else LatentKVCache.block_tables(self.seqs)
            if not self.is_decode:
                seq_of = torch.repeat_interleave(torch.arange(len(self.new_lens)), torch.tensor(self.new_lens))
                tables = tables[seq_of]
            lens = (self.positions + 1).to(torch.int32)
            self._memo[key] = (tables.to(device), lens.to(device))
        return self._memo[key]


class DeepseekV3:
    def __init__(self, cfg: ModelConfig, weights: dict, ops, dtype: torch.dtype, absorb: str = "decode"):
        if hasattr(ops, "prepare_weights"):  # backends repack weights once, at load
            weights = ops.prepare_weights(weights)
        self.cfg, self.w, self.ops, self.dtype, self.absorb = cfg, weights, ops, dtype, absorb
        self.rotary = RotaryAngles(cfg)
        self.scale = cfg.softmax_scale
        self.w_uk, self.w_uv = {}, {}
        for i in range(cfg.num_hidden_layers):
            self.w_uk[i], self.w_uv[i] = self._absorbed_weights(i)
        prepare = getattr(ops, "prepare", lambda w: w)
        self.routers = {i: prepare(DenseWeight(weights[f"layers.{i}.router"]))
                        for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)}
        self.runner = None  # engine.cpp_runner.CppDecodeRunner under graph_mode=cpp: runs decode steps

    # ------------------------------------------------------------ weights for absorption

    def _absorbed_weights(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj split per head: W_UKᵀ [H, R, N] (q_nope → latent) and W_UV [H, V, R]."""
        c = self.cfg
        kv_b = self.w[f"layers.{i}.kv_b_proj"].dequantize(torch.float32)
        kv_b = kv_b.view(c.num_attention_heads, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)
        w_uk, w_uv = kv_b.split([c.qk_nope_head_dim, c.v_head_dim], dim=1)
        return w_uk.transpose(1, 2).contiguous().to(self.dtype), w_uv.contiguous().to(self.dtype)

    # ------------------------------------------------------------ forward

    def forward(self, batch: Batch, cache: LatentKVCache) -> torch.Tensor:
        """Hidden states after the final norm, [T, D]."""
        if self.runner is not None and batch.is_decode:
            return self.runner.forward(batch, cache)
        dev = self.w["embed"].device  # the batch is built on the host; the model may live on a GPU
        x = F.embedding(batch.token_ids.to(dev), self.w["embed"])
        cos, sin = (t.to(dev) for t in self.rotary(batch.positions))
        residual = x
        h = self.ops.rms_norm(x, self.w["layers.0.attn_norm"], self.cfg.rms_norm_eps)
        for i in range(self.cfg.num_hidden_layers):
            p = f"layers.{i}."
            a = self.attention(i, h, cos, sin, batch, cache)
            h, residual = self.ops.add_rms_norm(a, residual, self.w[p + "ffn_norm"], self.cfg.rms_norm_eps)
            m = self.moe(i, h) if self.cfg.is_moe_layer(i) else self.mlp(p + "mlp", h)
            next_norm = self.w[f"layers.{i + 1}.attn_norm"] if i + 1 < self.cfg.num_hidden_layers else self.w["norm"]
            h, residual = self.ops.add_rms_norm(m, residual, next_norm, self.cfg.rms_norm_eps)
        return h

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[T, D] → [T, vocab] float32, on the host (where sampling runs)."""
        return self.ops.linear(hidden, self.w["lm_head"]).float().cpu()

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

    # ------------------------------------------------------------ feed-forward

    def mlp(self, key: str, h: torch.Tensor) -> torch.Tensor:
        o = self.ops
        return o.linear(o.silu_and_mul(o.linear(h, self.w[key + ".gate_up"])), self.w[key + ".down"])

    def moe(self, i: int, h: torch.Tensor) -> torch.Tensor:
        o, c, p = self.ops, self.cfg, f"layers.{i}."
        router_logits = o.linear(h.float(), self.routers[i])
        weights, ids = o.grouped_topk(router_logits, self.w.get(p + "router_bias"), c.num_experts_per_tok,
                                      c.n_group, c.topk_group, c.scoring_func, c.norm_topk_prob,
                                      c.routed_scaling_factor)
        out = o.fused_moe(h, self.w[p + "experts.w13"], self.w[p + "experts.w2"], weights, ids)
        if c.n_shared_experts:
            out = out + self.mlp(p + "shared", h)
        return out



