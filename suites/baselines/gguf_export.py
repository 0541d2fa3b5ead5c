"""Export an engine checkpoint (a preset or any HF checkpoint of a supported family) to GGUF: DeepSeek
as `deepseek2`, Qwen3-MoE as `qwen3moe`, Qwen2-MoE as `qwen2moe`, Llama 3 as `llama`.

    python -m suites.baselines.gguf_export MODEL OUT.gguf [--type f32|bf16|q8_0|q4_0]

The same weights llama.cpp then runs, in the precision matching ours (MATCHING): fp32 ↔ F32 (for
the token-agreement check), bf16 ↔ BF16, int8 ↔ Q8_0, int4 ↔ Q4_0 (gguf-py can quantize Q4_0 but
not Q4_K, which needs llama.cpp's own quantize tool). FP8-block and INT8-channel checkpoints (the
released layouts, `moetune quantize`) are dequantized first; the tensors such a checkpoint keeps in
high precision (LM head, embeddings) are written BF16 in a Q8_0 / Q4_0 export, as ours reads them.

What llama.cpp's deepseek2 loader expects (facts, learned from its loader and converter):

* MLA as "MQA with one KV head": head_count_kv = 1, key_length = R + P, value_length = R, and the
  real per-head sizes in key_length_mla = N + P / value_length_mla = V.
* kv_b_proj [H·(N+V), R] split per head into k_b [H, R, N] (transposed) and v_b [H, V, R].
* Routed experts stacked per layer into ffn_{gate,up,down}_exps [E, out, in].
* Routing: gating defaults to softmax unless `expert_gating_func` says sigmoid (written from
  `scoring_func`); the correction bias is `exp_probs_b.bias`; group-limited routing (top-2 sum per
  group, as noaux_tc) only when 1 < n_group and topk_group < n_group (it asserts this).
  When topk_group ≥ n_group the group limit selects every group, i.e. it is a no-op, so the group
  keys are left out (same routing). n_experts not divisible by n_group is refused (neither engine
  nor HF defines it).
* YaRN: rope type yarn, factor, original context, beta fast/slow, and yarn_log_mul written as
  0.1 · mscale_all_dim (llama.cpp divides by 0.1 again when loading).
* Rope pairs interleaved (2i, 2i+1) as the released weights are: checkpoints with
  rope_interleave = false are refused rather than silently permuted.

What its GQA architectures expect (qwen3moe, qwen2moe, llama):

* head_count_kv, key_length = value_length = rope_dimension_count = head_dim; q/k norms
  `attn_{q,k}_norm`; q/k/v biases `attn_{q,k,v}.bias`; the shared expert `ffn_*_shexp` and its gate
  `ffn_gate_inp_shexp` [D]; experts stacked as for deepseek2.
* qwen3moe / qwen2moe rope in rotate-half (NEOX) form as stored; llama's rope pairs are (2i, 2i+1),
  so q_proj / k_proj rows are permuted per head from the HF rotate-half order; Llama 3's rope
  scaling is the `rope_freqs.weight` tensor of per-pair frequency divisors.
* Every qwen layer is MoE (no mlp_only_layers / decoder_sparse_step), qwen2moe has q/k/v biases,
  and qwen3moe renormalizes its top-k weights while qwen2moe does not (as llama.cpp runs them);
  other settings are refused, and so is YaRN on these families (not checked against llama.cpp).

Norms, biases and the router stay F32; a tensor whose row length is not a multiple of the quant
block (32) stays F32 (f32/bf16 exports) or BF16 — it is listed in the returned summary. The
tokenizer is written as GPT-2-style byte-level BPE (`tokenizer.ggml.model = gpt2`, pre `gpt-2`):
llama.cpp identifies pre-tokenizers by a hash and rejects newly trained ones otherwise.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from engine.config import ModelConfig
from engine.errors import MoetuneError

GGUF_TYPES = ("f32", "bf16", "q8_0", "q4_0")
# part of the cached exports' key (llamacpp.gguf_path): 2 = a quantized checkpoint's high-precision
# tensors stay BF16 in Q8_0 / Q4_0 exports
LAYOUT_VERSION = 2
MATCHING = {"fp32": "f32", "bf16": "bf16", "int8": "q8_0", "int4": "q4_0"}  # our format → GGUF type

_ATTN = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
         "self_attn.q_proj": "attn_q", "self_attn.q_a_proj": "attn_q_a", "self_attn.q_b_proj": "attn_q_b",
         "self_attn.q_a_layernorm": "attn_q_a_norm", "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa",
         "self_attn.kv_a_layernorm": "attn_kv_a_norm", "self_attn.o_proj": "attn_output",
         "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
         "mlp.gate": "ffn_gate_inp", "mlp.shared_experts.gate_proj": "ffn_gate_shexp",
         "mlp.shared_experts.up_proj": "ffn_up_shexp", "mlp.shared_experts.down_proj": "ffn_down_shexp"}
_ATTN_GQA = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
             "mlp.gate": "ffn_gate_inp", "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
             "mlp.shared_expert.up_proj": "ffn_up_shexp", "mlp.shared_expert.down_proj": "ffn_down_shexp",
             "mlp.shared_expert_gate": "ffn_gate_inp_shexp"}
ARCHES = {"deepseek_v3": "deepseek2", "deepseek_v2": "deepseek2", "qwen3_moe": "qwen3moe",
          "qwen2_moe": "qwen2moe", "llama": "llama"}
_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight"}


@dataclass
class TensorPlan:
    """One GGUF tensor: its name, numpy shape (outermost first) and how it is built from HF tensors."""
    name: str
    shape: tuple[int, ...]
    kind: str  # "plain" | "experts" | "k_b" | "v_b" | "rope_perm" (llama q/k rows) | "rope_freqs"
    sources: list[str] = field(default_factory=list)
    keep_f32: bool = False
    heads: int = 0  # rope_perm: the heads whose rows are permuted


def plan_tensors(cfg: ModelConfig, hf_shapes: dict[str, tuple[int, ...]]) -> list[TensorPlan]:
    """The GGUF tensors of a checkpoint, in file order."""
    H, N, V, R = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    arch = ARCHES[cfg.model_type]
    plans: list[TensorPlan] = []
    if cfg.llama3_rope is not None:
        plans.append(TensorPlan("rope_freqs.weight", (cfg.head_dim // 2,), "rope_freqs", keep_f32=True))
    experts: dict[tuple[int, str], list[str]] = {}
    for name, shape in hf_shapes.items():
        if name in _TOP:
            plans.append(TensorPlan(_TOP[name], shape, "plain", [name], keep_f32=len(shape) == 1))
            continue
        parts = name.split(".")
        if parts[:2] != ["model", "layers"]:
            raise MoetuneError(f"cannot place tensor {name!r} in a {arch} GGUF")
        layer, rest = int(parts[2]), ".".join(parts[3:])
        if layer >= cfg.num_hidden_layers:
            continue  # MTP layers: llama.cpp's deepseek2 does not run them either
        if rest.startswith("mlp.experts."):
            proj = parts[6]  # gate_proj | up_proj | down_proj
            experts.setdefault((layer, proj), []).append(name)
            if len(experts[(layer, proj)]) == cfg.n_routed_experts:
                srcs = sorted(experts[(layer, proj)], key=lambda s: int(s.split(".")[5]))
                gname = f"blk.{layer}.ffn_{proj.removesuffix('_proj')}_exps.weight"
                plans.append(TensorPlan(gname, (len(srcs), *shape), "experts", srcs))
            continue
        if rest == "self_attn.kv_b_proj.weight":
            plans.append(TensorPlan(f"blk.{layer}.attn_k_b.weight", (H, R, N), "k_b", [name]))
            plans.append(TensorPlan(f"blk.{layer}.attn_v_b.weight", (H, V, R), "v_b", [name]))
            continue
        if rest == "mlp.gate.e_score_correction_bias":
            plans.append(TensorPlan(f"blk.{layer}.exp_probs_b.bias", shape, "plain", [name], keep_f32=True))
            continue
        names = _ATTN if arch == "deepseek2" else _ATTN_GQA
        base, suffix = rest.rsplit(".", 1)
        if base not in names or suffix not in ("weight", "bias"):
            raise MoetuneError(f"cannot place tensor {name!r} in a {arch} GGUF")
        if base == "mlp.shared_expert_gate":
            shape = (shape[-1],)  # llama.cpp reads the gate as one row [D]
        keep = len(shape) == 1 or base == "mlp.gate"
        plan = TensorPlan(f"blk.{layer}.{names[base]}.{suffix}", shape, "plain", [name], keep_f32=keep)
        if arch == "llama" and base in ("self_attn.q_proj", "self_attn.k_proj"):
            plan.kind = "rope_perm"
            plan.heads = H if base == "self_attn.q_proj" else cfg.num_key_value_heads
        plans.append(plan)
    return plans


def check_exportable(cfg: ModelConfig) -> None:
    """Refuse what llama.cpp cannot run the same way (one line each)."""
    if not cfg.is_mla:
        return _check_gqa(cfg)
    if cfg.n_routed_experts == 0:
        raise MoetuneError("dense checkpoints are not a deepseek2 MoE export target")
    if not cfg.rope_interleave:
        raise MoetuneError("rope_interleave = false checkpoints are not supported by the GGUF export")
    if cfg.n_group > 1 and cfg.n_routed_experts % cfg.n_group:
        raise MoetuneError(f"n_routed_experts {cfg.n_routed_experts} is not divisible by n_group {cfg.n_group}")
    if cfg.quant is not None and cfg.quant.method == "moetune_int4":
        raise MoetuneError("int4 checkpoints (moetune's own layout) are not exported to GGUF: export their "
                           "high-precision source (--type q4_0 for llama.cpp's INT4)")


def _check_gqa(cfg: ModelConfig) -> None:
    arch = ARCHES[cfg.model_type]
    if cfg.yarn is not None:
        raise MoetuneError(f"yarn rope scaling is not exported for {arch} (not checked against llama.cpp)")
    if arch == "llama":
        return
    if cfg.mlp_only_layers or cfg.decoder_sparse_step != 1:
        raise MoetuneError(f"{arch} GGUF: every layer must be MoE (mlp_only_layers / decoder_sparse_step "
                           "are not exported)")
    if arch == "qwen2moe" and not cfg.qkv_bias:
        raise MoetuneError("qwen2moe GGUF: qkv_bias=false is not exported (llama.cpp reads the q/k/v biases)")
    want = arch == "qwen3moe"  # llama.cpp renormalizes qwen3moe's top-k weights, never qwen2moe's
    if cfg.norm_topk_prob != want:
        raise MoetuneError(f"{arch} GGUF: norm_topk_prob={str(cfg.norm_topk_prob).lower()} is not what "
                           f"llama.cpp runs for {arch} ({str(want).lower()})")


def group_keys(cfg: ModelConfig) -> tuple[int, int] | None:
    """(expert_group_count, expert_group_used_count) to write, or None when the limit is a no-op."""
    grouped = cfg.topk_method in ("noaux_tc", "group_limited_greedy")
    if not grouped or cfg.n_group <= 1 or cfg.topk_group >= cfg.n_group:
        return None
    return cfg.n_group, cfg.topk_group


def write_metadata_gqa(w, cfg: ModelConfig) -> None:
    """The hyperparameters llama.cpp's qwen3moe / qwen2moe / llama read (the trunk's are common)."""
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_dimension_count(cfg.head_dim)
    if cfg.n_routed_experts:
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        w.add_expert_count(cfg.n_routed_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
    if cfg.shared_expert_intermediate_size:
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)


def write_metadata(w, cfg: ModelConfig, name: str, ftype: int) -> None:
    """Every hyperparameter llama.cpp reads for the checkpoint's architecture."""
    import gguf

    w.add_name(name)
    w.add_file_type(ftype)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    if not cfg.is_mla:
        return write_metadata_gqa(w, cfg)
    w.add_head_count_kv(1)  # MLA as MQA over the latent
    w.add_leading_dense_block_count(cfg.first_k_dense_replace)
    if cfg.q_lora_rank:
        w.add_q_lora_rank(cfg.q_lora_rank)
    w.add_kv_lora_rank(cfg.kv_lora_rank)
    w.add_key_length(cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    w.add_value_length(cfg.kv_lora_rank)
    w.add_key_length_mla(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
    w.add_value_length_mla(cfg.v_head_dim)
    w.add_rope_dimension_count(cfg.qk_rope_head_dim)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_expert_count(cfg.n_routed_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_expert_shared_count(cfg.n_shared_experts)
    w.add_expert_weights_scale(cfg.routed_scaling_factor)
    if cfg.norm_topk_prob:
        w.add_expert_weights_norm(True)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if cfg.scoring_func == "sigmoid"
                             else gguf.ExpertGatingFuncType.SOFTMAX)
    groups = group_keys(cfg)
    if groups:
        w.add_expert_group_count(groups[0])
        w.add_expert_group_used_count(groups[1])
    y = cfg.yarn
    if y is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(y.factor)
        w.add_rope_scaling_orig_ctx_len(y.original_max_position_embeddings)
        w.add_rope_scaling_yarn_beta_fast(y.beta_fast)
        w.add_rope_scaling_yarn_beta_slow(y.beta_slow)
        if y.mscale_all_dim is not None:
            w.add_rope_scaling_yarn_log_mul(0.1 * y.mscale_all_dim)


def write_tokenizer(w, model_dir: Path, cfg: ModelConfig) -> None:
    """tokenizer.json (byte-level BPE) as llama.cpp's GPT-2-style vocab; padded to vocab_size."""
    import gguf

    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise MoetuneError(f"{model_dir} has no tokenizer.json to export")
    tj = json.loads(path.read_text(encoding="utf-8"))
    model = tj.get("model", {})
    if model.get("type") != "BPE":
        raise MoetuneError(f"{path}: only byte-level BPE tokenizers are exported (got {model.get('type')})")
    by_id: dict[int, tuple[str, int]] = {i: (t, gguf.TokenType.NORMAL) for t, i in model["vocab"].items()}
    for added in tj.get("added_tokens", []):
        kind = gguf.TokenType.CONTROL if added.get("special") else gguf.TokenType.USER_DEFINED
        by_id[added["id"]] = (added["content"], kind)
    tokens, types = [], []
    for i in range(cfg.vocab_size):
        tok, kind = by_id.get(i, (f"[PAD{i}]", gguf.TokenType.UNUSED))
        tokens.append(tok)
        types.append(kind)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    if cfg.bos_token_id is not None:
        w.add_bos_token_id(cfg.bos_token_id)
        w.add_add_bos_token(True)
    if cfg.eos_token_id is not None:
        w.add_eos_token_id(cfg.eos_token_id)
    w.add_add_eos_token(False)


class _Source:
    """Reads HF tensors as float32, dequantizing FP8-block / INT8-channel weights."""

    def __init__(self, model_dir: Path, cfg: ModelConfig):
        from safetensors import safe_open

        from engine.weights.loader import shard_files

        self.cfg = cfg
        self.files = {}
        for f in shard_files(model_dir):
            h = safe_open(str(f), framework="pt")
            for k in h.keys():
                self.files[k] = h

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {k: tuple(h.get_slice(k).get_shape()) for k, h in self.files.items()
                if not k.endswith(("_scale_inv", "_scale"))}

    def quantized(self) -> set[str]:
        """The weights stored quantized (FP8 block, INT8 channel, INT4 group: each has a scale)."""
        return {k for k in self.files if not k.endswith(("_scale_inv", "_scale"))
                and (k + "_scale_inv" in self.files or k + "_scale" in self.files)}

    def get(self, name: str) -> torch.Tensor:
        t = self.files[name].get_tensor(name)
        if name + "_scale_inv" in self.files:  # FP8 block: w * s per (b0 × b1) block
            s = self.files[name + "_scale_inv"].get_tensor(name + "_scale_inv").float()
            b0, b1 = self.cfg.quant.weight_block_size if self.cfg.quant else (128, 128)
            s = s.repeat_interleave(b0, 0)[: t.shape[0]].repeat_interleave(b1, 1)[:, : t.shape[1]]
            return t.float() * s
        if name + "_scale" in self.files:  # INT8 channel: w * s[N, 1]
            return t.float() * self.files[name + "_scale"].get_tensor(name + "_scale").float()
        return t.float()


def _build(plan: TensorPlan, src: _Source, cfg: ModelConfig) -> np.ndarray:
    """The float32 numpy array of one GGUF tensor (numpy order: outermost dimension first)."""
    if plan.kind == "experts":
        return torch.stack([src.get(s) for s in plan.sources]).numpy()
    if plan.kind == "rope_freqs":  # llama.cpp divides each pair's base frequency by this factor
        from engine.rope import RotaryAngles

        d = cfg.head_dim
        base = 1.0 / cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
        return (base / RotaryAngles(cfg).inv_freq).numpy()
    t = src.get(plan.sources[0])
    if plan.kind == "rope_perm":  # per head, rows [first halves | second halves] → pairs (2i, 2i+1)
        rows = t.shape[0] // plan.heads
        t = t.reshape(plan.heads, 2, rows // 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)
    if plan.kind == "plain":
        t = t.reshape(plan.shape)
    if plan.kind in ("k_b", "v_b"):
        H, N, V = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
        kv = t.view(H, N + V, t.shape[-1])
        t = kv[:, :N].transpose(1, 2) if plan.kind == "k_b" else kv[:, N:]
    return np.ascontiguousarray(t.contiguous().numpy())


def _tensor_type(plan: TensorPlan, gtype: str, high_precision: bool = False):
    """The GGML type a tensor is stored in for an export of `gtype` (F32 for norms, router, odd rows).
    high_precision: the source checkpoint is quantized but keeps this tensor in high precision (the
    LM head, the embeddings of the released FP8 / INT8 layouts): BF16, so that both engines read the
    same weights (a Q8_0 LM head would read 70 MB of `small`'s per token where ours reads 131)."""
    import gguf

    Q = gguf.GGMLQuantizationType
    want = {"f32": Q.F32, "bf16": Q.BF16, "q8_0": Q.Q8_0, "q4_0": Q.Q4_0}[gtype]
    if plan.keep_f32 or want == Q.F32:
        return Q.F32
    if high_precision and want in (Q.Q8_0, Q.Q4_0):
        want = Q.BF16
    block = gguf.GGML_QUANT_SIZES[want][0]
    if plan.shape[-1] % block:
        return Q.BF16 if plan.shape[-1] % 2 == 0 else Q.F32
    return want


def export_gguf(model: str | Path, out: str | Path, gtype: str = "bf16", progress: bool = True) -> dict:
    """Write `out` (GGUF deepseek2); returns a summary: path, type, tensors per GGML type, bytes."""
    import gguf

    from engine.weights.presets import resolve_model

    if gtype not in GGUF_TYPES:
        raise MoetuneError(f"GGUF type {gtype!r} is not one of {', '.join(GGUF_TYPES)}")
    model_dir = resolve_model(model, progress)
    cfg = ModelConfig.from_dict(json.loads((model_dir / "config.json").read_text()))
    check_exportable(cfg)
    src = _Source(model_dir, cfg)
    plans = plan_tensors(cfg, src.shapes())
    ftype = {"f32": gguf.LlamaFileType.ALL_F32, "bf16": gguf.LlamaFileType.MOSTLY_BF16,
             "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0}[gtype]
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    w = gguf.GGUFWriter(tmp, ARCHES[cfg.model_type])
    write_metadata(w, cfg, Path(str(model)).name, int(ftype))
    write_tokenizer(w, model_dir, cfg)
    quantized = src.quantized()
    types = [_tensor_type(p, gtype, bool(quantized) and not any(n in quantized for n in p.sources)) for p in plans]
    F32 = gguf.GGMLQuantizationType.F32
    for p, qt in zip(plans, types):
        if qt == F32:
            w.add_tensor_info(p.name, p.shape, np.dtype(np.float32), 4 * int(np.prod(p.shape)))
        else:
            byte_shape = gguf.quant_shape_to_byte_shape(p.shape, qt)
            w.add_tensor_info(p.name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for p, qt in tqdm(list(zip(plans, types)), desc=f"GGUF {gtype}", disable=not progress, leave=False):
        arr = _build(p, src, cfg).astype(np.float32, copy=False)
        w.write_tensor_data(arr if qt == F32 else gguf.quants.quantize(arr, qt))
    w.close()
    tmp.replace(out)
    counts: dict[str, int] = {}
    for qt in types:
        counts[qt.name] = counts.get(qt.name, 0) + 1
    return {"path": str(out), "type": gtype, "tensors": counts, "bytes": out.stat().st_size,
            "groups": group_keys(cfg)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m suites.baselines.gguf_export", description=__doc__.splitlines()[0])
    ap.add_argument("model", help="preset name or checkpoint directory")
    ap.add_argument("out", help="output .gguf file")
    ap.add_argument("--type", default="bf16", choices=GGUF_TYPES)
    args = ap.parse_args(argv)
    try:
        print(json.dumps(export_gguf(args.model, args.out, args.type)))
    except MoetuneError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
