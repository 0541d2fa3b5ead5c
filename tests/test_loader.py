"""The safetensors loader on checkpoints transformers saved: sharding, MTP layers, every error, knobs.

One small DeepseekV3 model (hf_oracle "v3_base") saved twice — as one model.safetensors and as
≥ 2 shards with model.safetensors.index.json; every other case copies the sharded save and breaks it.
"""
import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from engine import LLM
from engine.errors import MoetuneError
from engine.llm import RequestOutput, SamplingParams
from engine.scheduler import Request as _Request
from engine.sampling import Sampler
from hf_oracle import build_hf_model, hf_logits, rel_err, save_checkpoint

INDEX = "model.safetensors.index.json"
PROMPT = torch.randint(2, 300, (30,), generator=torch.Generator().manual_seed(7)).tolist()
MOE_LAYER = 1  # v3_base: layer 0 dense (first_k_dense_replace=1), layers 1.. MoE


def load(path: Path, **knobs) -> LLM:
    return LLM(str(path), dtype="float32", knobs=knobs, progress=False)


@pytest.fixture(scope="module")
def hf_model():
    return build_hf_model("v3_base")


@pytest.fixture(scope="module")
def single(hf_model, tmp_path_factory) -> Path:
    return save_checkpoint(hf_model, tmp_path_factory.mktemp("single"))


@pytest.fixture(scope="module")
def sharded(hf_model, tmp_path_factory) -> Path:
    return save_checkpoint(hf_model, tmp_path_factory.mktemp("sharded"), max_shard_size="200KB")


@pytest.fixture(scope="module")
def ref_logits(single) -> torch.Tensor:
    return load(single).logits(PROMPT)


@pytest.fixture
def ckpt(sharded, tmp_path) -> Path:
    """A private copy of the sharded checkpoint, free to break."""
    return Path(shutil.copytree(sharded, tmp_path / "ckpt"))


# ---------------------------------------------------------------- checkpoint surgery


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())


def write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2))


def shard_of(ckpt: Path, name: str) -> Path:
    return ckpt / read_json(ckpt / INDEX)["weight_map"][name]


def rewrite_shard(ckpt: Path, name: str, change) -> Path:
    """Rewrite the shard holding `name` with change(tensor) in its place (None: drop it)."""
    shard = shard_of(ckpt, name)
    tensors = load_file(shard)
    new = change(tensors.pop(name))
    if new is not None:
        tensors[name] = new
    save_file(tensors, shard, metadata={"format": "pt"})
    return shard


def set_config(ckpt: Path, **fields) -> None:
    write_json(ckpt / "config.json", {**read_json(ckpt / "config.json"), **fields})


# ---------------------------------------------------------------- sharding


def test_sharded_checkpoint_matches_single_file(hf_model, single, sharded, ref_logits):
    shards = sorted(sharded.glob("*.safetensors"))
    assert len(shards) >= 2 and (sharded / INDEX).is_file()
    assert len(set(read_json(sharded / INDEX)["weight_map"].values())) == len(shards)
    assert [p.name for p in single.glob("*.safetensors")] == ["model.safetensors"]
    assert rel_err(ref_logits, hf_logits(hf_model, PROMPT)) < 1e-4  # the reference itself is right
    got = load(sharded).logits(PROMPT)
    assert got.dtype == torch.float32 and got.shape == ref_logits.shape
    assert rel_err(got, ref_logits) < 1e-6


def test_shards_without_index_are_globbed(ckpt, ref_logits):
    (ckpt / INDEX).unlink()
    assert rel_err(load(ckpt).logits(PROMPT), ref_logits) < 1e-6


# ---------------------------------------------------------------- multi-token-prediction layers


def add_mtp_layer(ckpt: Path) -> int:
    """Append an MTP layer the way the DeepSeek-V3 release stores it: index N, its own shard."""
    cfg = read_json(ckpt / "config.json")
    n, d, vocab = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]
    index = read_json(ckpt / INDEX)
    src = f"model.layers.{MOE_LAYER}."
    mtp = {}
    for name, file in index["weight_map"].items():
        if name.startswith(src):
            with safe_open(ckpt / file, framework="pt") as st:
                mtp[f"model.layers.{n}." + name[len(src):]] = st.get_tensor(name)
    p = f"model.layers.{n}."
    mtp.update({p + "enorm.weight": torch.ones(d), p + "hnorm.weight": torch.ones(d),
                p + "eh_proj.weight": torch.randn(d, 2 * d), p + "shared_head.norm.weight": torch.ones(d),
                p + "shared_head.head.weight": torch.randn(vocab, d)})
    save_file(mtp, ckpt / "model-mtp.safetensors", metadata={"format": "pt"})
    index["weight_map"].update({k: "model-mtp.safetensors" for k in mtp})
    write_json(ckpt / INDEX, index)
    set_config(ckpt, num_nextn_predict_layers=1)
    return n


