"""Breakdown suite: where a decode step's (and a prefill's) time goes, kernel op by kernel op.

    python -m suites.breakdown --model tiny|small [--dtype bfloat16] [--prompt-len 128] [--decode 16]
                               [--batch 1] [--repeats 5] [--backend auto] [--knob NAME=VALUE ...]
                               [--profile auto|PATH] [--no-probe] [--no-store] [--json]
    python -m suites.e2e --breakdown ...   (the same, from the end-to-end suite's arguments)

How: the model's kernel backend is wrapped (`OpTimer`) so that every op call is timed with
perf_counter (on a GPU, synchronized before and after), and each step is timed as a whole around
`Scheduler.step()`. A repeat prefills `--batch` random prompts of `--prompt-len` tokens (the steps
until every request has its first token: "prefill"; figures are for the whole prefill), then runs
`--decode` decode-only steps ("decode"; figures are per step, the mean over those steps). A warm-up
repeat comes first.

Parts of a step (seconds; per repeat they add up exactly to the step's wall time):
    linear.attn (q/kv/o projections), head_linear (MLA absorption: W_UK, W_UV), attention
    (mla_decode, extend_attention, paged_*), norms (rms_norm, add_rms_norm), rope, routing
    (grouped_topk), linear.router, fused_moe (routed experts), linear.shared (shared experts),
    linear.dense (dense FFN layers), activation (silu_and_mul), lm_head, linear.other (any other
    weight);
    rest.model: LLM._step's time outside the ops (the step's tensors and cache blocks, embedding,
      rotary angles, views/cat/split, the logits' copy to float32 on the host: Python and copies);
    rest.runner: graph_mode=cpp only: the time inside the C++ decode runner (engine/cpp_runner.py) outside
      its kernel calls (its glue: rounding, buffers, the ATen calls between kernels); the runner times
      each kernel call inside it (steady_clock) into the parts above, so a decode step's parts mean the
      same in both modes (calls: the runner's kernel calls);
    rest.scheduler: the step outside LLM._step (scheduling, sampling, detokenization, stop strings);
    timer_overhead: the wrappers' own cost (calls × a per-call cost calibrated beforehand; with
      graph_mode=cpp also the time spent reading the runner's timings back after each step).
"The rest" = rest.model + rest.runner + rest.scheduler; fixed cost per layer = the decode step's rest ÷
layers (per-step costs included: on a 2-layer model they dominate it).

Bytes: every weight an op is handed counts once per call (linear: the whole matrix; fused_moe:
only the experts the step's routing selected, w13 and w2; the embedding: one row per token); per
token = per step ÷ the tokens the step fed (decode: the batch). The whole step's read bandwidth =
weight bytes per step ÷ step time, as a fraction of the probe's read bandwidth (tuner.probe,
measured once per machine).
KV-cache bytes that mla_decode reads are reported beside (not in the weight bytes).

Rows (results.store, suite "breakdown"; one run_id per invocation; the machine's fingerprint hash
and hardware key in every row, as append_rows fills them):
    metric "part_seconds", unit s: workload {phase, part, prompt_len, batch, decode_steps};
        samples = per repeat; extra {calls_per_step, share (of the median total)}; part "total"
        is the step's wall time;
    metric "weight_bytes_per_token" (B), "kv_bytes_per_token" (B), "weight_gb_s" (GB/s),
        "read_bw_fraction" (fraction of the probe's read_gbps; absent with --no-probe),
        "paired_read_gb_s" / "paired_read_fraction" (decode: the fastest of PairedRead's methods over one
        step's weight bytes, timed after each repeat, and the step's GB/s as a fraction of it; absent with --no-probe),
        "fixed_cost_per_layer" (s; the rest ÷ layers): workload {phase, prompt_len, batch,
        decode_steps}; extra: bytes by group (attention, dense, routed experts, shared experts,
        router, lm_head, embed), the probe's read_gbps, the CPU model.
Timing is noisy on shared machines: medians and min–max over repeats are printed and stored.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from contextlib import contextmanager

import torch

PARTS = ("linear.attn", "head_linear", "attention", "norms", "rope", "routing", "linear.router",
         "fused_moe", "linear.shared", "linear.dense", "activation", "lm_head", "linear.other")
REST = ("rest.model", "rest.runner", "rest.scheduler", "timer_overhead")
OP_PART = {"rms_norm": "norms", "add_rms_norm": "norms", "rope": "rope", "grouped_topk": "routing",
           "fused_moe": "fused_moe", "head_linear": "head_linear", "silu_and_mul": "activation",
           "mla_decode": "attention", "extend_attention": "attention", "paged_decode": "attention",
           "paged_extend": "attention"}
BYTE_GROUPS = ("attention", "dense", "routed_experts", "shared_experts", "router", "lm_head", "embed")


def _nbytes(w) -> int:
    return int(w.nbytes if hasattr(w, "nbytes") else w.numel() * w.element_size())


def _linear_part(key: str) -> str:
    if key == "lm_head":
        return "lm_head"
    if key.endswith(".router"):
        return "linear.router"
    if ".shared." in key or key.endswith(".shared_gate"):
        return "linear.shared"
    if ".mlp." in key:
        return "linear.dense"
    if key.endswith(("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj", "kv_b_proj", "o_proj", "k_proj", "v_proj")):
        return "linear.attn"
    return "linear.other"


def _byte_group(part: str) -> str:
    return {"linear.attn": "attention", "head_linear": "attention", "linear.dense": "dense",
            "fused_moe": "routed_experts", "linear.shared": "shared_experts", "linear.router": "router",
            "lm_head": "lm_head"}.get(part, "attention")


class OpTimer:
    """A kernel backend wrapper: the same ops, each call timed into its part, and the weights each
    call is handed logged (bytes are counted by `step_bytes`, outside the timed calls)."""

    def __init__(self, ops, model, sync=None):
        self._ops, self._sync = ops, sync
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.log: list[tuple] = []
        self.wrapped_calls, self.runner_glue, self.runner_accounting = 0, 0.0, 0.0
        self._keys = {id(w): k for k, w in model.w.items()}
        self._keys.update({id(w): f"layers.{i}.router" for i, w in model.routers.items()})
        self._keys.update({id(w): f"layers.{i}.shared_gate" for i, w in getattr(model, "shared_gates", {}).items()})
        self._wrapped = {}

    def reset(self) -> None:
        self.seconds, self.calls, self.log = defaultdict(float), defaultdict(int), []
        self.wrapped_calls = 0  # calls through the Python wrappers (the timer overhead counts these)
        self.runner_glue = 0.0  # graph_mode=cpp: time inside the C++ runner outside its kernel calls
        self.runner_accounting = 0.0  # graph_mode=cpp: reading the runner's timings back (timer overhead)

    def add_runner_step(self, runner, lm_head: bool) -> None:
        """graph_mode=cpp: one decode step of the C++ runner (engine/cpp_runner.py), its kernel calls
        timed inside it; each goes to its part, and the weights they read to the log."""
        inside = 0.0
        for part, (seconds, calls) in runner.runner.parts().items():
            self.seconds[part] += seconds
            self.calls[part] += calls
            inside += seconds
        self.runner_glue += runner.runner.total_seconds - inside
        if getattr(self, "_runner_log", (None,))[0] is not runner:  # the calls every step makes, once
            fixed, moe = [], []
            for i, by_slot in enumerate(runner.layer_weights):
                for slot, w in by_slot.items():
                    if slot == "ffn1" and ".experts." in self._keys.get(id(w), ""):
                        moe.append((i, w, by_slot["w2"]))
                    elif slot != "w2":
                        fixed.append(("linear", _linear_part(self._keys.get(id(w), "")), (None, w)))
                if hasattr(runner.model, "w_uk"):  # MLA's absorbed per-head products
                    fixed += [("head_linear", "head_linear", (None, t)) for t in (runner.model.w_uk[i], runner.model.w_uv[i])]
            self._runner_log = (runner, fixed, moe)
        _, fixed, moe = self._runner_log
        self.log += fixed
        used = runner.runner.experts_used
        self.log += [("fused_moe_used", "fused_moe", (w13, w2, used[i])) for i, w13, w2 in moe]
        if lm_head:
            self.log.append(("linear", "lm_head", (None, runner.lm_head)))
        self.log.append(("kv_bytes", "attention", (runner.runner.kv_bytes * len(runner.layer_weights),)))  # per layer

    def __getattr__(self, name: str):
        fn = getattr(self._ops, name)
        if not callable(fn) or name.startswith("_") or name in ("prepare_weights", "configure"):
            return fn
        if name not in self._wrapped:
            self._wrapped[name] = self._wrap(name, fn)
        return self._wrapped[name]

    def _wrap(self, name: str, fn):
        sync, perf = self._sync, time.perf_counter

        def timed(*args, **kw):
            if sync:
                sync()
            t0 = perf()
            out = fn(*args, **kw)
            if sync:
                sync()
            dt = perf() - t0
            part = _linear_part(self._keys.get(id(args[1]), "")) if name == "linear" else OP_PART.get(name, name)
            self.seconds[part] += dt
            self.calls[part] += 1
            self.wrapped_calls += 1
            self.log.append(self._entry(name, part, args))
            return out
        return timed

    @staticmethod
    def _entry(name: str, part: str, args: tuple) -> tuple:
        """What step_bytes needs of a call, without its activations: holding a step's inputs until the
        step ends would keep the allocator from reusing their memory, and every later op of the step
        would then write fresh pages (a prefill of 512 tokens read the router 5x slower so)."""
        if name in ("linear", "head_linear"):
            return name, part, (None, args[1])
        if name == "fused_moe":
            return "fused_moe_used", part, (args[1], args[2], int(torch.unique(args[4]).numel()))
        if name == "mla_decode":
            cache, lens = args[2], args[4]
            return "kv_bytes", part, (int(lens.sum()) * cache.shape[-1] * cache.element_size(),)
        if name == "paged_decode":  # GQA: per key one K and one V row per KV head
            k_cache, v_cache, lens = args[1], args[2], args[4]
            row = k_cache[0, 0].numel() * k_cache.element_size() + v_cache[0, 0].numel() * v_cache.element_size()
            return "kv_bytes", part, (int(lens.sum()) * row,)
        return name, part, ()

    def step_bytes(self) -> tuple[dict[str, int], int]:
        """(weight bytes by group, KV-cache bytes) that the logged calls read; clears the log."""
        groups, kv = dict.fromkeys(BYTE_GROUPS, 0), 0
        for name, part, args in self.log:
            if name in ("linear", "head_linear"):
                groups[_byte_group(part)] += _nbytes(args[1])
            elif name == "fused_moe_used":
                w13, w2, used = args
                groups["routed_experts"] += (_nbytes(w13) + _nbytes(w2)) * used // w13.shape[0]
            elif name == "kv_bytes":
                kv += args[0]
        self.log = []
        return groups, kv


def calibrate_overhead(n: int = 2000) -> float:
    """Seconds one wrapped call adds over a direct call (the wrapper's own cost)."""
    class Noop:
        @staticmethod
        def rms_norm(*a):
            return None

    class Model:
        w, routers = {}, {}

    t = OpTimer(Noop, Model)
    wrapped, direct = t.rms_norm, Noop.rms_norm
    rounds = []
    for _ in range(7):
        t0 = time.perf_counter()
        for _ in range(n):
            wrapped(0)
        t1 = time.perf_counter()
        for _ in range(n):
            direct(0)
        t2 = time.perf_counter()
        t.reset()
        rounds.append(((t1 - t0) - (t2 - t1)) / n)
    return max(statistics.median(rounds), 0.0)


@contextmanager
def timed_model(llm):
    """Install an OpTimer on the model and a timer around LLM._step; restore both afterwards."""
    model = llm.model
    sync = torch.cuda.synchronize if getattr(llm, "device", torch.device("cpu")).type == "cuda" else None
    timer = OpTimer(model.ops, model, sync)
    timer.forward_s, timer.tokens = 0.0, 0
    real_step = llm._step

    def step(reqs, new_tokens):
        t0 = time.perf_counter()
        try:
            return real_step(reqs, new_tokens)
        finally:
            timer.forward_s += time.perf_counter() - t0
            timer.tokens += sum(len(t) for t in new_tokens)

    model.ops, llm._step = timer, step
    runner = getattr(model, "runner", None)  # graph_mode=cpp: decode steps run in the C++ runner
    if runner is not None:
        def timed_call(real, lm_head: bool):
            def call(*args):
                out = real(*args)
                t0 = time.perf_counter()
                timer.add_runner_step(runner, lm_head)
                timer.runner_accounting += time.perf_counter() - t0  # the timer's own cost, not the model's
                return out
            return call

        runner.runner.timing = True
        runner.forward, runner.step_logits = timed_call(runner.forward, False), timed_call(runner.step_logits, True)
    try:
        yield timer
    finally:
        model.ops = timer._ops
        del llm._step  # the instance attribute: back to the class's method
        if runner is not None:
            runner.runner.timing = False
            del runner.forward, runner.step_logits


def _sample(timer: OpTimer, wall: float, steps: int, overhead: float, embed_row: int) -> dict:
    """One repeat's figures per step: parts (adding up to total), bytes."""
    calls = timer.wrapped_calls
    parts = {p: timer.seconds.get(p, 0.0) / steps for p in PARTS}
    parts["timer_overhead"] = (calls * overhead + timer.runner_accounting) / steps
    parts["rest.runner"] = timer.runner_glue / steps
    parts["rest.model"] = (timer.forward_s - sum(timer.seconds.values()) - calls * overhead - timer.runner_glue
                           - timer.runner_accounting) / steps
    parts["rest.scheduler"] = (wall - timer.forward_s) / steps
    parts["total"] = wall / steps
    groups, kv = timer.step_bytes()
    groups["embed"] += timer.tokens * embed_row
    return {"parts": parts, "calls": {p: timer.calls.get(p, 0) / steps for p in PARTS},
            "bytes": {g: b / steps for g, b in groups.items()}, "kv_bytes": kv / steps,
            "tokens": timer.tokens / steps}


def measure(llm, prompt_len: int = 128, decode: int = 16, batch: int = 1, repeats: int = 5,
            seed: int = 0, progress: bool = True, paired_read: bool = False) -> dict:
    """Prefill and decode breakdowns: per phase, per-repeat samples of every part and bytes.
    `paired_read`: after each repeat's decode steps, the fastest of the paired read's methods over one decode
    step's weight bytes (suites.kernels.PairedRead), so the step's bandwidth has a limit measured beside it."""
    from tqdm import tqdm

    from engine.llm import RequestOutput, SamplingParams
    from engine.scheduler import Request, Scheduler

    if min(prompt_len, decode, batch, repeats) < 1:
        from engine.errors import MoetuneError
        raise MoetuneError("--prompt-len, --decode, --batch and --repeats must be ≥ 1")
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(2, llm.config.vocab_size, (prompt_len,), generator=g).tolist() for _ in range(batch)]
    llm._check_prompt(prompts[0], decode + 1)
    overhead = calibrate_overhead()
    embed = llm.model.w["embed"]
    embed_row = embed.shape[-1] * embed.element_size()
    samples = {"prefill": [], "decode": []}
    reader = None
    with timed_model(llm) as timer:
        for rep in tqdm(range(repeats + 1), desc="breakdown repeats", leave=False, disable=not progress):
            sched = Scheduler(llm)
            reqs = [Request(RequestOutput(list(p)), SamplingParams(max_tokens=decode + 1, ignore_eos=True))
                    for p in prompts]
            for r in reqs:
                sched.add(r)
            try:
                timer.reset()
                timer.forward_s, timer.tokens, steps = 0.0, 0, 0
                t0 = time.perf_counter()
                while not all(r.out.token_ids for r in reqs):
                    sched.step()
                    steps += 1
                wall = time.perf_counter() - t0
                pre = _sample(timer, wall, 1, overhead, embed_row)  # the whole prefill, not per step
                pre["steps"] = steps
                timer.reset()
                timer.forward_s, timer.tokens = 0.0, 0
                t0 = time.perf_counter()
                for _ in range(decode):
                    sched.step()
                wall = time.perf_counter() - t0
                dec = _sample(timer, wall, decode, overhead, embed_row)
                dec["steps"] = decode
            finally:
                sched.cancel_all()
            if paired_read:
                if reader is None:
                    from suites.kernels import PairedRead

                    reader = PairedRead(sum(dec["bytes"].values()))
                dec["paired_read_gb_s"] = reader.nbytes / reader(rep) / 1e9
            if rep:  # the first is the warm-up
                samples["prefill"].append(pre)
                samples["decode"].append(dec)
    return summarize(llm, samples, prompt_len, decode, batch, overhead)


