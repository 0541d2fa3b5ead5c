"""Qwen3-MoE (`qwen3_moe`, Qwen3MoeForCausalLM): GQA with an RMSNorm per head on q and k before
rope; softmax top-k routing (renormalized when norm_topk_prob), no shared expert; dense MLP layers
where mlp_only_layers / decoder_sparse_step say so."""
from __future__ import annotations

import torch

from engine.models.gqa import GqaDecoder


class Qwen3Moe(GqaDecoder):
    def project_qkv(self, i: int, h: torch.Tensor):
        o, c, p = self.ops, self.cfg, f"layers.{i}."
        q, k, v = super().project_qkv(i, h)
        q = o.rms_norm(q, self.w[p + "q_norm"], c.rms_norm_eps)
        k = o.rms_norm(k, self.w[p + "k_norm"], c.rms_norm_eps)
        return q, k, v
