"""System-tier objectives on the tiny preset: each returns its metrics at every point of its mix;
the latency limit fails a trial; the correctness gate rejects a wrong engine and passes a right one;
the mix says what it lets a knob show."""
import pytest
import torch

from engine.knobs import CATALOGUE, resolve_knobs
from tuner.objectives import (DEFAULT_MIX, GATE_TOL, METRICS, Answer, Point, SystemObjective, check_answer,
                              mix_slug, parse_mix, shared_weights)
from tuner.search import TrialFailure, WrongAnswer, sample_key
from tuner.space import SearchSpace

MIX = (Point(5, 3), Point(12, 3, batch=2))


@pytest.mark.parametrize("kind", list(METRICS))
def test_each_objective_measures_its_metrics_at_every_point(kind):
    obj = SystemObjective(kind, "tiny", "float32", mix=MIX)
    with shared_weights():
        out = obj.prepare(resolve_knobs({"kv_block_size": 16}))()
    assert obj.points == ("prompt 5/3", "batch 2 × 12/3")
    for m in obj.metrics:
        for p in obj.points:
            assert out[sample_key(m.name, p)] > 0
    assert obj.workload["mix"] == list(obj.points)
    assert obj.workload_of("batch 2 × 12/3") == {"prompt_len": 12, "decode": 3, "batch": 2,
                                                 "label": "batch 2 × 12/3", "dtype": "float32"}


def test_latency_limit_fails_the_trial():
    obj = SystemObjective("throughput", "tiny", "float32", prompt_len=4, decode=3, batch=2, latency_limit_s=1e-9)
    assert obj.points == ("batch 2 × 4/3",)
    with pytest.raises(TrialFailure, match="latency limit"):
        obj.prepare(resolve_knobs())()


def test_weights_are_loaded_once_per_session(monkeypatch):
    import engine.llm as llm_mod

    calls = []
    real = llm_mod.load_weights
    monkeypatch.setattr(llm_mod, "load_weights", lambda *a, **k: calls.append(1) or real(*a, **k))
    obj = SystemObjective("tpot", "tiny", "float32", mix=(Point(4, 2),))
    with shared_weights():
        a = obj.prepare(resolve_knobs({"kv_block_size": 8}))
        b = obj.prepare(resolve_knobs({"kv_block_size": 32, "mla_absorb": "always"}))
        ra, rb = a(), b()
    assert len(calls) == 1 and ra["tpot_s @ prompt 4/2"] > 0 and rb["tpot_s @ prompt 4/2"] > 0
    assert llm_mod.load_weights.__name__ == "<lambda>"  # the session ended: the loader is restored


def test_unknown_objective_and_bad_mix_are_user_errors():
    from engine.errors import MoetuneError

    with pytest.raises(MoetuneError, match="objective"):
        SystemObjective("fastest")
    for bad in ("128", "4x128/1", "x/3", "128/16,,"):
        with pytest.raises(MoetuneError, match="mix point"):
            parse_mix(bad)


def test_mix_names_and_what_it_provides():
    mix = parse_mix("128/16, 4x128/16,1024/16")
    assert [p.label for p in mix] == ["prompt 128/16", "batch 4 × 128/16", "prompt 1024/16"]
    assert mix_slug(mix) == "p128d16+b4p128d16+p1024d16"
    w = SystemObjective("tpot", "tiny", mix=mix).provides
    assert (w.concurrency, w.prompt_tokens, w.contexts, w.kv_tokens) == (4, 1024, (144, 1040), 1040 * 1)
    assert not w.measures_concurrency  # a latency objective
    assert SystemObjective("throughput", "tiny", batch=8).provides.measures_concurrency
    for model in DEFAULT_MIX:  # the default mixes hold short and long prompts, batch 1 and 4
        ctx = SystemObjective("tpot", model).provides
        assert min(ctx.contexts) <= 256 and max(ctx.contexts) >= 1024 and ctx.concurrency == 4


