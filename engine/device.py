"""Where the engine runs: "cpu", or "cuda" (every layer, the weights and the KV cache on one GPU).

`--device cuda` needs a CUDA GPU visible to torch and Triton installed (`pip install moetune[cuda]`);
without them it fails with one clear MoetuneError instead of a traceback.
"""
from __future__ import annotations

import importlib.util

import torch

from engine.errors import MoetuneError

DEVICES = ("cpu", "cuda")


def resolve_device(name: str) -> torch.device:
    """The torch device for "cpu" / "cuda"; raises MoetuneError when it cannot run here."""
    if name not in DEVICES:
        raise MoetuneError(f"device {name!r} is not supported (choose {', '.join(DEVICES)})")
    if name == "cuda":
        if not torch.cuda.is_available():
            raise MoetuneError("no CUDA device: torch sees no GPU on this machine "
                               f"(torch {torch.__version__}, built with CUDA {torch.version.cuda}); use --device cpu")
        if importlib.util.find_spec("triton") is None:
            raise MoetuneError("--device cuda needs Triton: pip install 'moetune[cuda]'")
    return torch.device(name)


def _move(value, device: torch.device, moved: dict):
    """A tensor or a weight-format dataclass with its tensors on `device` (shared tensors moved once)."""
    if isinstance(value, torch.Tensor):
        key = (value.data_ptr(), value.dtype, tuple(value.shape), value.stride())
        if key not in moved:
            moved[key] = value.to(device)
        return moved[key]
    if hasattr(value, "__dataclass_fields__"):  # DenseWeight, Fp8BlockWeight, Int8ChannelWeight, …
        fields = {k: getattr(value, k) for k in value.__dataclass_fields__}
        return type(value)(**{k: _move(v, device, moved) if isinstance(v, torch.Tensor) else v
                              for k, v in fields.items()})
    return value  # plain Python values (none today) stay as they are


def to_device(weights: dict, device: torch.device) -> dict:
    """The engine's weight dict with every tensor on `device`, in place, one entry at a time (the
    host copy of each goes as soon as it is moved); tensors shared by two entries are moved once."""
    if device.type == "cpu":
        return weights
    moved: dict = {}
    for key in list(weights):
        weights[key] = _move(weights[key], device, moved)
    return weights
