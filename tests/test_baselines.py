"""Baselines: the GGUF export (read back; run by llama.cpp against our greedy tokens) and the
JSON-lines worker protocol on its error paths (kt-kernel's worker, fake workers)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.config import ModelConfig
from engine.errors import MoetuneError
from engine.weights.presets import PRESETS, ensure_preset
from suites.baselines.client import BaselineError, Worker
from suites.baselines.gguf_export import export_gguf, group_keys, plan_tensors

ROOT = Path(__file__).resolve().parents[1]
KT_WORKER = ROOT / "suites" / "baselines" / "kt_worker.py"
N_TOKENS = 32
PROMPTS = [[0, 17, 250, 33, 101, 7, 480, 66], [0] + list(range(100, 140))]


# ------------------------------------------------------------------ the export itself


@pytest.fixture(scope="module")
def tiny_f32(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("gguf") / "tiny-f32.gguf"
    export_gguf("tiny", out, "f32", progress=False)
    return out


@pytest.fixture(scope="module")
def tiny_mla(tmp_path_factory) -> tuple[Path, Path]:
    """`tiny` with DeepSeek's attention sizes (kv_lora_rank 512, RoPE 64: MLA K 576, V 512), the only
    ones ik_llama.cpp's loader takes in llama.cpp's MLA layout: (checkpoint, its F32 GGUF)."""
    from engine.weights.presets import write_random_checkpoint

    root = tmp_path_factory.mktemp("tiny-mla")
    (root / "tiny-mla").mkdir()
    write_random_checkpoint({**PRESETS["tiny"], "kv_lora_rank": 512, "qk_rope_head_dim": 64}, root / "tiny-mla",
                            seed=7, progress=False)
    export_gguf(str(root / "tiny-mla"), root / "tiny-mla-f32.gguf", "f32", progress=False)
    return root / "tiny-mla", root / "tiny-mla-f32.gguf"


def test_gguf_metadata_and_mla_split(tiny_f32):
    """Read back: routing keys, MQA view of MLA, and k_b / v_b equal to slices of kv_b_proj."""
    import gguf
    from safetensors import safe_open

    r = gguf.GGUFReader(tiny_f32)
    kv = {f.name: f.contents() for f in r.fields.values() if not f.name.startswith("tokenizer.ggml.")}
    cfg = ModelConfig.from_dict(PRESETS["tiny"])
    assert kv["general.architecture"] == "deepseek2"
    assert kv["deepseek2.expert_gating_func"] == int(gguf.ExpertGatingFuncType.SIGMOID)
    assert (kv["deepseek2.expert_group_count"], kv["deepseek2.expert_group_used_count"]) == (4, 2)
    assert kv["deepseek2.attention.head_count_kv"] == 1
    assert kv["deepseek2.attention.key_length"] == cfg.kv_lora_rank + cfg.qk_rope_head_dim
    assert kv["deepseek2.rope.scaling.yarn_log_multiplier"] == pytest.approx(0.1)
    tensors = {t.name: t for t in r.tensors}
    assert "blk.1.ffn_gate_exps.weight" in tensors and "blk.1.exp_probs_b.bias" in tensors
    assert not any("kv_b" in n for n in tensors)
    src = ensure_preset("tiny", progress=False)
    with safe_open(str(src / "model-00001-of-00002.safetensors"), "pt") as f:
        kv_b = f.get_tensor("model.layers.0.self_attn.kv_b_proj.weight").float()
    H, N, V = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
    per_head = kv_b.view(H, N + V, -1)
    k_b = np.asarray(tensors["blk.0.attn_k_b.weight"].data).reshape(H, cfg.kv_lora_rank, N)
    v_b = np.asarray(tensors["blk.0.attn_v_b.weight"].data).reshape(H, V, cfg.kv_lora_rank)
    torch.testing.assert_close(torch.from_numpy(k_b.copy()), per_head[:, :N].transpose(1, 2), rtol=0, atol=0)
    torch.testing.assert_close(torch.from_numpy(v_b.copy()), per_head[:, N:], rtol=0, atol=0)
    tok = r.fields["tokenizer.ggml.model"].contents()
    assert tok == "gpt2" and len(r.fields["tokenizer.ggml.tokens"].contents()) == cfg.vocab_size


def test_gguf_group_rules():
    """topk_group ≥ n_group is a no-op limit (keys left out); indivisible groups are refused."""
    base = dict(PRESETS["tiny"])
    assert group_keys(ModelConfig.from_dict(base)) == (4, 2)
    assert group_keys(ModelConfig.from_dict({**base, "topk_group": 4})) is None
    assert group_keys(ModelConfig.from_dict({**base, "n_group": 1, "topk_group": 1})) is None
    from suites.baselines.gguf_export import check_exportable

    with pytest.raises(MoetuneError, match="not divisible"):
        check_exportable(ModelConfig.from_dict({**base, "n_group": 3, "topk_group": 1}))


def test_gguf_q8_keeps_odd_rows_unquantized(tmp_path):
    """Q8_0 blocks are 32 wide: tiny's k_b rows (16) stay BF16; norms and the router stay F32."""
    s = export_gguf("tiny", tmp_path / "q8.gguf", "q8_0", progress=False)
    assert s["tensors"]["Q8_0"] > 0 and s["tensors"]["F32"] > 0 and s["tensors"]["BF16"] > 0
    cfg = ModelConfig.from_dict(PRESETS["tiny"])
    plans = plan_tensors(cfg, {"model.layers.0.self_attn.kv_b_proj.weight": (64, 32)})
    assert [(p.name, p.shape) for p in plans] == [("blk.0.attn_k_b.weight", (4, 32, 16)),
                                                 ("blk.0.attn_v_b.weight", (4, 16, 32))]


