"""tuner.cuda_ops: the kernel tier's adapters of the Triton kernels register only where a GPU is,
and together they search every cuda_* tile knob (each in exactly one op)."""
from __future__ import annotations

import torch

from engine.knobs import CATALOGUE
from tuner import cuda_ops, kernel_tier


def test_nothing_registered_without_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    before = dict(kernel_tier._OPS)
    assert cuda_ops.register_cuda_ops() is False
    assert kernel_tier._OPS == before


def test_ops_cover_every_tile_knob_once(monkeypatch):
    monkeypatch.setattr(cuda_ops, "available", lambda: True)
    monkeypatch.setattr(kernel_tier, "_OPS", {})
    assert cuda_ops.register_cuda_ops()
    ops = {n: op for n, op in kernel_tier._OPS.items() if n.startswith("cuda_")}
    assert set(ops) == {"cuda_fused_moe_decode", "cuda_fused_moe_prefill", "cuda_fp8_linear", "cuda_mla_decode"}
    searched = [k for op in ops.values() for k in op.knobs]
    assert len(searched) == len(set(searched))
    cuda = {n for n, k in CATALOGUE.items() if k.component == "kernels/cuda"}
    assert set(searched) == cuda - {"cuda_moe_masked_max_tokens"}  # a layout threshold, not a tile