def test_mtp_layers_are_skipped(ckpt, ref_logits, caplog):
    n = add_mtp_layer(ckpt)
    caplog.set_level(logging.INFO, logger="moetune.weights")
    llm = load(ckpt)
    assert llm.config.num_hidden_layers == n and llm.config.num_nextn_predict_layers == 1
    assert rel_err(llm.logits(PROMPT), ref_logits) < 1e-6
    records = [r for r in caplog.records if r.name == "moetune.weights"]
    skipping = [r.getMessage() for r in records if "skip" in r.getMessage().lower()]
    assert len(skipping) == 1, skipping
    assert str(n) in skipping[0]
    assert not [r for r in records if r.levelno >= logging.WARNING], [r.getMessage() for r in records]


# ---------------------------------------------------------------- errors: each names its culprit

EXPERT_GATE = f"model.layers.{MOE_LAYER}.mlp.experts.3.gate_proj.weight"


def _no_config(ckpt):
    (ckpt / "config.json").unlink()
    return ["no config.json", str(ckpt)]


def _config_not_json(ckpt):
    (ckpt / "config.json").write_text('{"model_type": "deepseek_v3", ')
    return ["config.json", "not valid JSON"]


def _mixtral(ckpt):
    set_config(ckpt, model_type="mixtral")
    return ["'mixtral'", "not supported", "qwen3_moe"]


def _drop(name):
    def mutate(ckpt):
        rewrite_shard(ckpt, name, lambda t: None)
        return [name, "missing"]
    return mutate


def _truncated(ckpt):
    shard = shard_of(ckpt, EXPERT_GATE)
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    return [shard.name, "corrupt"]


def _garbage(ckpt):
    shard = shard_of(ckpt, EXPERT_GATE)
    shard.write_bytes(torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(0),
                                    dtype=torch.uint8).numpy().tobytes())
    return [shard.name, "corrupt"]


def _shard_deleted(ckpt):
    shard = shard_of(ckpt, EXPERT_GATE)
    shard.unlink()
    return [shard.name, "missing", INDEX]


def _index_not_json(ckpt):
    (ckpt / INDEX).write_text("{ weight_map")
    return [INDEX, "not a valid"]


def _index_map_not_object(ckpt):
    write_json(ckpt / INDEX, {"weight_map": ["model-00001-of-00005.safetensors"]})
    return [INDEX, "weight_map"]


def _retype(name, dtype, words):
    def mutate(ckpt):
        rewrite_shard(ckpt, name, lambda t: t.to(dtype))
        return [name, "dtype mismatch", *words]
    return mutate


def _reshape(name, change, words):
    def mutate(ckpt):
        rewrite_shard(ckpt, name, change)
        return [name, "shape", *words]
    return mutate


ERROR_CASES = {
    "missing config.json": _no_config,
    "config.json not JSON": _config_not_json,
    "unsupported model_type": _mixtral,
    "missing expert tensor": _drop(f"model.layers.{MOE_LAYER}.mlp.experts.5.up_proj.weight"),
    "missing final norm": _drop("model.norm.weight"),
    "truncated shard": _truncated,
    "garbage shard": _garbage,
    "shard in index deleted": _shard_deleted,
    "index not JSON": _index_not_json,
    "index weight_map a list": _index_map_not_object,
    "one expert float16": _retype(EXPERT_GATE, torch.float16, ["F16", "F32"]),
    "one expert int8": _retype(EXPERT_GATE, torch.int8, ["I8", "F32"]),
    "int norm": _retype("model.layers.0.input_layernorm.weight", torch.int32, ["I32", "float"]),
    "norm too long": _reshape("model.layers.0.self_attn.kv_a_layernorm.weight",
                              lambda t: torch.ones(t.shape[0] + 1), ["[33]", "[32]"]),
    "expert down_proj transposed": _reshape(f"model.layers.{MOE_LAYER}.mlp.experts.2.down_proj.weight",
                                            lambda t: t.t().contiguous(), ["[32, 64]", "[64, 32]"]),
    "embedding wrong vocab": _reshape("model.embed_tokens.weight", lambda t: t[:-1].clone(), ["[299, 64]"]),
}


