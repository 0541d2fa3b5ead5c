"""Streaming safetensors loader: headers first (every check before any byte is read), then the
shards one by one through mmap, each tensor copied once into its preallocated engine slot.

Formats are recognised per linear from the stored dtypes: float8_e4m3fn + `weight_scale_inv`
(FP8 128×128 block, the official DeepSeek-V3 release), int8 + `weight_scale` (channel INT8),
uint8 + `weight_scale` per group (moetune's group INT4, `moetune quantize --to int4`), otherwise
high precision. Quantized weights stay quantized in memory.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from tqdm import tqdm

from engine.config import ModelConfig
from engine.errors import MoetuneError
from engine.weights.layout import LinearSpec, TensorSpec, checkpoint_layout, layer_of
from kernels.formats import DenseWeight, Fp8BlockWeight, Int4GroupWeight, Int8ChannelWeight

log = logging.getLogger("moetune.weights")

ST_DTYPES = {
    "F8_E4M3": torch.float8_e4m3fn, "BF16": torch.bfloat16, "F16": torch.float16,
    "F32": torch.float32, "F64": torch.float64, "I8": torch.int8, "U8": torch.uint8,
}
FLOAT_DTYPES = ("BF16", "F16", "F32", "F64")


@dataclass(frozen=True)
class TensorInfo:
    shard: Path
    dtype: str  # safetensors dtype tag, e.g. "BF16", "F8_E4M3"
    shape: tuple[int, ...]


# a stored weight's safetensors dtype → the quantized format it holds (packed INT4: two values a byte)
QUANTIZED_DTYPES = {"F8_E4M3": "fp8", "I8": "int8", "U8": "int4"}


# ---------------------------------------------------------------- shards and headers


def _weight_map(path: Path) -> dict[str, str] | None:
    """model.safetensors.index.json's tensor name → shard file, checked; None without an index."""
    index = path / "model.safetensors.index.json"
    if not index.is_file():
        return None
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise MoetuneError(f"{index} is not a valid safetensors index ({e})") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise MoetuneError(f"{index} is not a valid safetensors index (weight_map must map names to files)")
    return weight_map


