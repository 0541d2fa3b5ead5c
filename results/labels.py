"""Rows named as people say them, for every table, figure and printed line.

    workload_label({"kind": "batch", "batch": 4, "prompt": 128, "decode": 16})  →  "batch 4 × 128/16"
    workload_label({"kind": "ttft", "prompt": 512, "decode": 2})                →  "prompt 512"
    workload_label({"prompt_len": 128, "decode": 32, "dtype": "bfloat16"})      →  "io 128/32"
    workload_label({"op": "fused_moe", "format": "int8", "tokens": 16})         →  "fused_moe int8, 16 tokens"
    metric_axis("tpot_s", "s")  →  ("time per output token", "ms", 1000.0)

A workload is what a suite or the tuner stores in the result store's `workload` column (a dict,
or its JSON text); P/D is prompt tokens / output tokens.
"""
from __future__ import annotations

import json
import math

_METRIC_NAMES = {
    "ttft_s": "time to first token", "tpot_s": "time per output token", "moe_s": "MoE layer",
    "time_s": "kernel time", "kernel_seconds": "kernel time", "latency_s": "request latency",
    "itl_s": "inter-token latency", "prefill_tok_s": "prefill", "decode_tok_s": "decode",
    "throughput_tok_s": "throughput", "output_tok_s": "output throughput",
    "kl_mean": "KL divergence, mean", "kl_median": "KL divergence, median", "kl_p99": "KL divergence, p99",
    "kl_max": "KL divergence, max", "top1_agreement": "top-1 agreement", "ppl": "perplexity",
}
_RATE_UNITS = ("tok/s", "tokens/s")


def metric_axis(metric: str, unit: str | None) -> tuple[str, str, float]:
    """(name, unit shown, scale): seconds are shown in milliseconds, token rates as tokens/s."""
    name = _METRIC_NAMES.get(metric, metric)
    if unit == "s":
        return name, "ms", 1e3
    if unit in _RATE_UNITS:
        return name, "tokens/s", 1.0
    return name, unit or "", 1.0


def metric_title(metric: str, unit: str | None) -> str:
    """'time per output token (ms)'."""
    name, shown, _ = metric_axis(metric, unit)
    return f"{name} ({shown})" if shown else name


def number(x: float) -> str:
    """A measured value for a table: 4 significant digits, never an exponent above 1000."""
    if x != x:
        return "—"
    return f"{x:.0f}" if abs(x) >= 1000 else f"{x:.4g}"


def _tokens(n) -> str:
    return f"{n} token" if n == 1 else f"{n} tokens"


def _value(v) -> str:
    if isinstance(v, (list, tuple)):
        return ", ".join(_value(x) for x in v)
    if isinstance(v, dict):
        return workload_label(v)
    return str(v)


def _kernel(w: dict) -> str:
    head = " ".join(str(w[k]) for k in ("op", "variant", "format", "shape") if w.get(k))
    parts = [f"batch {w['batch']}"] if "batch" in w else []
    parts += [_tokens(w["tokens"])] if "tokens" in w else []
    parts += [f"context {w['context']}"] if "context" in w else []
    rest = {k: v for k, v in w.items() if k not in ("op", "variant", "format", "shape", "batch", "tokens", "context")}
    parts += [f"{k} {_value(v)}" for k, v in rest.items()]
    return ", ".join([head, *parts]) if parts else head


def workload_label(workload) -> str:
    """One workload (dict, JSON text, list of them, or nothing) as a short phrase; never a raw dict."""
    w = workload
    if w is None or (isinstance(w, float) and math.isnan(w)):
        return ""
    if isinstance(w, str):
        try:
            w = json.loads(w)
        except ValueError:
            return w
    if isinstance(w, (list, tuple)):
        return " + ".join(workload_label(x) for x in w)
    if not isinstance(w, dict):
        return str(w)
    kind = w.get("kind")
    if kind == "io":
        return f"io {w['prompt']}/{w['decode']}"
    if kind == "ttft":
        return f"prompt {w['prompt']}"
    if kind == "batch":
        return f"batch {w['batch']} × {w['prompt']}/{w['decode']}"
    if kind == "moe":
        return f"MoE layer, {_tokens(w['tokens'])}"
    if "op" in w:  # the kernel suite, the kernel tier, the GPU check
        return _kernel(w)
    if "prompt_len" in w:  # a system-tier objective
        b, p, d = w.get("batch", 1), w["prompt_len"], w.get("decode", "?")
        text = f"batch {b} × {p}/{d}" if b != 1 else f"io {p}/{d}"
        if w.get("latency_limit_s") is not None:
            text += f", ≤ {w['latency_limit_s']:g} s/token"
        return text
    if "text" in w and "ctx" in w:  # the quality suite
        return f"{w['text']}, {w['windows']} × {w['ctx']} tokens"
    if "input_len" in w:  # the serving suite
        text = f"serving {w['input_len']}/{w.get('output_len', '?')}"
        if "num_prompts" in w:
            text += f", {w['num_prompts']} prompts"
        if "concurrency" in w:
            text += f", concurrency {w['concurrency']}"
        rate = w.get("request_rate")
        return text + (f", {rate:g} requests/s" if isinstance(rate, (int, float)) and rate else "")
    return "; ".join(f"{k} {_value(v)}" for k, v in w.items() if k != "dtype")