def _stats(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "samples": list(xs)}


def summarize(llm, samples: dict, prompt_len: int, decode: int, batch: int, overhead: float) -> dict:
    c = llm.config
    phases = {}
    for phase, runs in samples.items():
        # tokens fed per decode step (batch, unless decode_batch_cap is lower) or in the whole prefill
        tokens = statistics.median([r["tokens"] for r in runs])
        names = PARTS + REST + ("total",)
        parts = {p: _stats([r["parts"][p] for r in runs]) for p in names}
        total = parts["total"]["median"]
        for p in names:
            parts[p]["share"] = parts[p]["median"] / total if total else 0.0
            parts[p]["calls"] = statistics.median([r["calls"].get(p, 0) for r in runs]) if p in PARTS else 0
        weight = [sum(r["bytes"].values()) / r["tokens"] for r in runs]
        rest = [r["parts"]["rest.model"] + r["parts"]["rest.runner"] + r["parts"]["rest.scheduler"] for r in runs]
        gbs = [sum(r["bytes"].values()) / r["parts"]["total"] / 1e9 for r in runs]
        phases[phase] = {
            "tokens": tokens, "steps": statistics.median([r["steps"] for r in runs]), "parts": parts,
            "weight_bytes_per_token": _stats(weight),
            "bytes_by_group": {g: statistics.median([r["bytes"][g] / r["tokens"] for r in runs]) for g in BYTE_GROUPS},
            "kv_bytes_per_token": _stats([r["kv_bytes"] / r["tokens"] for r in runs]),
            "weight_gb_s": _stats(gbs),
            "rest": _stats(rest),
            "fixed_cost_per_layer": _stats([x / c.num_hidden_layers for x in rest]),
            "runner_glue_per_layer": _stats([r["parts"]["rest.runner"] / c.num_hidden_layers for r in runs]),
        }
        if all("paired_read_gb_s" in r for r in runs):  # the step's GB/s over the read timed after it
            phases[phase]["paired_read_gb_s"] = _stats([r["paired_read_gb_s"] for r in runs])
            phases[phase]["paired_read_fraction"] = _stats([g / r["paired_read_gb_s"] for g, r in zip(gbs, runs)])
    return {"prompt_len": prompt_len, "decode_steps": decode, "batch": batch, "repeats": len(samples["decode"]),
            "layers": c.num_hidden_layers, "timer_overhead_per_call_s": overhead,
            "backend": llm.knobs["kernel_backend"], "dtype": str(llm.dtype).replace("torch.", ""),
            "graph_mode": "cpp" if getattr(llm.model, "runner", None) is not None else "eager",
            "threads": {"prefill": llm.knobs["threads_prefill"], "decode": llm.knobs["threads_decode"]},
            "phases": phases}


