"""`moetune report [--out DIR]`: static plotly HTML from the result store, readable offline.

    DIR/plotly.min.js        written once, beside the pages (no network needed)
    DIR/index.html           the page to open first: the machine, the tuned profile in use, its gain
                             over the defaults with the spread, moetune against llama.cpp and
                             KTransformers; then tuned vs defaults, kernel rooflines, baselines
                             (one figure per unit), the study list
    DIR/compare.html         `moetune compare` runs: TTFT/TPOT/MoE bars with spreads, ratio tables
    DIR/quality.html         `moetune quality` runs: KL divergence (mean, p99), top-1 agreement and
                             perplexity of each format against BF16, and a table
    DIR/study-<n>.html       per study: tuning history + best so far, knob importances,
                             parallel coordinates, Pareto front (two objectives)

Everything is read from the Parquet store (results.store), so a report can be built on another
machine from a copied results folder (and the profiles from the profile folder). Workloads are
named by results.labels (`batch 4 × 128/16`, `prompt 512`), never shown as raw dicts; each axis
has one unit (seconds shown in milliseconds). Each figure is a div with a stable id (FIGURE_IDS
says which a page should have), which the headless-browser test checks.
"""
from __future__ import annotations

import html
import json
import re
from pathlib import Path

import numpy as np

from dashboards.quality import FIGURE_IDS as QUALITY_FIGURE_IDS
from results.labels import metric_axis, metric_title, number, workload_label

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


def build_report(out: Path | None = None, results: Path | None = None, profiles: Path | None = None) -> Path:
    """Write every page; returns the folder. `profiles`: the profile folder (default: the engine's)."""
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
            wl = workload_label(rows["workload"].iloc[0])
            parts = study_figures(rows)
            drift = df[(df["study"] == study) & (df["suite"] == "autotune-defaults")]
            if len(drift):  # the defaults re-measured through the study: the machine's drift
                parts.append(_div(drift_figure(drift), "drift",
                                  "The defaults re-measured through the study (drift; trials are scored against the nearest)"))
            _write(out / name, f"Study {study}" + (f": {wl}" if wl else ""), parts)
            links.append(f'<li><a href="{name}">{html.escape(study)}</a> ({html.escape(wl)}; '
                         f'{rows["trial"].nunique()} trials)</li>')
    from dashboards.compare import compare_parts

    compare = compare_parts(df, _div)
    if compare:  # `moetune compare` runs: their own page
        _write(out / "compare.html", "moetune vs baselines", compare)
        links.append('<li><a href="compare.html">moetune vs baselines (moetune compare)</a></li>')
    from dashboards.quality import quality_parts

    quality = quality_parts(df, _div)
    if quality:  # `moetune quality` runs: their own page
        _write(out / "quality.html", "Quantization quality against BF16", quality)
        links.append('<li><a href="quality.html">quantization quality against BF16 (moetune quality)</a></li>')
    body = (first_page(df, profiles) + ["<h2>Figures</h2>"] + overview_figures(df)
            + [f"<h2>Studies</h2><ul>{''.join(links) or '<li>none yet</li>'}</ul>"])
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
    name = _axis(first)[0]
    wl = workload_label(rows["workload"].iloc[0])
    parts = [f"<p>Workload: <b>{html.escape(wl)}</b></p>" if wl else "",
             _div(history_figure(first), "history", f"Tuning history: {name} per trial, best so far"),
             _div(importance_figure(first), "importance", "Knob importance (ω²: share of the variance of log value)"),
             _div(parallel_figure(first), "parallel", f"Parallel coordinates: knobs → {name}")]
    if len(metrics) == 2:
        names = [_axis(rows[rows["metric"] == m])[0] for m in metrics]
        parts.append(_div(pareto_figure(rows, metrics), "pareto", f"Pareto front: {names[0]} vs {names[1]}"))
    return parts


def _axis(rows) -> tuple[str, float]:
    """(axis title with its unit, scale to that unit) of the rows' metric (one metric)."""
    metric = rows["metric"].iloc[0]
    unit = rows["unit"].iloc[0] if "unit" in rows else ""  # rows of old stores may lack it
    return metric_title(metric, unit), metric_axis(metric, unit)[2]


