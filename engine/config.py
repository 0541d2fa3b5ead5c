"""ModelConfig: every field of a Hugging Face `config.json` that changes the math.

Read from the released checkpoints of two attention kinds:
- MLA, the DeepSeek family (`deepseek_v3`: V3, R1, Kimi-K2; `deepseek_v2`: V2, V2-Lite);
- GQA, with a paged K/V cache per KV head: `qwen3_moe` (Qwen3-MoE), `qwen2_moe` (Qwen1.5/Qwen2-MoE)
  and `llama` (Llama 3 dense). Their heads are described in the same fields: every q/k dim is a
  rope dim (qk_nope_head_dim 0, qk_rope_head_dim = v_head_dim = head_dim, kv_lora_rank 0).
Rope settings come from `rope_scaling` (released checkpoints) or `rope_parameters` (what current
transformers writes): YaRN, or Llama 3's scaling.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.errors import MoetuneError
from kernels.formats import INT4_GROUPS

MLA_MODEL_TYPES = ("deepseek_v3", "deepseek_v2")
GQA_MODEL_TYPES = ("qwen3_moe", "qwen2_moe", "llama")
SUPPORTED_MODEL_TYPES = MLA_MODEL_TYPES + GQA_MODEL_TYPES


@dataclass(frozen=True)
class YarnConfig:
    """YaRN rope scaling (arXiv 2309.00071) as DeepSeek uses it."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None  # numerator of the cos/sin attention factor
    mscale_all_dim: float | None = None  # denominator; also scales the softmax by mscale**2
    attention_factor: float | None = None  # explicit cos/sin factor, overrides mscale
    truncate: bool = True  # round the correction range to whole dims


@dataclass(frozen=True)
class Llama3Rope:
    """Llama 3.1's rope scaling: low frequencies divided by `factor`, a smooth blend between."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class QuantConfig:
    """`quantization_config`: FP8 block (the official DeepSeek-V3 release), channel INT8, or
    moetune's own group INT4 (`moetune quantize --to int4`)."""

    method: str  # "fp8" (block) | "w8a8_int8" (channel) | "moetune_int4" (group, weight-only)
    weight_block_size: tuple[int, int] = (128, 128)
    group_size: int = 128  # moetune_int4: inputs per scale


@dataclass(frozen=True)
class ModelConfig:
    """The architecture of a supported checkpoint (MLA: DeepSeek-V2/V3; GQA: Qwen3-MoE, Qwen2-MoE, Llama 3).

    Shape legend used across the engine: D hidden, H heads, R kv_lora_rank, P qk_rope_head_dim,
    N qk_nope_head_dim, V v_head_dim, E routed experts, K experts per token, I moe intermediate.
    """

    model_type: str
    # --- trunk
    vocab_size: int
    hidden_size: int  # D
    num_hidden_layers: int
    intermediate_size: int  # dense FFN width (first_k_dense layers)
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    bos_token_id: int | None
    eos_token_id: int | None
    # --- mla
    num_attention_heads: int  # H
    q_lora_rank: int | None  # None: a plain q_proj (V2-Lite)
    kv_lora_rank: int  # R
    qk_nope_head_dim: int  # N
    qk_rope_head_dim: int  # P
    v_head_dim: int  # V
    rope_theta: float
    rope_interleave: bool  # rope pairs (2i, 2i+1), as the released weights are laid out
    yarn: YarnConfig | None
    # --- moe
    n_routed_experts: int  # E (0: dense model)
    n_shared_experts: int
    num_experts_per_tok: int  # K
    moe_intermediate_size: int  # I
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    scoring_func: str  # "sigmoid" (V3) | "softmax" (V2)
    topk_method: str  # "noaux_tc" (V3, correction bias) | "greedy" | "group_limited_greedy"
    norm_topk_prob: bool
    first_k_dense_replace: int
    moe_layer_freq: int
    # --- gqa families (defaults: the MLA family's values)
    num_key_value_heads: int = 0  # Hkv (0: MLA)
    qkv_bias: bool = False  # q/k/v projections carry a bias (Qwen2-MoE)
    qk_norm: bool = False  # RMSNorm per head on q and k before rope (Qwen3-MoE)
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's one shared expert, behind a sigmoid gate
    decoder_sparse_step: int = 1  # Qwen: layer i is MoE when (i + 1) % step == 0 ...
    mlp_only_layers: tuple[int, ...] = ()  # ... and i is not listed here
    llama3_rope: Llama3Rope | None = None
    # --- extras
    num_nextn_predict_layers: int = 0  # MTP layers stored after the trunk; skipped
    quant: QuantConfig | None = None
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def is_mla(self) -> bool:
        return self.model_type in MLA_MODEL_TYPES

    @property
    def head_dim(self) -> int:
        """A GQA head's width (q, k and v)."""
        return self.qk_rope_head_dim

    @property
    def has_correction_bias(self) -> bool:
        return self.topk_method == "noaux_tc"

    @property
    def shared_width(self) -> int:
        """The shared FFN's width beside the routed experts (0: none)."""
        if self.shared_expert_intermediate_size:
            return self.shared_expert_intermediate_size
        return self.moe_intermediate_size * self.n_shared_experts

    def is_moe_layer(self, layer: int) -> bool:
        if self.n_routed_experts == 0:
            return False
        if not self.is_mla:
            return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0
        return layer >= self.first_k_dense_replace and layer % self.moe_layer_freq == 0

    @property
    def softmax_scale(self) -> float:
        """1/sqrt(qk_head_dim), times mscale(factor, mscale_all_dim)**2 under YaRN (DeepSeek's MLA
        only: the GQA families scale the softmax by 1/sqrt(head_dim) whatever the rope)."""
        scale = self.qk_head_dim ** -0.5
        if self.is_mla and self.yarn is not None and self.yarn.mscale_all_dim:
            m = yarn_mscale(self.yarn.factor, self.yarn.mscale_all_dim)
            scale *= m * m
        return scale

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> "ModelConfig":
        return _parse(cfg)

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise MoetuneError(f"no config.json at {path}: not a Hugging Face checkpoint directory")
        try:
            cfg = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise MoetuneError(f"{path} is not valid JSON ({e})") from None
        if not isinstance(cfg, dict):
            raise MoetuneError(f"{path} does not hold a JSON object")
        return _parse(cfg)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1·mscale·ln(scale) + 1 (1 when scale ≤ 1)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _rope_section(cfg: dict) -> dict:
    """The rope dict, whichever key the checkpoint used; {} when absent."""
    section = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    if not isinstance(section, dict):
        raise MoetuneError("config.json: rope_scaling must be an object or null")
    return section


