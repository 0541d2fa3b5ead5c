"""System-tier objectives: the engine end to end on one model, one workload.

    tpot        seconds per output token of one request (batch 1), after the first      minimize
    ttft        seconds to the first token of a `prompt_len` prompt                      minimize
    throughput  output tokens/s of `batch` requests decoded together; a configuration
                whose per-token latency exceeds `latency_limit_s` is a failed trial      maximize
    pareto      ttft and tpot together (two objectives; the Pareto front is kept)

Every trial builds an `LLM` with its knobs. Weights are loaded once per tuning session and shared
by every trial's engine (`shared_weights`): only the engine around them is rebuilt.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from tuner.search import Metric, TrialFailure

TTFT = Metric("ttft_s", "minimize", "s")
TPOT = Metric("tpot_s", "minimize", "s")
THROUGHPUT = Metric("throughput_tok_s", "maximize", "tokens/s")
METRICS = {"tpot": (TPOT,), "ttft": (TTFT,), "throughput": (THROUGHPUT,), "pareto": (TTFT, TPOT)}


@contextlib.contextmanager
def shared_weights():
    """While active, LLM() loads each (checkpoint, dtype) once and shares the weights (read-only)."""
    import engine.llm as llm_mod

    original, cache = llm_mod.load_weights, {}

    def cached(path, config, dtype, progress=True):
        key = (str(path), dtype)
        if key not in cache:
            cache[key] = original(path, config, dtype, progress)
        return cache[key]

    llm_mod.load_weights = cached
    try:
        yield
    finally:
        llm_mod.load_weights = original


@dataclass
class SystemObjective:
    kind: str  # tpot | ttft | throughput | pareto
    model: str = "small"
    dtype: str = "bfloat16"
    prompt_len: int = 8
    decode: int = 4
    batch: int = 4  # throughput only
    latency_limit_s: float = 10.0  # throughput only: most seconds per output token
    format: str = ""
    workload: dict = field(default_factory=dict)
    kernel_tables: dict | None = None  # the kernel tier's tables: every trial runs on top of them

    def __post_init__(self):
        if self.kind not in METRICS:
            from engine.errors import MoetuneError

            raise MoetuneError(f"objective {self.kind!r} is not one of {', '.join(METRICS)}")
        self.metrics = METRICS[self.kind]
        self.name = f"system-{self.kind}"
        self.workload = {"prompt_len": self.prompt_len, "decode": self.decode, "dtype": self.dtype,
                         **({"batch": self.batch, "latency_limit_s": self.latency_limit_s}
                            if self.kind == "throughput" else {})}

    def prompt(self, vocab: int, seed: int = 0) -> list[int]:
        g = torch.Generator().manual_seed(seed)
        return torch.randint(2, vocab, (self.prompt_len,), generator=g).tolist()

    def prepare(self, knobs: dict[str, Any]) -> Callable[[], dict[str, float]]:
        """Build the engine with `knobs`; the runner does one request (or one batch) per call."""
        from engine.llm import LLM

        llm = LLM(self.model, dtype=self.dtype, knobs=knobs, progress=False, kernel_tables=self.kernel_tables)
        threads = llm.knobs["threads"]
        if self.kind == "throughput":
            prompts = [self.prompt(llm.config.vocab_size, seed) for seed in range(self.batch)]
            return lambda: self._throughput(llm, threads, prompts)
        prompt = self.prompt(llm.config.vocab_size)
        return lambda: self._single(llm, threads, prompt)

    def _single(self, llm, threads: int, prompt: list[int]) -> dict[str, float]:
        from engine.llm import SamplingParams

        torch.set_num_threads(threads)  # global: every runner sets its own before running
        out = llm.generate(prompt, SamplingParams(max_tokens=self.decode, ignore_eos=True))[0]
        n = len(out.token_ids)
        return {"ttft_s": out.ttft_s, "tpot_s": out.decode_s / max(1, n - 1)}

    def _throughput(self, llm, threads: int, prompts: list[list[int]]) -> dict[str, float]:
        import time

        from engine.llm import SamplingParams

        torch.set_num_threads(threads)
        t = time.perf_counter()
        outs = llm.generate(prompts, SamplingParams(max_tokens=self.decode, ignore_eos=True))
        wall = time.perf_counter() - t
        tokens = sum(len(o.token_ids) for o in outs)
        tpot = max(o.decode_s / max(1, len(o.token_ids) - 1) for o in outs)
        if tpot > self.latency_limit_s:
            raise TrialFailure(f"over the latency limit: {tpot:.3f} s per token > {self.latency_limit_s} s")
        return {"throughput_tok_s": tokens / wall, "tpot_s": tpot}
