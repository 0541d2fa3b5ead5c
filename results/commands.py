"""`moetune results`: list and filter the Parquet store.

    moetune results [--suite autotune] [--status ok] [--model small] [--study S] [--metric M]
                    [--last 20] [--csv FILE] [--compact]
"""
from __future__ import annotations

SHOWN = ["ts", "suite", "study", "trial", "model", "workload", "metric", "median", "p10", "p90", "repeats", "status"]


def add_parser(sub) -> None:
    r = sub.add_parser("results", help="list and filter the result store (Parquet)")
    for name in ("suite", "status", "model", "study", "metric", "run-id"):
        r.add_argument(f"--{name}", help=f"only rows with this {name.replace('-', ' ')}")
    r.add_argument("--last", type=int, default=20, help="show the last N rows (0: all)")
    r.add_argument("--csv", metavar="FILE", help="write the selected rows (all columns) to a CSV file")
    r.add_argument("--compact", action="store_true", help="merge the store's part files first")
    r.set_defaults(func=run_results)


def run_results(args) -> int:
    import pandas as pd

    from results.labels import workload_label
    from results.store import compact, read_results, results_dir

    if args.compact:
        out = compact()
        print(f"compacted into {out}" if out else "nothing to compact")
    df = read_results(suite=args.suite, status=args.status, model=args.model, study=args.study,
                      metric=args.metric, run_id=args.run_id)
    if args.csv:
        df.to_csv(args.csv, index=False)
        print(f"wrote {len(df)} rows to {args.csv}")
    print(f"{len(df)} rows in {results_dir()}")
    if len(df):
        shown = df.tail(args.last) if args.last else df
        shown = shown.assign(workload=shown["workload"].map(workload_label))  # as people say it
        knob_cols = [c for c in df.columns if c.startswith("knob.")]
        with pd.option_context("display.width", 200, "display.max_columns", 40, "display.max_colwidth", 24):
            print(shown[[c for c in SHOWN if c in df] + knob_cols].to_string(index=False))
    return 0