def _parse_yarn(section: dict, max_pos: int) -> YarnConfig | None:
    kind = section.get("rope_type", section.get("type", "default"))
    if kind in (None, "default"):
        return None
    if kind != "yarn":
        raise MoetuneError(f"config.json: rope scaling type {kind!r} is not supported (only yarn)")
    orig = section.get("original_max_position_embeddings") or max_pos
    factor = section.get("factor") or max_pos / orig
    return YarnConfig(
        factor=float(factor),
        original_max_position_embeddings=int(orig),
        beta_fast=float(section.get("beta_fast") or 32),
        beta_slow=float(section.get("beta_slow") or 1),
        mscale=section.get("mscale"),
        mscale_all_dim=section.get("mscale_all_dim"),
        attention_factor=section.get("attention_factor"),
        truncate=bool(section.get("truncate", True)),
    )


def _parse_quant(cfg: dict) -> QuantConfig | None:
    q = cfg.get("quantization_config")
    if not q:
        return None
    method = q.get("quant_method")
    if method not in ("fp8", "w8a8_int8", "moetune_int4"):
        raise MoetuneError(f"config.json: quantization method {method!r} is not supported "
                           "(fp8 with 128x128 blocks, w8a8_int8 per channel, or moetune_int4 per group)")
    if q.get("activation_scheme", "dynamic") != "dynamic":
        raise MoetuneError("config.json: only dynamic activation scaling is supported")
    block = tuple(q.get("weight_block_size") or (128, 128))
    group = q.get("group_size", 128)
    if method == "moetune_int4" and (group not in INT4_GROUPS or q.get("symmetric", True) is not True):
        raise MoetuneError(f"config.json: moetune_int4 needs symmetric groups of {INT4_GROUPS}, "
                           f"got group_size {group!r}, symmetric {q.get('symmetric')!r}")
    return QuantConfig(method=method, weight_block_size=(int(block[0]), int(block[1])), group_size=int(group))


def _first_id(value) -> int | None:
    if isinstance(value, list):
        return int(value[0]) if value else None
    return None if value is None else int(value)


def _require(cfg: dict, key: str):
    if key not in cfg or cfg[key] is None:
        raise MoetuneError(f"config.json: required field {key!r} is missing")
    return cfg[key]


