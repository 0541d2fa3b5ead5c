"""Qwen2-MoE (`qwen2_moe`, Qwen1.5-MoE / Qwen2-MoE): GQA with biases on q, k and v; softmax top-k
routing plus one shared expert whose output is scaled by sigmoid(shared_expert_gate · x)."""
from __future__ import annotations

import torch

from engine.models.gqa import GqaDecoder
from kernels.formats import DenseWeight


class Qwen2Moe(GqaDecoder):
    def __init__(self, cfg, weights, ops, dtype):
        super().__init__(cfg, weights, ops, dtype)
        prepare = getattr(ops, "prepare", lambda w: w)
        self.shared_gates = {i: prepare(DenseWeight(self.w[f"layers.{i}.shared_gate"]))
                             for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)}

    def project_qkv(self, i: int, h: torch.Tensor):
        q, k, v = super().project_qkv(i, h)
        if not self.cfg.qkv_bias:
            return q, k, v
        p = f"layers.{i}."
        return (q + self.w[p + "q_bias"].view(q.shape[1:]), k + self.w[p + "k_bias"].view(k.shape[1:]),
                v + self.w[p + "v_bias"].view(v.shape[1:]))

    def shared_ffn(self, i: int, h: torch.Tensor) -> torch.Tensor:
        gate = torch.sigmoid(self.ops.linear(h.float(), self.shared_gates[i]))  # [T, 1] float32
        return (super().shared_ffn(i, h).float() * gate).to(h.dtype)
