"""System-tier objectives: the engine end to end on one model, over a mix of workloads.

    tpot        seconds per output token (each request's, averaged over a batch), after the first   minimize
    ttft        seconds to a request's first token (averaged over a batch)                           minimize
    throughput  output tokens/s of `batch` requests decoded together; a configuration
                whose per-token latency exceeds `latency_limit_s` is a failed trial                  maximize
    pareto      ttft and tpot together (two objectives; the Pareto front is kept)

The workload is a mix of points, each named as people say it: `prompt 128/16` (one request, a
128-token prompt, 16 output tokens), `batch 4 × 128/16` (four such requests together). One call of
a runner measures every point once and returns one sample per (metric, point); the search scores
a trial by the geometric mean over the points of its ratio to the defaults (tuner/search.py), and
the confirmation keeps a profile only if it is not slower than the defaults beyond the spread at
any point. DEFAULT_MIX: the contexts serving sees, sized for a 10-minute run on 2 cores (`small`:
a 2K-token prompt took about 9 s to prefill on such a machine, issue 13, so its mix stops at 1K;
estimated 8 s a call, so under ten trials in 10 minutes); the throughput objective measures one
point, `batch B × P/D`.

`provides` tells the search space what the mix can observe (knobspec.Provides): knobs it cannot
observe are neither searched nor written (serving limits only under `throughput`, which measures
concurrency).

Correctness gate: every configuration, before it is timed, generates greedily from a fixed prompt
and gives the last-position logits of that prompt; both are compared with the defaults'.
Logits: |Δ| ≤ tol · (1 + max |reference logit|) everywhere, tol = GATE_TOL[dtype] (float32
1e-4; bfloat16 2e-2 and float16 1e-2: those dtypes round each layer's output, and a different
reduction order or MLA form moves the logits by a few units in the last place; on `tiny` the
measured change is ≤ 5e-3 of the largest logit in bf16, ≤ 2e-7 in float32). Greedy tokens: equal,
step by step, while the defaults' top two logits at that step are more than 2 · bound apart (a
near-tie may flip legitimately; the sequences are not compared after one). Beyond that the trial
fails with WrongAnswer (status "wrong") and is never chosen.

Every trial builds an `LLM` with its knobs. Weights are loaded once per tuning session and shared
by every trial's engine (`shared_weights`): only the engine around them is rebuilt.
"""
from __future__ import annotations

import contextlib
import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from kernels.knobspec import Provides
from tuner.search import Metric, TrialFailure, WrongAnswer

TTFT = Metric("ttft_s", "minimize", "s")
TPOT = Metric("tpot_s", "minimize", "s")
THROUGHPUT = Metric("throughput_tok_s", "maximize", "tokens/s")
METRICS = {"tpot": (TPOT,), "ttft": (TTFT,), "throughput": (THROUGHPUT,), "pareto": (TTFT, TPOT)}
GATE_TOL = {"float32": 1e-4, "bfloat16": 2e-2, "float16": 1e-2}
GATE_PROMPT, GATE_TOKENS = 32, 8  # the gate's fixed prompt (seeded random ids) and greedy tokens


@dataclass(frozen=True)
class Point:
    """One workload of a mix: `batch` requests of a `prompt`-token prompt and `decode` output tokens."""
    prompt: int
    decode: int
    batch: int = 1

    @property
    def label(self) -> str:
        return f"prompt {self.prompt}/{self.decode}" if self.batch == 1 else \
            f"batch {self.batch} × {self.prompt}/{self.decode}"

    @property
    def context(self) -> int:
        return self.prompt + self.decode

    def as_dict(self) -> dict:
        return {"prompt_len": self.prompt, "decode": self.decode, "batch": self.batch, "label": self.label}


DEFAULT_MIX = {
    # tiny runs a 2K prompt in 0.1 s: the mix spans the contexts MLA's form depends on
    "tiny": (Point(128, 16), Point(2032, 16), Point(128, 16, 4)),
    # small on 2 cores: about 8 s a call, estimated from a 2K prefill's 9 s (not measured here)
    "small": (Point(128, 16), Point(1024, 16), Point(128, 16, 4)),
}


def default_mix(model: str) -> tuple[Point, ...]:
    return DEFAULT_MIX.get(model, DEFAULT_MIX["small"])


