"""System-tier objectives on the tiny preset: each returns its metrics; the latency limit fails a trial."""
import pytest

from engine.knobs import resolve_knobs
from tuner.objectives import METRICS, SystemObjective, shared_weights
from tuner.search import TrialFailure


@pytest.mark.parametrize("kind", list(METRICS))
def test_each_objective_measures_its_metrics(kind):
    obj = SystemObjective(kind, "tiny", "float32", prompt_len=5, decode=3, batch=2)
    with shared_weights():
        out = obj.prepare(resolve_knobs({"kv_block_size": 16}))()
    for m in obj.metrics:
        assert out[m.name] > 0
    assert obj.workload["prompt_len"] == 5 and ("batch" in obj.workload) == (kind == "throughput")


def test_latency_limit_fails_the_trial():
    obj = SystemObjective("throughput", "tiny", "float32", prompt_len=4, decode=3, batch=2, latency_limit_s=1e-9)
    with pytest.raises(TrialFailure, match="latency limit"):
        obj.prepare(resolve_knobs())()


def test_weights_are_loaded_once_per_session(monkeypatch):
    import engine.llm as llm_mod

    calls = []
    real = llm_mod.load_weights
    monkeypatch.setattr(llm_mod, "load_weights", lambda *a, **k: calls.append(1) or real(*a, **k))
    obj = SystemObjective("tpot", "tiny", "float32", prompt_len=4, decode=2)
    with shared_weights():
        a = obj.prepare(resolve_knobs({"kv_block_size": 8}))
        b = obj.prepare(resolve_knobs({"kv_block_size": 32, "mla_absorb": "always"}))
        ra, rb = a(), b()
    assert len(calls) == 1 and ra["tpot_s"] > 0 and rb["tpot_s"] > 0
    assert llm_mod.load_weights.__name__ == "<lambda>"  # the session ended: the loader is restored


def test_unknown_objective_is_a_user_error():
    from engine.errors import MoetuneError

    with pytest.raises(MoetuneError, match="objective"):
        SystemObjective("fastest")