def add_bandwidth(result: dict, read_gbps: float | None) -> dict:
    """The fraction of the probe's read bandwidth each phase's whole step reaches (None: unknown)."""
    result["read_gbps"] = read_gbps
    for ph in result["phases"].values():
        ph["read_bw_fraction"] = (None if read_gbps is None else
                                  {k: v / read_gbps for k, v in ph["weight_gb_s"].items() if k != "samples"}
                                  | {"samples": [x / read_gbps for x in ph["weight_gb_s"]["samples"]]})
    return result


# ---------------------------------------------------------------- output


def rows(result: dict, model: str, fmt: str, knobs: dict, machine: dict) -> list[dict]:
    """The result as result-store rows (see the module docstring)."""
    out = []
    base = {"prompt_len": result["prompt_len"], "batch": result["batch"], "decode_steps": result["decode_steps"]}
    for phase, ph in result["phases"].items():
        work = {"phase": phase, **base}
        for part, st in ph["parts"].items():
            out.append({"metric": "part_seconds", "unit": "s", "direction": "minimize",
                        "workload": {**work, "part": part}, "samples": st["samples"],
                        "extra": {"share": st["share"], "calls_per_step": st["calls"]}})
        extra = {"bytes_by_group": ph["bytes_by_group"], "read_gbps": result["read_gbps"],
                 "cpu_model": machine.get("cpu_model"), "layers": result["layers"],
                 "tokens_per_step": ph["tokens"], "steps": ph["steps"]}
        figures = [("weight_bytes_per_token", "B", "minimize", ph["weight_bytes_per_token"]),
                   ("kv_bytes_per_token", "B", "minimize", ph["kv_bytes_per_token"]),
                   ("weight_gb_s", "GB/s", "maximize", ph["weight_gb_s"]),
                   ("fixed_cost_per_layer", "s", "minimize", ph["fixed_cost_per_layer"])]
        if ph["read_bw_fraction"] is not None:
            figures.append(("read_bw_fraction", "fraction", "maximize", ph["read_bw_fraction"]))
        if "paired_read_fraction" in ph:
            figures += [("paired_read_gb_s", "GB/s", "maximize", ph["paired_read_gb_s"]),
                        ("paired_read_fraction", "fraction", "maximize", ph["paired_read_fraction"])]
        for metric, unit, direction, st in figures:
            out.append({"metric": metric, "unit": unit, "direction": direction, "workload": work,
                        "samples": st["samples"], "extra": extra})
    for r in out:
        r.update({"model": model, "format": fmt, "knobs": knobs})
        r["extra"] = {**r["extra"], "profile": result.get("profile")}
    return out