def test_gguf_q8_of_a_quantized_checkpoint_keeps_its_high_precision_tensors(tmp_path):
    """An INT8-channel checkpoint (LM head and embeddings kept high precision, as the releases do):
    in its Q8_0 export those stay BF16, so llama.cpp reads the same weights as ours; the quantized
    projections are Q8_0. A BF16 checkpoint's Q8_0 export quantizes its LM head as before."""
    import gguf

    from engine.weights.quantize import quantize_checkpoint

    q = quantize_checkpoint(ensure_preset("tiny", progress=False), tmp_path / "int8", "int8", progress=False)
    export_gguf(q, tmp_path / "q8.gguf", "q8_0", progress=False)
    kinds = {t.name: t.tensor_type.name for t in gguf.GGUFReader(tmp_path / "q8.gguf").tensors}
    assert kinds["output.weight"] == "BF16" and kinds["token_embd.weight"] == "BF16"
    assert kinds["blk.1.ffn_gate_exps.weight"] == "Q8_0" and kinds["blk.0.attn_output.weight"] == "Q8_0"
    export_gguf("tiny", tmp_path / "q8-from-bf16.gguf", "q8_0", progress=False)
    kinds = {t.name: t.tensor_type.name for t in gguf.GGUFReader(tmp_path / "q8-from-bf16.gguf").tensors}
    assert kinds["output.weight"] == "Q8_0"
    # `moetune quantize --lm-head` (compare --precision int8-head): the INT8 LM head is exported Q8_0, the
    # embeddings still BF16
    qh = quantize_checkpoint(ensure_preset("tiny", progress=False), tmp_path / "int8h", "int8", progress=False,
                             lm_head=True)
    export_gguf(qh, tmp_path / "q8h.gguf", "q8_0", progress=False)
    kinds = {t.name: t.tensor_type.name for t in gguf.GGUFReader(tmp_path / "q8h.gguf").tensors}
    assert kinds["output.weight"] == "Q8_0" and kinds["token_embd.weight"] == "BF16"


# ------------------------------------------------------------------ llama.cpp runs it


def _llama_cpp_or_fail():
    """llama-cpp-python is built by the set-up step (`make test`: the venv's baselines extra), never
    inside a test; where it is missing the comparison tests fail with the reason, not skip."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError as e:
        pytest.fail(f"llama-cpp-python is not installed ({e}): `make test` builds it in its set-up step "
                    "(or CMAKE_ARGS=-DGGML_NATIVE=ON pip install -e '.[baselines]')")


def test_llama_cpp_greedy_tokens_match_ours(tiny_f32):
    """f32 export of `tiny`: llama.cpp's first 32 greedy tokens are ours (float32 both sides)."""
    _llama_cpp_or_fail()
    from suites.baselines.llamacpp import LlamaCpp

    with LlamaCpp(tiny_f32, threads=1, n_ctx=256) as ll:
        _greedy_is_ours_and_timed(ll)


