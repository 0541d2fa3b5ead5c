"""graph_mode=cpp: decode steps through the C++ decode-layer runner (kernels/cpu/csrc/runner.cpp).

- Against transformers (tests/hf_oracle.py checkpoints: dense first layers, q_lora_rank None, sigmoid
  with bias and softmax routing, group limits, yarn): float32 logits of every decode step within the
  eager oracle test's bound (1e-4 relative), greedy tokens equal.
- Against the eager path, teacher-forced (both fed the same tokens) over several decode steps, batch 1,
  3 and 34 (the GEMM path): float32 within 1e-5 relative per row and step (measured ≤ 3e-7);
  bfloat16 within 5e-3 (measured: bitwise equal at batch 1 and 3, 1.3e-3 at 34). The two round at
  the same points; they differ only in summation order (head_linear, the GEMM path's activation
  conversion) and in exp / cos / sin implementations (routing, SiLU, rotary angles), which a bf16
  rounding can turn into one unit in the last place of an activation.
- INT4 at batch 34: the runner's INT4 linears take the VNNI INT4 GEMM (cpu_int4_gemm) as the eager
  path's do; float32 within 1e-5.
- The serial threshold (cpu_serial_below_bytes) changes no result bit.
- A kernel-table value and a command-line knob reach the runner's calls (kernels.cpu.recording()).
- Where the runner does not apply (prefill, batch_invariant, the reference backend, mla_absorb=never)
  the eager path runs.
"""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.llm import RequestOutput
from engine.sampling import Sampler
from engine.scheduler import Request
from hf_oracle import CONFIGS, build_hf_model, hf_greedy, hf_logits, rel_err, save_checkpoint

cpu = pytest.importorskip("kernels.cpu", reason="the C++ cpu kernels do not build here")

PROMPT = torch.randint(2, 300, (12,), generator=torch.Generator().manual_seed(3)).tolist()


def _llm(path, dtype="float32", **knobs) -> LLM:
    return LLM(str(path), dtype=dtype, knobs={"kv_block_size": 16, **knobs}, progress=False)


def counted(llm: LLM) -> list:
    """Counts the runner's steps, each as its number of sequences (fails the test if the runner is
    missing); test_oracle_families.py uses it too."""
    runner = llm.model.runner
    assert runner is not None and runner.has_lm_head
    seen, real = [], runner.step_logits

    def logits(ids, *rest):
        seen.append(len(ids))
        return real(ids, *rest)

    runner.step_logits = logits
    return seen


def teacher_forced(llm: LLM, prompts: list[list[int]], feeds: list[list[int]]) -> torch.Tensor:
    """Prefill every prompt in one step, then decode feeds[k] (one token per sequence) step by step;
    the logits of every decode step [steps, B, vocab]."""
    params = SamplingParams(max_tokens=len(feeds) + 1, ignore_eos=True)
    reqs = [Request(RequestOutput(p), params, Sampler(params)) for p in prompts]
    try:
        llm._step(reqs, prompts)
        return torch.stack([llm._step(reqs, [[t] for t in feed]) for feed in feeds])
    finally:
        for r in reqs:
            llm.cache.release(r.seq)


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def oracle(request, tmp_path_factory):
    model = build_hf_model(request.param)
    return model, save_checkpoint(model, tmp_path_factory.mktemp(request.param))


def test_decode_logits_match_transformers(oracle):
    model, path = oracle
    llm = _llm(path, graph_mode="cpp")
    seen = counted(llm)
    feeds = [[t] for t in torch.randint(2, 300, (5,), generator=torch.Generator().manual_seed(4)).tolist()]
    got = teacher_forced(llm, [PROMPT], feeds)[:, 0]
    assert seen == [1] * 5  # every decode step ran in the runner
    seq = PROMPT + [f[0] for f in feeds]
    ref = hf_logits(model, seq)[len(PROMPT):]
    for k in range(5):
        assert rel_err(got[k], ref[k]) < 1e-4, k


def test_greedy_tokens_match_transformers(oracle):
    model, path = oracle
    llm = _llm(path, graph_mode="cpp")
    seen = counted(llm)
    out = llm.generate(PROMPT, SamplingParams(max_tokens=8, ignore_eos=True))[0]
    assert len(seen) == 7
    assert out.token_ids == hf_greedy(model, PROMPT, 8)