@pytest.mark.parametrize("case", ERROR_CASES)
def test_loader_errors_name_the_culprit(case, ckpt):
    words = ERROR_CASES[case](ckpt)
    with pytest.raises(MoetuneError) as err:
        load(ckpt)
    message = str(err.value)
    assert "\n" not in message
    for w in words:
        assert w in message, f"{w!r} not in {message!r}"


# ---------------------------------------------------------------- knobs


def decode_logits(llm: LLM, prompts: list[list[int]], steps: int) -> torch.Tensor:
    """Prefill each prompt, then `steps` greedy decode steps of all of them together: [steps+1, B, vocab]."""
    params = SamplingParams(max_tokens=steps, ignore_eos=True)
    reqs = [_Request(RequestOutput(p), params, Sampler(params)) for p in prompts]
    rows = [torch.stack([llm._step([r], [r.out.prompt_token_ids])[0] for r in reqs])]
    try:
        for _ in range(steps):
            rows.append(llm._step(reqs, [[int(row.argmax())] for row in rows[-1]]))
    finally:
        for r in reqs:
            llm.cache.release(r.seq)
    return torch.stack(rows)


@pytest.mark.parametrize("absorb", ["decode", "always"])
def test_kv_block_sizes_agree(single, ref_logits, absorb):
    """Prefill and batched decode read the paged cache; odd block sizes must not change a thing."""
    prompts = [PROMPT[:5], PROMPT[:13]]  # decode crosses block boundaries of 1 and 7 at different steps
    runs = {}
    for bs in (1, 7, 64):
        llm = load(single, kv_block_size=bs, mla_absorb=absorb)
        assert rel_err(llm.logits(PROMPT), ref_logits) < 1e-6, f"kv_block_size={bs}"
        runs[bs] = decode_logits(llm, prompts, 9)
        assert llm.cache.allocator.num_free == llm.cache.allocator.num_blocks
    for bs in (1, 7):
        assert rel_err(runs[bs], runs[64]) < 1e-6, f"kv_block_size={bs}"


@pytest.mark.parametrize("knobs, words", [
    ({"bogus": 1}, ["unknown knob", "'bogus'"]),
    ({"kv_block_size": 0}, ["kv_block_size", "outside"]),
    ({"kv_block_size": 4096}, ["kv_block_size", "outside"]),
    ({"kv_block_size": "seven"}, ["kv_block_size", "not a int"]),
    ({"max_total_tokens": 8}, ["max_total_tokens", "outside"]),
    ({"mla_absorb": "sometimes"}, ["mla_absorb", "not one of"]),
    ({"threads": 0}, ["threads", "outside"]),
])
def test_bad_knobs(single, knobs, words):
    with pytest.raises(MoetuneError) as err:
        load(single, **knobs)
    for w in words:
        assert w in str(err.value), str(err.value)


def test_weights_load_straight_into_huge_pages(single, ref_logits, monkeypatch):
    """With cpu_huge_pages the loader allocates each weight's bytes in huge-page storage
    (kernels.cpu.weight_empty): prepare() then wraps them without a copy, and the model is unchanged.
    The threshold is lowered to 4 KiB so that this small model's weights take that path."""
    from kernels import cpu
    from kernels.formats import DenseWeight

    monkeypatch.setattr(cpu, "HUGE_MIN_BYTES", 4096)
    llm = load(single, kernel_backend="cpu", cpu_huge_pages=True)
    try:
        packed = [w for w in llm.model.w.values() if isinstance(w, cpu.Packed)]
        big = [p for p in packed if p.orig.nbytes >= 4096 and isinstance(p.orig, DenseWeight)]
        assert big, "no weight reached the lowered threshold"
        for p in big:
            assert p.orig.w.data_ptr() % (2 << 20) == 0, "weight bytes not in huge-page storage"
            assert p.args[1].data_ptr() == p.orig.w.data_ptr(), "prepare() copied a weight already in place"
        assert rel_err(llm.logits(PROMPT), ref_logits) < 1e-6
    finally:
        cpu.configure({"cpu_huge_pages": cpu.KNOB_DEFAULTS["cpu_huge_pages"]})
