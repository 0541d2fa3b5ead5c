"""The GQA families' presets through the scheduler and the server: batched generation equals each
prompt alone (batch_invariant), and a server completion equals the offline one."""
import pytest

from engine import LLM, SamplingParams
from engine.config import ModelConfig
from engine.weights.presets import PRESETS, ensure_preset
from server_util import post_json, wait_idle
from suites.live_server import ServerProcess

FAMILY_PRESETS = ["tiny-qwen3moe", "tiny-qwen2moe", "tiny-llama"]
KNOBS = {"batch_invariant": True, "max_total_tokens": 256, "kv_block_size": 16}
PROMPTS = ["The router of the mixture of experts", "A kernel", "Every token of the layer is cached in blocks"]


@pytest.mark.parametrize("name", FAMILY_PRESETS)
def test_family_preset_batched_generate_equals_alone(name):
    """Three prompts through continuous batching (prefill chunks mixed with decodes, 256 cache
    tokens: admission waits for blocks) give each prompt's tokens when run alone."""
    llm = LLM(name, dtype="float32", knobs=KNOBS, progress=False)
    assert type(llm.model).__module__ == f"engine.models.{llm.config.model_type}"
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    together = llm.generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, together):
        alone = llm.generate(prompt, params)[0]
        assert out.token_ids == alone.token_ids and out.text == alone.text and len(out.token_ids) == 40
    assert llm.cache.allocator.num_free == llm.cache.allocator.num_blocks


@pytest.mark.parametrize("name", ["small-qwen3moe", "small-qwen2moe", "small-llama"])
def test_small_family_presets_are_near_one_billion_parameters(name):
    import math

    from engine.weights.presets import hf_tensor_shapes

    params = sum(math.prod(s) for s in hf_tensor_shapes(ModelConfig.from_dict(PRESETS[name])).values())
    assert 0.9e9 < params < 1.4e9, params


def test_server_completion_on_qwen3moe():
    ensure_preset("tiny-qwen3moe", progress=False)
    args = ["--model", "tiny-qwen3moe", "--dtype", "float32"]
    for k, v in KNOBS.items():
        args += ["--knob", f"{k}={str(v).lower()}"]
    srv = ServerProcess(args).wait_ready()
    try:
        status, body = post_json(srv, "/v1/completions", {"model": "tiny-qwen3moe", "prompt": PROMPTS[0],
                                                          "max_tokens": 12, "temperature": 0, "ignore_eos": True})
        assert status == 200, body
        want = LLM("tiny-qwen3moe", dtype="float32", knobs=KNOBS, progress=False).generate(
            PROMPTS[0], SamplingParams(max_tokens=12, ignore_eos=True))[0]
        assert body["choices"][0]["text"] == want.text and body["usage"]["completion_tokens"] == 12
        assert wait_idle(srv)["kv_blocks_used"] == 0
    finally:
        srv.stop()
