"""The GQA families (Qwen3-MoE, Qwen2-MoE, Llama 3) against transformers' own classes, on
checkpoints transformers saved (hf_oracle.FAMILY_CONFIGS: GQA ratios 1-8, odd head counts, an
explicit head_dim, tied embeddings, yarn / llama3 rope scaling on and off, dense layers).

Tolerances (‖Δ‖/‖ref‖ over the logits of a 40-token prompt):
- float32: 1e-4 on every kernel backend (measured 2.5e-7 to 4.5e-7: only summation order differs);
- bfloat16 vs the float32 reference: 5e-2 overall, as the DeepSeek oracle test.
"""
import pytest
import torch

from engine import LLM, SamplingParams
from engine.errors import MoetuneError
from hf_oracle import FAMILY_CONFIGS, build_hf_model, hf_greedy, hf_logits, rel_err, save_checkpoint
from test_runner import counted, teacher_forced

PROMPT = torch.randint(2, 300, (40,), generator=torch.Generator().manual_seed(1)).tolist()
BACKENDS = ["reference", "cpu"]


@pytest.fixture(scope="module", params=sorted(FAMILY_CONFIGS))
def oracle(request, tmp_path_factory):
    model = build_hf_model(request.param)
    path = save_checkpoint(model, tmp_path_factory.mktemp(request.param))
    return model, path, hf_logits(model, PROMPT)


@pytest.mark.parametrize("backend", BACKENDS)
def test_float32_logits_match(oracle, backend):
    _, path, ref = oracle
    got = LLM(str(path), dtype="float32", knobs={"kernel_backend": backend}, progress=False).logits(PROMPT)
    assert got.shape == ref.shape and got.dtype == torch.float32
    assert rel_err(got, ref) < 1e-4


def test_bfloat16_logits_match(oracle):
    _, path, ref = oracle
    got = LLM(str(path), dtype="bfloat16", progress=False).logits(PROMPT)
    assert rel_err(got, ref) < 5e-2


@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_tokens_match(oracle, backend):
    """12 greedy tokens through the scheduler: a prefill (paged_extend), then decode steps (paged_decode)."""
    model, path, _ = oracle
    llm = LLM(str(path), dtype="float32", knobs={"kernel_backend": backend}, progress=False)
    out = llm.generate(PROMPT, SamplingParams(max_tokens=12, ignore_eos=True))[0]
    assert out.token_ids == hf_greedy(model, PROMPT, 12)
    assert out.finish_reason == "length"


# The decode path on small cache blocks (a sequence across many blocks) and the cpu attention
# kernels' tiles cut small, row-by-row execution, and the eager graph mode: the same logits.
DECODE_KNOBS = [
    {"kernel_backend": "reference", "kv_block_size": 4},
    {"kernel_backend": "cpu", "kv_block_size": 4, "cpu_attn_decode_kv_block": 16, "cpu_attn_kv_splits": 3,
     "cpu_attn_head_fold": 1, "cpu_attn_extend_q_block": 8, "cpu_attn_extend_kv_block": 16,
     "cpu_attn_f32_form": "transpose"},
    {"kernel_backend": "cpu", "kv_block_size": 16, "cpu_attn_blas_rows": 1, "cpu_attn_blas_kv_block": 16},
    {"kernel_backend": "cpu", "batch_invariant": True, "graph_mode": "eager"},
]


@pytest.mark.parametrize("knobs", DECODE_KNOBS, ids=lambda k: ",".join(f"{a}={b}" for a, b in k.items()))
def test_stepwise_decode_matches(oracle, knobs):
    """A 9-token prefill then 14 single-token steps through the paged K/V cache: each step's logits
    are transformers' logits at that position of the whole prompt."""
    from engine.llm import RequestOutput
    from engine.sampling import Sampler
    from engine.scheduler import Request

    _, path, ref = oracle
    llm = LLM(str(path), dtype="float32", knobs=knobs, progress=False)
    params = SamplingParams(max_tokens=1)
    r = Request(RequestOutput(PROMPT[:9]), params, Sampler(params))
    rows = [llm._step([r], [PROMPT[:9]])[0]]
    for t in PROMPT[9:23]:
        rows.append(llm._step([r], [[t]])[0])
    llm.cache.release(r.seq)
    assert rel_err(torch.stack(rows), ref[8:23]) < 1e-4