def _parse(cfg: dict) -> ModelConfig:
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise MoetuneError(f"model_type {model_type!r} is not supported "
                           f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    mc = _parse_mla(cfg) if model_type in MLA_MODEL_TYPES else _parse_gqa(cfg)
    _validate(mc)
    return mc


def _parse_mla(cfg: dict) -> ModelConfig:
    model_type = cfg["model_type"]
    if cfg.get("attention_bias"):
        raise MoetuneError("config.json: attention_bias=true is not supported (no released checkpoint uses it)")
    if cfg.get("hidden_act", "silu") != "silu":
        raise MoetuneError(f"config.json: hidden_act {cfg['hidden_act']!r} is not supported (silu only)")
    v3 = model_type == "deepseek_v3"
    heads = int(_require(cfg, "num_attention_heads"))
    kv_heads = cfg.get("num_key_value_heads") or heads
    if kv_heads != heads:
        raise MoetuneError("config.json: MLA needs num_key_value_heads == num_attention_heads")
    max_pos = int(cfg.get("max_position_embeddings") or 4096)
    rope = _rope_section(cfg)
    experts = int(cfg.get("n_routed_experts") or 0)
    topk_method = cfg.get("topk_method") or ("noaux_tc" if v3 else "greedy")
    mc = ModelConfig(
        model_type=model_type,
        vocab_size=int(_require(cfg, "vocab_size")),
        hidden_size=int(_require(cfg, "hidden_size")),
        num_hidden_layers=int(_require(cfg, "num_hidden_layers")),
        intermediate_size=int(_require(cfg, "intermediate_size")),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        max_position_embeddings=max_pos,
        bos_token_id=_first_id(cfg.get("bos_token_id")),
        eos_token_id=_first_id(cfg.get("eos_token_id")),
        num_attention_heads=heads,
        q_lora_rank=cfg.get("q_lora_rank"),
        kv_lora_rank=int(_require(cfg, "kv_lora_rank")),
        qk_nope_head_dim=int(_require(cfg, "qk_nope_head_dim")),
        qk_rope_head_dim=int(_require(cfg, "qk_rope_head_dim")),
        v_head_dim=int(_require(cfg, "v_head_dim")),
        rope_theta=float(rope.get("rope_theta") or cfg.get("rope_theta") or 10000.0),
        rope_interleave=bool(cfg.get("rope_interleave", True)),
        yarn=_parse_yarn(rope, max_pos),
        n_routed_experts=experts,
        n_shared_experts=int(cfg.get("n_shared_experts") or 0),
        num_experts_per_tok=int(cfg.get("num_experts_per_tok") or 0),
        moe_intermediate_size=int(cfg.get("moe_intermediate_size") or 0),
        n_group=int(cfg.get("n_group") or 1),
        topk_group=int(cfg.get("topk_group") or 1),
        routed_scaling_factor=float(cfg.get("routed_scaling_factor") or 1.0),
        scoring_func=cfg.get("scoring_func") or ("sigmoid" if v3 else "softmax"),
        topk_method=topk_method,
        norm_topk_prob=bool(cfg.get("norm_topk_prob", v3)),
        first_k_dense_replace=int(cfg.get("first_k_dense_replace") or 0),
        moe_layer_freq=int(cfg.get("moe_layer_freq") or 1),
        num_nextn_predict_layers=int(cfg.get("num_nextn_predict_layers") or 0),
        quant=_parse_quant(cfg),
        raw=cfg,
    )
    return mc


def _trunk(cfg: dict) -> dict:
    """The fields every family reads the same way."""
    return dict(
        model_type=cfg["model_type"],
        vocab_size=int(_require(cfg, "vocab_size")),
        hidden_size=int(_require(cfg, "hidden_size")),
        num_hidden_layers=int(_require(cfg, "num_hidden_layers")),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        bos_token_id=_first_id(cfg.get("bos_token_id")),
        eos_token_id=_first_id(cfg.get("eos_token_id")),
        quant=_parse_quant(cfg),
        raw=cfg,
    )


def _parse_llama3(section: dict, max_pos: int) -> Llama3Rope:
    try:
        return Llama3Rope(factor=float(section["factor"]), low_freq_factor=float(section["low_freq_factor"]),
                          high_freq_factor=float(section["high_freq_factor"]),
                          original_max_position_embeddings=int(section.get("original_max_position_embeddings")
                                                               or max_pos))
    except (KeyError, TypeError, ValueError) as e:
        raise MoetuneError(f"config.json: llama3 rope scaling needs factor, low_freq_factor and "
                           f"high_freq_factor ({e})") from None


def _parse_gqa(cfg: dict) -> ModelConfig:
    """Qwen3-MoE, Qwen2-MoE and Llama 3: GQA attention, softmax top-k MoE (or dense)."""
    model_type = cfg["model_type"]
    if cfg.get("hidden_act", "silu") != "silu":
        raise MoetuneError(f"config.json: hidden_act {cfg['hidden_act']!r} is not supported (silu only)")
    if cfg.get("use_sliding_window"):
        raise MoetuneError("config.json: use_sliding_window=true is not supported (full attention only)")
    if cfg.get("attention_bias") or cfg.get("mlp_bias"):
        raise MoetuneError("config.json: attention_bias / mlp_bias=true is not supported "
                           "(no released checkpoint of this family uses it)")
    if float(cfg.get("partial_rotary_factor") or 1.0) != 1.0:
        raise MoetuneError("config.json: partial_rotary_factor is not supported")
    heads = int(_require(cfg, "num_attention_heads"))
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    hidden = int(_require(cfg, "hidden_size"))
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    max_pos = int(cfg.get("max_position_embeddings") or 4096)
    rope = _rope_section(cfg)
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in (None, "default", "yarn", "llama3"):
        raise MoetuneError(f"config.json: rope scaling type {kind!r} is not supported (yarn or llama3)")
    moe = model_type != "llama"
    experts = int((cfg.get("num_experts") or cfg.get("num_local_experts") or 0) if moe else 0)
    mlp_only = cfg.get("mlp_only_layers") or []
    if not isinstance(mlp_only, list) or not all(isinstance(i, int) for i in mlp_only):
        raise MoetuneError("config.json: mlp_only_layers must be a list of layer indices")
    mc = ModelConfig(
        **_trunk(cfg),
        intermediate_size=int(_require(cfg, "intermediate_size")),
        max_position_embeddings=max_pos,
        num_attention_heads=heads,
        q_lora_rank=None, kv_lora_rank=0, qk_nope_head_dim=0, qk_rope_head_dim=head_dim, v_head_dim=head_dim,
        rope_theta=float(rope.get("rope_theta") or cfg.get("rope_theta") or 10000.0),
        rope_interleave=False,  # rotate-half pairs (x[i], x[i + d/2]), as transformers runs them
        yarn=_parse_yarn(rope, max_pos) if kind == "yarn" else None,
        llama3_rope=_parse_llama3(rope, max_pos) if kind == "llama3" else None,
        n_routed_experts=experts,
        n_shared_experts=0,
        num_experts_per_tok=int(cfg.get("num_experts_per_tok") or 0) if experts else 0,
        moe_intermediate_size=int(cfg.get("moe_intermediate_size") or 0) if experts else 0,
        n_group=1, topk_group=1, routed_scaling_factor=1.0, scoring_func="softmax", topk_method="greedy",
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        first_k_dense_replace=0, moe_layer_freq=1,
        num_key_value_heads=kv_heads,
        qkv_bias=model_type == "qwen2_moe" and bool(cfg.get("qkv_bias", True)),
        qk_norm=model_type == "qwen3_moe",
        shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0)
        if model_type == "qwen2_moe" and experts else 0,
        decoder_sparse_step=int(cfg.get("decoder_sparse_step") or 1),
        mlp_only_layers=tuple(int(i) for i in mlp_only),
    )
    if heads % kv_heads:
        raise MoetuneError(f"config.json: num_attention_heads {heads} is not a multiple of "
                           f"num_key_value_heads {kv_heads}")
    return mc


