"""Quality suite: how far each quantized format (and any knob that changes numerics) moves the model
from BF16, measured as llama.cpp's `llama-perplexity --kl-divergence` mode does.

    python -m suites.quality --model tiny|small|DIR [--format int8 --format fp8 ...] [--ctx 512]
                             [--chunks N] [--knob NAME=VALUE[,NAME=VALUE] ...] [--dtype bfloat16]
                             [--backend auto] [--device cpu] [--no-store] [--json]
    moetune quality ...      (the same)

What runs: the checkpoint itself in BF16 (the reference), then every --format (default: every
format `moetune quantize` writes: fp8, int8, int4) as the checkpoint `moetune quantize` makes of it
(cached under <cache>/quantized), all with the same activation dtype (--dtype). `bf16` as a
format is the reference loaded a second time: a self-check that must give KL 0.

The text: engine/weights/corpus.txt (the text the project ships; the presets' tokenizer is trained
on it), tokenized with the model's own tokenizer, cut into consecutive windows of --ctx tokens
(--chunks: the first N windows; default all that fit). As in llama-perplexity, each window starts
with the BOS token (when the model has one, it replaces the window's first token), is one
teacher-forced prefill (`LLM.logits`), and only its second half is scored: the logits at positions
ctx/2 … ctx-2 against the next tokens, so every scored token has at least ctx/2 tokens of context.

Per scored token, with P the reference's softmax and Q the variant's (the engine's float32 logits,
log-softmax and sums in float64):
    KL(P‖Q) = Σ_v P_v (log P_v − log Q_v)   (nats)  → mean, median, p99, max over the tokens
    top-1 agreement: argmax Q = argmax P            → the fraction of tokens
    NLL = −log Q(next token)                        → perplexity exp(mean NLL), of every variant
                                                       and of the reference

Knobs (--knob, repeatable; each NAME=VALUE[,NAME=VALUE] is one variant): every measured format,
and BF16, is run again with the knob(s) set and compared with the same weights at the defaults
(the reference of such a row is that format with default knobs, not BF16). Knobs that change the
numbers (their help in engine/knobs.py, kernels/cpu_knobs.py): cpu_int4_method (INT4: activations
quantized to int8 per group, to int16, or none), cpu_bf16_gemm and cpu_bf16_isa (BF16 weights:
oneDNN / vdpbf16ps round activations or outputs to bf16; avx512bf16 needs AVX512-BF16), cpu_fp8_gemm
(FP8 prefill: onednn / avx512bf16 round value × scale to bf16; on `tiny` on AMD Zen 4, 4 × 128 tokens,
the default avx512bf16 against unpack: KL mean 2.5e-7, against onednn 6.5e-8, FP8 itself vs BF16 5.9e-6),
cpu_gemm_min_tokens (which rows take the microkernel or the BLAS path: another summation order),
mla_absorb (the absorbed or the naive MLA form), batch_invariant (one row at a time and the
absorbed form). graph_mode changes decode steps only, never a teacher-forced prefill; the tile and
thread knobs change the order of float sums at most. Measured on `tiny` here (4 × 128 tokens, BF16
weights; INT4 in brackets), KL mean against the defaults: graph_mode=eager 0 [0]; cpu_int4_method=int16
0 [6e-8]; cpu_bf16_gemm=onednn 6e-8 [≈0]; cpu_gemm_min_tokens=4096 2e-9 [1e-6]; mla_absorb=always and
batch_invariant=true 2e-7 [1e-6]; INT4 itself against BF16: 6e-5. On a GPU (--device cuda) FP8 weights always
multiply FP8-quantized activations (DeepSeek-V3's math), which an fp8 row on the GPU includes.

Rows (results.store, suite "quality", one run_id per invocation, the machine's fingerprint hash and
hardware key in every row as append_rows fills them): model, format, knobs (the variant's
overrides), workload {text, ctx, windows, scored_tokens, dtype}, metric kl_mean / kl_median /
kl_p99 / kl_max (nats, minimize), top1_agreement (fraction, maximize), ppl (minimize; the
reference's own row has extra.role "reference"), extra {label, reference, role, ppl_reference,
kl_mean_stderr, backend, device, cpu_model}. Memory: the reference's float32 logits are kept,
scored tokens × vocabulary × 4 bytes (a knob variant also keeps its format's).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np
import torch

from engine.errors import MoetuneError
from engine.weights.quantize import FORMATS as QUANTIZED  # what `moetune quantize` writes

CORPUS = Path(__file__).resolve().parent.parent / "engine" / "weights" / "corpus.txt"
FORMATS = ("bf16",) + QUANTIZED
METRICS = (("kl_mean", "nats", "minimize"), ("kl_median", "nats", "minimize"), ("kl_p99", "nats", "minimize"),
           ("kl_max", "nats", "minimize"), ("top1_agreement", "fraction", "maximize"), ("ppl", "", "minimize"))


# ---------------------------------------------------------------- the text and its windows


def windows(tokens: list[int], ctx: int, chunks: int | None, bos: int | None) -> list[list[int]]:
    """Consecutive windows of `ctx` tokens (the first `chunks`), each starting with `bos` if any."""
    n = len(tokens) // ctx
    if n == 0:
        raise MoetuneError(f"the text has {len(tokens)} tokens, fewer than one window of --ctx {ctx}")
    out = [list(tokens[i * ctx:(i + 1) * ctx]) for i in range(min(n, chunks) if chunks else n)]
    if bos is not None:
        for w in out:
            w[0] = bos
    return out


def scored(ctx: int) -> slice:
    """The logits rows scored in a window: ctx/2 … ctx-2 (each predicts the token after it)."""
    return slice(ctx // 2, ctx - 1)


def corpus_tokens(tokenizer) -> list[int]:
    if tokenizer is None:
        raise MoetuneError("the model has no tokenizer.json: the quality suite tokenizes the shipped text with it")
    return tokenizer.encode(CORPUS.read_text(), add_bos=False)


# ---------------------------------------------------------------- the measures


def window_logits(llm, window: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(the scored rows' float32 logits [S, vocab], the next tokens [S])."""
    rows = scored(len(window))
    return llm.logits(window)[rows].float().cpu(), torch.tensor(window[rows.start + 1:rows.stop + 1])


