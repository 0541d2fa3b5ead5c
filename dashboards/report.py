"""`moetune report [--out DIR]`: static plotly HTML from the result store, readable offline.

    DIR/plotly.min.js        written once, beside the pages (no network needed)
    DIR/index.html           tuned vs defaults (with spreads), kernel rooflines, baselines, study list
    DIR/compare.html         `moetune compare` runs: TTFT/TPOT/MoE bars with spreads, ratio tables
    DIR/study-<n>.html       per study: tuning history + best so far, knob importances,
                             parallel coordinates, Pareto front (two objectives)

Everything is read from the Parquet store (results.store), so a report can be built on another
machine from a copied results folder. Each figure is a div with a stable id (FIGURE_IDS says which
a page should have), which the headless-browser test checks.
"""
from __future__ import annotations

import html
import json
import re
from pathlib import Path

import numpy as np

_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<script src="plotly.min.js"></script>
<style>body{{font-family:sans-serif;margin:2em;max-width:1200px}} .fig{{margin-bottom:2em}}
table{{border-collapse:collapse}} td,th{{border:1px solid #ccc;padding:2px 8px}}</style>
</head><body><h1>{title}</h1>
{body}
</body></html>
"""


def add_parser(sub) -> None:
    r = sub.add_parser("report", help="build the HTML dashboards from the result store")
    r.add_argument("--out", help="output folder (default: <results>/report)")
    r.set_defaults(func=run_report)


def run_report(args) -> int:
    out = build_report(Path(args.out) if args.out else None)
    print(f"report: {out / 'index.html'}")
    return 0


def default_report_dir() -> Path:
    from results.store import results_dir

    return results_dir() / "report"


def latest_report_dir() -> Path | None:
    """The folder of the last report built in the default place (for `moetune serve` at /dashboard)."""
    d = default_report_dir()
    return d if (d / "index.html").is_file() else None


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-")[:80]


def build_report(out: Path | None = None, results: Path | None = None) -> Path:
    """Write every page; returns the folder."""
    import plotly.offline

    from results.store import read_results

    out = Path(out or default_report_dir())
    out.mkdir(parents=True, exist_ok=True)
    (out / "plotly.min.js").write_text(plotly.offline.get_plotlyjs())
    df = read_results(results)
    studies = sorted(s for s in df["study"].dropna().unique()) if len(df) else []
    links = []
    for study in studies:
        rows = df[(df["study"] == study) & (df["suite"].isin(["autotune", "kernels-autotune"]))]
        if len(rows):
            name = f"study-{slug(study)}.html"
            _write(out / name, f"Study {study}", study_figures(rows))
            links.append(f'<li><a href="{name}">{html.escape(study)}</a> ({rows["trial"].nunique()} trials)</li>')
    from dashboards.compare import compare_parts

    compare = compare_parts(df, _div)
    if compare:  # `moetune compare` runs: their own page
        _write(out / "compare.html", "moetune vs baselines", compare)
        links.append('<li><a href="compare.html">moetune vs baselines (moetune compare)</a></li>')
    body = overview_figures(df) + [f"<h2>Studies</h2><ul>{''.join(links) or '<li>none yet</li>'}</ul>"]
    _write(out / "index.html", "moetune report", body)
    return out


def _write(path: Path, title: str, parts: list[str]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(_PAGE.format(title=html.escape(title), body="\n".join(parts)))
    tmp.replace(path)


def _div(fig, div_id: str, title: str) -> str:
    top = max(50, fig.layout.margin.t or 0)
    fig.update_layout(title=title, height=420, margin=dict(l=60, r=20, t=top, b=50))
    return f'<div class="fig">{fig.to_html(full_html=False, include_plotlyjs=False, div_id=div_id)}</div>'


# ------------------------------------------------------------------ per study

def study_figures(rows) -> list[str]:
    """History, importances, parallel coordinates (first metric), Pareto front (two metrics)."""
    metrics = list(dict.fromkeys(rows["metric"]))
    first = rows[rows["metric"] == metrics[0]]
    parts = [_div(history_figure(first), "history", f"Tuning history: {metrics[0]} per trial, best so far"),
             _div(importance_figure(first), "importance", "Knob importance (ω²: share of the variance of log value)"),
             _div(parallel_figure(first), "parallel", f"Parallel coordinates: knobs → {metrics[0]}")]
    if len(metrics) == 2:
        parts.append(_div(pareto_figure(rows, metrics), "pareto", f"Pareto front: {metrics[0]} vs {metrics[1]}"))
    return parts


def history_figure(rows):
    import plotly.graph_objects as go

    fig = go.Figure()
    for status, marker in (("ok", "circle"), ("pruned", "x"), ("failed", "triangle-down"),
                           ("wrong", "diamond"), ("timeout", "square")):
        sel = rows[rows["status"] == status]
        if len(sel):
            y = sel["median"].where(np.isfinite(sel["median"]), other=None)
            fig.add_scatter(x=sel["trial"], y=y, mode="markers", name=status, marker_symbol=marker,
                            text=sel["error"].fillna(""), hovertemplate="trial %{x}: %{y}<br>%{text}")
    ok = rows[rows["status"] == "ok"].sort_values("trial")
    if len(ok):
        best = ok["median"].cummin() if ok["direction"].iloc[0] != "maximize" else ok["median"].cummax()
        fig.add_scatter(x=ok["trial"], y=best, mode="lines", name="best so far", line_shape="hv")
    fig.update_xaxes(title="trial")
    fig.update_yaxes(title=f"{rows['metric'].iloc[0]} ({rows['unit'].iloc[0] or ''})")
    return fig


def knob_columns(rows) -> list[str]:
    return [c for c in rows.columns if c.startswith("knob.") and rows[c].notna().any()]


def _groups(values, bins: int = 4):
    """Trial indices grouped by knob value; numeric knobs with many values in ≤ `bins` rank bins."""
    import pandas as pd

    if values.nunique() > bins and pd.api.types.is_numeric_dtype(values):
        values = pd.qcut(values.rank(method="first"), bins, labels=False)
    return [g for g in values.astype(str).groupby(values.astype(str)).indices.values()]


def importances(rows) -> dict[str, float]:
    """ω² of each knob on log(value) over completed trials (one-way ANOVA, corrected for the
    number of groups so a knob with many values gains nothing by chance), normalized to sum 1."""
    ok = rows[(rows["status"] == "ok") & (rows["median"] > 0)].reset_index(drop=True)
    if len(ok) < 3:
        return {}
    y = np.log(ok["median"].to_numpy(dtype=float))
    total = float(((y - y.mean()) ** 2).sum())
    out = {}
    for col in knob_columns(ok):
        groups = _groups(ok[col])
        between = sum(len(g) * (y[g].mean() - y.mean()) ** 2 for g in groups)
        dof_within = len(y) - len(groups)
        ms_within = (total - between) / dof_within if dof_within > 0 else 0.0
        omega = (between - (len(groups) - 1) * ms_within) / (total + ms_within) if total > 0 else 0.0
        out[col.removeprefix("knob.")] = max(0.0, omega)
    s = sum(out.values())
    return {k: v / s for k, v in sorted(out.items(), key=lambda kv: -kv[1])} if s > 0 else out


def importance_figure(rows):
    import plotly.graph_objects as go

    imp = importances(rows)
    fig = go.Figure(go.Bar(x=list(imp.values()), y=list(imp.keys()), orientation="h"))
    fig.update_xaxes(title="importance", range=[0, 1])
    if not imp:
        fig.add_annotation(text="fewer than three completed trials, or no knob explains the spread",
                           showarrow=False)
    return fig


def parallel_figure(rows):
    import plotly.graph_objects as go

    ok = rows[rows["status"] == "ok"]
    dims = []
    for col in knob_columns(ok):
        values = ok[col]
        if values.map(lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)).all():
            dims.append(dict(label=col.removeprefix("knob."), values=values.astype(float).tolist()))
        else:
            # a trial from before a knob existed has no value for it: "unset" (pandas ≥ 3 keeps
            # missing values missing through astype(str), which would not sort among strings)
            labels = values.map(lambda v: "unset" if v is None or v != v else str(v))
            cats = sorted(labels.unique())
            dims.append(dict(label=col.removeprefix("knob."), values=[cats.index(v) for v in labels],
                             tickvals=list(range(len(cats))), ticktext=cats))
    y = ok["median"].astype(float).tolist()
    dims.append(dict(label=ok["metric"].iloc[0] if len(ok) else "value", values=y))
    fig = go.Figure(go.Parcoords(dimensions=dims, line=dict(color=y, colorscale="Viridis", showscale=True)))
    fig.update_layout(margin=dict(t=110))
    return fig


def pareto_front(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats on both (both minimized)."""
    return [i for i, (a, b) in enumerate(points)
            if not any(c <= a and d <= b and (c < a or d < b) for c, d in points)]


def pareto_figure(rows, metrics):
    import plotly.graph_objects as go

    ok = rows[rows["status"] == "ok"].pivot_table(index="trial", columns="metric", values="median")
    ok = ok.dropna()
    pts = list(zip(ok[metrics[0]], ok[metrics[1]]))
    front = sorted(pareto_front(pts), key=lambda i: pts[i][0])
    fig = go.Figure()
    fig.add_scatter(x=ok[metrics[0]], y=ok[metrics[1]], mode="markers", name="trials",
                    text=[f"trial {t}" for t in ok.index])
    fig.add_scatter(x=[pts[i][0] for i in front], y=[pts[i][1] for i in front], mode="lines+markers",
                    name="Pareto front", line_shape="hv")
    fig.update_xaxes(title=metrics[0])
    fig.update_yaxes(title=metrics[1])
    return fig


# ------------------------------------------------------------------ overview

def overview_figures(df) -> list[str]:
    parts = []
    confirm = df[df["suite"] == "autotune-confirm"] if len(df) else df
    if len(confirm):
        parts.append(_div(tuned_vs_defaults_figure(confirm), "tuned-vs-defaults",
                          "Tuned vs defaults: re-measured alternately (median, bars p10–p90)"))
    # The kernel suite's rows, and the kernel tier's confirmation rows (defaults and finalists).
    kern = df[(df["suite"] == "kernels") | ((df["suite"] == "autotune-confirm")
                                           & df["extra"].fillna("").str.contains('"flops"'))] if len(df) else df
    if len(kern):
        parts.append(_div(roofline_figure(kern, df[df["suite"] == "probe"]), "roofline",
                          "Kernel roofline: achieved GFLOP/s vs arithmetic intensity, probe limits"))
    base = df[df["extra"].fillna("").str.contains('"engine"')] if len(df) else df
    if len(base):
        parts.append(_div(baseline_figure(base), "baselines", "Against baselines (median, bars p10–p90)"))
    if not parts:
        parts.append("<p>No results yet: run <code>moetune autotune</code>.</p>")
    return parts


def tuned_vs_defaults_figure(confirm):
    """The latest confirmation of each study: defaults and finalists, per metric."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    latest = confirm[confirm["run_id"] == confirm.groupby("study")["run_id"].transform("max")]
    metrics = list(dict.fromkeys(latest["metric"]))
    fig = make_subplots(rows=1, cols=len(metrics), subplot_titles=metrics)
    for j, metric in enumerate(metrics, start=1):
        sel = latest[latest["metric"] == metric]
        labels = [json.loads(e).get("label", "?") for e in sel["extra"]]
        base = {st: m for st, m, lab in zip(sel["study"], sel["median"], labels) if lab == "defaults"}
        sign = -1 if (sel["direction"] == "minimize").all() else 1
        text = [("" if lab == "defaults" or st not in base else
                 f"{(base[st] / m if sign < 0 else m / base[st]) - 1:+.1%}")
                for st, m, lab in zip(sel["study"], sel["median"], labels)]
        x = labels if sel["study"].nunique() == 1 else [f"{lab}<br>{st[-30:]}" for lab, st in zip(labels, sel["study"])]
        fig.add_bar(x=x, y=sel["median"], name=metric, showlegend=False, row=1, col=j, text=text,
                    hovertext=sel["study"], error_y=dict(type="data", symmetric=False,
                                                         array=sel["p90"] - sel["median"],
                                                         arrayminus=sel["median"] - sel["p10"]))
    return fig


def _work(extra: dict, seconds: float) -> tuple[float, float]:
    """(bytes, flops) of one kernel row: given directly (tuner rows: bytes, flops) or derived from
    the kernel suite's weight_bytes / gbps and gflops."""
    nbytes = extra.get("bytes") or extra.get("weight_bytes") or extra.get("gbps", 0) * 1e9 * seconds
    flops = extra.get("flops") or extra.get("gflops", 0) * 1e9 * seconds
    return float(nbytes or 0), float(flops or 0)


def probe_limits(probe_rows) -> dict[str, float]:
    """read_bw_gbps and peak_gflops_<path> from "probe" rows, else from tuner.probe's cached
    result for this machine (never measured here)."""
    limits = {m: v for m, v in zip(probe_rows["metric"], probe_rows["median"])} if len(probe_rows) else {}
    if limits:
        return limits
    try:
        from tuner.probe import _path

        cached = json.loads(_path().read_text())
    except (ImportError, OSError, ValueError):
        return {}
    out = {"read_bw_gbps": cached.get("read_gbps")}
    for key, name in (("fp32_fma_gflops", "fp32_fma"), ("int16_madd_gops", "int16_madd"), ("vnni_int8_gops", "vnni_int8")):
        if cached.get(key):
            out[f"peak_gflops_{name}"] = cached[key]
    return {k: v for k, v in out.items() if v}


def roofline_figure(kern, probe_rows):
    """Each kernel row at (flops / bytes, GFLOP/s); the roofs min(peak, read bandwidth × intensity)."""
    import plotly.graph_objects as go

    fig = go.Figure()
    for op, sel in kern.assign(op=[json.loads(w).get("op", "?") if isinstance(w, str) else "?"
                                   for w in kern["workload"]]).groupby("op"):
        pts = []
        for e, w, t, fmt in zip(sel["extra"], sel["workload"], sel["median"], sel["format"]):
            x = json.loads(e) if isinstance(e, str) else {}
            nbytes, flops = _work(x, t)
            if t and t > 0 and nbytes and flops:
                wl = json.loads(w) if isinstance(w, str) else {}
                who = f" ({x['label']})" if x.get("label") else ""
                pts.append((flops / nbytes, flops / t / 1e9, f"{op} {fmt} T={wl.get('tokens', '')}{who}: "
                                                               f"{nbytes / t / 1e9:.2f} GB/s"))
        if pts:
            fig.add_scatter(x=[p[0] for p in pts], y=[p[1] for p in pts], mode="markers", name=op,
                            text=[p[2] for p in pts])
    limits = probe_limits(probe_rows)
    bw = limits.get("read_bw_gbps")
    xs = np.logspace(-2, 3, 60)
    for name, peak in limits.items():
        if name.startswith("peak_gflops") and bw:
            fig.add_scatter(x=xs, y=np.minimum(peak, bw * xs), mode="lines",
                            name=f"roof: {bw:.1f} GB/s, {name.removeprefix('peak_gflops_')} {peak:.0f} G/s")
    if bw and not any(n.startswith("peak_gflops") for n in limits):
        fig.add_scatter(x=xs, y=bw * xs, mode="lines", name=f"read bandwidth {bw:.1f} GB/s")
    if not limits:
        fig.add_annotation(text="no probe result yet (python -m tuner.probe)", showarrow=False)
    fig.update_xaxes(type="log", title="arithmetic intensity (FLOP/byte)")
    fig.update_yaxes(type="log", title="GFLOP/s")
    return fig


def baseline_figure(base):
    import plotly.graph_objects as go

    engines = [json.loads(e).get("engine", "?") for e in base["extra"]]
    base = base.assign(engine=engines)
    fig = go.Figure()
    for engine, sel in base.groupby("engine"):
        fig.add_bar(name=engine, x=sel["metric"] + " " + sel["workload"].fillna("").str.slice(0, 30),
                    y=sel["median"], error_y=dict(type="data", symmetric=False,
                                                  array=sel["p90"] - sel["median"],
                                                  arrayminus=sel["median"] - sel["p10"]))
    fig.update_layout(barmode="group")
    return fig


FIGURE_IDS = {"index": ("tuned-vs-defaults", "roofline", "baselines"),
              "study": ("history", "importance", "parallel"), "study2": ("pareto",)}
