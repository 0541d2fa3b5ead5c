"""A tuned profile against the defaults, end to end: `python -m suites.profile_ab --model small`.

Two engines on the same weights — one with the profile (its knobs and its per-call kernel tables),
one with the defaults — run each point of a workload mix in alternation (tuned, defaults, tuned,
…), so the machine's drift falls on both. Per point: TTFT and TPOT medians [min–max] of each, and
the gain (defaults / tuned − 1) with the spread of the paired per-round gains. The profile is this
machine's tuned one for the model unless --profile names another. Rows go to the result store
(suite "profile-ab").
"""
from __future__ import annotations

import argparse
import statistics
import sys

from engine.errors import MoetuneError


def measure(tuned, defaults, mix, repeats: int, progress: bool = True) -> list[dict]:
    """Per point and metric: both engines' samples, alternating within each round."""
    from tqdm import tqdm

    from suites.e2e import run_batch, run_once
    from tuner.objectives import SystemObjective

    rows = []
    for point in mix:
        prompts = [SystemObjective.prompt(tuned.config.vocab_size, point.prompt, seed) for seed in range(point.batch)]

        def run(llm):
            r = run_batch(llm, prompts, point.decode) if point.batch > 1 else run_once(llm, prompts[0], point.decode)
            steps = r["decoded"] / point.batch
            return {"ttft_s": r["ttft_s"], "tpot_s": r["decode_s"] / max(1, steps)}

        run(tuned), run(defaults)  # warm-up
        samples = {"tuned": [], "defaults": []}
        for _ in tqdm(range(repeats), desc=point.label, leave=False, disable=not progress):
            samples["tuned"].append(run(tuned))
            samples["defaults"].append(run(defaults))
        for metric in ("ttft_s", "tpot_s"):
            t = [s[metric] for s in samples["tuned"]]
            d = [s[metric] for s in samples["defaults"]]
            gains = sorted(b / a - 1 for a, b in zip(t, d))
            rows.append({"point": point.label, "metric": metric, "tuned": t, "defaults": d, "gains": gains})
    return rows


def table(rows: list[dict]) -> str:
    def ms(v):
        return f"{statistics.median(v) * 1e3:.1f} [{min(v) * 1e3:.1f}–{max(v) * 1e3:.1f}]"

    lines = ["| point | metric | tuned: ms median [min–max] | defaults | gain (median [min–max] of paired rounds) |",
             "|---|---|---|---|---|"]
    for r in rows:
        g = r["gains"]
        lines.append(f"| {r['point']} | {r['metric']} | {ms(r['tuned'])} | {ms(r['defaults'])} | "
                     f"{statistics.median(g):+.1%} [{g[0]:+.1%}–{g[-1]:+.1%}] |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m suites.profile_ab", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--profile", default="auto", help="a profile TOML (default: this machine's for the model)")
    ap.add_argument("--force-profile", action="store_true")
    ap.add_argument("--mix", default=None, help="workload points, e.g. 128/16,1024/16,4x128/16 (default: the "
                                                "autotune default mix of the model)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-store", action="store_true")
    args = ap.parse_args(argv)
    try:
        from engine.llm import LLM
        from tuner.objectives import default_mix, parse_mix

        mix = parse_mix(args.mix) if args.mix else default_mix(args.model)
        if args.repeats < 1:
            raise MoetuneError("--repeats must be ≥ 1")
        tuned = LLM(args.model, dtype=args.dtype, profile=args.profile, force_profile=args.force_profile)
        if tuned.profile is None:
            raise MoetuneError(f"no tuned profile for {tuned.model_key} on this machine (run moetune autotune)")
        defaults = LLM(args.model, dtype=args.dtype, profile=None, progress=False)
        rows = measure(tuned, defaults, mix, args.repeats)
    except MoetuneError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from engine.fingerprint import fingerprint

    fp = fingerprint()
    print(f"profile {tuned.profile.path} vs the defaults — {args.model} ({args.dtype}), {args.repeats} alternating "
          f"rounds, on {fp.get('cpu_model')} [{fp.get('hash')}]")
    print(table(rows))
    if not args.no_store:
        from results.store import append_rows

        append_rows([{"model": args.model, "metric": r["metric"], "unit": "s", "direction": "minimize",
                      "samples": r[side], "workload": {"point": r["point"]},
                      "extra": {"engine": side, "profile": str(tuned.profile.path), "gains": r["gains"]}}
                     for r in rows for side in ("tuned", "defaults")], "profile-ab")
    return 0


if __name__ == "__main__":
    sys.exit(main())