@pytest.mark.parametrize("dtype, bound", [("float32", 1e-5), ("bfloat16", 5e-3)])
@pytest.mark.parametrize("batch", [1, 3])
def test_eager_and_cpp_agree(dtype, bound, batch):
    g = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(2, 512, (n,), generator=g).tolist() for n in (7, 20, 33)[:batch]]
    feeds = [torch.randint(2, 512, (batch,), generator=g).tolist() for _ in range(6)]
    eager = teacher_forced(LLM("tiny", dtype=dtype, knobs={"graph_mode": "eager"}, progress=False), prompts, feeds)
    llm = LLM("tiny", dtype=dtype, knobs={"graph_mode": "cpp"}, progress=False)
    seen = counted(llm)
    got = teacher_forced(llm, prompts, feeds)
    assert seen == [batch] * 6
    for k in range(6):
        for b in range(batch):
            assert rel_err(got[k, b], eager[k, b]) < bound, (k, b)


def test_eager_and_cpp_agree_on_a_grouped_softmax_model(oracle):
    _, path = oracle
    feeds = [[5, 9], [17, 3], [250, 101]]
    prompts = [PROMPT, PROMPT[:5]]
    eager = teacher_forced(_llm(path, graph_mode="eager"), prompts, feeds)
    got = teacher_forced(_llm(path, graph_mode="cpp"), prompts, feeds)
    assert rel_err(got, eager) < 1e-5


def test_serial_threshold_changes_no_bit():
    prompts, feeds = [list(range(2, 30)), list(range(40, 49))], [[3, 4], [5, 6], [7, 8]]
    outs = [teacher_forced(LLM("tiny", dtype="bfloat16", progress=False,
                                knobs={"graph_mode": "cpp", "threads": 2, "cpu_serial_below_bytes": v}), prompts, feeds)
            for v in (0, 1 << 24)]
    assert torch.equal(outs[0], outs[1])


def test_prefetch_knobs_change_no_bit():
    """The runner's head projections (and the kernels) prefetch as cpu_prefetch_ahead / cpu_prefetch_hint say:
    every value gives the same logits."""
    prompts, feeds = [list(range(2, 30)), list(range(40, 49))], [[3, 4], [5, 6]]
    outs = [teacher_forced(LLM("tiny", dtype="bfloat16", progress=False,
                                knobs={"graph_mode": "cpp", "threads": 2, "cpu_prefetch_ahead": a, "cpu_prefetch_hint": h}),
                           prompts, feeds)
            for a, h in ((2048, "t2"), (0, "t0"), (64, "t1"), (4096, "none"))]
    assert all(torch.equal(o, outs[0]) for o in outs[1:])


def test_kernel_table_and_command_line_knobs_reach_the_runner():
    tables = {"linear": [{"format": "bf16", "tokens": 1, "cpu_linear_block_n": 16}],
              "cpu_mla_decode": [{"format": "bf16", "batch": 1, "context": 8, "cpu_attn_kv_splits": 3}]}
    llm = LLM("tiny", dtype="bfloat16", knobs={"graph_mode": "cpp", "cpu_moe_block_n": 8},
              kernel_tables=tables, progress=False)
    assert llm.model.runner is not None
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    r = Request(RequestOutput([5, 6, 7]), params, Sampler(params))
    llm._step([r], [[5, 6, 7]])
    with cpu.recording() as rec:
        llm._step([r], [[8]])
    llm.cache.release(r.seq)
    layers = llm.config.num_hidden_layers
    by_op = {}
    for call in rec:
        by_op.setdefault(call["op"], []).append(call)
    assert len(by_op["mla_decode"]) == layers and len(by_op["fused_moe"]) == 1
    linears = [c for c in by_op["linear"] if c["format"] == "bf16"]
    assert linears and all(c["knobs"]["cpu_linear_block_n"] == 16 and c["tokens"] == 1 for c in linears)
    assert all(c["knobs"]["cpu_attn_kv_splits"] == 3 and c["format"] == "bf16" for c in by_op["mla_decode"])
    assert by_op["fused_moe"][0]["knobs"]["cpu_moe_block_n"] == 8
    router = [c for c in by_op["linear"] if c["format"] == "f32"]  # the router: float32, no table row
    assert len(router) == 1 and router[0]["knobs"]["cpu_linear_block_n"] == cpu.KNOB_DEFAULTS["cpu_linear_block_n"]
    assert all(c["isa"] for c in rec)
    # attention 4 per layer, dense 2, shared 2, router, lm_head: every call of the step is the runner's
    assert len(by_op["linear"]) == layers * 4 + 2 + 2 + 1 + 1


@pytest.mark.parametrize("knobs", [{"batch_invariant": True}, {"kernel_backend": "reference"},
                                   {"mla_absorb": "never"}])
def test_runner_stays_off_where_it_does_not_apply(knobs):
    llm = LLM("tiny", dtype="float32", knobs={"graph_mode": "cpp", **knobs}, progress=False)
    assert llm.model.runner is None
    assert len(llm.generate([3, 4, 5], SamplingParams(max_tokens=3, ignore_eos=True))[0].token_ids) == 3


