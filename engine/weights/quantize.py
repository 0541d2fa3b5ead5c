"""`moetune quantize SRC DST --to fp8|int8|int4`: a high-precision checkpoint into the released
layouts (fp8, int8) or moetune's own group-INT4 layout (int4).

- fp8: every decoder projection as float8_e4m3fn `weight` + float32 `weight_scale_inv` per
  128×128 block, and `quantization_config` {quant_method: fp8, weight_block_size} in config.json —
  the official DeepSeek-V3 release.
- int8: every decoder projection as int8 `weight` + float32 `weight_scale` [N, 1] per output
  channel (activations are quantized per token at run time) — the channel-INT8 R1 layout.
- int4: every decoder projection as uint8 `weight` [N, Kp/2] (two symmetric 4-bit values per byte,
  q + 8, in kernels.formats' nibble layout; Kp = K rounded up to the group) + float32
  `weight_scale` [N, Kp/group] (amax / 7 per group), and `quantization_config` {quant_method:
  moetune_int4, group_size, symmetric: true}. Weight-only; moetune's own layout (no released
  checkpoint uses it), read by engine/weights/loader.py.
Embeddings, the LM head, norms, the router and its bias stay as they are, as in the released checkpoints;
`lm_head=True` (`--lm-head`) quantizes an untied LM head too, into the same format (llama.cpp's Q8_0 does: its
output matrix is the largest single read of a decode step of a small model). Streams shard by shard.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from engine.config import ModelConfig
from engine.errors import MoetuneError
from engine.weights.layout import is_quantizable
from engine.weights.loader import shard_files
from kernels.formats import INT4_GROUPS, quantize_fp8_block, quantize_int4_group, quantize_int8_channel

FORMATS = ("fp8", "int8", "int4")
FP8_BLOCK = (128, 128)


LM_HEAD = "lm_head.weight"
# per format, the quantizer's output revision where it changed (in the cache's names: a cached quantization is
# redone, not reused): int4 2, its symmetric scales rounded to bfloat16 values (session 44)
REVISION = {"int4": 2}


def quantize_tensor(name: str, t: torch.Tensor, to: str, group: int = 128,
                    lm_head: bool = False) -> dict[str, torch.Tensor]:
    """The tensors that replace `name` in the output checkpoint (lm_head: the LM head's weight too)."""
    wanted = is_quantizable(name) or (lm_head and name == LM_HEAD)
    if not wanted or t.dtype in (torch.float8_e4m3fn, torch.int8, torch.uint8):
        return {name: t}
    if to == "fp8":
        q = quantize_fp8_block(t, FP8_BLOCK)
        return {name: q.w, name + "_scale_inv": q.scale_inv}
    if to == "int4":
        q4 = quantize_int4_group(t, group)
        return {name: q4.packed, name + "_scale": q4.scale}
    q = quantize_int8_channel(t)
    return {name: q.w, name + "_scale": q.scale.unsqueeze(-1)}


def _out_config(src: Path, to: str, group: int) -> dict:
    cfg = json.loads((src / "config.json").read_text())
    if cfg.get("quantization_config"):
        raise MoetuneError(f"{src} is already quantized ({cfg['quantization_config'].get('quant_method')})")
    if to == "fp8":
        cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                      "weight_block_size": list(FP8_BLOCK)}
    elif to == "int4":
        cfg["quantization_config"] = {"quant_method": "moetune_int4", "group_size": group, "symmetric": True}
    else:
        cfg["quantization_config"] = {"quant_method": "w8a8_int8", "activation_scheme": "dynamic"}
    return cfg


def quantize_checkpoint(src: str | Path, dst: str | Path, to: str, progress: bool = True,
                        group: int = 128, lm_head: bool = False) -> Path:
    """`group`: inputs per scale, int4 only. `lm_head`: quantize the LM head too (an untied one)."""
    src, dst = Path(src), Path(dst)
    if to not in FORMATS:
        raise MoetuneError(f"--to must be one of {', '.join(FORMATS)}, got {to!r}")
    if group not in INT4_GROUPS:
        raise MoetuneError(f"--group must be one of {', '.join(map(str, INT4_GROUPS))}, got {group}")
    model_cfg = ModelConfig.from_file(src)  # a clear error for anything we could not load afterwards
    if lm_head and model_cfg.tie_word_embeddings:
        raise MoetuneError(f"{src} ties its LM head to the embeddings (tie_word_embeddings): there is no separate "
                           "LM head to quantize; leave out --lm-head")
    cfg = _out_config(src, to, group)
    files = shard_files(src)
    if dst.exists() and any(dst.iterdir()):
        raise MoetuneError(f"destination {dst} exists and is not empty")
    dst.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for f in tqdm(files, desc=f"quantizing to {to}", unit="shard", disable=not progress):
        out = {}
        with safe_open(f, framework="pt") as st:
            for name in st.keys():
                out.update(quantize_tensor(name, st.get_tensor(name), to, group, lm_head))
        save_file(out, dst / f.name, metadata={"format": "pt"})
        weight_map.update({k: f.name for k in out})
    total = sum((dst / f.name).stat().st_size for f in files)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    for extra in src.iterdir():
        if extra.suffix != ".safetensors" and extra.name not in ("config.json", "model.safetensors.index.json") \
                and extra.is_file() and not extra.name.startswith("."):
            shutil.copy2(extra, dst / extra.name)
    return dst


def cached_quantization(src: str | Path, to: str, progress: bool = True, lm_head: bool = False) -> Path:
    """`src` quantized to `to` once, in the cache (<cache>/quantized/<name>-<hash of the source's path>-<to>,
    then `-r<n>` from the format's REVISION and `-head` where the LM head is quantized too); written to a temporary
    folder renamed into place, so a killed run leaves nothing that a later one would take for a finished
    checkpoint."""
    import hashlib
    import os

    from engine.weights.presets import cache_root

    src = Path(src).resolve()
    tag = hashlib.sha1(str(src).encode()).hexdigest()[:8]
    rev = f"-r{REVISION[to]}" if to in REVISION else ""
    dst = cache_root() / "quantized" / f"{src.name}-{tag}-{to}{rev}{'-head' if lm_head else ''}"
    if (dst / "config.json").is_file():
        return dst
    tmp = dst.with_name(f"{dst.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        quantize_checkpoint(src, tmp, to, progress, lm_head=lm_head)
        if not (dst / "config.json").is_file():  # another process may have finished first
            shutil.rmtree(dst, ignore_errors=True)
            tmp.rename(dst)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dst