def test_llama_cpp_without_repacking_gives_the_same_tokens(tiny_f32):
    """repack=False (llama.cpp's extra buffer types off, its CLI's --no-repack: the fallback where its
    repacking back end aborts, as its AMX one did on an AMX VM) loads and decodes the same tokens; the
    settings say which ran."""
    _llama_cpp_or_fail()
    from suites.baselines.llamacpp import LlamaCpp

    prompt = list(range(2, 40))
    with LlamaCpp(tiny_f32, threads=1, n_ctx=256) as ll:
        want = ll.greedy(prompt, 8)
        assert ll.settings["repack"] is True and "repack_note" not in ll.settings
    with LlamaCpp(tiny_f32, threads=1, n_ctx=256, repack=False) as ll:
        assert ll.greedy(prompt, 8) == want and ll.settings["repack"] is False


def _greedy_is_ours_and_timed(engine, model: str = "tiny") -> list[list[int]]:
    """A GGUF engine's first N_TOKENS greedy tokens on PROMPTS are ours (float32 both sides, our
    reference kernels); its own clock (the time inside llama_decode) is ≤ ours around its Python
    loop. Returns its tokens."""
    from engine.llm import LLM, SamplingParams

    llm = LLM(model, dtype="float32", knobs={"kernel_backend": "reference"}, progress=False)
    assert engine.load["n_vocab"] == 512
    out = []
    for prompt in PROMPTS:
        ours = llm.generate(prompt, SamplingParams(max_tokens=N_TOKENS, ignore_eos=True))[0].token_ids
        theirs = engine.greedy(prompt, N_TOKENS)
        agree = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), N_TOKENS)
        print(f"\nprompt of {len(prompt)}: {agree}/{N_TOKENS} greedy tokens of {engine.engine} agree")
        assert agree == N_TOKENS, (ours, theirs)
        out.append(theirs)
    r = engine.run_once(PROMPTS[1], 6)
    assert r["decoded"] == 5 and 0 < r["ttft_s"] <= r["python"]["ttft_s"]
    assert 0 < r["decode_s"] <= r["python"]["decode_s"]
    return out


def test_llama_cpp_batch_api_decodes_each_sequence_as_alone(tiny_f32):
    """The batch workload's driver: B prompts of different lengths in one llama_decode, then steps of B
    tokens; each sequence's greedy tokens equal llama.cpp's own single-sequence ones and ours."""
    _llama_cpp_or_fail()
    from engine.llm import LLM, SamplingParams
    from suites.baselines.llamacpp import LlamaCpp
    from suites.e2e import run_batch

    prompts = [[0, 17, 250, 33, 101, 7, 480, 66], [0] + list(range(100, 140)), [0, 5, 9]]
    llm = LLM("tiny", dtype="float32", knobs={"kernel_backend": "reference"}, progress=False)
    with LlamaCpp(tiny_f32, threads=1, n_ctx=256) as ll:
        r = ll.worker.call("time_batch", prompts=prompts, n_decode=11)
        assert r["decoded"] == 33 and r["ttft_s"] > 0 and r["decode_s"] > 0  # llama.cpp's own clock
        # its clock counts only llama_decode: never more than ours around the Python calls
        assert r["ttft_s"] <= r["python"]["ttft_s"] and r["decode_s"] <= r["python"]["decode_s"]
        for prompt, tokens in zip(prompts, r["tokens"]):
            assert tokens == ll.greedy(prompt, 12)
            assert tokens == llm.generate(prompt, SamplingParams(max_tokens=12, ignore_eos=True))[0].token_ids
        timed = ll.run_batch(prompts, 12)
        assert timed["decoded"] == 33
    ours = run_batch(llm, prompts, 12)
    assert ours["decoded"] == 33 and ours["decode_s"] > 0


# ------------------------------------------------------------------ ik_llama.cpp runs it


def _ik_llama_or_fail():
    """ik_llama.cpp is built by the set-up step (`make test`: python -m suites.baselines.ikllama
    --setup), never inside a test; where it is missing the comparison tests fail with the reason."""
    from suites.baselines.ikllama import require_ik_llama

    try:
        require_ik_llama()
    except BaselineError as e:
        pytest.fail(str(e))


