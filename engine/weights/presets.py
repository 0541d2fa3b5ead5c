"""Built-in models: deterministic random-weight checkpoints in the real HF layout, per family:
`tiny` / `small` (DeepSeek-V3), `tiny-qwen3moe` / `small-qwen3moe`, `tiny-qwen2moe` /
`small-qwen2moe`, `tiny-llama` / `small-llama` (Llama 3).

Generated on first use into the cache directory ($MOETUNE_CACHE, default ~/.cache/moetune) as
config.json + sharded safetensors (with model.safetensors.index.json) + tokenizer files, exactly
what `save_pretrained` of the family's transformers class would write, so the same loader path
serves real checkpoints. `tiny-*` take a second (tests); `small-*` have a fixed shape near 1 B
parameters so figures compare across runs and machines.
"""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import zlib
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from engine.config import ModelConfig
from engine.errors import MoetuneError
from engine.weights.layout import LinearSpec, TensorSpec, checkpoint_layout, layer_of

PRESET_VERSION = 1  # bump when generation changes: old caches are then regenerated

_V3_COMMON = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "initializer_range": 0.02,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "moe_layer_freq": 1,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "torch_dtype": "bfloat16",
    "num_nextn_predict_layers": 0,
}

PRESETS: dict[str, dict] = {
    # A second to generate; for tests and the server's smoke checks.
    "tiny": {
        **_V3_COMMON,
        "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
        "num_hidden_layers": 2, "first_k_dense_replace": 1,
        "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 48, "kv_lora_rank": 32,
        "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
        "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2,
        "max_position_embeddings": 2048,
        "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512,
                         "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    },
    # ≈1.34 B parameters, 2.7 GB in BF16: decode is memory-bound on a CPU.
    "small": {
        **_V3_COMMON,
        "vocab_size": 32000, "hidden_size": 2048, "intermediate_size": 5632, "moe_intermediate_size": 1408,
        "num_hidden_layers": 3, "first_k_dense_replace": 1,
        "num_attention_heads": 16, "num_key_value_heads": 16, "q_lora_rank": 768, "kv_lora_rank": 512,
        "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "n_routed_experts": 64, "n_shared_experts": 2, "num_experts_per_tok": 6, "n_group": 8, "topk_group": 4,
        "max_position_embeddings": 16384,
        "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096,
                         "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    },
}


_QWEN3_MOE = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_act": "silu",
    "rms_norm_eps": 1e-6, "initializer_range": 0.02, "attention_bias": False, "use_sliding_window": False,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True, "tie_word_embeddings": False,
    "bos_token_id": 0, "eos_token_id": 1, "torch_dtype": "bfloat16",
}
_QWEN2_MOE = {
    "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "hidden_act": "silu",
    "rms_norm_eps": 1e-6, "initializer_range": 0.02, "qkv_bias": True, "use_sliding_window": False,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": False, "tie_word_embeddings": False,
    "bos_token_id": 0, "eos_token_id": 1, "torch_dtype": "bfloat16",
}
_LLAMA3 = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu", "rms_norm_eps": 1e-5,
    "initializer_range": 0.02, "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": True,
    "bos_token_id": 0, "eos_token_id": 1, "torch_dtype": "bfloat16",
}

# The tiny ones draw weights wider than a real init (0.02), so attention is sharp enough for rope and
# the K/V cache to change greedy tokens (with near-uniform attention a rope error would not show).
TINY_INIT = {"initializer_range": 0.15}

PRESETS.update({
    "tiny-qwen3moe": {
        **_QWEN3_MOE, **TINY_INIT, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_experts": 8,
        "num_experts_per_tok": 2, "moe_intermediate_size": 32, "max_position_embeddings": 2048,
        "rope_theta": 1000000.0,
    },
    # ≈1.09 B parameters: Qwen3-30B-A3B's layer shape (GQA 32/4, head_dim 128, top-8 of 768-wide experts), 64 experts, 3 layers.
    "small-qwen3moe": {
        **_QWEN3_MOE, "vocab_size": 32000, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 3,
        "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 64,
        "num_experts_per_tok": 8, "moe_intermediate_size": 768, "max_position_embeddings": 16384,
        "rope_theta": 1000000.0,
    },
    "tiny-qwen2moe": {
        **_QWEN2_MOE, **TINY_INIT, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": 8, "num_experts_per_tok": 2,
        "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64, "max_position_embeddings": 2048,
        "rope_theta": 1000000.0,
    },
    # ≈1.07 B parameters: Qwen1.5-MoE-A2.7B's layer shape (16 heads, top-4 of 1408-wide experts, a
    # 5632-wide gated shared expert), 48 experts, 2 layers.
    "small-qwen2moe": {
        **_QWEN2_MOE, "vocab_size": 32000, "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 2,
        "num_attention_heads": 16, "num_key_value_heads": 16, "num_experts": 48, "num_experts_per_tok": 4,
        "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632, "max_position_embeddings": 16384,
        "rope_theta": 1000000.0,
    },
    "tiny-llama": {
        **_LLAMA3, **TINY_INIT, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 1, "max_position_embeddings": 2048,
        "tie_word_embeddings": False,  # tied random embeddings make greedy decoding echo its input
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 256},
        "rope_theta": 500000.0,
    },
    # ≈1.04 B parameters: Llama 3.2 1B's shape (16 layers, GQA 32/8, 8192-wide MLP, tied embeddings)
    # with a 32000-token vocabulary.
    "small-llama": {
        **_LLAMA3, "vocab_size": 32000, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "max_position_embeddings": 16384,
        "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
        "rope_theta": 500000.0,
    },
})


