"""The search space read from the knob catalogue; constraints built in, never violated."""
import optuna
import pytest

from engine.errors import MoetuneError
from engine.knobs import CATALOGUE, Divides, Knob, check_constraints, resolve_knobs
from tuner.space import SearchSpace
from tuner_toys import TOY_CATALOGUE, TOY_LIMITS, toy_space

optuna.logging.set_verbosity(optuna.logging.WARNING)


def sample(space, n, sampler):
    study = optuna.create_study(sampler=sampler)
    out = []
    for _ in range(n):
        trial = study.ask()
        knobs = space.suggest(trial)
        out.append((trial, knobs))
        study.tell(trial, float(sum(v for v in knobs.values() if isinstance(v, int))))
    return study, out


def test_catalogue_maps_to_distributions():
    """Every tunable engine knob of the real catalogue is searched, with its declared range/choices."""
    space = SearchSpace.from_catalogue(limits={"cores": 2, "ranks": 1})
    expected = [k.name for k in CATALOGUE.values() if k.tune and not k.component.startswith("kernels")]
    assert sorted(space.names) == sorted(expected)
    assert "max_total_tokens" not in space.names  # tune=False
    _, trials = sample(space, 1, optuna.samplers.RandomSampler(seed=0))
    dists = trials[0][0].distributions
    for k in space.knobs:
        if k.choices is not None:
            assert dists[k.name].choices == tuple(k.choices)
        elif k.pow2:
            d = dists[f"log2_{k.name}"]
            assert (2 ** d.low, 2 ** d.high) == (max(1, k.low), k.high)
        else:
            assert dists[k.name].low == k.low and dists[k.name].log == k.log
    assert dists["threads"].high == 2  # AtMost("cores") with 2 cores


def test_new_knob_is_picked_up():
    """A knob added to a catalogue appears in the space with no tuner change."""
    cat = dict(TOY_CATALOGUE)
    cat["ring_slots"] = Knob("ring_slots", int, 2, "engine/hybrid", "slots", low=1, high=6)
    space = SearchSpace.from_catalogue(catalogue=cat, limits=TOY_LIMITS, exclude_components=())
    assert "ring_slots" in space.names and "capacity" not in space.names
    _, trials = sample(space, 5, optuna.samplers.RandomSampler(seed=1))
    assert all(1 <= kn["ring_slots"] <= 6 for _, kn in trials)


@pytest.mark.parametrize("sampler", ["random", "tpe"])
def test_constraints_never_violated(sampler):
    space = toy_space()
    s = optuna.samplers.RandomSampler(seed=2) if sampler == "random" else \
        optuna.samplers.TPESampler(seed=2, multivariate=True, n_startup_trials=10)
    _, trials = sample(space, 150 if sampler == "random" else 60, s)
    seen_m = set()
    for _, k in trials:
        assert k["block_k"] % k["block_m"] == 0, k
        assert k["block_k"] & (k["block_k"] - 1) == 0 and k["block_m"] & (k["block_m"] - 1) == 0
        assert k["tp"] * k["ep"] <= TOY_LIMITS["ranks"], k
        assert 1 <= k["threads"] <= TOY_LIMITS["cores"], k
        assert 8 <= k["block_k"] <= 256 and k["method"] in ("lut", "vector", "broken")
        check_constraints({**space.fixed, **k}, TOY_LIMITS, TOY_CATALOGUE)  # raises on a violation
        assert space.contains(k)
        seen_m.add(k["block_m"])
    assert len(seen_m) >= 4  # the dynamic range is explored, not collapsed


def test_params_round_trip_and_contains():
    space = toy_space()
    knobs = {"block_k": 128, "block_m": 32, "tp": 2, "ep": 4, "threads": 3, "method": "vector", "fast_path": True}
    params = space.params_of(knobs)
    assert params["log2_block_k"] == 7 and params["log2_block_m"] == 5
    assert space.knobs_of_params(params) == knobs
    assert space.contains(knobs)
    assert not space.contains({**knobs, "block_m": 256})  # does not divide block_k
    assert not space.contains({**knobs, "ep": 8})  # 2 × 8 > 8 ranks
    assert not space.contains({**knobs, "threads": 5})  # > 4 cores
    assert not space.contains({**knobs, "block_m": 24})  # not a power of two


def test_enqueued_params_reproduce_knobs():
    space = toy_space()
    knobs = {"block_k": 32, "block_m": 8, "tp": 1, "ep": 8, "threads": 1, "method": "lut", "fast_path": False}
    study = optuna.create_study()
    study.enqueue_trial(space.params_of(knobs))
    assert space.suggest(study.ask()) == knobs


def test_resolve_knobs_checks_constraints_between_knobs():
    check_constraints({"block_k": 64, "block_m": 16}, {}, TOY_CATALOGUE)
    with pytest.raises(MoetuneError, match="block_m=48"):
        check_constraints({"block_k": 64, "block_m": 48}, {}, TOY_CATALOGUE)
    with pytest.raises(MoetuneError, match="ep=5"):
        check_constraints({"tp": 2, "ep": 5}, {"ranks": 8}, TOY_CATALOGUE)
    check_constraints({"threads": 64}, {}, TOY_CATALOGUE)  # machine limit not given: users may oversubscribe
    assert resolve_knobs({"threads": 1})["threads"] == 1


def test_bad_declarations_are_refused():
    cat = {"a": Knob("a", int, 8, "engine", "", low=1, high=64, constraints=(Divides("b"),)),
           "b": Knob("b", int, 8, "engine", "", low=1, high=64, pow2=True)}
    with pytest.raises(MoetuneError, match="pow2"):
        SearchSpace.from_catalogue(catalogue=cat, limits={}, exclude_components=())
    cyc = {"a": Knob("a", int, 8, "engine", "", low=1, high=64, pow2=True, constraints=(Divides("b"),)),
           "b": Knob("b", int, 8, "engine", "", low=1, high=64, pow2=True, constraints=(Divides("a"),))}
    with pytest.raises(MoetuneError, match="cycle"):
        SearchSpace.from_catalogue(catalogue=cyc, limits={}, exclude_components=())
    with pytest.raises(MoetuneError, match="unknown knobs"):
        SearchSpace.from_catalogue(["nope"], catalogue=TOY_CATALOGUE, limits=TOY_LIMITS)
