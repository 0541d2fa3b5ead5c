"""Tiny random checkpoints written by transformers itself (the oracle), and its logits/greedy tokens."""
from __future__ import annotations

import json
from pathlib import Path

import torch

V3_BASE = dict(
    vocab_size=300, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
    num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4,
    q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
    n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=4, topk_group=2,
    routed_scaling_factor=2.5, norm_topk_prob=True, max_position_embeddings=1024,
    tie_word_embeddings=False, bos_token_id=0, eos_token_id=1,
)
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=256,
            beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0)
NO_YARN = dict(rope_type="default", rope_theta=10000.0)

# name → (model_type, config overrides): covers q_lora on/off, n_group 1 and > 1, yarn on/off,
# first_k_dense 0/1, tied/untied, odd head and expert counts; every V3 one has a non-zero bias.
CONFIGS = {
    "v3_base": ("deepseek_v3", dict(rope_parameters=YARN)),
    "v3_noqlora_tied_dense0_nogroup": ("deepseek_v3", dict(
        q_lora_rank=None, n_group=1, topk_group=1, first_k_dense_replace=0, tie_word_embeddings=True,
        rope_parameters=NO_YARN)),
    "v3_odd": ("deepseek_v3", dict(
        hidden_size=40, num_attention_heads=3, num_key_value_heads=3, n_routed_experts=6, n_group=3,
        topk_group=2, num_experts_per_tok=3, moe_intermediate_size=24, intermediate_size=56,
        qk_nope_head_dim=12, qk_rope_head_dim=6, v_head_dim=10, kv_lora_rank=20, q_lora_rank=28,
        n_shared_experts=2, rope_parameters=dict(YARN, factor=8.0, mscale=0.9, mscale_all_dim=0.7))),
    "v2_lite_greedy": ("deepseek_v2", dict(
        q_lora_rank=None, n_group=1, topk_group=1, topk_method="greedy", norm_topk_prob=False,
        routed_scaling_factor=1.0, rope_parameters=NO_YARN)),
    "v2_group_limited": ("deepseek_v2", dict(
        q_lora_rank=48, n_group=4, topk_group=2, topk_method="group_limited_greedy", norm_topk_prob=False,
        routed_scaling_factor=16.0, rope_parameters=YARN)),
}


def build_hf_model(name: str, seed: int = 0):
    """A float32 transformers model for CONFIGS[name], with a random correction bias (V3)."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM

    model_type, over = CONFIGS[name]
    kwargs = dict(V3_BASE, **over)
    torch.manual_seed(seed)
    if model_type == "deepseek_v3":
        model = DeepseekV3ForCausalLM(DeepseekV3Config(**kwargs))
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.e_score_correction_bias.uniform_(-0.05, 0.05)
    else:
        kwargs.pop("rope_interleave", None)
        model = DeepseekV2ForCausalLM(DeepseekV2Config(**kwargs))
    return model.float().eval()


def save_checkpoint(model, path: Path, max_shard_size: str | None = None) -> Path:
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["model_type"] in ("deepseek_v3", "deepseek_v2")
    return path


@torch.no_grad()
def hf_logits(model, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0].float()


@torch.no_grad()
def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """Greedy tokens by full recomputation each step (independent of any cache)."""
    seq = list(ids)
    for _ in range(n):
        seq.append(int(hf_logits(model, seq)[-1].argmax()))
    return seq[len(ids):]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())