def test_prefill_steps_stay_eager():
    llm = LLM("tiny", dtype="float32", knobs={"graph_mode": "cpp"}, progress=False)
    seen = counted(llm)
    eager = LLM("tiny", dtype="float32", knobs={"graph_mode": "eager"}, progress=False)
    assert torch.equal(llm.logits(PROMPT), eager.logits(PROMPT))
    assert seen == []


def test_breakdown_attributes_the_runners_calls():
    from suites import breakdown

    llm = LLM("tiny", dtype="bfloat16", knobs={"graph_mode": "cpp", "threads": 1}, progress=False)
    eager = breakdown.measure(LLM("tiny", dtype="bfloat16", knobs={"threads": 1, "graph_mode": "eager"}, progress=False),
                              prompt_len=5, decode=2, batch=1, repeats=1, progress=False)
    r = breakdown.measure(llm, prompt_len=5, decode=2, batch=1, repeats=1, progress=False)
    assert r["graph_mode"] == "cpp" and eager["graph_mode"] == "eager"
    assert "forward" not in vars(llm.model.runner) and "step_logits" not in vars(llm.model.runner)
    dec, ref = r["phases"]["decode"], eager["phases"]["decode"]
    for part in ("linear.attn", "head_linear", "attention", "norms", "rope", "routing", "linear.router", "fused_moe",
                 "linear.shared", "linear.dense", "activation", "lm_head"):
        assert dec["parts"][part]["calls"] > 0 and dec["parts"][part]["median"] > 0, part
    assert dec["parts"]["head_linear"]["calls"] == ref["parts"]["head_linear"]["calls"]
    assert dec["parts"]["fused_moe"]["calls"] == ref["parts"]["fused_moe"]["calls"]
    assert dec["parts"]["rest.runner"]["median"] > 0 and ref["parts"]["rest.runner"]["median"] == 0
    assert dec["runner_glue_per_layer"]["median"] * 2 == dec["parts"]["rest.runner"]["median"]
    groups, want = dec["bytes_by_group"], ref["bytes_by_group"]
    for g in ("dense", "routed_experts", "shared_experts", "router", "lm_head", "embed"):
        assert groups[g] == want[g], g
    assert dec["kv_bytes_per_token"]["median"] == ref["kv_bytes_per_token"]["median"]
    assert "C++ runner" in breakdown.table(breakdown.add_bandwidth(r, None), "t")


@pytest.mark.parametrize("fmt", ["fp8", "int8", "int4"])  # the formats `moetune quantize` writes
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_eager_and_cpp_agree_on_quantized_weights(fmt, dtype, tmp_path_factory):
    """The runner calls the same kernels on every weight format (INT8 w8a8 quantizes the activations
    it hands over, so the rounding points must agree too): float32 1e-5, bfloat16 5e-3 relative."""
    from engine.weights.quantize import quantize_checkpoint

    src = save_checkpoint(build_hf_model("v3_base"), tmp_path_factory.mktemp("src"))
    q = quantize_checkpoint(src, tmp_path_factory.mktemp(fmt) / fmt, fmt, progress=False)
    prompts, feeds = [PROMPT, PROMPT[:4]], [[5, 9], [17, 3], [250, 101], [7, 7]]
    eager = teacher_forced(_llm(q, dtype, graph_mode="eager"), prompts, feeds)
    llm = _llm(q, dtype, graph_mode="cpp")
    seen = counted(llm)
    got = teacher_forced(llm, prompts, feeds)
    assert seen == [2] * 4
    assert rel_err(got, eager) < (1e-5 if dtype == "float32" else 5e-3)


def test_the_runner_takes_the_int4_gemm_on_the_gemm_path(tmp_path_factory):
    """An INT4 checkpoint at 34 sequences: the runner's INT4 linears (≥ cpu_gemm_min_tokens rows) run the
    VNNI INT4 GEMM (cpu_int4_gemm auto; on its C++ model where the CPU lacks VNNI; AMX's where AMX runs) as the eager path's
    do, and the two agree within the GEMM path's float32 bound (1e-5)."""
    from engine.weights.quantize import quantize_checkpoint

    src = save_checkpoint(build_hf_model("v3_base"), tmp_path_factory.mktemp("src"))
    q = quantize_checkpoint(src, tmp_path_factory.mktemp("int4") / "int4", "int4", progress=False)
    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(2, 300, (int(n),), generator=g).tolist() for n in torch.randint(1, 9, (34,), generator=g)]
    feeds = [torch.randint(2, 300, (34,), generator=g).tolist() for _ in range(2)]
    model_only = [] if "avx512_vnni" in cpu.features() else ["avx512_vnni"]
    with cpu.emulate(model_only):
        eager = teacher_forced(_llm(q, graph_mode="eager"), prompts, feeds)
        llm = _llm(q, graph_mode="cpp")
        assert llm.model.runner is not None
        with cpu.recording() as rec:
            got = teacher_forced(llm, prompts, feeds)
    decode = [c for c in rec if c["op"] == "linear" and c["format"] == "int4" and c["tokens"] == 34]
    want = "amx" if "amx" in cpu.features() else "vnni-model" if model_only else "vnni"  # AMX's INT4 GEMM where it runs
    assert decode and all(c["isa"] == want for c in decode), decode[:3]
    assert rel_err(got, eager) < 1e-5


