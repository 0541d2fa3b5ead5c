"""The model families, one module each, chosen by config.json's `model_type`."""
from __future__ import annotations

import importlib

from engine.config import SUPPORTED_MODEL_TYPES, ModelConfig
from engine.errors import MoetuneError

# model_type → (module, class); imported on use
FAMILIES: dict[str, tuple[str, str]] = {
    "deepseek_v3": ("engine.models.deepseek_v3", "DeepseekV3"),
    "deepseek_v2": ("engine.models.deepseek_v3", "DeepseekV3"),
    "qwen3_moe": ("engine.models.qwen3_moe", "Qwen3Moe"),
    "qwen2_moe": ("engine.models.qwen2_moe", "Qwen2Moe"),
    "llama": ("engine.models.llama", "Llama"),
}
assert set(FAMILIES) == set(SUPPORTED_MODEL_TYPES)


def model_class(model_type: str):
    if model_type not in FAMILIES:
        raise MoetuneError(f"model_type {model_type!r} is not supported (supported: {', '.join(FAMILIES)})")
    module, name = FAMILIES[model_type]
    return getattr(importlib.import_module(module), name)


def build_model(cfg: ModelConfig, weights: dict, ops, dtype, absorb: str = "decode"):
    """The family's model over loaded weights (absorb: the MLA form, DeepSeek only)."""
    cls = model_class(cfg.model_type)
    if cfg.is_mla:
        return cls(cfg, weights, ops, dtype, absorb=absorb)
    return cls(cfg, weights, ops, dtype)
