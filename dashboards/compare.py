"""The comparison page of `moetune report` (compare.html): `moetune compare` rows of the store.

Per run (latest first): bars of each time metric (TTFT, TPOT, MoE layer) per workload and engine,
median with p10–p90 error bars, and a ratio table in llama-bench's compare style (baseline /
ours: > 1 means moetune is faster; one column per baseline: llama.cpp, ik_llama.cpp, kt-kernel …),
with the settings each engine ran with.
"""
from __future__ import annotations

import html
import json

from results.labels import metric_axis, metric_title, number, workload_label

TIME_METRICS = ("ttft_s", "tpot_s", "moe_s")
FIGURE_ID = "compare"
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b")  # one per engine


def compare_figure(rows):
    """One subplot per time metric present; bars per engine, in milliseconds."""
    from plotly.subplots import make_subplots

    rows = rows.assign(engine=[json.loads(e).get("engine", "?") for e in rows["extra"]],
                       label=[workload_label(w) for w in rows["workload"]])
    metrics = [m for m in TIME_METRICS if (rows["metric"] == m).any()]
    fig = make_subplots(rows=1, cols=max(len(metrics), 1), subplot_titles=[metric_title(m, "s") for m in metrics])
    colours = {}
    for j, metric in enumerate(metrics, start=1):
        sel = rows[rows["metric"] == metric]
        for engine, part in sel.groupby("engine", sort=False):
            colour = colours.setdefault(engine, PALETTE[len(colours) % len(PALETTE)])
            fig.add_bar(name=engine, x=part["label"], y=part["median"] * 1e3, marker_color=colour,
                        legendgroup=engine, showlegend=j == 1, row=1, col=j,
                        error_y=dict(type="data", symmetric=False, array=(part["p90"] - part["median"]) * 1e3,
                                     arrayminus=(part["median"] - part["p10"]) * 1e3))
        fig.update_yaxes(title_text="ms", row=1, col=j)
    fig.update_layout(barmode="group")
    return fig


def ratio_table(rows, engines: tuple[str, ...] | None = None) -> str:
    """HTML: workload | metric | moetune | one column per baseline (median [p10–p90], ratio to ours);
    only `engines`' columns when given. Times in milliseconds, rates in tokens/s."""
    rows = rows.assign(engine=[json.loads(e).get("engine", "?") for e in rows["extra"]])
    names = [n for n in dict.fromkeys(rows["engine"])
             if n != "moetune" and (engines is None or n in engines)]
    out = ["<table><tr><th>workload</th><th>metric</th><th>moetune median [p10–p90]</th>"
           + "".join(f"<th>{html.escape(n)} median [p10–p90] (ratio)</th>" for n in names) + "</tr>"]
    for (wl, metric), grp in rows.groupby(["workload", "metric"], sort=False):
        ours = grp[grp["engine"] == "moetune"]
        if not len(ours):
            continue
        o = ours.iloc[-1]
        name, shown, scale = metric_axis(metric, o["unit"])

        def fmt(r) -> str:
            return f"{number(r['median'] * scale)} [{number(r['p10'] * scale)}–{number(r['p90'] * scale)}] {shown}"

        cells = []
        for n in names:
            theirs = grp[grp["engine"] == n]
            if not len(theirs):
                cells.append("<td>–</td>")
                continue
            t = theirs.iloc[-1]
            ratio = t["median"] / o["median"] if o["direction"] == "minimize" else o["median"] / t["median"]
            cells.append(f"<td>{fmt(t)} <b>{ratio:.2f}×</b></td>")
        out.append(f"<tr><td>{html.escape(workload_label(wl))}</td><td>{html.escape(name)}</td>"
                   f"<td>{fmt(o)}</td>{''.join(cells)}</tr>")
    out.append("</table>")
    return "".join(out)


def settings_list(rows) -> str:
    seen = {}
    for e in rows["extra"]:
        x = json.loads(e)
        seen.setdefault(x.get("engine", "?"), x.get("settings", {}))
    items = "".join(f"<li><b>{html.escape(k)}</b>: <code>{html.escape(json.dumps(v, sort_keys=True))}</code></li>"
                    for k, v in seen.items())
    return f"<ul>{items}</ul>"


def compare_parts(df, div) -> list[str]:
    """Page parts, newest run first; `div(fig, id, title)` is the report's figure wrapper."""
    rows = df[df["suite"] == "compare"] if len(df) else df
    if not len(rows):
        return []
    parts = ["<p>Alternating runs on one machine; ratio = baseline / moetune for times, moetune / baseline "
             "for rates (&gt; 1: moetune faster). Only figures measured here appear on this page.</p>"]
    for i, run in enumerate(sorted(rows["run_id"].unique(), reverse=True)):
        sel = rows[rows["run_id"] == run]
        title = f"Run {run}: {', '.join(sel['model'].dropna().unique())} ({', '.join(sel['format'].dropna().unique())})"
        parts.append(f"<h2>{html.escape(title)}</h2>")
        parts.append(div(compare_figure(sel), FIGURE_ID if i == 0 else f"{FIGURE_ID}-{i}",
                         "Median, bars p10–p90"))
        parts.append(ratio_table(sel))
        parts.append(settings_list(sel))
    return parts