def table(result: dict, title: str) -> str:
    lines = [title]
    for phase, ph in result["phases"].items():
        what = (f"decode step ({result['batch']} sequence{'s' if result['batch'] > 1 else ''})" if phase == "decode"
                else f"prefill of {result['batch']} × {result['prompt_len']} tokens ({ph['steps']:g} step(s))")
        lines.append(f"\n{what}, median [min–max] over {result['repeats']} repeats")
        lines.append(f"  {'part':16s} {'ms':>9s}  {'spread':>19s} {'share':>7s} {'calls':>6s}")
        for part, st in ph["parts"].items():
            if part != "total" and st["calls"] == 0 and part in PARTS:
                continue
            if part == "total":
                lines.append("  " + "-" * 62)
            lines.append(f"  {part:16s} {st['median'] * 1e3:9.3f}  [{st['min'] * 1e3:8.3f}–{st['max'] * 1e3:8.3f}]"
                         f" {st['share'] * 100:6.1f}% {format(st['calls'], 'g') if part in PARTS else '':>6}")
        wb = ph["weight_bytes_per_token"]["median"]
        groups = ", ".join(f"{g.replace('_', ' ')} {b / 1e6:.2f}" for g, b in ph["bytes_by_group"].items() if b)
        lines.append(f"  weight bytes read per token: {wb / 1e6:.3f} MB ({groups}); "
                     f"KV cache {ph['kv_bytes_per_token']['median'] / 1e6:.3f} MB")
        gbs = ph["weight_gb_s"]
        frac = ph["read_bw_fraction"]
        of_probe = (" (no read bandwidth from the probe)" if frac is None else
                    f" = {frac['median'] * 100:.1f} % of the probe's read bandwidth ({result['read_gbps']:.1f} GB/s)")
        lines.append(f"  the whole step reads weights at {gbs['median']:.2f} GB/s "
                     f"[{gbs['min']:.2f}–{gbs['max']:.2f}]{of_probe}")
        if "paired_read_fraction" in ph:
            pf, pg = ph["paired_read_fraction"], ph["paired_read_gb_s"]
            lines.append(f"    = {pf['median'] * 100:.1f} % [{pf['min'] * 100:.1f}–{pf['max'] * 100:.1f}] of a paired read "
                         f"of the same bytes after each repeat ({pg['median']:.1f} GB/s [{pg['min']:.1f}–{pg['max']:.1f}]: "
                         "the memory as fast as it ran then)")
        fc = ph["fixed_cost_per_layer"]
        lines.append(f"  the rest (outside the ops) ÷ {result['layers']} layers: {fc['median'] * 1e6:.1f} µs "
                     f"per layer [{fc['min'] * 1e6:.1f}–{fc['max'] * 1e6:.1f}]")
        if result.get("graph_mode") == "cpp" and phase == "decode":
            g = ph["runner_glue_per_layer"]
            lines.append(f"    of which inside the C++ runner, between its kernel calls: {g['median'] * 1e6:.1f} µs "
                         f"per layer [{g['min'] * 1e6:.1f}–{g['max'] * 1e6:.1f}] (the rest is per step: Python, "
                         "the scheduler)")
    lines.append(f"\n(timer overhead ≈ {result['timer_overhead_per_call_s'] * 1e6:.2f} µs per op call, "
                 "shown as its own part and not in the rest)")
    if result.get("graph_mode") == "cpp":
        lines.append("(graph_mode=cpp: decode steps ran every layer in one call of the C++ runner; its kernel "
                     "calls were timed inside it into their parts, its own glue between them is rest.runner)")
    return "\n".join(lines)


