"""`--device`: one clear error where CUDA cannot run; weights of every format move to a device."""
from __future__ import annotations

import pytest
import torch

from moetune_cli import main
from engine.device import resolve_device, to_device
from engine.errors import MoetuneError
from kernels.formats import DenseWeight, Fp8BlockWeight, quantize_fp8_block, quantize_int8_channel


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_cuda_without_gpu_is_one_clear_error(no_gpu):
    with pytest.raises(MoetuneError, match="no CUDA device"):
        resolve_device("cuda")


def test_llm_refuses_cuda_before_loading_anything(no_gpu):
    from engine.llm import LLM

    with pytest.raises(MoetuneError, match="no CUDA device"):
        LLM("/nonexistent/checkpoint", device="cuda")


def test_cli_generate_device_cuda_exits_2_with_one_line(no_gpu, capsys):
    assert main(["generate", "--model", "tiny", "--prompt", "hi", "--device", "cuda"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no CUDA device" in err[0]


def test_unknown_device():
    with pytest.raises(MoetuneError, match="not supported"):
        resolve_device("tpu")
    assert resolve_device("cpu") == torch.device("cpu")


def test_to_device_moves_every_format_and_shared_tensors_once():
    embed = torch.randn(8, 4)
    weights = {"embed": embed, "lm_head": DenseWeight(embed), "fp8": quantize_fp8_block(torch.randn(3, 256, 128)),
               "int8": quantize_int8_channel(torch.randn(5, 4))}
    assert to_device(dict(weights), torch.device("cpu"))["embed"] is embed
    moved = to_device(weights, torch.device("meta"))
    assert moved["embed"].is_meta and moved["lm_head"].w is moved["embed"]
    f8 = moved["fp8"]
    assert isinstance(f8, Fp8BlockWeight) and f8.w.is_meta and f8.scale_inv.is_meta and f8.block == (128, 128)
    assert f8.w.dtype == torch.float8_e4m3fn and f8.shape == (3, 256, 128)
    assert moved["int8"].w.is_meta and moved["int8"].scale.is_meta