def history_figure(rows):
    import plotly.graph_objects as go

    title, scale = _axis(rows)
    fig = go.Figure()
    for status, marker in (("ok", "circle"), ("pruned", "x"), ("failed", "triangle-down"),
                           ("wrong", "diamond"), ("timeout", "square")):
        sel = rows[rows["status"] == status]
        if len(sel):
            y = (sel["median"] * scale).where(np.isfinite(sel["median"]), other=None)
            fig.add_scatter(x=sel["trial"], y=y, mode="markers", name=status, marker_symbol=marker,
                            text=sel["error"].fillna(""), hovertemplate="trial %{x}: %{y}<br>%{text}")
    ok = rows[rows["status"] == "ok"].sort_values("trial")
    if len(ok):
        best = ok["median"].cummin() if ok["direction"].iloc[0] != "maximize" else ok["median"].cummax()
        fig.add_scatter(x=ok["trial"], y=best * scale, mode="lines", name="best so far", line_shape="hv")
    fig.update_xaxes(title="trial")
    fig.update_yaxes(title=title)
    return fig


def drift_figure(rows):
    """The defaults' median at each re-measurement (x: trials finished then), one line per metric and
    workload point: how much the machine drifted while the study ran."""
    import plotly.graph_objects as go

    fig = go.Figure()
    rows = rows.assign(after=[json.loads(e).get("after_trials", 0) if isinstance(e, str) else 0 for e in rows["extra"]],
                       point=[workload_label(w) for w in rows["workload"]])
    for (metric, point), sel in rows.groupby(["metric", "point"], sort=False):
        title, scale = _axis(sel)
        sel = sel.sort_values("after")
        fig.add_scatter(x=sel["after"], y=sel["median"] * scale, mode="lines+markers",
                        name=f"{title} @ {point}" if point else title)
    fig.update_xaxes(title="trials finished")
    fig.update_yaxes(title=f"the defaults' median: {_axis(rows)[0]}")  # a study's metrics share a unit
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
    title, scale = _axis(ok) if len(ok) else ("value", 1.0)
    y = (ok["median"].astype(float) * scale).tolist()
    dims.append(dict(label=title, values=y))
    fig = go.Figure(go.Parcoords(dimensions=dims, line=dict(color=y, colorscale="Viridis", showscale=True)))
    fig.update_layout(margin=dict(t=110))
    return fig


