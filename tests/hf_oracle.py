"""Tiny random checkpoints written by transformers itself (the oracle), and its logits/greedy tokens:
DeepseekV3/V2 (CONFIGS) and the GQA families Qwen3-MoE, Qwen2-MoE, Llama 3 (FAMILY_CONFIGS)."""
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


GQA_BASE = dict(
    vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=False, bos_token_id=0,
    eos_token_id=1, rms_norm_eps=1e-6, initializer_range=0.05,
)
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
DEFAULT_ROPE = dict(rope_type="default", rope_theta=10000.0)
QWEN_YARN = dict(rope_type="yarn", rope_theta=1000000.0, factor=4.0, original_max_position_embeddings=256)
LLAMA3 = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=32)

# name → (model_type, config overrides): GQA ratios 1, 2, 4 and 8, odd head counts, an explicit
# head_dim ≠ hidden/heads, tied and untied embeddings, rope scaling on (yarn, llama3) and off,
# norm_topk_prob on/off, dense layers by mlp_only_layers and decoder_sparse_step, qkv_bias on/off.
FAMILY_CONFIGS = {
    "qwen3_base": ("qwen3_moe", dict(MOE, head_dim=16, norm_topk_prob=True, rope_parameters=DEFAULT_ROPE)),
    "qwen3_gqa8_yarn_tied": ("qwen3_moe", dict(
        MOE, hidden_size=40, num_attention_heads=8, num_key_value_heads=1, head_dim=10, num_experts=6,
        num_experts_per_tok=3, moe_intermediate_size=24, intermediate_size=56, norm_topk_prob=False,
        mlp_only_layers=[1], tie_word_embeddings=True, rope_parameters=QWEN_YARN)),
    "qwen3_mha_odd_sparse2": ("qwen3_moe", dict(
        MOE, hidden_size=36, num_attention_heads=3, num_key_value_heads=3, head_dim=12, num_experts=5,
        decoder_sparse_step=2, norm_topk_prob=True, rope_parameters=DEFAULT_ROPE)),
    "qwen2_base": ("qwen2_moe", dict(
        MOE, num_key_value_heads=4, shared_expert_intermediate_size=48, rope_parameters=DEFAULT_ROPE)),
    "qwen2_odd_gqa3_tied": ("qwen2_moe", dict(
        MOE, hidden_size=36, num_attention_heads=6, num_key_value_heads=2, num_experts=7, num_experts_per_tok=3,
        shared_expert_intermediate_size=20, norm_topk_prob=True, mlp_only_layers=[0], tie_word_embeddings=True,
        rope_parameters=QWEN_YARN)),
    "qwen2_nobias_gqa8": ("qwen2_moe", dict(
        MOE, num_attention_heads=8, num_key_value_heads=1, qkv_bias=False, shared_expert_intermediate_size=40,
        rope_parameters=DEFAULT_ROPE)),
    "llama3_gqa4": ("llama", dict(num_attention_heads=8, num_key_value_heads=2, rope_parameters=LLAMA3)),
    "llama_mha_odd_tied": ("llama", dict(
        hidden_size=40, num_attention_heads=5, num_key_value_heads=5, tie_word_embeddings=True,
        rope_parameters=DEFAULT_ROPE)),
    "llama3_gqa8": ("llama", dict(num_attention_heads=8, num_key_value_heads=1, rope_parameters=LLAMA3)),
}


def _build_family(name: str):
    from transformers import (LlamaConfig, LlamaForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM, Qwen3MoeConfig,
                              Qwen3MoeForCausalLM)

    model_type, over = FAMILY_CONFIGS[name]
    kwargs = dict(GQA_BASE, **over)
    cls, cfg_cls = {"qwen3_moe": (Qwen3MoeForCausalLM, Qwen3MoeConfig),
                    "qwen2_moe": (Qwen2MoeForCausalLM, Qwen2MoeConfig),
                    "llama": (LlamaForCausalLM, LlamaConfig)}[model_type]
    model = cls(cfg_cls(**kwargs))
    with torch.no_grad():  # routers spread wider than the init's, so no two experts nearly tie
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.weight.normal_(0, 0.5)
            for norm in ("q_norm", "k_norm"):  # non-trivial norm weights: a wrong norm shows
                if hasattr(layer.self_attn, norm):
                    getattr(layer.self_attn, norm).weight.uniform_(0.5, 1.5)
    return model


def build_hf_model(name: str, seed: int = 0):
    """A float32 transformers model for CONFIGS[name] (with a random correction bias, V3) or
    FAMILY_CONFIGS[name]."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM

    if name in FAMILY_CONFIGS:
        torch.manual_seed(seed)
        return _build_family(name).float().eval()
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
    assert cfg["model_type"] in ("deepseek_v3", "deepseek_v2", "qwen3_moe", "qwen2_moe", "llama")
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
