"""`moetune explain`: which knob values the kernel calls use, per op, shape and bucket, and where
each came from (default, profile knobs, kernel table, command line).

    moetune explain --model small [--profile P | --no-profile] [--knob NAME=VALUE] [--json]

The model is loaded as `serve` and `generate` load it (weights included: the call sites are its
prepared weights), and the plan the engine resolved is printed (engine/kernel_tables.py).
"""
from __future__ import annotations

import json
import sys

ABBREV = {"default": "d", "profile": "p", "table": "t", "command line": "c"}


def add_parser(sub) -> None:
    from moetune_cli import _knob

    e = sub.add_parser("explain", help="show the knob values each kernel call uses and where they come from")
    e.add_argument("--model", default="small", help="preset name or checkpoint directory")
    e.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    e.add_argument("--profile", default="auto",
                   help="tuned profile TOML (default 'auto': this machine's profile for the model, if any)")
    e.add_argument("--no-profile", action="store_true", help="the defaults, whatever profile exists")
    e.add_argument("--force-profile", action="store_true", help="accept a profile tuned on another machine")
    e.add_argument("--knob", action="append", type=_knob, metavar="NAME=VALUE", help="override a knob")
    e.add_argument("--json", action="store_true", help="one JSON document instead of the table")
    e.set_defaults(func=run_explain)


def run_explain(args) -> int:
    from engine.llm import LLM

    llm = LLM(args.model, dtype=args.dtype, profile=None if args.no_profile else args.profile,
              knobs=dict(args.knob or []), force_profile=args.force_profile, progress=sys.stderr.isatty())
    rows = llm.explain()
    profile = str(llm.profile.path) if llm.profile else None
    if args.json:
        json.dump({"model_key": llm.model_key, "profile": profile, "kernel_backend": llm.knobs["kernel_backend"],
                   "calls": rows}, sys.stdout, indent=1)
        print()
        return 0
    print(f"model {llm.model_key}; kernel backend {llm.knobs['kernel_backend']}; "
          f"profile {profile or 'none (defaults)'}")
    if not rows:
        print("no per-call knobs: this backend takes none (only the cpu backend has per-call tables)")
        return 0
    print("sources: d default, p profile [knobs], t kernel table, c command line")
    last = None
    for r in rows:
        site = f"{r['op']} {r['format']} " + " ".join(f"{k}={v}" for k, v in r["shape"].items())
        if site != last:
            print(f"\n{site}")
            last = site
        knobs = "  ".join(f"{k.removeprefix('cpu_')}={v}({ABBREV[r['sources'][k]]})" for k, v in r["knobs"].items())
        print(f"  {r['bucket_text']:>22s}: {knobs}")
    return 0