def parse_mix(text: str) -> tuple[Point, ...]:
    """'128/16,1024/16,4x128/16' → points (B x P/D: B requests together; P/D: one request)."""
    from engine.errors import MoetuneError

    points = []
    for part in text.split(","):
        m = re.fullmatch(r"\s*(?:(\d+)\s*[x×]\s*)?(\d+)\s*/\s*(\d+)\s*", part)
        if not m or int(m.group(2)) < 1 or int(m.group(3)) < 2 or int(m.group(1) or 1) < 1:
            raise MoetuneError(f"mix point {part.strip()!r} is not PROMPT/OUTPUT or BATCHxPROMPT/OUTPUT "
                               "(e.g. 128/16 or 4x128/16; at least 2 output tokens)")
        points.append(Point(int(m.group(2)), int(m.group(3)), int(m.group(1) or 1)))
    return tuple(dict.fromkeys(points))


def mix_slug(points) -> str:
    """For study names: 'p128d16+p1024d16+b4p128d16'."""
    return "+".join((f"b{p.batch}" if p.batch > 1 else "") + f"p{p.prompt}d{p.decode}" for p in points)


@contextlib.contextmanager
def shared_weights():
    """While active, LLM() loads each (checkpoint, dtype) once and shares the weights (read-only)."""
    import engine.llm as llm_mod

    original, cache = llm_mod.load_weights, {}

    def cached(path, config, dtype, progress=True, bulk_alloc=None):
        key = (str(path), dtype, bulk_alloc is not None)
        if key not in cache:
            cache[key] = original(path, config, dtype, progress, bulk_alloc=bulk_alloc)
        return cache[key]

    llm_mod.load_weights = cached
    try:
        yield
    finally:
        llm_mod.load_weights = original


@dataclass
class Answer:
    """What the gate compares: greedy tokens, and the logits at the prompt's last position.
    `margins`: the top-1 minus top-2 logit at each greedy step (defaults only)."""
    tokens: list[int]
    last_logits: torch.Tensor
    margins: list[float] = field(default_factory=list)


def check_answer(ref: Answer, got: Answer, dtype: str) -> None:
    """Raise WrongAnswer when `got` differs from the defaults' `ref` beyond the dtype's bound."""
    tol = GATE_TOL.get(dtype, 2e-2)
    bound = tol * (1.0 + float(ref.last_logits.abs().max()))
    err = float((got.last_logits - ref.last_logits).abs().max())
    if not math.isfinite(err) or err > bound:
        raise WrongAnswer(f"wrong answer: last-position logits differ from the defaults' by {err:.3g} "
                          f"(bound {bound:.3g} for {dtype})")
    for i, (a, b) in enumerate(zip(got.tokens, ref.tokens)):
        if a == b:
            continue
        if ref.margins[i] <= 2 * bound:
            return  # a near-tie: the sequences may part here, legitimately
        raise WrongAnswer(f"wrong answer: greedy token {i} is {a}, the defaults give {b} "
                          f"(their top two logits {ref.margins[i]:.3g} apart)")
    if len(got.tokens) != len(ref.tokens):
        raise WrongAnswer(f"wrong answer: {len(got.tokens)} greedy tokens, the defaults give {len(ref.tokens)}")