def cache_root() -> Path:
    return Path(os.environ.get("MOETUNE_CACHE") or Path.home() / ".cache" / "moetune")


def preset_dir(name: str) -> Path:
    return cache_root() / "presets" / f"{name}-v{PRESET_VERSION}"


def resolve_model(model: str | os.PathLike, progress: bool = True) -> Path:
    """A preset name (generated on first use) or a checkpoint directory."""
    if str(model) in PRESETS:
        return ensure_preset(str(model), progress)
    path = Path(model).expanduser()
    if not path.is_dir():
        raise MoetuneError(f"model {str(model)!r} is neither a preset ({', '.join(PRESETS)}) "
                           "nor a checkpoint directory")
    return path


def ensure_preset(name: str, progress: bool = True) -> Path:
    """The preset's directory, generating it if it is not cached yet.

    Generation happens in a temporary folder renamed into place when complete, under a file lock,
    so concurrent processes never see (or delete) a half-written preset.
    """
    out = preset_dir(name)
    if (out / ".complete").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_name(out.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / ".complete").is_file():
            _generate_into(name, out, progress)
    return out


def _generate_into(name: str, out: Path, progress: bool) -> None:
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        write_random_checkpoint(PRESETS[name], tmp, seed=zlib.crc32(name.encode()), progress=progress)
        (tmp / ".complete").write_text(f"moetune preset {name} v{PRESET_VERSION}\n")
        shutil.rmtree(out, ignore_errors=True)  # an incomplete leftover of a killed run
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ---------------------------------------------------------------- generation


def hf_tensor_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the checkpoint in HF naming, in model order, with its shape."""
    shapes: dict[str, tuple[int, ...]] = {}
    for spec in checkpoint_layout(cfg):
        if isinstance(spec, TensorSpec):
            shapes[spec.source] = spec.shape
            continue
        for row in spec.sources:
            for prefix, rows in zip(row, spec.parts):
                shapes[prefix + ".weight"] = (rows, spec.in_features)
    return shapes


def _random_tensor(name: str, shape: tuple[int, ...], seed: int, std: float) -> torch.Tensor:
    """Deterministic per name, whatever the generation order."""
    if name.endswith("norm.weight"):  # every RMSNorm (layer, q/k, MLA's q_a/kv_a, final) starts at one
        return torch.ones(shape)
    g = torch.Generator().manual_seed(seed ^ zlib.crc32(name.encode()))
    if name.endswith("e_score_correction_bias"):
        return torch.randn(shape, generator=g) * 0.05
    return torch.randn(shape, generator=g) * std


def _shard_of(name: str, num_layers: int) -> int:
    layer = layer_of(name)
    if layer is not None:
        return layer
    return 0 if name.startswith("model.embed_tokens") else num_layers - 1


def write_random_checkpoint(config: dict, out: Path, seed: int, progress: bool = True) -> None:
    """config.json, one safetensors shard per decoder layer plus the index, and the tokenizer."""
    from engine.tokenizer import build_preset_tokenizer

    cfg = ModelConfig.from_dict(config)
    shapes = hf_tensor_shapes(cfg)
    n = cfg.num_hidden_layers
    files = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    dtype = getattr(torch, config.get("torch_dtype", "bfloat16"))
    weight_map, total, nbytes = {}, sum(_numel(s) for s in shapes.values()), 0
    with tqdm(total=total, unit=" params", unit_scale=True, desc=f"generating {out.name}", disable=not progress) as bar:
        for shard in range(n):
            names = [k for k in shapes if _shard_of(k, n) == shard]
            tensors = {}
            for k in names:
                t = _random_tensor(k, shapes[k], seed, config.get("initializer_range", 0.02))
                keep_f32 = k.endswith(("mlp.gate.weight", "e_score_correction_bias"))
                tensors[k] = t if keep_f32 else t.to(dtype)
                nbytes += tensors[k].nbytes
                bar.update(_numel(shapes[k]))
            save_file(tensors, out / files[shard], metadata={"format": "pt"})
            weight_map.update({k: files[shard] for k in names})
            del tensors
    index = {"metadata": {"total_size": nbytes}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    build_preset_tokenizer(cfg.vocab_size, out)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