def test_space_holds_only_what_the_workload_observes():
    """The old default workload (one request, 8-token prompt) observes none of the scheduler's
    knobs; the tiny default mix observes chunking up to its longest prompt and MLA's form; only a
    concurrency-measuring objective searches the serving limits, and only up to its batch."""
    limits = {"cores": 2, "ranks": 1}
    old = SearchSpace.from_catalogue(limits=limits, workload=SystemObjective("tpot", "tiny", mix=(Point(8, 4),)).provides)
    assert sorted(old.names) == ["graph_mode", "kv_block_size", "threads", "threads_decode", "threads_prefill"]
    assert {"decode_batch_cap", "max_running_requests", "chunked_prefill_size", "mla_absorb"} <= set(old.skipped)
    assert "serving limit" in old.skipped["max_running_requests"]
    assert "prompt tokens" in old.skipped["chunked_prefill_size"]
    mix = SearchSpace.from_catalogue(limits=limits, workload=SystemObjective("tpot", "tiny").provides)
    assert sorted(mix.names) == ["chunked_prefill_size", "graph_mode", "kv_block_size", "mla_absorb", "threads",
                                 "threads_decode", "threads_prefill"]
    assert mix.caps == {"chunked_prefill_size": 2032}
    small = SearchSpace.from_catalogue(limits=limits, workload=SystemObjective("tpot", "small").provides)
    assert "mla_absorb" in small.skipped and "contexts" in small.skipped["mla_absorb"]
    thr = SearchSpace.from_catalogue(limits=limits, workload=SystemObjective("throughput", "tiny", batch=8).provides)
    assert {"decode_batch_cap", "max_running_requests"} <= set(thr.names)
    assert thr.caps["decode_batch_cap"] == thr.caps["max_running_requests"] == 8
    for k in CATALOGUE.values():  # every serving limit says so
        if k.name in ("max_running_requests", "decode_batch_cap", "max_total_tokens"):
            assert k.serving_limit


# ------------------------------------------------------------------ the correctness gate

class Planted(SystemObjective):
    """kv_block_size=8 plants a wrong engine: its logits are shifted by `shift` (one token's, or all)."""
    shift: float = 0.0
    token: int | None = None

    def build(self, knobs):
        llm = super().build(knobs)
        if knobs.get("kv_block_size") == 8:
            logits, shift, token = llm.model.logits, self.shift, self.token

            def wrong(hidden):
                out = logits(hidden).clone()
                if token is None:
                    out += shift
                else:
                    out[..., token] += shift
                return out

            llm.model.logits = wrong
        return llm


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gate_rejects_a_planted_wrong_engine(dtype):
    obj = Planted("tpot", "tiny", dtype, mix=(Point(4, 2),))
    with shared_weights():
        ref = obj.reference()
        bound = GATE_TOL[dtype] * (1 + float(ref.last_logits.abs().max()))
        obj.prepare({"kv_block_size": 16, "mla_absorb": "always", "threads": 1})  # right: passes
        obj.shift, obj.token = 0.5 * bound, None  # every logit moved by half the bound: passes
        obj.prepare({"kv_block_size": 8})
        obj.shift = 3 * bound  # moved beyond the bound
        with pytest.raises(WrongAnswer, match="logits differ"):
            obj.prepare({"kv_block_size": 8})
        # one token pushed to the top: greedy decoding changes (and so do the logits)
        obj.shift, obj.token = 100.0, (ref.tokens[0] + 1) % 512
        with pytest.raises(WrongAnswer, match="wrong answer"):
            obj.prepare({"kv_block_size": 8})


def test_gate_compares_tokens_only_while_not_near_tied():
    ref = Answer([5, 6, 7, 8], torch.tensor([1.0, 2.0, 3.0]), margins=[1.0, 1.0, 1e-6, 1.0])
    same = torch.tensor([1.0, 2.0, 3.0])
    check_answer(ref, Answer([5, 6, 7, 8], same), "float32")
    check_answer(ref, Answer([5, 6, 9, 1], same), "float32")  # parted at a near-tie: allowed
    with pytest.raises(WrongAnswer, match="greedy token 1"):
        check_answer(ref, Answer([5, 9, 7, 8], same), "float32")
    with pytest.raises(WrongAnswer, match="logits"):
        check_answer(ref, Answer([5, 6, 7, 8], same + 1e-3), "float32")
    check_answer(ref, Answer([5, 6, 7, 8], same + 1e-3), "bfloat16")  # within bf16's bound
    with pytest.raises(WrongAnswer, match="logits"):
        check_answer(ref, Answer([5, 6, 7, 8], same + float("nan")), "bfloat16")