@pytest.mark.parametrize("settings", [{}, {"rtr": False, "fused_moe": False}], ids=["best", "no-rtr-no-fmoe"])
def test_ik_llama_greedy_tokens_match_ours_and_llama_cpp(tiny_mla, settings):
    """F32 export of `tiny` with DeepSeek's attention sizes: ik_llama.cpp's first 32 greedy tokens (its
    best configuration: MLA 3, flash attention, fused MoE, run-time repack; and without repack /
    fused MoE) are ours and mainline llama.cpp's, from the same GGUF; its settings go with its rows.
    (It rebuilds kv_b from the F32 k_b / v_b in Q8_0 for its prefill path: the tokens still agree.)"""
    _ik_llama_or_fail()
    _llama_cpp_or_fail()
    from suites.baselines.ikllama import BEST, IkLlamaCpp
    from suites.baselines.llamacpp import LlamaCpp

    model, gguf = tiny_mla
    with IkLlamaCpp(gguf, threads=1, n_ctx=256, **settings) as ik, LlamaCpp(gguf, threads=1, n_ctx=256) as ll:
        assert {k: ik.settings[k] for k in BEST} == {**BEST, **settings}
        assert "AVX512" in ik.settings["system_info"] or "AVX2" in ik.settings["system_info"]
        assert _greedy_is_ours_and_timed(ik, str(model)) == [ll.greedy(p, N_TOKENS) for p in PROMPTS]


def test_ik_llama_refuses_what_its_loader_aborts_on(tiny_f32, tiny_mla):
    """Plain `tiny` (MLA K 40, V 32, RoPE 8) would abort the fork's loader: one clear error instead,
    before any worker starts; DeepSeek's sizes pass."""
    from suites.baselines.ikllama import ik_refusal

    assert "K 40, V 32, RoPE 8" in ik_refusal(tiny_f32) and ik_refusal(tiny_mla[1]) is None


def test_ik_llama_batch_api_and_long_prompts(tiny_mla):
    """Its batch driver: each sequence's greedy tokens equal its single-sequence ones and ours; a
    prompt longer than a batch goes in batch-sized pieces and gives the same tokens."""
    _ik_llama_or_fail()
    from engine.llm import LLM, SamplingParams
    from suites.baselines.ikllama import IkLlamaCpp

    model, gguf = tiny_mla
    prompts = [[0, 17, 250, 33, 101, 7, 480, 66], [0] + list(range(100, 140)), [0, 5, 9]]
    llm = LLM(str(model), dtype="float32", knobs={"kernel_backend": "reference"}, progress=False)
    with IkLlamaCpp(gguf, threads=1, n_ctx=256) as ik:
        r = ik.worker.call("time_batch", prompts=prompts, n_decode=11)
        assert r["decoded"] == 33 and 0 < r["ttft_s"] <= r["python"]["ttft_s"]
        assert 0 < r["decode_s"] <= r["python"]["decode_s"]
        for prompt, tokens in zip(prompts, r["tokens"]):
            assert tokens == ik.greedy(prompt, 12)
            assert tokens == llm.generate(prompt, SamplingParams(max_tokens=12, ignore_eos=True))[0].token_ids
        assert ik.run_batch(prompts, 12)["decoded"] == 33
        long_prompt = [0] + [(7 * i) % 500 + 2 for i in range(80)]
        whole = ik.greedy(long_prompt, 4)
    with IkLlamaCpp(gguf, threads=1, n_ctx=256, n_batch=32) as ik:  # 81 tokens: 3 llama_decode calls
        assert ik.greedy(long_prompt, 4) == whole