def compare(ref: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor) -> dict[str, np.ndarray]:
    """Per token: KL(ref‖logits), whether the argmaxes agree, the NLL of each. The float32 logits'
    log-softmax is taken in float64, so a KL is never below zero by more than float64 rounding."""
    r, q = torch.log_softmax(ref.double(), -1), torch.log_softmax(logits.double(), -1)
    kl = (r.exp() * (r - q)).sum(-1)
    idx = targets.unsqueeze(-1)
    return {"kl": kl.numpy(), "agree": (ref.argmax(-1) == logits.argmax(-1)).numpy(),
            "nll": -q.gather(-1, idx).squeeze(-1).numpy(), "nll_ref": -r.gather(-1, idx).squeeze(-1).numpy()}


def summarize(parts: list[dict[str, np.ndarray]]) -> dict[str, float]:
    kl = np.concatenate([p["kl"] for p in parts])
    nll = np.concatenate([p["nll"] for p in parts])
    nll_ref = np.concatenate([p["nll_ref"] for p in parts])
    return {"kl_mean": float(kl.mean()), "kl_median": float(np.median(kl)),
            "kl_p99": float(np.percentile(kl, 99)), "kl_max": float(kl.max()),
            "kl_mean_stderr": float(kl.std(ddof=1) / math.sqrt(kl.size)) if kl.size > 1 else float("nan"),
            "top1_agreement": float(np.concatenate([p["agree"] for p in parts]).mean()),
            "ppl": float(math.exp(nll.mean())), "ppl_reference": float(math.exp(nll_ref.mean())),
            "tokens": int(kl.size)}


# ---------------------------------------------------------------- the run


def parse_formats(values: list[str] | None) -> list[str]:
    out = []
    for v in values or QUANTIZED:
        for f in v.split(","):
            f = f.strip()
            if f not in FORMATS:
                raise MoetuneError(f"unknown format {f!r} (choose {', '.join(FORMATS)})")
            if f not in out:
                out.append(f)
    return out


def parse_knob_variants(values: list[str] | None) -> list[dict[str, str]]:
    """Each NAME=VALUE[,NAME=VALUE] is one variant (names checked against the catalogue)."""
    from engine.knobs import CATALOGUE

    out = []
    for v in values or []:
        variant = {}
        for kv in v.split(","):
            name, eq, value = kv.partition("=")
            if not eq or not name.strip():
                raise MoetuneError(f"--knob {v!r}: expected NAME=VALUE[,NAME=VALUE]")
            if name.strip() not in CATALOGUE:
                raise MoetuneError(f"unknown knob {name.strip()!r} in --knob {v!r}")
            variant[name.strip()] = value.strip()
        out.append(variant)
    return out


def _label(fmt: str, knobs: dict) -> str:
    return fmt + "".join(f" {k}={v}" for k, v in knobs.items())


