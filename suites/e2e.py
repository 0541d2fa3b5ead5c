"""End-to-end suite: time to first token (prefill) and decode tokens/s of one request.

    python -m suites.e2e --model small --prompt-len 128 --decode 32 --repeats 3 [--json]
    python -m suites.e2e --breakdown ...   (suites/breakdown.py: each step's time op by op)

Each repeat runs one fixed-seed random prompt through `LLM.generate` (greedy, EOS ignored); a
warm-up run comes first. Reports median and spread (min–max) per figure, the weight bytes a decode
step reads, and the machine fingerprint.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
from tqdm import tqdm

from engine.errors import MoetuneError
from engine.fingerprint import fingerprint
from engine.llm import LLM, SamplingParams
from suites import breakdown


def active_weight_bytes(llm: LLM) -> int:
    """Weight bytes one decode token reads: every non-expert weight plus K routed experts per MoE layer."""
    c, total = llm.config, 0
    for key, w in llm.model.w.items():
        if key == "embed":
            continue  # one row is read, not the table
        nbytes = w.nbytes if hasattr(w, "nbytes") else w.numel() * w.element_size()
        if key.endswith(("experts.w13", "experts.w2")):
            nbytes = nbytes * c.num_experts_per_tok // c.n_routed_experts
        total += nbytes
    return total


def run_once(llm: LLM, prompt: list[int], decode: int) -> dict:
    out = llm.generate(prompt, SamplingParams(max_tokens=decode, ignore_eos=True))[0]
    return {"ttft_s": out.ttft_s, "decode_s": out.decode_s, "decoded": len(out.token_ids) - 1}


def run_batch(llm: LLM, prompts: list[list[int]], decode: int) -> dict:
    """B requests at once (continuous batching: the prompts prefill together, then decode steps of B
    tokens): ttft_s until every first token, decode_s the rest of the wall time, decoded the tokens
    generated after each first one (all sequences)."""
    t0 = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=decode, ignore_eos=True))
    wall = time.perf_counter() - t0
    ttft = max(o.ttft_s for o in outs)
    return {"ttft_s": ttft, "decode_s": wall - ttft, "decoded": sum(len(o.token_ids) - 1 for o in outs)}


def summarize(samples: list[float]) -> dict:
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples)}


def measure(llm: LLM, prompt_len: int, decode: int, repeats: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(2, llm.config.vocab_size, (prompt_len,), generator=g).tolist()
    run_once(llm, prompt, 2)  # warm-up
    runs = [run_once(llm, prompt, decode) for _ in tqdm(range(repeats), desc="e2e repeats", leave=False)]
    prefill = summarize([prompt_len / r["ttft_s"] for r in runs])
    dec = summarize([r["decoded"] / r["decode_s"] for r in runs])
    gbs = active_weight_bytes(llm) * dec["median"] / 1e9
    return {"prompt_len": prompt_len, "decode_tokens": decode, "repeats": repeats,
            "ttft_s": summarize([r["ttft_s"] for r in runs]), "prefill_tok_s": prefill,
            "decode_tok_s": dec, "decode_weight_gb_s": gbs,
            "backend": "cuda" if llm.device.type == "cuda" else llm.knobs["kernel_backend"], "dtype": str(llm.dtype).replace("torch.", ""),
            "threads": llm.knobs["threads"], "threads_prefill": llm.knobs["threads_prefill"],
            "threads_decode": llm.knobs["threads_decode"], "machine": fingerprint()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m suites.e2e", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--backend", default="auto", help="kernel back end: auto, cpu, reference (knob kernel_backend)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="where the model runs (cuda: every layer on one GPU, the Triton kernels)")
    ap.add_argument("--json", action="store_true", help="one JSON object on stdout")
    ap.add_argument("--knob", action="append", metavar="NAME=VALUE", help="override a knob (repeatable)")
    ap.add_argument("--profile", default=None, metavar="auto|PATH",
                    help="a tuned profile (knobs and kernel tables): auto, this machine's for the model; default none")
    ap.add_argument("--breakdown", action="store_true",
                    help="split the prefill's and a decode step's time into kernel ops and the rest "
                         "(suites/breakdown.py; --decode is then the decode steps timed per repeat)")
    breakdown.add_arguments(ap.add_argument_group("with --breakdown"))
    args = ap.parse_args(argv)
    try:
        if args.breakdown:
            return breakdown.run_args(args, LLM)
        llm = LLM(args.model, dtype=args.dtype, profile=args.profile, knobs=breakdown.knob_overrides(args),
                  device=args.device)
    except MoetuneError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    r = measure(llm, args.prompt_len, args.decode, args.repeats)
    if args.json:
        print(json.dumps(r))
        return 0
    f = lambda d, fmt: f"{fmt.format(d['median'])} [{fmt.format(d['min'])}–{fmt.format(d['max'])}]"  # noqa: E731
    print(f"model {args.model} on {args.device} ({r['dtype']}, backend {r['backend']}, {r['threads_prefill']}/{r['threads_decode']} "
          f"threads prefill/decode) on {r['machine']['cpu_model']} [{r['machine']['hash']}]")
    print(f"  prefill {args.prompt_len} tokens: TTFT {f(r['ttft_s'], '{:.3f}')} s, {f(r['prefill_tok_s'], '{:.1f}')} tokens/s")
    print(f"  decode {args.decode} tokens: {f(r['decode_tok_s'], '{:.2f}')} tokens/s "
          f"(≈{r['decode_weight_gb_s']:.2f} GB/s of weights read)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