def test_compare_default_set_leaves_out_what_ik_llama_cannot_run(tmp_path):
    """`moetune compare` with the default baselines on plain `tiny` (its sizes abort the fork's
    loader): a one-line note, then ours vs llama.cpp alone; the rows go to the store."""
    _ik_llama_or_fail()
    _llama_cpp_or_fail()
    env = {**os.environ, "MOETUNE_RESULTS": str(tmp_path / "res")}
    p = subprocess.run([sys.executable, "-m", "moetune_cli", "compare", "--model", "tiny", "--precision", "fp32",
                        "--workloads", "io:8/3", "--repeats", "1"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "note: ik_llama.cpp cannot run" in p.stderr and "K 40, V 32, RoPE 8" in p.stderr
    header = next(line for line in p.stdout.splitlines() if line.startswith("| workload"))
    assert "llama.cpp: median" in header and "ik_llama.cpp" not in header


def test_compare_with_a_tuned_profile_says_so_and_records_it(tmp_path):
    """--profile PATH runs our engine with that profile (its path in the rows' settings and the header);
    --profile auto with no profile for the model here is one clear error, not the defaults in disguise."""
    _llama_cpp_or_fail()
    from engine.fingerprint import fingerprint
    from engine.llm import LLM
    from engine.profile import Profile, save_profile
    from results.store import read_results

    base = LLM("tiny", dtype="float32", profile=None, progress=False)
    path = tmp_path / "p.toml"
    save_profile(Profile({"hardware_key": fingerprint()["hardware_key"], "model_key": base.model_key},
                         {"kv_block_size": 16}, {"linear": [{"format": "f32", "tokens": 1, "cpu_micro_rows": 8}]}), path)
    env = {**os.environ, "MOETUNE_RESULTS": str(tmp_path / "res"), "MOETUNE_PROFILES": str(tmp_path / "none")}
    cmd = [sys.executable, "-m", "moetune_cli", "compare", "--model", "tiny", "--precision", "fp32", "--baselines",
           "llama.cpp", "--workloads", "io:8/3", "--repeats", "1"]
    p = subprocess.run(cmd + ["--profile", str(path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    assert f"moetune: tuned profile {path}" in p.stdout
    rows = read_results(tmp_path / "res")
    extra = [json.loads(x) if isinstance(x, str) else x for x in rows["extra"]]
    ours = [x["settings"] for x in extra if x["engine"] == "moetune"]
    assert ours and all(s["profile"] == str(path) for s in ours)
    p = subprocess.run(cmd + ["--profile", "auto"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 2 and "no tuned profile for" in p.stderr and "Traceback" not in p.stderr


def test_ik_llama_missing_build_is_one_error(tmp_path, monkeypatch):
    """No build (or one made with other flags): `moetune compare --baselines ik` says so in one line
    before exporting or loading anything; the default set leaves ik_llama.cpp out."""
    from suites.baselines import ikllama
    from suites.baselines.compare import parse_baselines

    monkeypatch.setenv("MOETUNE_IK_DIR", str(tmp_path / "ik"))
    assert not ikllama.have_ik_llama() and parse_baselines(None) == ["llama.cpp"]
    assert parse_baselines("ik,llama.cpp") == ["ik_llama.cpp", "llama.cpp"]
    lib = tmp_path / "ik" / "ik_llama_cpp" / "lib"
    lib.mkdir(parents=True)
    (lib / "libllama.so").write_bytes(b"")
    (tmp_path / "ik" / ".complete").write_text(json.dumps({"version": ikllama.IK_VERSION,
                                                            "cmake_args": ["-DGGML_NATIVE=OFF"]}))
    assert ikllama.build_record() is None  # built with other flags: not this build
    env = {**os.environ, "MOETUNE_IK_DIR": str(tmp_path / "ik")}
    p = subprocess.run([sys.executable, "-m", "moetune_cli", "compare", "--model", "tiny", "--baselines", "ik",
                        "--repeats", "1"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode != 0
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "ik_llama.cpp baseline is not built" in lines[0] and "--setup" in lines[0], p.stderr


# ------------------------------------------------------------------ the GQA families (qwen3moe, qwen2moe, llama)

FAMILY_PRESETS = {"tiny-qwen3moe": "qwen3moe", "tiny-qwen2moe": "qwen2moe", "tiny-llama": "llama"}
NEAR_TIE = 5e-3  # logits: llama.cpp keeps its KV cache in F16, which moves logits by ~1e-3 here


@pytest.fixture(scope="module", params=sorted(FAMILY_PRESETS))
def family_f32(request, tmp_path_factory) -> tuple[str, Path]:
    out = tmp_path_factory.mktemp("gguf") / f"{request.param}-f32.gguf"
    export_gguf(request.param, out, "f32", progress=False)
    return request.param, out


def test_gguf_family_metadata_and_tensors(family_f32):
    """Read back: the architecture, GQA sizes, each family's own tensors, llama's q/k rows permuted
    into (2i, 2i+1) rope pairs and its Llama 3 rope divisors."""
    import gguf
    from safetensors import safe_open

    name, path = family_f32
    arch = FAMILY_PRESETS[name]
    cfg = ModelConfig.from_dict(PRESETS[name])
    r = gguf.GGUFReader(path)
    kv = {f.name: f.contents() for f in r.fields.values() if not f.name.startswith("tokenizer.ggml.")}
    assert kv["general.architecture"] == arch
    assert kv[f"{arch}.attention.head_count_kv"] == cfg.num_key_value_heads
    assert kv[f"{arch}.attention.key_length"] == cfg.head_dim == kv[f"{arch}.rope.dimension_count"]
    tensors = {t.name: np.asarray(t.data) for t in r.tensors}
    want = {"qwen3moe": ["blk.1.attn_q_norm.weight", "blk.1.ffn_gate_exps.weight", "blk.1.ffn_gate_inp.weight"],
            "qwen2moe": ["blk.1.attn_q.bias", "blk.1.ffn_gate_inp_shexp.weight", "blk.1.ffn_up_shexp.weight"],
            "llama": ["rope_freqs.weight", "blk.1.ffn_gate.weight", "output.weight"]}[arch]
    assert all(n in tensors for n in want), sorted(tensors)
    src = ensure_preset(name, progress=False)
    with safe_open(str(src / "model-00001-of-00002.safetensors"), "pt") as f:
        q = f.get_tensor("model.layers.0.self_attn.q_proj.weight").float()
    got = torch.from_numpy(tensors["blk.0.attn_q.weight"].copy()).reshape(q.shape)
    if arch == "llama":  # head h, pair i: rows (h, i) and (h, i + d/2) of HF become rows 2i, 2i + 1
        d = cfg.head_dim
        per_head = q.view(cfg.num_attention_heads, 2, d // 2, -1)
        torch.testing.assert_close(got.view(cfg.num_attention_heads, d // 2, 2, -1), per_head.transpose(1, 2),
                                   rtol=0, atol=0)
        from engine.rope import RotaryAngles

        base = 1.0 / cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
        freqs = torch.from_numpy(tensors["rope_freqs.weight"].copy())
        torch.testing.assert_close(base / freqs, RotaryAngles(cfg).inv_freq)
        assert freqs.max() == pytest.approx(8.0) and freqs.min() == pytest.approx(1.0)
    else:  # rotate-half rope as stored
        torch.testing.assert_close(got, q, rtol=0, atol=0)


def test_gguf_family_refusals():
    from suites.baselines.gguf_export import check_exportable

    cases = [("tiny-qwen3moe", {"norm_topk_prob": False}, "norm_topk_prob"),
             ("tiny-qwen2moe", {"qkv_bias": False}, "qkv_bias"),
             ("tiny-qwen3moe", {"mlp_only_layers": [0]}, "every layer must be MoE"),
             ("tiny-llama", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                              "original_max_position_embeddings": 512}}, "yarn")]
    for name, over, match in cases:
        with pytest.raises(MoetuneError, match=match):
            check_exportable(ModelConfig.from_dict({**PRESETS[name], **over}))


def test_llama_cpp_greedy_tokens_match_ours_per_family(family_f32):
    """f32 export of each tiny family: llama.cpp's greedy tokens are ours up to the first step where
    our own top-2 logits are within NEAR_TIE (there F16 KV-cache rounding may pick either), and at
    least 16 tokens are compared in all. (A q/k row permutation or Llama 3 rope divisor left out makes
    them differ from the first tokens.)"""
    _llama_cpp_or_fail()
    from engine.llm import LLM, SamplingParams
    from suites.baselines.llamacpp import LlamaCpp

    name, path = family_f32
    llm = LLM(name, dtype="float32", knobs={"kernel_backend": "reference"}, progress=False)
    prompts = [[0, 17, 250, 33, 101, 7, 480, 66], [0] + list(range(100, 140)), [0, 5, 9, 300, 301, 42]]
    compared = 0
    with LlamaCpp(path, threads=1, n_ctx=256) as ll:
        for prompt in prompts:
            ours = llm.generate(prompt, SamplingParams(max_tokens=N_TOKENS, ignore_eos=True))[0].token_ids
            top2 = llm.logits(prompt + ours[:-1])[len(prompt) - 1:].topk(2, dim=-1).values
            clear = next((i for i, m in enumerate((top2[:, 0] - top2[:, 1]).tolist()) if m < NEAR_TIE), N_TOKENS)
            theirs = ll.greedy(prompt, N_TOKENS)
            agree = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), N_TOKENS)
            print(f"\n{name}, prompt of {len(prompt)}: {agree}/{N_TOKENS} agree, first near tie at {clear}")
            assert agree >= clear, (ours, theirs)
            compared += clear
    assert compared >= 16


# ------------------------------------------------------------------ the worker protocol


def _kt_worker() -> Worker:
    """kt_worker.py in *our* interpreter: kt_kernel is absent here, the protocol is the same."""
    return Worker([sys.executable, str(KT_WORKER)], "kt-kernel", timeout_s=60)


def test_worker_protocol_error_paths():
    with _kt_worker() as w:
        with pytest.raises(BaselineError, match="unknown op 'nope'"):
            w.call("nope")
        with pytest.raises(BaselineError, match="call setup first"):
            w.call("load", method="AMXInt8_MOE", experts=8, topk=2, hidden=256, inter=256)
        with pytest.raises(BaselineError, match="threads must be an integer"):
            w.call("setup", threads=0)
        with pytest.raises(BaselineError, match="unexpected keyword argument 'colour'"):
            w.call("forward", colour="red")
        with pytest.raises(BaselineError, match="kt_kernel is not installed"):
            w.call("setup", threads=1)
        w.proc.stdin.write(b"{not json\n")  # a malformed request gets an error reply, the loop goes on
        w.proc.stdin.flush()
        assert json.loads(w._readline(10))["ok"] is False
        with pytest.raises(BaselineError, match="call load first"):
            w.call("forward", tokens=1)


@pytest.mark.parametrize("script, match", [
    ("import sys; sys.stderr.write('boom: bad instruction\\n'); sys.exit(3)", r"exited \(code 3\).*boom"),
    ("import sys; sys.stdin.readline(); print('hello', flush=True); sys.stdin.readline()", "not JSON"),
    ("import sys; sys.stdin.readline(); print('[1]', flush=True); sys.stdin.readline()", "malformed reply"),
    ("import sys, time; sys.stdin.readline(); time.sleep(30)", "no reply within 1 s"),
])
def test_worker_failures_become_one_line_errors(script, match):
    with Worker([sys.executable, "-c", script], "fake", timeout_s=1) as w:
        with pytest.raises(BaselineError, match=match):
            w.call("info")
        assert w.proc.poll() is not None or match == "not JSON" or match == "malformed reply"


def test_our_kt_layer_is_prepared_for_the_backend():
    """The layer timed against kt-kernel is prepared once for the kernel back end, as the engine's
    weights are at load (not per call: the INT8 row sums of a V3 stack took seconds a call)."""
    import kernels
    from kernels import cpu
    from suites.baselines.ktkernel import our_inputs, our_layer, time_ours

    shape, E = (256, 128, 2), 4
    w13, w2 = our_layer("int8", E, shape, seed=0, backend=cpu)
    assert isinstance(w13, cpu.Packed) and isinstance(w2, cpu.Packed)
    raw13, raw2 = our_layer("int8", E, shape, seed=0)
    x, wts, ids = our_inputs(E, shape, 3, seed=3)
    _, ours = time_ours(cpu, w13, w2, x, wts, ids, repeats=1, warmup=0)
    _, ref = time_ours(kernels.get_backend("reference"), raw13, raw2, x, wts, ids, repeats=1, warmup=0)
    assert np.linalg.norm(ours - ref) / np.linalg.norm(ref) < 2e-2  # int8 activations on our side


def test_kt_kernel_layer_matches_ours():
    """The real kt-kernel (own virtualenv, made when missing): BF16 layer = our reference on the
    same weights and inputs; its refusals (too many tokens, unknown class) come back as errors."""
    from suites.baselines.ktkernel import KtKernel, ensure_kt_venv, our_inputs, our_layer, relative_error, time_ours

    try:
        py = ensure_kt_venv(progress=False)
    except BaselineError as e:  # the set-up step (`make test`) makes it; a failure here is a failure
        pytest.fail(f"kt-kernel virtualenv could not be made: {e}")
    import kernels

    shape, E = (256, 256, 2), 8
    with KtKernel(threads=1, python=py) as kt:
        print(f"\nkt-kernel variant here: {kt.setup['loaded']} (detected {kt.info['detected']})")
        with pytest.raises(BaselineError, match="no MoE class 'Nope_MOE'"):
            kt.worker.call("load", method="Nope_MOE", experts=E, topk=2, hidden=256, inter=256)
        kt.load("bf16", E, shape, seed=0, max_len=4)
        w13, w2 = our_layer("bf16", E, shape, seed=0)
        for t in (1, 3):
            x, wts, ids = our_inputs(E, shape, t, seed=t)
            _, ours = time_ours(kernels.get_backend("reference"), w13, w2, x, wts, ids, repeats=1, warmup=0)
            theirs = np.asarray(kt.forward(t, seed=t, repeats=1)["output"])
            assert relative_error(theirs, ours) < 1e-2
        with pytest.raises(BaselineError, match="tokens must be an integer in 1..64"):
            kt.forward(65, seed=0, repeats=1)


def test_compare_alternation_pauses_before_every_run(monkeypatch):
    """Every timed run (each engine's, ours included) comes after SETTLE_S of quiet: a worker process keeps
    its threads busy for a while after a call (kt-kernel's doubled our MoE layer's time at T=1 without it)."""
    from suites.baselines import compare

    events = []
    monkeypatch.setattr(compare, "settle", lambda: events.append("settle"))
    engines = {name: (lambda n: lambda prompt, decode: events.append(n) or {"n": n})(name) for name in ("ours", "theirs")}
    runs = compare.alternate(engines, [1, 2], 3, 2)
    assert runs == {"ours": [{"n": "ours"}] * 2, "theirs": [{"n": "theirs"}] * 2}
    timed = events[2:]  # after one warm-up each
    assert timed == ["settle", "ours", "settle", "theirs"] * 2
    assert compare.SETTLE_S > 0


# ------------------------------------------------------------------ compare: parsing, table, page


def test_compare_workloads_table_and_page(tmp_path):
    from dashboards.report import build_report
    from results.store import append_rows
    from suites.baselines.compare import parse_baselines, parse_workloads, rows_for, table

    assert parse_workloads("io:128/32,ttft:512;2048,moe:1") == [
        {"kind": "io", "prompt": 128, "decode": 32}, {"kind": "ttft", "prompt": 512, "decode": 2},
        {"kind": "ttft", "prompt": 2048, "decode": 2}, {"kind": "moe", "tokens": 1}]
    assert parse_workloads("batch:4/128/32") == [{"kind": "batch", "batch": 4, "prompt": 128, "decode": 32}]
    for bad in ("io:128", "speed:3", "io:0/4", "", "batch:4/128", "batch:0/8/4"):
        with pytest.raises(MoetuneError):
            parse_workloads(bad)
    assert parse_baselines("kt,llama.cpp,llamacpp") == ["ktransformers", "llama.cpp"]
    with pytest.raises(MoetuneError, match="unknown baseline"):
        parse_baselines("vllm")
    w = {"kind": "io", "prompt": 8, "decode": 4}
    rows = (rows_for("moetune", {"ttft_s": ([0.1, 0.2, 0.1], "s", "minimize")}, w, "tiny", "bf16", {"threads": 1})
            + rows_for("llama.cpp", {"ttft_s": ([0.3, 0.3, 0.4], "s", "minimize")}, w, "tiny", "bf16", {"threads": 1})
            + rows_for("ik_llama.cpp", {"ttft_s": ([0.05, 0.05, 0.06], "s", "minimize")}, w, "tiny", "bf16",
                       {"threads": 1, "mla": 3}))
    text = table(rows)  # a column per baseline, each with its ratio to ours
    assert "| moetune: median [min–max] | llama.cpp: median [min–max] (ratio) | ik_llama.cpp: " in text
    assert "| io 8/4 | ttft_s (ms) | 100 [100–200] | 300 [300–400] (3.00×) | 50 [50–60] (0.50×) |" in text
    append_rows(rows, "compare", directory=tmp_path / "res")
    out = build_report(tmp_path / "rep", tmp_path / "res")
    page = (out / "compare.html").read_text()
    assert 'id="compare"' in page and "3.00×" in page and "0.50×" in page
    assert "<th>ik_llama.cpp median [p10–p90] (ratio)</th>" in page
    index = (out / "index.html").read_text()
    assert "compare.html" in index and "<h3>ik_llama.cpp</h3>" in index
