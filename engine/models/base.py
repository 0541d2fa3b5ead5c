"""The decoder skeleton every family shares: the step's batch, the layer loop (embedding, pre-norm
residual blocks, final norm), the dense MLP, the routed MoE with its optional shared FFN, and
lm_head. A family (one module per `model_type`, see engine/models/__init__.py) supplies its
attention and its KV cache.

Shape legend: T new tokens in the batch, D hidden, E routed experts, K experts per token.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from engine.cache import PagedCache, SeqCache
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

    def tables(self) -> torch.Tensor:
        """The sequences' block tables [B, max blocks] int32, on the host."""
        if self.block_tables is None:
            self.block_tables = PagedCache.block_tables(self.seqs)
        return self.block_tables

    def decode_rows(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Every new token as one decode query: its sequence's block table [T, max blocks] int32
        and the keys it sees [T] int32 (causal: position + 1), on `device`; built once per step."""
        key = ("decode_rows", str(device))
        if key not in self._memo:
            tables = self.tables()
            if not self.is_decode:
                seq_of = torch.repeat_interleave(torch.arange(len(self.new_lens)), torch.tensor(self.new_lens))
                tables = tables[seq_of]
            lens = (self.positions + 1).to(torch.int32)
            self._memo[key] = (tables.to(device), lens.to(device))
        return self._memo[key]


class Decoder:
    """A pre-norm decoder: x → [attention, FFN] × layers → norm. Subclasses define `attention`
    (and its cache, `make_cache`) and may add to the FFN (`shared_ffn`)."""

    def __init__(self, cfg: ModelConfig, weights: dict, ops, dtype: torch.dtype):
        if hasattr(ops, "prepare_weights"):  # backends repack weights once, at load
            weights = ops.prepare_weights(weights)
        self.cfg, self.w, self.ops, self.dtype = cfg, weights, ops, dtype
        self.rotary = RotaryAngles(cfg)
        self.scale = cfg.softmax_scale
        prepare = getattr(ops, "prepare", lambda w: w)
        self.routers = {i: prepare(DenseWeight(weights[f"layers.{i}.router"]))
                        for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)}
        self.runner = None  # engine.cpp_runner.CppDecodeRunner under graph_mode=cpp: runs decode steps

    # ------------------------------------------------------------ what a family defines

    def make_cache(self, num_tokens: int, block_size: int, device) -> PagedCache:
        raise NotImplementedError

    def attention(self, i: int, h: torch.Tensor, cos, sin, batch: Batch, cache) -> torch.Tensor:
        """Layer i's attention output [T, D] (the new tokens' K/V stored in the cache)."""
        raise NotImplementedError

    def attention_sites(self) -> list[tuple[str, tuple]]:
        """The tunable attention call sites (op, shape key) the kernel tables may name."""
        return []

    # ------------------------------------------------------------ forward

    def forward(self, batch: Batch, cache) -> torch.Tensor:
        """Hidden states after the final norm, [T, D]."""
        if self.runner is not None and batch.is_decode:
            return self.runner.forward(batch, cache)
        c, o = self.cfg, self.ops
        dev = self.w["embed"].device  # the batch is built on the host; the model may live on a GPU
        x = F.embedding(batch.token_ids.to(dev), self.w["embed"])
        cos, sin = (t.to(dev) for t in self.rotary(batch.positions))
        residual = x
        h = o.rms_norm(x, self.w["layers.0.attn_norm"], c.rms_norm_eps)
        for i in range(c.num_hidden_layers):
            p = f"layers.{i}."
            a = self.attention(i, h, cos, sin, batch, cache)
            h, residual = o.add_rms_norm(a, residual, self.w[p + "ffn_norm"], c.rms_norm_eps)
            m = self.moe(i, h) if c.is_moe_layer(i) else self.mlp(p + "mlp", h)
            next_norm = self.w[f"layers.{i + 1}.attn_norm"] if i + 1 < c.num_hidden_layers else self.w["norm"]
            h, residual = o.add_rms_norm(m, residual, next_norm, c.rms_norm_eps)
        return h

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[T, D] → [T, vocab] float32, on the host (where sampling runs)."""
        return self.ops.linear(hidden, self.w["lm_head"]).float().cpu()

    # ------------------------------------------------------------ feed-forward

    def mlp(self, key: str, h: torch.Tensor) -> torch.Tensor:
        o = self.ops
        return o.linear(o.silu_and_mul(o.linear(h, self.w[key + ".gate_up"])), self.w[key + ".down"])

    def moe(self, i: int, h: torch.Tensor) -> torch.Tensor:
        """Routed experts (grouped top-k: plain softmax top-k is its one-group case), plus the
        shared FFN where the family has one."""
        o, c, p = self.ops, self.cfg, f"layers.{i}."
        router_logits = o.linear(h.float(), self.routers[i])
        weights, ids = o.grouped_topk(router_logits, self.w.get(p + "router_bias"), c.num_experts_per_tok,
                                      c.n_group, c.topk_group, c.scoring_func, c.norm_topk_prob,
                                      c.routed_scaling_factor)
        out = o.fused_moe(h, self.w[p + "experts.w13"], self.w[p + "experts.w2"], weights, ids)
        if c.shared_width:
            out = out + self.shared_ffn(i, h)
        return out

    def shared_ffn(self, i: int, h: torch.Tensor) -> torch.Tensor:
        return self.mlp(f"layers.{i}.shared", h)