def run(llm, model: str, prompt_len: int, decode: int, batch: int, repeats: int, probe: bool = True,
        store: bool = True, as_json: bool = False, out=None) -> dict:
    """Measure, add the bandwidth fraction, print, store; returns the result."""
    out = out or sys.stdout
    from engine.fingerprint import fingerprint

    read_gbps = None
    if probe:
        from tuner.probe import probe as run_probe

        try:
            read_gbps = run_probe()["read_gbps"]
        except ImportError as e:  # the probe needs the cpu kernels
            print(f"no read-bandwidth fraction: {e}", file=sys.stderr)
    result = measure(llm, prompt_len, decode, batch, repeats, progress=not as_json, paired_read=read_gbps is not None)
    add_bandwidth(result, read_gbps)
    machine = fingerprint()
    result["machine"] = {"cpu_model": machine.get("cpu_model"), "hash": machine.get("hash"),
                         "hardware_key": machine.get("hardware_key")}
    from engine.llm import _format_name

    fmt = _format_name(llm.config, result["dtype"])
    prof = getattr(llm, "profile", None)
    result["profile"] = str(prof.path) if prof is not None else None  # None: the defaults
    if store:
        from results.store import append_rows

        path = append_rows(rows(result, model, fmt, dict(llm.knobs), machine), suite="breakdown")
        result["stored"] = str(path)
    if as_json:
        print(json.dumps(result), file=out)
    else:
        th = result["threads"]
        print(table(result, f"breakdown: model {model} ({fmt}, backend {result['backend']}, threads prefill "
                            f"{th['prefill']} / decode {th['decode']}) on {machine.get('cpu_model')} "
                            f"[{machine.get('hash')}], {'profile ' + result['profile'] if result['profile'] else 'defaults'}"),
              file=out)
    return result


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--batch", type=int, default=1, help="sequences prefilled and decoded together")
    ap.add_argument("--no-probe", action="store_true",
                    help="no read-bandwidth fraction (skips tuner.probe, which measures once per machine)")
    ap.add_argument("--no-store", action="store_true", help="do not append the rows to the result store")


