"""The offline API: `LLM(model=...)`, `llm.logits(ids)`, `llm.generate(prompts, SamplingParams(...))`."""
from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Sequence

import torch

import kernels
from engine.cache import PagedCache, SeqCache
from engine.config import ModelConfig
from engine.device import resolve_device, to_device
from engine.errors import MoetuneError
from engine.knobs import resolve_knobs
from engine.invariant import RowwiseOps
from engine.models import build_model
from engine.models.base import Batch
from engine.profile import Profile, find_profile, load_profile, model_key
from engine.sampling import TokenLogprob, token_logprobs
from engine.scheduler import Request, Scheduler
from engine.tokenizer import IncrementalDecoder, Tokenizer
from engine.weights.loader import lm_head_quantized, load_weights
from engine.weights.presets import resolve_model

log = logging.getLogger("moetune")

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def _format_name(cfg: ModelConfig, dtype: str) -> str:
    if cfg.quant is not None:
        return {"fp8": "fp8", "moetune_int4": "int4"}.get(cfg.quant.method, "int8")
    return {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16"}[dtype]


def checkpoint_model_key(path, cfg: ModelConfig, dtype: str) -> str:
    """The profile key of the checkpoint at `path` run at `dtype` (the engine and the tuner both key by it)."""
    return model_key(cfg, _format_name(cfg, dtype), quantized_head=lm_head_quantized(path))


def _pick_profile(profile, mkey: str, force: bool) -> Profile | None:
    """None: defaults; "auto": this machine's tuned profile for the model if any; else a path."""
    if profile is None:
        return None
    found = find_profile(mkey) if profile == "auto" else load_profile(profile, force)
    if found is None:
        log.info("no tuned profile for %s on this machine: running with the defaults", mkey)
    else:
        log.info("running with tuned profile %s", found.path)
    return found


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    seed: int | None = None
    stop: list[str] | str | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # k: each generated token's logprob and the top k at its position
    prompt_logprobs: int | None = None  # k: the same for every prompt token but the first

    def validate(self) -> None:
        if self.max_tokens < (0 if self.prompt_logprobs is not None else 1):
            raise MoetuneError(f"max_tokens must be ≥ 1 (0 only with prompt_logprobs), got {self.max_tokens}")
        if self.temperature < 0:
            raise MoetuneError(f"temperature must be ≥ 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise MoetuneError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise MoetuneError(f"top_k must be ≥ 0, got {self.top_k}")

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


@dataclass
class RequestOutput:
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None  # "length" | "stop"
    ttft_s: float = 0.0  # time to first token
    decode_s: float = 0.0  # time from the first to the last token
    logprobs: list[TokenLogprob] = field(default_factory=list)  # per token_ids entry, when params.logprobs
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)  # per prompt token (the first: None)
    cumulative_logprob: float = 0.0  # the sum of `logprobs`


class LLM:
    """A model of a supported family (DeepSeek-V2/V3, Qwen3-MoE, Qwen2-MoE, Llama 3: engine/models)
    loaded for inference on this machine.

    model: a preset name ("tiny", "small") or a Hugging Face checkpoint directory.
    dtype: activation (and high-precision weight) dtype, "bfloat16" or "float32".
    knobs: overrides of the knob catalogue (engine.knobs), e.g. {"kv_block_size": 32}.
    device: "cpu", or "cuda" (every layer, the weights and the KV cache on the GPU; the "cuda"
    kernel backend, whatever kernel_backend says).
    kernel_tables: per-call kernel tables (a profile's [kernel_tables] form) used instead of the
    profile's: the tuner's system tier runs on top of the tables its kernel tier found.
    """

    def __init__(self, model: str, dtype: str = "bfloat16", profile: str | None = None,
                 knobs: dict | None = None, progress: bool = True, force_profile: bool = False,
                 device: str = "cpu", kernel_tables: dict | None = None):
        if dtype not in DTYPES:
            raise MoetuneError(f"dtype {dtype!r} is not supported (choose {', '.join(DTYPES)})")
        self.device = resolve_device(device)
        self.path = resolve_model(model, progress)
        self.config = ModelConfig.from_file(self.path)
        self.model_key = checkpoint_model_key(self.path, self.config, dtype)
        self.profile = _pick_profile(profile, self.model_key, force_profile)
        self.knobs = resolve_knobs({**(self.profile.knobs if self.profile else {}), **(knobs or {})})
        torch.set_num_threads(self.knobs["threads"])
        self.tokenizer = Tokenizer.from_dir(self.path) if (self.path / "tokenizer.json").exists() else None
        self.dtype = DTYPES[dtype]
        ops = kernels.get_backend("cuda" if self.device.type == "cuda" else self.knobs["kernel_backend"])
        # the cpu backend's weights go straight into huge-page storage (cpu_huge_pages): prepare() copies none
        huge = getattr(ops, "__name__", "") == "kernels.cpu" and self.knobs["cpu_huge_pages"]
        weights = to_device(load_weights(self.path, self.config, self.dtype, progress,
                                         bulk_alloc=ops.weight_empty if huge else None), self.device)
        if hasattr(ops, "configure"):  # backends with tile knobs read them from the catalogue
            try:
                ops.configure(self.knobs)
            except ValueError as e:
                raise MoetuneError(str(e)) from e
        absorb = self.knobs["mla_absorb"]
        if self.knobs["batch_invariant"]:  # see engine/invariant.py
            absorb = "always"
        self.model = build_model(self.config, weights, ops, self.dtype, absorb=absorb)
        self.kernel_plan: list = []  # per call site and bucket: the knobs its calls use (moetune explain)
        cpu_backend = getattr(ops, "__name__", "") == "kernels.cpu"
        if cpu_backend:
            sited = {**self.model.w, **{f"layers.{i}.router": r for i, r in self.model.routers.items()}}
            ops = self._tuned_ops(ops, sited, knobs or {}, kernel_tables)
        if self.knobs["batch_invariant"]:
            ops = RowwiseOps(ops)
        self.model.ops = ops
        self.model.runner = self._decode_runner(ops, cpu_backend)
        self.cache = self.model.make_cache(self.knobs["max_total_tokens"], self.knobs["kv_block_size"], self.device)

    def _tuned_ops(self, ops, weights: dict, command_line: dict, kernel_tables: dict | None):
        """The cpu backend wrapped so that every linear / fused MoE / attention call takes the knobs of
        its shape and bucket from the profile's kernel tables (engine/kernel_tables.py)."""
        from engine import kernel_tables as kt

        if kernel_tables is not None:
            tables, where = dict(kernel_tables), "kernel tables"
        else:
            tables = dict(self.profile.kernel_tables) if self.profile else {}
            where = f"profile {self.profile.path}" if self.profile else "kernel tables"
        kt.check_tables(tables, where)
        sources = kt.knob_sources(self.profile.knobs if self.profile else {}, command_line)
        make_arg = getattr(ops, "make_knobs", None)
        sites: dict[tuple, kt.SitePlan] = {}

        def site(op: str, fmt: str, shape: dict) -> kt.SitePlan:
            key = (op, fmt, tuple(shape.items()))
            if key not in sites:
                sites[key] = kt.build_site(op, fmt, shape, tables, self.knobs, sources, make_arg)
            return sites[key]

        by_weight: dict[int, kt.SitePlan] = {}
        for name, w in weights.items():
            if not isinstance(w, ops.Packed) or name.endswith("experts.w2"):
                continue
            fmt, n, k = ops.FORMAT_NAMES[w.args[0]], w.args[2], w.args[3]
            if name.endswith("experts.w13"):
                shape = {"experts": w.args[1].shape[0], "inter": n // 2, "hidden": k,
                         "topk": self.config.num_experts_per_tok}
                by_weight[id(w)] = site("fused_moe", fmt, shape)
            else:
                by_weight[id(w)] = site("linear", fmt, {"n": n, "k": k})
            by_weight[id(w)].names.append(name)
        cache_fmt = "f32" if self.dtype == torch.float32 else "bf16"

        def attention_site(op: str, key: tuple) -> kt.SitePlan:
            return site(op, cache_fmt, kt.attention_shape(op, key))

        for op, key in self.model.attention_sites():
            attention_site(op, key)
        self.kernel_plan = list(sites.values())
        return kt.TunedOps(ops, by_weight, attention_site)

    def _decode_runner(self, ops, cpu_backend: bool):
        """The C++ decode runner under graph_mode=cpp, where it applies (else None: eager)."""
        if self.knobs["graph_mode"] != "cpp":
            return None
        from engine import cpp_runner

        why = ("it runs on the cpu kernel backend only" if not cpu_backend or self.device.type != "cpu" else
               "batch_invariant runs every op row by row" if self.knobs["batch_invariant"] else
               "mla_absorb=never asks for the naive MLA form" if getattr(self.model, "absorb", None) == "never" else
               cpp_runner.unsupported(self.model))
        if why:
            log.info("graph_mode=cpp: decode steps stay eager (%s)", why)
            return None
        return cpp_runner.CppDecodeRunner(self.model, ops, self.knobs)

    def explain(self) -> list[dict]:
        """Per call site, bucket and knob: the value the kernel calls use and where it came from."""
        from engine.kernel_tables import plan_rows

        return plan_rows(self.kernel_plan)

    @property
    def eos_token_id(self) -> int | None:
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            return self.tokenizer.eos_token_id
        return self.config.eos_token_id

    @property
    def max_context(self) -> int:
        return min(self.config.max_position_embeddings, self.cache.capacity_tokens)

    # ------------------------------------------------------------ one forward

    def _step(self, reqs: list[Request], new_tokens: list[list[int]]) -> torch.Tensor:
        """Feed each request its new tokens; returns the logits of each one's last token [B, vocab]."""
        return self._forward(reqs, new_tokens)[0]

    def _forward(self, reqs: list[Request], new_tokens: list[list[int]],
                 every_row: frozenset[int] = frozenset()) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """`_step`, and for the requests at the indices in `every_row` (prompt logprobs) the logits
        of all their new tokens too, {i: [len(new_tokens[i]), vocab]}: computed only when asked for."""
        runner = self.model.runner  # graph_mode=cpp: a decode step is one call, lm_head included
        if (runner is not None and runner.has_lm_head and not every_row
                and all(len(t) == 1 for t in new_tokens)):  # ... fed plain lists: no Batch, no tensors
            seqs = [r.seq for r in reqs]
            positions = [s.num_tokens for s in seqs]
            for s in seqs:
                self.cache.reserve(s, 1)
            self._set_threads(True)
            return runner.step_logits([t[0] for t in new_tokens], positions, [s.block_table for s in seqs],
                                      self.cache), {}
        batch = self._batch([r.seq for r in reqs], new_tokens)
        self._set_threads(batch.is_decode)
        with torch.inference_mode():
            hidden = self.model.forward(batch, self.cache)  # decode: every row is a last token
            last = self.model.logits(hidden if batch.is_decode else hidden[batch.last_token_index()])
            ends = torch.tensor(batch.new_lens).cumsum(0).tolist()
            rows = {i: self.model.logits(hidden[ends[i] - batch.new_lens[i]:ends[i]]) for i in every_row}
            return last, rows

    def _set_threads(self, decode_only: bool) -> None:
        """Intra-op threads for this step: knob threads_decode for a decode-only step, else
        threads_prefill. Set in the thread that runs the step (the count is per thread: the
        server's engine thread is not the one that built the LLM), and only when it changes."""
        n = self.knobs["threads_decode" if decode_only else "threads_prefill"]
        if torch.get_num_threads() != n:
            torch.set_num_threads(n)

    def _batch(self, seqs: list[SeqCache], new_tokens: list[list[int]]) -> Batch:
        """Room in the cache for every sequence's new tokens, and the step's tensors (token ids,
        positions, slots, block tables) built per sequence, never per token in Python."""
        lens = [len(t) for t in new_tokens]
        starts = torch.tensor([s.num_tokens for s in seqs])
        for s, n in zip(seqs, lens):
            self.cache.reserve(s, n)
        tables = PagedCache.block_tables(seqs)
        token_ids = torch.tensor(list(itertools.chain.from_iterable(new_tokens)))
        if all(n == 1 for n in lens):  # decode: one token per sequence
            seq_of, positions = torch.arange(len(seqs)), starts
        else:
            counts = torch.tensor(lens)
            seq_of = torch.repeat_interleave(torch.arange(len(seqs)), counts)
            first = counts.cumsum(0) - counts  # each sequence's first index in the step
            positions = torch.arange(len(token_ids)) + (starts - first)[seq_of]
        bs = self.cache.block_size
        slots = tables[seq_of, positions // bs].long() * bs + positions % bs
        return Batch(token_ids, positions, slots, seqs, lens, block_tables=tables)

    def logits(self, token_ids: Sequence[int]) -> torch.Tensor:
        """One prefill of `token_ids`: float32 logits for every position, [T, vocab]."""
        ids = self._check_prompt(list(token_ids), extra=0)
        seq = SeqCache()
        try:
            batch = self._batch([seq], [ids])
            self._set_threads(batch.is_decode)
            with torch.inference_mode():
                return self.model.logits(self.model.forward(batch, self.cache))
        finally:
            self.cache.release(seq)

    # ------------------------------------------------------------ generation

    def _check_prompt(self, ids: list[int], extra: int) -> list[int]:
        if not ids:
            raise MoetuneError("the prompt is empty")
        bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise MoetuneError(f"token id {bad[0]} is outside the vocabulary (0..{self.config.vocab_size - 1})")
        if len(ids) + extra > self.max_context:
            raise MoetuneError(f"prompt of {len(ids)} tokens plus {extra} new tokens exceeds the context "
                               f"of {self.max_context} tokens")
        return ids

    def _encode(self, prompt: str | list[int]) -> list[int]:
        if not isinstance(prompt, str):
            return list(prompt)
        if self.tokenizer is None:
            raise MoetuneError(f"{self.path} has no tokenizer.json: pass prompts as token ids")
        return self.tokenizer.encode(prompt)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids) if self.tokenizer is not None else ""

    def generate(self, prompts: str | list[int] | list, params: SamplingParams | None = None) -> list[RequestOutput]:
        """Generate for every prompt through the continuous-batching scheduler (as the server does)."""
        params = params or SamplingParams()
        params.validate()
        if isinstance(prompts, str) or not prompts or isinstance(prompts[0], int):
            prompts = [prompts]  # one prompt; [] is an empty one (rejected below), not an empty batch
        reqs = []
        for p in prompts:
            ids = self._check_prompt(self._encode(p), params.max_tokens)
            reqs.append(Request(RequestOutput(ids), params))
        scheduler = Scheduler(self)
        try:
            for r in reqs:
                scheduler.add(r)
            while scheduler.has_work():
                scheduler.step()
        finally:
            scheduler.cancel_all()  # only after an error: every block back
        return [r.out for r in reqs]

    def _accept(self, r: Request, logits: torch.Tensor) -> None:
        """Sample r's next token; update its text (incrementally: see IncrementalDecoder) and
        finish it on a stop string, EOS or max_tokens. out.text is at every step what decoding the
        whole output (less a final EOS) gives, cut before the first stop string."""
        token = r.sampler(logits)
        out = r.out
        out.token_ids.append(token)
        if r.params.logprobs is not None:
            out.logprobs += token_logprobs(logits[None], [token], r.params.logprobs)
            out.cumulative_logprob += out.logprobs[-1].logprob
        eos = token == self.eos_token_id and not r.params.ignore_eos
        if r.detok is None:
            r.detok = IncrementalDecoder(self._decode)
        out.text = r.detok.update(out.token_ids[:-1] if eos else out.token_ids)
        stop, at = _first_stop(out.text, r.params.stop_strings, r.detok.changed_from)
        if stop is not None:
            out.text, out.finish_reason = out.text[:at], "stop"
        elif eos:
            out.finish_reason = "stop"
        elif len(out.token_ids) >= r.params.max_tokens:
            out.finish_reason = "length"
        if out.finish_reason is not None:
            out.decode_s = time.perf_counter() - r.t_first


def _first_stop(text: str, stops: list[str], changed_from: int) -> tuple[str | None, int]:
    """The first of `stops` (in their order) that occurs in `text`, and where it first occurs,
    given that text[:changed_from] is unchanged since a check that found none: an occurrence
    must end after changed_from, so only the text from changed_from - len(stop) + 1 is searched."""
    for s in stops:
        at = text.find(s, max(0, changed_from - max(len(s), 1) + 1))
        if at >= 0:
            return s, at
    return None, -1