def shard_files(path: Path) -> list[Path]:
    """The checkpoint's shards: from model.safetensors.index.json, else every *.safetensors."""
    weight_map = _weight_map(path)
    if weight_map is not None:
        index = path / "model.safetensors.index.json"
        files = sorted({path / f for f in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise MoetuneError(f"checkpoint shard {missing[0]} named in {index.name} is missing from {path}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise MoetuneError(f"no *.safetensors weights in {path}")
    return files


def lm_head_quantized(path: Path) -> bool:
    """Whether the checkpoint's LM head is stored quantized (`moetune quantize --lm-head`, llama.cpp's Q8_0
    output): its weight is an int8, packed-int4 or float8 tensor. Reads one shard's header (the one the index
    names); False for a tied or float head."""
    path = Path(path)
    files = shard_files(path)  # the checkpoint checked as the loader will (index, shards present)
    weight_map = _weight_map(path)
    if weight_map is not None:
        files = [path / weight_map["lm_head.weight"]] if "lm_head.weight" in weight_map else []
    for f in files:
        info = scan([f]).get("lm_head.weight")
        if info is not None:
            return info.dtype in QUANTIZED_DTYPES
    return False


def scan(files: list[Path]) -> dict[str, TensorInfo]:
    """Read every shard's header (no tensor data): name → shard, dtype, shape."""
    infos: dict[str, TensorInfo] = {}
    for f in files:
        try:
            with safe_open(f, framework="pt") as st:
                for name in st.keys():
                    sl = st.get_slice(name)
                    infos[name] = TensorInfo(f, sl.get_dtype(), tuple(sl.get_shape()))
        except (SafetensorError, OSError) as e:
            raise MoetuneError(f"checkpoint shard {f.name} is corrupt or not a safetensors file ({e})") from None
    return infos


# ---------------------------------------------------------------- planning: formats, shapes, padding


@dataclass
class LinearPlan:
    spec: LinearSpec
    fmt: str  # "dense" | "fp8" | "int8" | "int4"
    part_rows: int  # rows reserved per part (≥ the part's rows; fp8 FFNs pad to the block)
    in_features: int  # columns reserved (≥ spec.in_features for a padded down projection)
    block: tuple[int, int]
    group: int = 128  # int4: inputs per scale

    @property
    def packed_in(self) -> int:
        """int4: the inputs rounded up to whole groups (two per stored byte)."""
        return -(-self.in_features // self.group) * self.group


def _info(infos: dict[str, TensorInfo], name: str) -> TensorInfo:
    if name not in infos:
        raise MoetuneError(f"tensor {name} is missing from the checkpoint shards")
    return infos[name]


def _linear_format(spec: LinearSpec, infos: dict[str, TensorInfo]) -> str:
    prefixes = [prefix for row in spec.sources for prefix in row]
    first = _info(infos, prefixes[0] + ".weight").dtype
    for prefix in prefixes[1:]:
        tag = _info(infos, prefix + ".weight").dtype
        if tag != first:
            raise MoetuneError(f"dtype mismatch: {prefixes[0]}.weight is {first} but {prefix}.weight is {tag} "
                               f"(all parts of {spec.key} must share one format)")
    tag = first
    if tag in QUANTIZED_DTYPES:
        return QUANTIZED_DTYPES[tag]
    if tag in FLOAT_DTYPES:
        return "dense"
    raise MoetuneError(f"dtype mismatch: {spec.sources[0][0]}.weight has dtype {tag}, "
                       "expected a float, float8_e4m3fn, int8 or (packed int4) uint8 weight")


def _check_linear(spec: LinearSpec, fmt: str, infos: dict[str, TensorInfo], block: tuple[int, int],
                  group: int) -> None:
    scale_suffix = {"fp8": ".weight_scale_inv", "int8": ".weight_scale", "int4": ".weight_scale"}.get(fmt)
    packed_in = -(-spec.in_features // group) * group
    for row in spec.sources:
        for prefix, rows in zip(row, spec.parts):
            shape = _info(infos, prefix + ".weight").shape
            want = (rows, packed_in // 2) if fmt == "int4" else (rows, spec.in_features)
            if shape != want:
                raise MoetuneError(f"tensor {prefix}.weight has shape {list(shape)}, "
                                   f"config.json implies {list(want)}"
                                   + (f" (int4: two values per byte, groups of {group})" if fmt == "int4" else ""))
            if scale_suffix is None:
                continue
            scale = _info(infos, prefix + scale_suffix)
            want = ((-(-rows // block[0]), -(-spec.in_features // block[1])) if fmt == "fp8"
                    else (rows, packed_in // group) if fmt == "int4" else (rows,))
            if tuple(d for d in scale.shape if fmt != "int8" or d != 1) != want or scale.dtype not in FLOAT_DTYPES:
                raise MoetuneError(f"tensor {prefix}{scale_suffix} has shape {list(scale.shape)} "
                                   f"({scale.dtype}), expected {list(want)} float")


def plan_linears(cfg: ModelConfig, specs: list, infos: dict[str, TensorInfo]) -> dict[str, LinearPlan]:
    block = cfg.quant.weight_block_size if cfg.quant else (128, 128)
    group = cfg.quant.group_size if cfg.quant else 128
    linears = [s for s in specs if isinstance(s, LinearSpec)]
    fmts = {s.key: _linear_format(s, infos) for s in linears}
    for s in linears:
        _check_linear(s, fmts[s.key], infos, block, group)
    fp8_ffns = {s.ffn for s in linears if s.ffn and fmts[s.key] == "fp8"}
    plans = {}
    for s in linears:
        pad = block[0] if s.ffn in fp8_ffns else 1
        width = s.in_features if not s.padded_input else -(-s.in_features // pad) * pad
        rows = -(-s.parts[0] // pad) * pad if len(s.parts) > 1 else s.parts[0]
        plans[s.key] = LinearPlan(s, fmts[s.key], rows, width, block, group)
    return plans


def _check_tensors(specs: list, infos: dict[str, TensorInfo]) -> None:
    for s in specs:
        if isinstance(s, TensorSpec):
            info = _info(infos, s.source)
            if info.shape != s.shape:
                raise MoetuneError(f"tensor {s.source} has shape {list(info.shape)}, "
                                   f"config.json implies {list(s.shape)}")
            if info.dtype not in FLOAT_DTYPES:
                raise MoetuneError(f"dtype mismatch: {s.source} is {info.dtype}, expected a float tensor")


# ---------------------------------------------------------------- allocation and filling


def _allocate(p: LinearPlan, dtype: torch.dtype, bulk_alloc=None):
    """The weight's tensors, zero until filled; its bulk (the weight bytes) from bulk_alloc(shape,
    dtype) where given (the cpu backend's huge-page storage), else torch's allocator."""
    lead = (len(p.spec.sources),) if p.spec.stacked else ()
    rows = p.part_rows * len(p.spec.parts)

    def bulk(shape, dt, fill=0):
        return (bulk_alloc or torch.empty)(shape, dtype=dt).fill_(fill)

    if p.fmt == "fp8":
        bn, bk = p.block
        w = bulk((*lead, rows, p.in_features), torch.float8_e4m3fn)
        return Fp8BlockWeight(w, torch.ones(*lead, -(-rows // bn), -(-p.in_features // bk)), p.block)
    if p.fmt == "int8":
        return Int8ChannelWeight(bulk((*lead, rows, p.in_features), torch.int8), torch.ones(*lead, rows))
    if p.fmt == "int4":  # symmetric: zero point 8 (0x88: both nibbles 8, a zero weight until filled)
        groups = p.packed_in // p.group
        return Int4GroupWeight(bulk((*lead, rows, p.packed_in // 2), torch.uint8, 0x88),
                               torch.ones(*lead, rows, groups), torch.full((*lead, rows, groups), 8.0),
                               p.in_features, p.group)
    return DenseWeight(bulk((*lead, rows, p.in_features), dtype))


def _targets(plans: dict[str, LinearPlan]) -> dict[str, tuple]:
    """HF tensor name → (plan, expert index or None, part index, component)."""
    out = {}
    for key, p in plans.items():
        for e, row in enumerate(p.spec.sources):
            for part, prefix in enumerate(row):
                where = (p, e if p.spec.stacked else None, part)
                out[prefix + ".weight"] = (*where, "weight")
                if p.fmt != "dense":
                    out[prefix + (".weight_scale_inv" if p.fmt == "fp8" else ".weight_scale")] = (*where, "scale")
    return out


def _place(weight, plan: LinearPlan, expert, part: int, component: str, t: torch.Tensor) -> None:
    w = weight if expert is None else weight[expert]
    row0 = part * plan.part_rows
    if component == "weight":
        dst = w.packed if plan.fmt == "int4" else w.w
        dst[row0:row0 + t.shape[0], : t.shape[1]] = t.to(dst.dtype)
    elif plan.fmt == "int4":
        w.scale[row0:row0 + t.shape[0]] = t.float()
    elif plan.fmt == "fp8":
        b0 = row0 // plan.block[0]
        w.scale_inv[b0:b0 + t.shape[0], : t.shape[1]] = t.float()
    else:
        w.scale[row0:row0 + t.shape[0]] = t.float().reshape(-1)


def load_weights(path: str | Path, cfg: ModelConfig, dtype: torch.dtype, progress: bool = True,
                 bulk_alloc=None) -> dict:
    """Engine-layout weights: key → Tensor (norms, embedding, router) or a weight format object.
    bulk_alloc(shape, dtype=...): where each linear's weight bytes are allocated (default: torch)."""
    path = Path(path)
    infos = scan(shard_files(path))
    specs = checkpoint_layout(cfg)
    _check_tensors(specs, infos)
    plans = plan_linears(cfg, specs, infos)
    _log_skipped(cfg, infos, specs, plans)
    weights: dict = {k: _allocate(p, dtype, bulk_alloc) for k, p in plans.items()}
    tensors = {s.source: s for s in specs if isinstance(s, TensorSpec)}
    targets = _targets(plans)
    wanted = [n for n in infos if n in tensors or n in targets]
    total = sum(_nbytes(infos[n]) for n in wanted)
    with tqdm(total=total, unit="B", unit_scale=True, desc="loading weights", disable=not progress) as bar:
        for shard in sorted({infos[n].shard for n in wanted}):
            with safe_open(shard, framework="pt") as st:
                for name in (n for n in wanted if infos[n].shard == shard):
                    t = st.get_tensor(name)
                    if name in tensors:
                        s = tensors[name]
                        weights[s.key] = t.to(torch.float32 if s.float32 else dtype, copy=True)  # no mmap view kept
                    else:
                        p, e, part, comp = targets[name]
                        _place(weights[p.spec.key], p, e, part, comp, t)
                    bar.update(_nbytes(infos[name]))
    if cfg.tie_word_embeddings:
        weights["lm_head"] = DenseWeight(weights["embed"])
    return weights


def _nbytes(info: TensorInfo) -> int:
    n = 1
    for d in info.shape:
        n *= d
    return n * ST_DTYPES.get(info.dtype, torch.float32).itemsize


def _log_skipped(cfg: ModelConfig, infos: dict, specs: list, plans: dict) -> None:
    mtp = {layer_of(n) for n in infos if (layer_of(n) or -1) >= cfg.num_hidden_layers}
    if mtp:
        log.info("skipping %d multi-token-prediction layer(s) stored after the trunk: %s",
                 len(mtp), ", ".join(str(i) for i in sorted(mtp)))
    used = {s.source for s in specs if isinstance(s, TensorSpec)} | set(_targets(plans))
    other = [n for n in infos if n not in used and (layer_of(n) or -1) < cfg.num_hidden_layers]
    if other:
        log.warning("ignoring %d tensor(s) the engine does not use, e.g. %s", len(other), other[0])