def main(argv=None) -> int:
    from engine.errors import MoetuneError
    from engine.llm import LLM

    ap = argparse.ArgumentParser(prog="python -m suites.breakdown", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--decode", type=int, default=16, help="decode steps timed per repeat")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--backend", default="auto", help="kernel back end: auto, cpu, reference (knob kernel_backend)")
    ap.add_argument("--json", action="store_true", help="one JSON object on stdout")
    ap.add_argument("--knob", action="append", metavar="NAME=VALUE", help="override a knob (repeatable)")
    ap.add_argument("--profile", default=None, metavar="auto|PATH",
                    help="a tuned profile (knobs and kernel tables): auto, this machine's for the model; default none")
    add_arguments(ap)
    args = ap.parse_args(argv)
    try:
        return run_args(args, LLM)
    except MoetuneError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def knob_overrides(args) -> dict:
    """--backend and every --knob NAME=VALUE as LLM knobs."""
    from engine.errors import MoetuneError

    knobs = {"kernel_backend": args.backend}
    for kv in args.knob or []:
        if "=" not in kv:
            raise MoetuneError(f"--knob {kv!r}: expected NAME=VALUE")
        name, value = kv.split("=", 1)
        knobs[name] = value
    return knobs


def run_args(args, LLM) -> int:
    from engine.errors import MoetuneError

    if min(args.prompt_len, args.decode, args.batch, args.repeats) < 1:
        raise MoetuneError("--prompt-len, --decode, --batch and --repeats must be ≥ 1")
    llm = LLM(args.model, dtype=args.dtype, profile=getattr(args, "profile", None), knobs=knob_overrides(args),
              progress=not args.json)
    run(llm, args.model, args.prompt_len, args.decode, args.batch, args.repeats, probe=not args.no_probe,
        store=not args.no_store, as_json=args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