@pytest.mark.parametrize("dtype, bound", [("float32", 1e-5), ("bfloat16", 5e-3)])
def test_cpp_runner_matches_eager(oracle, dtype, bound):
    """graph_mode=cpp runs these families' decode steps in the C++ runner (GQA attention, biases, q/k
    norms, the shared expert's gate, dense layers): two sequences of different lengths across small
    cache blocks, every step's logits as the eager path's. float32: summation order only (measured
    1.9e-7 to 3.0e-7); bfloat16: the same roundings at the same points (measured: equal bit for bit
    on every family config; the bound leaves room for sigmoid and rope angles computed by other code)."""
    _, path, _ = oracle
    g = torch.Generator().manual_seed(5)
    prompts, feeds = [PROMPT[:13], PROMPT[:4]], torch.randint(2, 300, (7, 2), generator=g).tolist()
    knobs = {"kv_block_size": 4}
    eager = teacher_forced(LLM(str(path), dtype=dtype, knobs={**knobs, "graph_mode": "eager"}, progress=False),
                           prompts, feeds)
    llm = LLM(str(path), dtype=dtype, knobs={**knobs, "graph_mode": "cpp"}, progress=False)
    steps = counted(llm)
    got = teacher_forced(llm, prompts, feeds)
    assert steps == [2] * len(feeds)
    for k in range(len(feeds)):
        for b in range(2):
            assert rel_err(got[k, b], eager[k, b]) < bound, (k, b)


def test_unsupported_model_type_names_the_supported(tmp_path):
    from engine.config import ModelConfig

    with pytest.raises(MoetuneError) as e:
        ModelConfig.from_dict({"model_type": "mixtral", "vocab_size": 10})
    msg = str(e.value)
    assert "'mixtral'" in msg and "\n" not in msg
    for supported in ("deepseek_v3", "deepseek_v2", "qwen3_moe", "qwen2_moe", "llama"):
        assert supported in msg


def test_paged_attention_kernel_tables_reach_the_calls(oracle):
    """The GQA model's paged decode / extend call sites take their knobs from kernel tables (a row
    for each), `explain` says so, and the logits are unchanged; the tuner's adapters of those sites
    verify their defaults against kernels.reference."""
    from engine.knobs import resolve_knobs
    from tuner.cpu_ops import model_ops
    from tuner.kernel_tier import KernelObjective

    _, path, ref = oracle
    tables = {"cpu_paged_decode": [{"format": "f32", "batch": 1, "context": 128, "cpu_attn_decode_kv_block": 16,
                                    "cpu_attn_kv_splits": 2}],
              "cpu_paged_extend": [{"format": "f32", "tokens": 16, "cpu_attn_extend_q_block": 8}]}
    llm = LLM(str(path), dtype="float32", knobs={"kernel_backend": "cpu", "kv_block_size": 8},
              kernel_tables=tables, progress=False)
    rows = {(r["op"], k): r["sources"][k] for r in llm.explain() for k in r["knobs"]}
    assert rows[("paged_decode", "cpu_attn_decode_kv_block")] == "table"
    assert rows[("paged_extend", "cpu_attn_extend_q_block")] == "table"
    assert rel_err(llm.logits(PROMPT), ref) < 1e-4
    ops = {op.name: op for op in model_ops(llm.kernel_plan, token_buckets=(1,))}
    assert {"cpu_paged_decode", "cpu_paged_extend"} <= set(ops)
    knobs = resolve_knobs()
    for name, bucket in (("cpu_paged_decode", {"batch": 3, "context": 100}), ("cpu_paged_extend", {"tokens": 70})):
        op = ops[name]
        shape = {k: v for k, v in op.buckets[0].items() if k not in ("batch", "context", "tokens")}
        obj = KernelObjective(op, "f32", {**shape, **bucket})
        assert obj.prepare({k: knobs[k] for k in op.knobs})()["time_s"] > 0  # raises WrongAnswer on a mismatch


def test_runner_calls_take_their_kernel_tables(oracle):
    """Under graph_mode=cpp a decode step's paged_decode and q/k/v/o linears are the runner's calls,
    recorded with the knob structs their kernel-table rows chose."""
    from kernels import cpu

    _, path, _ = oracle
    tables = {"cpu_paged_decode": [{"format": "f32", "batch": 1, "context": 16, "cpu_attn_kv_splits": 3}],
              "linear": [{"format": "f32", "tokens": 1, "cpu_linear_block_n": 16}]}
    llm = LLM(str(path), dtype="float32", knobs={"graph_mode": "cpp"}, kernel_tables=tables, progress=False)
    out = llm.generate(PROMPT[:6], SamplingParams(max_tokens=1))[0]  # warm: the prompt ran eager
    steps = counted(llm)
    with cpu.recording() as rec:
        llm.generate(PROMPT[:6] + out.token_ids, SamplingParams(max_tokens=2, ignore_eos=True))
    assert steps == [1]  # the one decode step ran in the runner
    layers = llm.config.num_hidden_layers
    decode = [c for c in rec if c["tokens"] == 1]
    attn = [c for c in decode if c["op"] == "paged_decode"]
    assert len(attn) == layers and all(c["knobs"]["cpu_attn_kv_splits"] == 3 for c in attn)
    lin = [c for c in decode if c["op"] == "linear" and c["knobs"]["cpu_linear_block_n"] == 16]
    assert len(lin) >= 4 * layers  # q, k, v, o of every layer (and the FFN's, the lm_head)