@dataclass
class SystemObjective:
    kind: str  # tpot | ttft | throughput | pareto
    model: str = "small"
    dtype: str = "bfloat16"
    mix: tuple[Point, ...] | None = None  # None: default_mix(model) (throughput: one batch point)
    batch: int = 4  # throughput only (with prompt_len/decode: its one point)
    latency_limit_s: float = 10.0  # throughput only: most seconds per output token
    prompt_len: int = 128  # throughput only
    decode: int = 16  # throughput only
    format: str = ""
    gate: bool = True  # the correctness gate against the defaults' answer
    workload: dict = field(default_factory=dict)
    kernel_tables: dict | None = None  # the kernel tier's tables: every trial runs on top of them

    def __post_init__(self):
        from engine.errors import MoetuneError

        if self.kind not in METRICS:
            raise MoetuneError(f"objective {self.kind!r} is not one of {', '.join(METRICS)}")
        self.metrics = METRICS[self.kind]
        self.name = f"system-{self.kind}"
        if self.mix is None:
            self.mix = (Point(self.prompt_len, self.decode, self.batch),) if self.kind == "throughput" \
                else default_mix(self.model)
        self.mix = tuple(self.mix)
        if not self.mix:
            raise MoetuneError("the workload mix is empty")
        self.points = tuple(p.label for p in self.mix)
        self.workload = {"mix": [p.label for p in self.mix], "dtype": self.dtype,
                         **({"latency_limit_s": self.latency_limit_s} if self.kind == "throughput" else {})}
        self._reference: Answer | None = None

    @property
    def provides(self) -> Provides:
        """What the mix lets a knob show (see knobspec.Provides)."""
        return Provides(concurrency=max(p.batch for p in self.mix),
                        prompt_tokens=max(p.batch * p.prompt for p in self.mix),
                        contexts=tuple(sorted({p.context for p in self.mix})),
                        kv_tokens=max(p.batch * p.context for p in self.mix),
                        measures_concurrency=self.kind == "throughput" and any(p.batch > 1 for p in self.mix))

    def workload_of(self, label: str) -> dict:
        point = next(p for p in self.mix if p.label == label)
        return {**point.as_dict(), "dtype": self.dtype}

    @staticmethod
    def prompt(vocab: int, length: int, seed: int = 0) -> list[int]:
        g = torch.Generator().manual_seed(seed)
        return torch.randint(2, vocab, (length,), generator=g).tolist()

    # ------------------------------------------------------------ building and checking

    def build(self, knobs: dict[str, Any]):
        """The engine for one configuration (a test may plant a behaviour here)."""
        from engine.llm import LLM

        return LLM(self.model, dtype=self.dtype, knobs=knobs, progress=False, kernel_tables=self.kernel_tables)

    def answer(self, llm, margins: bool = False) -> Answer:
        """The gate's measurement: greedy tokens from the fixed prompt, its last-position logits."""
        from engine.llm import SamplingParams

        torch.set_num_threads(llm.knobs["threads"])
        ids = self.prompt(llm.config.vocab_size, GATE_PROMPT, seed=12345)
        tokens = llm.generate(ids, SamplingParams(max_tokens=GATE_TOKENS, ignore_eos=True))[0].token_ids
        if not margins:
            return Answer(tokens, llm.logits(ids)[-1].float())
        forced = llm.logits(ids + tokens[:-1]).float()  # the logits each greedy token was chosen from
        top2 = forced[len(ids) - 1:].topk(2, dim=-1).values
        return Answer(tokens, forced[len(ids) - 1], (top2[:, 0] - top2[:, 1]).tolist())

    def reference(self) -> Answer:
        """The defaults' answer (computed once)."""
        if self._reference is None:
            self._reference = self.answer(self.build({}), margins=True)
        return self._reference

    def prepare(self, knobs: dict[str, Any]) -> Callable[[], dict[str, float]]:
        """Build the engine with `knobs`, check its answer; the runner measures every point once per call."""
        llm = self.build(knobs)
        if self.gate:
            check_answer(self.reference(), self.answer(llm), self.dtype)
        vocab = llm.config.vocab_size
        prompts = {p.label: [self.prompt(vocab, p.prompt, seed) for seed in range(p.batch)] for p in self.mix}
        return lambda: self._run(llm, prompts)

    # ------------------------------------------------------------ measuring

    def _run(self, llm, prompts: dict[str, list[list[int]]]) -> dict[str, float]:
        from tuner.search import sample_key

        out = {}
        for p in self.mix:
            for name, v in self._point(llm, p, prompts[p.label]).items():
                out[sample_key(name, p.label)] = v
        return out

    def _point(self, llm, p: Point, prompts: list[list[int]]) -> dict[str, float]:
        import time

        from engine.llm import SamplingParams

        torch.set_num_threads(llm.knobs["threads"])  # global: every runner sets its own before running
        t = time.perf_counter()
        outs = llm.generate(prompts, SamplingParams(max_tokens=p.decode, ignore_eos=True))
        wall = time.perf_counter() - t
        tpots = [o.decode_s / max(1, len(o.token_ids) - 1) for o in outs]
        res = {"ttft_s": sum(o.ttft_s for o in outs) / len(outs), "tpot_s": sum(tpots) / len(tpots)}
        if self.kind == "throughput":
            if max(tpots) > self.latency_limit_s:
                raise TrialFailure(f"over the latency limit: {max(tpots):.3f} s per token > {self.latency_limit_s} s")
            res["throughput_tok_s"] = sum(len(o.token_ids) for o in outs) / wall
        return res