def pareto_front(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats on both (both minimized)."""
    return [i for i, (a, b) in enumerate(points)
            if not any(c <= a and d <= b and (c < a or d < b) for c, d in points)]


def pareto_figure(rows, metrics):
    import plotly.graph_objects as go

    axes = {m: _axis(rows[rows["metric"] == m]) for m in metrics}
    ok = rows[rows["status"] == "ok"].pivot_table(index="trial", columns="metric", values="median")
    ok = ok.dropna()
    for m in metrics:
        ok[m] = ok[m] * axes[m][1]
    pts = list(zip(ok[metrics[0]], ok[metrics[1]]))
    front = sorted(pareto_front(pts), key=lambda i: pts[i][0])
    fig = go.Figure()
    fig.add_scatter(x=ok[metrics[0]], y=ok[metrics[1]], mode="markers", name="trials",
                    text=[f"trial {t}" for t in ok.index])
    fig.add_scatter(x=[pts[i][0] for i in front], y=[pts[i][1] for i in front], mode="lines+markers",
                    name="Pareto front", line_shape="hv")
    fig.update_xaxes(title=axes[metrics[0]][0])
    fig.update_yaxes(title=axes[metrics[1]][0])
    return fig


# ------------------------------------------------------------------ the first page

# (engine in the rows, name on the page, `moetune compare --baselines` value)
BASELINES = (("llama.cpp", "llama.cpp", "llama.cpp"), ("ik_llama.cpp", "ik_llama.cpp", "ik"),
             ("kt-kernel", "KTransformers (kt-kernel)", "ktransformers"))


def first_page(df, profiles: Path | None = None) -> list[str]:
    """What a user reads first: the machine, the profile in use, its gain, the baselines."""
    from engine.fingerprint import fingerprint

    here = fingerprint()
    profs = _profiles(profiles)
    return [machine_section(df, here, profs), profile_section(profs, here["hardware_key"]),
            gain_section(df, profs), baselines_section(df)]


def _profiles(directory: Path | None) -> list:
    """Every readable profile in the folder, whichever machine made it (broken files are skipped)."""
    from engine.errors import MoetuneError
    from engine.profile import load_profile, profile_dir

    out = []
    for path in sorted(Path(directory or profile_dir()).glob("*.toml")):
        try:
            out.append(load_profile(path, force=True))
        except MoetuneError:
            continue
    return out


def machine_section(df, here: dict, profs: list) -> str:
    """This machine, and every other machine whose rows the results hold (described where one of
    its profiles carries its fingerprint)."""
    from engine.fingerprint import describe

    key = here["hardware_key"]
    counts = df["hardware_key"].value_counts() if len(df) else {}
    lines = [f"<li><b>{html.escape(describe(here))}</b> — hardware key <code>{key}</code>, where this "
             f"report was built ({int(counts.get(key, 0))} result rows)</li>"]
    known = {p.hardware_key: p.meta.get("fingerprint") or {} for p in profs}
    for other, n in (counts.items() if len(df) else []):
        if other and other != key:
            fp = known.get(other)
            what = html.escape(describe(fp)) if fp else "not described here (no profile of it in the folder)"
            lines.append(f"<li>{what} — hardware key <code>{html.escape(str(other))}</code> "
                         f"({int(n)} result rows)</li>")
    return f"<h2>Machine</h2><ul>{''.join(lines)}</ul>"


def _gain_text(median: float, low: float, high: float) -> str:
    verdict = ("beyond the spread" if low > 0 else
               "worse beyond the spread" if high < 0 else "within the spread")
    return f"{median:+.1%} [{low:+.1%}, {high:+.1%}] ({verdict})"


def profile_section(profs: list, key: str) -> str:
    """The profiles `moetune serve` and `LLM(..., profile="auto")` load on this machine."""
    mine = [p for p in profs if p.hardware_key == key]
    others = len(profs) - len(mine)
    head = "<h2>Tuned profile in use</h2>"
    note = (f"<p>{others} profile(s) in the folder were tuned on other machines (refused here unless forced).</p>"
            if others else "")
    if not mine:
        return head + ("<p>No tuned profile for this machine: the engine runs with the defaults "
                       "(<code>moetune autotune</code> writes one).</p>") + note
    rows = ["<table><tr><th>model</th><th>objective (workload)</th><th>study, trial</th><th>knobs changed</th>"
            "<th>kernel tables</th><th>gain over the defaults, median [p10, p90]</th><th>made</th></tr>"]
    for p in mine:
        m = p.meta
        trial = ("kernel tier only" if m.get("objective") == "kernel tier" else
                 f"trial {m['trial']}" if m.get("trial", -1) not in (-1, None) else "defaults kept")
        knobs = ", ".join(f"{k} = {v}" for k, v in sorted(p.knobs.items())) or "none"
        tables = ", ".join(f"{op} ({len(t)} rows)" for op, t in sorted(p.kernel_tables.items())) or "none"
        spread = m.get("gain_spread", {})
        gains = "<br>".join(f"{html.escape(metric_axis(name, None)[0])}: "
                            + (_gain_text(g, *spread[name]) if len(spread.get(name, [])) == 2 else f"{g:+.1%}")
                            for name, g in m.get("gain", {}).items()) or "—"
        wl = workload_label(m.get("workload"))
        objective = str(m.get("objective", "")) + (f" ({wl})" if wl else "")
        made = f"{m.get('created', '')} (commit {m.get('commit', '?')})"
        cells = [f"{html.escape(p.model_key)}<br><small>{html.escape(str(p.path))}</small>", html.escape(objective),
                 html.escape(f"{m.get('study', '')}, {trial}"), html.escape(knobs), html.escape(tables), gains,
                 html.escape(made)]
        rows.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    rows.append("</table>")
    return head + "".join(rows) + note


def _latest_confirm(df):
    confirm = df[df["suite"] == "autotune-confirm"] if len(df) else df
    if not len(confirm):
        return confirm
    return confirm[confirm["run_id"] == confirm.groupby("study")["run_id"].transform("max")]


def _label(extra) -> str:
    return json.loads(extra).get("label", "?") if isinstance(extra, str) else "?"


def paired_gains(tuned, defaults, direction: str) -> list[float]:
    """Per round of the confirmation (the candidates were measured alternately): the gain of the
    tuned sample over the defaults' sample of the same round (0.1: 10 % better)."""
    n = min(len(tuned), len(defaults))
    if direction == "minimize":
        return [d / t - 1.0 for t, d in zip(tuned[:n], defaults[:n]) if t > 0]
    return [t / d - 1.0 for t, d in zip(tuned[:n], defaults[:n]) if d > 0]


def gain_section(df, profs: list) -> str:
    """Per study, the latest confirmation: the defaults against the kept (else the best) finalist."""
    from results.store import stats

    head = "<h2>Gain over the defaults</h2>"
    latest = _latest_confirm(df)
    if not len(latest):
        return head + "<p>No confirmation round yet: run <code>moetune autotune</code>.</p>"
    kept = {(p.meta.get("study"), p.meta.get("trial")) for p in profs if p.meta.get("kept", True)}
    out = [head, "<p>The confirmation round re-measures the defaults and the finalists alternately; the gain "
                 "is paired round by round (median [p10, p90]; &gt; 0: better than the defaults).</p>",
           "<table><tr><th>study</th><th>workload</th><th>metric</th><th>defaults, median [p10–p90]</th>"
           "<th>tuned</th><th>tuned, median [p10–p90]</th><th>gain</th></tr>"]
    for (study, metric), sel in latest.groupby(["study", "metric"], sort=False):
        labels = [_label(e) for e in sel["extra"]]
        base = [r for r, lab in zip(sel.itertuples(), labels) if lab == "defaults"]
        cands = [(r, lab) for r, lab in zip(sel.itertuples(), labels) if lab != "defaults"]
        if not base or not cands:
            continue
        d = base[-1]
        sign = 1 if d.direction == "minimize" else -1
        chosen = next(((r, lab) for r, lab in cands if (study, _trial(lab)) in kept), None)
        r, lab = chosen or min(cands, key=lambda c: sign * c[0].median)
        g = stats(paired_gains(list(r.samples), list(d.samples), d.direction))
        _, shown, scale = metric_axis(metric, d.unit)
        val = (lambda x: f"{number(x.median * scale)} [{number(x.p10 * scale)}–{number(x.p90 * scale)}] {shown}")
        gain = _gain_text(g["median"], g["p10"], g["p90"]) if g["repeats"] else "—"
        out.append(f"<tr><td>{html.escape(study)}</td><td>{html.escape(workload_label(d.workload))}</td>"
                   f"<td>{html.escape(metric_axis(metric, d.unit)[0])}</td><td>{val(d)}</td>"
                   f"<td>{html.escape(lab)}{' (in the profile)' if chosen else ' (best finalist, not kept)'}</td>"
                   f"<td>{val(r)}</td><td>{gain}</td></tr>")
    out.append("</table>")
    return "".join(out)


def _trial(label: str) -> int | None:
    parts = label.split()
    return int(parts[1]) if len(parts) == 2 and parts[0] == "trial" and parts[1].isdigit() else None


def baselines_section(df) -> str:
    """Ratios against each baseline, from its latest `moetune compare` run."""
    from dashboards.compare import ratio_table

    rows = df[df["suite"] == "compare"] if len(df) else df
    engines = [json.loads(e).get("engine", "?") if isinstance(e, str) else "?" for e in rows["extra"]]
    out = ["<h2>Against llama.cpp, ik_llama.cpp and KTransformers</h2>"]
    for engine, name, option in BASELINES:
        runs = rows["run_id"][[e == engine for e in engines]] if len(rows) else []
        if not len(runs):
            out.append(f"<h3>{html.escape(name)}</h3><p>No comparison run yet "
                       f"(<code>moetune compare --baselines {option}</code>).</p>")
            continue
        sel = rows[rows["run_id"] == runs.max()]
        models = ", ".join(sel["model"].dropna().unique())
        out.append(f"<h3>{html.escape(name)}</h3><p>Run {html.escape(runs.max())} ({html.escape(models)}); "
                   "ratio &gt; 1: moetune faster. Every run: <a href=\"compare.html\">compare.html</a>.</p>"
                   + ratio_table(sel, engines=(engine,)))
    return "".join(out)


# ------------------------------------------------------------------ overview figures

def overview_figures(df) -> list[str]:
    parts = []
    confirm = _latest_confirm(df)
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
    for shown, fig in baseline_figures(base):
        parts.append(_div(fig, "baselines" + (f"-{slug(shown)}" if shown else ""),
                          f"Against baselines{', ' + shown if shown else ''} (latest run; median, bars p10–p90)"))
    if not parts:
        parts.append("<p>No results yet: run <code>moetune autotune</code>.</p>")
    return parts


def tuned_vs_defaults_figure(latest):
    """The latest confirmation of each study (`latest`): defaults and finalists, one subplot (and
    one unit) per metric."""
    from plotly.subplots import make_subplots

    metrics = list(dict.fromkeys(latest["metric"]))
    units = {m: latest[latest["metric"] == m]["unit"].iloc[0] for m in metrics}
    fig = make_subplots(rows=1, cols=len(metrics), subplot_titles=[metric_title(m, units[m]) for m in metrics])
    for j, metric in enumerate(metrics, start=1):
        sel = latest[latest["metric"] == metric]
        _, shown, scale = metric_axis(metric, units[metric])
        labels = [_label(e) for e in sel["extra"]]
        wls = [workload_label(w) for w in sel["workload"]]
        base = {st: m for st, m, lab in zip(sel["study"], sel["median"], labels) if lab == "defaults"}
        sign = -1 if (sel["direction"] == "minimize").all() else 1
        text = [("" if lab == "defaults" or st not in base else
                 f"{(base[st] / m if sign < 0 else m / base[st]) - 1:+.1%}")
                for st, m, lab in zip(sel["study"], sel["median"], labels)]
        x = labels if sel["study"].nunique() == 1 else [f"{lab}<br>{wl}" for lab, wl in zip(labels, wls)]
        if len(set(x)) < len(x):  # two studies on one workload
            x = [f"{lab}<br>{wl}<br>{st[-24:]}" for lab, wl, st in zip(labels, wls, sel["study"])]
        fig.add_bar(x=x, y=sel["median"] * scale, name=metric, showlegend=False, row=1, col=j, text=text,
                    hovertext=[f"{st}: {wl}" for st, wl in zip(sel["study"], wls)],
                    error_y=dict(type="data", symmetric=False, array=(sel["p90"] - sel["median"]) * scale,
                                 arrayminus=(sel["median"] - sel["p10"]) * scale))
        fig.update_yaxes(title_text=shown, row=1, col=j)
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
                name = workload_label(wl) + (f" ({fmt})" if fmt and "format" not in wl else "")
                who = f" ({x['label']})" if x.get("label") else ""
                pts.append((flops / nbytes, flops / t / 1e9, f"{name}{who}: {nbytes / t / 1e9:.2f} GB/s"))
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


def baseline_figures(base) -> list[tuple[str, object]]:
    """[(unit, figure)]: one figure per unit shown (ms, tokens/s), one subplot per metric, bars per
    engine and workload; the latest row of each (engine, workload, metric)."""
    from plotly.subplots import make_subplots

    from dashboards.compare import PALETTE

    if not len(base):
        return []
    base = base.assign(engine=[json.loads(e).get("engine", "?") for e in base["extra"]],
                       label=[workload_label(w) for w in base["workload"]])
    base = base.sort_values("ts", kind="stable").groupby(["engine", "workload", "metric"], sort=False).tail(1)
    by_unit: dict[str, list[str]] = {}
    for metric, unit in dict.fromkeys(zip(base["metric"], base["unit"])):
        by_unit.setdefault(metric_axis(metric, unit)[1], []).append(metric)
    figures = []
    for shown, metrics in by_unit.items():
        fig = make_subplots(rows=1, cols=len(metrics),
                            subplot_titles=[metric_axis(m, None)[0] for m in metrics])
        colours: dict[str, str] = {}
        for j, metric in enumerate(metrics, start=1):
            sel = base[base["metric"] == metric]
            scale = metric_axis(metric, sel["unit"].iloc[0])[2]
            for engine, part in sel.groupby("engine", sort=False):
                colour = colours.setdefault(engine, PALETTE[len(colours) % len(PALETTE)])
                fig.add_bar(name=engine, x=part["label"], y=part["median"] * scale, marker_color=colour,
                            legendgroup=engine, showlegend=engine not in {t.name for t in fig.data},
                            row=1, col=j, error_y=dict(type="data", symmetric=False,
                                                       array=(part["p90"] - part["median"]) * scale,
                                                       arrayminus=(part["median"] - part["p10"]) * scale))
            fig.update_yaxes(title_text=shown, row=1, col=j)
        fig.update_layout(barmode="group")
        figures.append((shown, fig))
    return figures


FIGURE_IDS = {"index": ("tuned-vs-defaults", "roofline", "baselines-ms", "baselines-tokens-s"),
              "study": ("history", "importance", "parallel"), "study2": ("pareto",),
              "quality": QUALITY_FIGURE_IDS}