@pytest.mark.parametrize("dtype, bound", [("float32", 1e-5), ("bfloat16", 5e-3)])
def test_eager_and_cpp_agree_on_the_gemm_path(dtype, bound):
    """34 sequences: every linear of the step has ≥ cpu_gemm_min_tokens (32) rows, so the runner's
    linears take the unpack + BLAS path (and the router's float32 one)."""
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(2, 512, (int(n),), generator=g).tolist() for n in torch.randint(1, 9, (34,), generator=g)]
    feeds = [torch.randint(2, 512, (34,), generator=g).tolist() for _ in range(2)]
    eager = teacher_forced(LLM("tiny", dtype=dtype, knobs={"graph_mode": "eager"}, progress=False), prompts, feeds)
    llm = LLM("tiny", dtype=dtype, knobs={"graph_mode": "cpp"}, progress=False)
    seen = counted(llm)
    got = teacher_forced(llm, prompts, feeds)
    assert seen == [34, 34]
    for k in range(2):
        for b in range(34):
            assert rel_err(got[k, b], eager[k, b]) < bound, (k, b)


def test_step_lists_are_checked_against_the_cache():
    """step_logits writes each token's latent row at the slot its block table and position name: a
    block id outside the cache or a position past the table is one error, never a stray write."""
    llm = LLM("tiny", dtype="float32", knobs={"graph_mode": "cpp"}, progress=False)
    runner, cache = llm.model.runner, llm.cache
    blocks, bs = cache.layers.shape[1], cache.layers.shape[2]
    before = cache.layers.clone()
    for tables, positions, match in (([[blocks]], [0], "outside the cache"), ([[-1]], [0], "outside the cache"),
                                     ([[0]], [bs], "past its block table"), ([[0]], [-1], "past its block table")):
        with pytest.raises(RuntimeError, match=match):
            runner.step_logits([3], positions, tables, cache)
    assert torch.equal(cache.layers, before)
    with pytest.raises(RuntimeError, match="bad step lists"):
        runner.step_logits([3, 4], [0], [[0]], cache)
    logits = runner.step_logits([3], [0], [[1]], cache)  # a valid step writes block 1's first slot only
    assert logits.shape == (1, llm.model.cfg.vocab_size) and torch.isfinite(logits).all()
    changed = (cache.layers != before).flatten(2).any(-1)  # [layers, blocks]
    assert changed[:, 1].all() and changed.sum() == changed.shape[0]


@pytest.mark.parametrize("fmt", [None, "int8"])
def test_batch_size_changes_between_steps(fmt, tmp_path_factory):
    """The runner keeps each call site's activation buffers across steps: when the batch shrinks and
    grows again (a sequence pausing), every step still gives the eager path's logits."""
    from engine.weights.quantize import quantize_checkpoint

    path = save_checkpoint(build_hf_model("v3_base"), tmp_path_factory.mktemp("src"))
    if fmt:
        path = quantize_checkpoint(path, tmp_path_factory.mktemp(fmt) / fmt, fmt, progress=False)
    plan = [(0, 1), (0, 1), (0,), (0,), (1,), (0, 1)]  # which sequences decode at each step
    results = []
    for mode in ("eager", "cpp"):
        llm = _llm(path, "float32", graph_mode=mode)
        params = SamplingParams(max_tokens=10, ignore_eos=True)
        reqs = [Request(RequestOutput(p), params, Sampler(params)) for p in (PROMPT, PROMPT[:5])]
        llm._step(reqs, [PROMPT, PROMPT[:5]])
        results.append([llm._step([reqs[i] for i in who], [[11 + 7 * k + i] for i in who])
                        for k, who in enumerate(plan)])
        for r in reqs:
            llm.cache.release(r.seq)
    for eager, got in zip(*results):
        assert rel_err(got, eager) < 1e-5
