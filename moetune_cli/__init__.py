"""The `moetune` command line (`moetune ...` or `python -m moetune_cli ...`). User mistakes print
one line on stderr and exit 2, no traceback.

It sits above every other package: it gathers the engine's commands (generate, quantize, presets,
serve) and each layer's own (autotune, compare, bench, quality, results, report), so that no import runs
from the engine up to the tuner, the suites or the dashboards.
"""
from __future__ import annotations

import argparse
import logging
import sys


def _generate(args) -> int:
    from engine.llm import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype, knobs=dict(args.knob or []), device=args.device,
              profile=args.profile, force_profile=args.force_profile)
    prompt = args.prompt
    if args.chat:
        if llm.tokenizer is None or not llm.tokenizer.has_chat_template:
            from engine.errors import MoetuneError

            raise MoetuneError(f"{args.model} has no chat template")
        prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, stop=args.stop, ignore_eos=args.ignore_eos)
    out = llm.generate(prompt, params)[0]
    print(out.text)
    n = len(out.token_ids)
    rate = (n - 1) / out.decode_s if n > 1 and out.decode_s > 0 else float("nan")
    print(f"\n[{len(out.prompt_token_ids)} prompt tokens, {n} generated ({out.finish_reason}); "
          f"time to first token {out.ttft_s * 1000:.1f} ms; decode {rate:.2f} tokens/s]", file=sys.stderr)
    return 0


def _quantize(args) -> int:
    from engine.weights.presets import resolve_model
    from engine.weights.quantize import quantize_checkpoint

    dst = quantize_checkpoint(resolve_model(args.src), args.dst, args.to, group=args.group, lm_head=args.lm_head)
    print(f"wrote {args.to} checkpoint to {dst}")
    return 0


def _presets(args) -> int:
    from engine.weights.presets import PRESETS, ensure_preset, preset_dir

    for name in args.build or []:
        if name not in PRESETS:
            from engine.errors import MoetuneError

            raise MoetuneError(f"unknown preset {name!r} (known: {', '.join(PRESETS)})")
        ensure_preset(name)
    for name in PRESETS:
        path = preset_dir(name)
        state = "cached" if (path / ".complete").is_file() else "not generated yet"
        print(f"{name:15s} {state:18s} {path}")
    return 0


def _serve(args) -> int:
    from engine.server import serve

    return serve(args)


def _knob(text: str) -> tuple[str, str]:
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    name, value = text.split("=", 1)
    return name.strip(), value.strip()


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="moetune", description="Self-tuning MoE inference engine")
    ap.add_argument("-v", "--verbose", action="store_true", help="debug logging and full tracebacks")
    sub = ap.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text from a prompt")
    g.add_argument("--model", default="small", help="preset name (tiny, small) or checkpoint directory")
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    g.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="cuda: the whole model, weights and KV cache on the GPU (Triton kernels)")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--knob", action="append", type=_knob, metavar="NAME=VALUE", help="override a knob")
    g.add_argument("--profile", default="auto",
                   help="tuned profile TOML (default 'auto': this machine's profile for the model, if any)")
    g.add_argument("--force-profile", action="store_true", help="accept a profile tuned on another machine")
    g.set_defaults(func=_generate)

    q = sub.add_parser("quantize", help="convert a BF16 checkpoint to FP8-block, INT8-channel or group-INT4")
    q.add_argument("src", help="checkpoint directory or preset name")
    q.add_argument("dst", help="output directory (must not exist or be empty)")
    q.add_argument("--to", required=True, choices=["fp8", "int8", "int4"])
    q.add_argument("--group", type=int, default=128, help="int4: inputs per scale (32, 64 or 128)")
    q.add_argument("--lm-head", action="store_true",
                   help="quantize the LM head too (as llama.cpp's Q8_0 does); released checkpoints keep it BF16")
    q.set_defaults(func=_quantize)

    p = sub.add_parser("presets", help="list the built-in models (and generate some with --build)")
    p.add_argument("--build", action="append", metavar="NAME")
    p.set_defaults(func=_presets)

    s = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API")
    s.add_argument("--model", default="small", help="preset name (tiny, small) or checkpoint directory")
    s.add_argument("--profile", help="tuned profile TOML (default: this machine's profile for the model, if any)")
    s.add_argument("--force-profile", action="store_true", help="accept a profile tuned on another machine")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    s.add_argument("--served-model-name", help="the name clients ask for (default: --model)")
    s.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the model runs")
    s.add_argument("--knob", action="append", type=_knob, metavar="NAME=VALUE", help="override a knob")
    s.add_argument("--api-key", action="append", metavar="KEY",
                   help="require `Authorization: Bearer KEY` on every route but /health (repeatable; "
                        "or set MOETUNE_API_KEY, which `ps` does not show)")
    s.add_argument("--metrics-public", action="store_true", help="serve /metrics without a key")
    from engine.protocol import ServerOptions as so

    s.add_argument("--max-body-bytes", type=int, default=so.max_body_bytes,
                   help="largest request body; a larger one gets 413 (default %(default)s)")
    s.add_argument("--max-prompts", type=int, default=so.max_prompts,
                   help="most prompts in one completions request (default %(default)s)")
    s.add_argument("--max-request-tokens", type=int, default=so.max_request_tokens,
                   help="most tokens one request may ask for: (prompt + max_tokens) x samples, summed over "
                        "its prompts (default %(default)s)")
    s.add_argument("--request-timeout", type=float, default=so.request_timeout,
                   help="seconds after which a request is cancelled and answered 408; 0: never (default %(default)s)")
    s.add_argument("--shutdown-grace", type=float, default=so.shutdown_grace,
                   help="on SIGTERM/SIGINT, seconds the running requests get to finish before they are "
                        "cancelled; the process then exits 0 (default %(default)s)")
    s.set_defaults(func=_serve)

    from dashboards.report import add_parser as add_report
    from moetune_cli.explain import add_parser as add_explain
    from results.commands import add_parser as add_results
    from suites.kernels import add_parser as add_bench
    from suites.quality import add_parser as add_quality
    from suites.baselines.compare import add_parser as add_compare
    from tuner.autotune import add_parser as add_autotune

    add_autotune(sub)
    add_compare(sub)
    add_bench(sub)
    add_quality(sub)
    add_results(sub)
    add_report(sub)
    add_explain(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="moetune: %(message)s", stream=sys.stderr)
    from engine.errors import MoetuneError

    try:
        return args.func(args)
    except MoetuneError as e:
        if args.verbose:
            raise
        print(f"moetune: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("moetune: interrupted", file=sys.stderr)
        return 130

