"""Which tensors a checkpoint holds (DeepSeek-V2/V3, Qwen3-MoE, Qwen2-MoE, Llama 3), and where each
goes in the engine's layout.

Hugging Face names (`model.layers.3.mlp.experts.17.gate_proj.weight`) map onto engine keys
(`layers.3.experts.w13`, expert 17, part 0). Linears may fuse parts along their rows (gate | up)
and stack experts along a leading dim.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.config import ModelConfig


@dataclass(frozen=True)
class LinearSpec:
    """A (possibly expert-stacked, part-fused) linear of logical shape [E?, Σ parts, in_features]."""

    key: str
    parts: tuple[int, ...]  # rows of each fused part, in order
    in_features: int
    sources: tuple[tuple[str, ...], ...]  # [expert or 0][part] → HF prefix (name without ".weight")
    ffn: str | None = None  # FFN this belongs to (gate_up and down of one FFN pad together)
    padded_input: bool = False  # the down projection of an FFN (its input dim is the FFN width)
    stacked: bool = False  # experts stacked along a leading dim (one source row per expert)


@dataclass(frozen=True)
class TensorSpec:
    """A plain tensor (norm, embedding, router) kept in high precision."""

    key: str
    shape: tuple[int, ...]
    source: str  # full HF name
    float32: bool = False  # keep in float32 whatever the model dtype (router, correction bias)


def _gqa_attention(cfg: ModelConfig, i: int) -> list:
    """q/k/v/o projections, with Qwen2-MoE's q/k/v biases or Qwen3-MoE's per-head q/k norms."""
    p, hf = f"layers.{i}.", f"model.layers.{i}.self_attn."
    d, hq, hkv = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    specs: list = []
    for name, rows in (("q", hq), ("k", hkv), ("v", hkv)):
        specs.append(LinearSpec(f"{p}{name}_proj", (rows,), d, ((f"{hf}{name}_proj",),)))
        if cfg.qkv_bias:
            specs.append(TensorSpec(f"{p}{name}_bias", (rows,), f"{hf}{name}_proj.bias"))
    if cfg.qk_norm:
        specs += [TensorSpec(p + "q_norm", (cfg.head_dim,), hf + "q_norm.weight"),
                  TensorSpec(p + "k_norm", (cfg.head_dim,), hf + "k_norm.weight")]
    return specs + [LinearSpec(p + "o_proj", (d,), hq, ((hf + "o_proj",),))]


def _attention(cfg: ModelConfig, i: int) -> list:
    if not cfg.is_mla:
        return _gqa_attention(cfg, i)
    p, hf = f"layers.{i}.", f"model.layers.{i}.self_attn."
    d, h, r = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_lora_rank
    specs: list = []
    if cfg.q_lora_rank is None:
        specs.append(LinearSpec(p + "q_proj", (h * cfg.qk_head_dim,), d, ((hf + "q_proj",),)))
    else:
        q = cfg.q_lora_rank
        specs += [
            LinearSpec(p + "q_a_proj", (q,), d, ((hf + "q_a_proj",),)),
            TensorSpec(p + "q_a_norm", (q,), hf + "q_a_layernorm.weight"),
            LinearSpec(p + "q_b_proj", (h * cfg.qk_head_dim,), q, ((hf + "q_b_proj",),)),
        ]
    return specs + [
        LinearSpec(p + "kv_a_proj", (r + cfg.qk_rope_head_dim,), d, ((hf + "kv_a_proj_with_mqa",),)),
        TensorSpec(p + "kv_a_norm", (r,), hf + "kv_a_layernorm.weight"),
        LinearSpec(p + "kv_b_proj", (h * (cfg.qk_nope_head_dim + cfg.v_head_dim),), r, ((hf + "kv_b_proj",),)),
        LinearSpec(p + "o_proj", (d,), h * cfg.v_head_dim, ((hf + "o_proj",),)),
    ]


def _ffn(key: str, hf: list[str], width: int, d: int) -> list[LinearSpec]:
    """gate|up fused and down, for one MLP (hf has one prefix) or stacked experts (one per expert)."""
    stacked = key.endswith("experts")
    up, down = ("w13", "w2") if stacked else ("gate_up", "down")
    return [
        LinearSpec(f"{key}.{up}", (width, width), d,
                   tuple((p + "gate_proj", p + "up_proj") for p in hf), ffn=key, stacked=stacked),
        LinearSpec(f"{key}.{down}", (d,), width, tuple((p + "down_proj",) for p in hf),
                   ffn=key, padded_input=True, stacked=stacked),
    ]


def _mlp(cfg: ModelConfig, i: int) -> list:
    p, hf = f"layers.{i}.", f"model.layers.{i}.mlp."
    d = cfg.hidden_size
    if not cfg.is_moe_layer(i):
        return _ffn(p + "mlp", [hf], cfg.intermediate_size, d)
    e = cfg.n_routed_experts
    specs: list = [TensorSpec(p + "router", (e, d), hf + "gate.weight", float32=True)]
    if cfg.has_correction_bias:
        specs.append(TensorSpec(p + "router_bias", (e,), hf + "gate.e_score_correction_bias", float32=True))
    specs += _ffn(p + "experts", [f"{hf}experts.{x}." for x in range(e)], cfg.moe_intermediate_size, d)
    if cfg.n_shared_experts:  # DeepSeek: n_shared_experts experts' width in one FFN
        specs += _ffn(p + "shared", [hf + "shared_experts."], cfg.shared_width, d)
    elif cfg.shared_expert_intermediate_size:  # Qwen2-MoE: one shared expert behind a sigmoid gate
        specs += _ffn(p + "shared", [hf + "shared_expert."], cfg.shared_width, d)
        specs.append(TensorSpec(p + "shared_gate", (1, d), hf + "shared_expert_gate.weight", float32=True))
    return specs


def checkpoint_layout(cfg: ModelConfig) -> list:
    """Every tensor the engine needs from a checkpoint, in model order."""
    d = cfg.hidden_size
    specs: list = [TensorSpec("embed", (cfg.vocab_size, d), "model.embed_tokens.weight")]
    for i in range(cfg.num_hidden_layers):
        specs += [TensorSpec(f"layers.{i}.attn_norm", (d,), f"model.layers.{i}.input_layernorm.weight")]
        specs += _attention(cfg, i)
        specs += [TensorSpec(f"layers.{i}.ffn_norm", (d,), f"model.layers.{i}.post_attention_layernorm.weight")]
        specs += _mlp(cfg, i)
    specs.append(TensorSpec("norm", (d,), "model.norm.weight"))
    if not cfg.tie_word_embeddings:
        specs.append(LinearSpec("lm_head", (cfg.vocab_size,), d, (("lm_head",),)))
    return specs


def layer_of(hf_name: str) -> int | None:
    """The decoder layer index of a HF tensor name, if it belongs to one."""
    parts = hf_name.split(".")
    if len(parts) > 2 and parts[0] == "model" and parts[1] == "layers" and parts[2].isdigit():
        return int(parts[2])
    return None


# The linears the released FP8 / INT8 checkpoints quantize: every projection inside the decoder
# layers. Embeddings, the LM head, norms and the router stay in high precision.
QUANTIZED_PROJECTIONS = (
    "q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "k_proj", "v_proj",
    "gate_proj", "up_proj", "down_proj",
)


def is_quantizable(hf_name: str) -> bool:
    parts = hf_name.split(".")
    return (layer_of(hf_name) is not None and len(parts) > 2 and parts[-1] == "weight"
            and parts[-2] in QUANTIZED_PROJECTIONS)