class Run:
    """Loads each variant in turn and scores it against its reference, window by window."""

    def __init__(self, model: str, ctx: int, chunks: int | None, dtype: str, knobs: dict, device: str,
                 progress: bool):
        from engine.config import ModelConfig
        from engine.tokenizer import Tokenizer
        from engine.weights.presets import resolve_model

        if ctx < 4 or ctx % 2:
            raise MoetuneError(f"--ctx must be an even number ≥ 4, got {ctx}")
        if chunks is not None and chunks < 1:
            raise MoetuneError(f"--chunks must be ≥ 1, got {chunks}")
        self.src = resolve_model(model, progress)
        cfg = ModelConfig.from_file(self.src)
        if cfg.quant is not None:
            raise MoetuneError(f"{model} is already quantized ({cfg.quant.method}): the quality suite needs the "
                               "high-precision checkpoint, which it quantizes and uses as the BF16 reference")
        if ctx > cfg.max_position_embeddings:
            raise MoetuneError(f"--ctx {ctx} exceeds the model's context of {cfg.max_position_embeddings} tokens")
        tok = Tokenizer.from_dir(self.src) if (self.src / "tokenizer.json").exists() else None
        bos = cfg.bos_token_id if tok is None or tok.bos_token_id is None else tok.bos_token_id
        self.windows = windows(corpus_tokens(tok), ctx, chunks, bos)
        self.model, self.ctx, self.dtype, self.knobs, self.device = model, ctx, dtype, knobs, device
        self.progress = progress
        self.bar = None

    def path(self, fmt: str) -> Path:
        from engine.weights.quantize import cached_quantization

        return self.src if fmt == "bf16" else cached_quantization(self.src, fmt, self.progress)

    def load(self, fmt: str, knobs: dict):
        from engine.llm import LLM

        return LLM(str(self.path(fmt)), dtype=self.dtype, knobs={**self.knobs, **knobs}, device=self.device,
                   progress=False)

    def logits(self, llm, label: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
        out = []
        for w in self.windows:
            self.bar.set_postfix_str(label)
            out.append(window_logits(llm, w))
            self.bar.update(1)
        return out

    def score(self, llm, label: str, ref: list) -> tuple[dict, list]:
        got = self.logits(llm, label)
        return summarize([compare(r, q, t) for (r, _), (q, t) in zip(ref, got)]), got


def evaluate(model: str, formats: list[str], knob_variants: list[dict], ctx: int = 512,
             chunks: int | None = None, dtype: str = "bfloat16", knobs: dict | None = None,
             device: str = "cpu", progress: bool = True) -> dict:
    """Every variant against its reference; returns {model, workload, backend, results: [...]}, each
    result {label, format, knobs, reference, role, **summarize()}."""
    from tqdm import tqdm

    run = Run(model, ctx, chunks, dtype, knobs or {}, device, progress)
    variants = 1 + len(formats) + len(knob_variants) * (1 + len([f for f in formats if f != "bf16"]))
    results = []
    with tqdm(total=variants * len(run.windows), desc="quality: windows scored", unit="window",
              disable=not progress) as run.bar:
        llm = run.load("bf16", {})
        backend = llm.knobs["kernel_backend"]
        ref = run.logits(llm, "bf16 (reference)")
        del llm
        s = summarize([compare(r, r, t) for r, t in ref])
        results.append({"label": "bf16", "format": "bf16", "knobs": {}, "reference": None, "role": "reference",
                        **{k: s[k] for k in ("ppl", "tokens")}})
        for fmt in dict.fromkeys(["bf16"] + formats):
            own = ref
            if fmt in formats:
                llm = run.load(fmt, {})
                label = fmt if fmt != "bf16" else "bf16 (again)"
                s, own = run.score(llm, label, ref)
                del llm
                results.append({"label": label, "format": fmt, "knobs": {}, "reference": "bf16", "role": "format", **s})
            for kv in knob_variants:
                llm = run.load(fmt, kv)
                s, _ = run.score(llm, _label(fmt, kv), own)
                del llm
                results.append({"label": _label(fmt, kv), "format": fmt, "knobs": kv,
                                "reference": f"{fmt} (defaults)", "role": "knob", **s})
    workload = {"text": CORPUS.name, "ctx": ctx, "windows": len(run.windows),
                "scored_tokens": len(run.windows) * (ctx - 1 - ctx // 2), "dtype": dtype}
    return {"model": model, "workload": workload, "backend": backend, "device": device, "results": results}


def rows(out: dict, machine: dict) -> list[dict]:
    """The results as result-store rows (see the module docstring)."""
    rows_ = []
    for r in out["results"]:
        extra = {"label": r["label"], "reference": r["reference"], "role": r["role"], "backend": out["backend"],
                 "device": out["device"], "cpu_model": machine.get("cpu_model")}
        if r["role"] != "reference":
            extra.update(ppl_reference=r["ppl_reference"], kl_mean_stderr=r["kl_mean_stderr"])
        for metric, unit, direction in METRICS:
            if metric in r:
                rows_.append({"model": out["model"], "format": r["format"], "knobs": r["knobs"], "metric": metric,
                              "unit": unit, "direction": direction, "workload": out["workload"],
                              "median": r[metric], "samples": [r[metric]], "extra": extra})
    return rows_


def table(out: dict) -> str:
    w = out["workload"]
    lines = [f"quality: model {out['model']} ({w['dtype']} activations, backend {out['backend']}, {out['device']}); "
             f"{w['text']}: {w['windows']} windows of {w['ctx']} tokens, {w['scored_tokens']} tokens scored",
             f"  {'variant':34s} {'against':16s} {'KL mean':>10s} {'KL median':>10s} {'KL p99':>10s} "
             f"{'KL max':>10s} {'top-1':>8s} {'PPL':>9s} {'ref PPL':>9s}"]
    for r in out["results"]:
        if r["role"] == "reference":
            lines.append(f"  {r['label']:34s} {'(reference)':16s} {'':>10s} {'':>10s} {'':>10s} {'':>10s} {'':>8s} "
                         f"{r['ppl']:9.3f}")
            continue
        lines.append(f"  {r['label']:34s} {r['reference']:16s} {r['kl_mean']:10.3g} {r['kl_median']:10.3g} "
                     f"{r['kl_p99']:10.3g} {r['kl_max']:10.3g} {r['top1_agreement'] * 100:7.2f}% {r['ppl']:9.3f} "
                     f"{r['ppl_reference']:9.3f}")
    lines.append("  (KL in nats per token; top-1: the share of tokens whose most likely next token is the reference's)")
    return "\n".join(lines)


def run_args(args) -> int:
    from engine.fingerprint import fingerprint

    knobs = {"kernel_backend": args.backend}
    formats = parse_formats(args.format)
    out = evaluate(args.model, formats, parse_knob_variants(args.knob), args.ctx, args.chunks, args.dtype,
                   knobs, args.device, progress=not args.json)
    machine = fingerprint()
    out["machine"] = {"cpu_model": machine.get("cpu_model"), "hash": machine.get("hash"),
                      "hardware_key": machine.get("hardware_key")}
    if not args.no_store:
        from results.store import append_rows

        out["stored"] = str(append_rows(rows(out, machine), suite="quality"))
    if args.json:
        print(json.dumps(out))
    else:
        print(table(out))
        print(f"  on {machine.get('cpu_model')} [{machine.get('hash')}]" +
              (f"; rows in {out['stored']}" if "stored" in out else ""))
    return 0


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default="small", help="preset name (tiny, small) or a high-precision checkpoint")
    ap.add_argument("--format", action="append", metavar="FORMAT",
                    help=f"{', '.join(FORMATS)} (repeatable or comma-separated; default {', '.join(QUANTIZED)}; "
                         "bf16: the reference again, a self-check)")
    ap.add_argument("--ctx", type=int, default=512, help="tokens per window (its second half is scored)")
    ap.add_argument("--chunks", type=int, default=None, help="windows scored (default: all that fit in the text)")
    ap.add_argument("--knob", action="append", metavar="NAME=VALUE[,NAME=VALUE]",
                    help="a variant: every format (and BF16) again with these knobs, against the same weights "
                         "at the defaults (repeatable)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="activation dtype")
    ap.add_argument("--backend", default="auto", help="kernel back end: auto, cpu, reference (knob kernel_backend)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--no-store", action="store_true", help="do not append the rows to the result store")
    ap.add_argument("--json", action="store_true", help="one JSON object on stdout")


def add_parser(sub) -> None:
    """`moetune quality ...` (moetune_cli calls this)."""
    q = sub.add_parser("quality", help="KL divergence, top-1 agreement and perplexity of each format against BF16")
    add_arguments(q)
    q.set_defaults(func=run_args)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m suites.quality", description=__doc__.splitlines()[0])
    add_arguments(ap)
    args = ap.parse_args(argv)
    try:
        return run_args(args)
    except MoetuneError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