def _validate(c: ModelConfig) -> None:
    if c.scoring_func not in ("sigmoid", "softmax"):
        raise MoetuneError(f"config.json: scoring_func {c.scoring_func!r} is not supported")
    if c.topk_method not in ("noaux_tc", "greedy", "group_limited_greedy"):
        raise MoetuneError(f"config.json: topk_method {c.topk_method!r} is not supported")
    if c.n_routed_experts:
        if c.n_routed_experts % c.n_group:
            raise MoetuneError(f"config.json: n_routed_experts {c.n_routed_experts} "
                               f"is not divisible by n_group {c.n_group}")
        if not 0 < c.topk_group <= c.n_group:
            raise MoetuneError(f"config.json: topk_group {c.topk_group} must be in 1..n_group ({c.n_group})")
        if not 0 < c.num_experts_per_tok <= c.topk_group * (c.n_routed_experts // c.n_group):
            raise MoetuneError(f"config.json: num_experts_per_tok {c.num_experts_per_tok} exceeds the "
                               "experts reachable in topk_group groups")
        if c.moe_intermediate_size <= 0:
            raise MoetuneError("config.json: moe_intermediate_size must be positive")
    if c.qk_rope_head_dim % 2:
        raise MoetuneError("config.json: qk_rope_head_dim must be even")
