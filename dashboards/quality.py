"""The quality page of `moetune report` (quality.html): `moetune quality` rows of the store.

Per run (newest first): KL divergence from the reference (mean and p99, nats per token, log axis),
top-1 agreement (%) and perplexity of each variant (the BF16 reference's too), then a table of every
figure with the reference each row is measured against (BF16, or for a knob the same format at the
defaults).
"""
from __future__ import annotations

import html
import json

from results.labels import number, workload_label

FIGURE_IDS = ("quality-kl", "quality-top1", "quality-ppl")
_COLUMNS = ("kl_mean", "kl_median", "kl_p99", "kl_max", "top1_agreement", "ppl")


def run_table(rows):
    """One run's rows → per variant (in the order measured): {label, reference, role, metric: value}."""
    out: dict[str, dict] = {}
    for _, r in rows.iterrows():
        extra = json.loads(r["extra"]) if isinstance(r["extra"], str) else {}
        v = out.setdefault(extra.get("label", r["format"]), {"label": extra.get("label", r["format"]),
                                                              "reference": extra.get("reference"),
                                                              "role": extra.get("role"),
                                                              "ppl_reference": extra.get("ppl_reference")})
        v[r["metric"]] = float(r["median"])
    return list(out.values())


def kl_figure(table):
    import plotly.graph_objects as go

    measured = [v for v in table if v["role"] != "reference"]
    fig = go.Figure()
    for metric, name in (("kl_mean", "mean"), ("kl_p99", "p99")):
        fig.add_bar(name=name, x=[v["label"] for v in measured], y=[v.get(metric) for v in measured])
    fig.update_layout(barmode="group")
    fig.update_yaxes(type="log", title_text="KL divergence (nats per token)")
    return fig


def top1_figure(table):
    import plotly.graph_objects as go

    measured = [v for v in table if v["role"] != "reference"]
    fig = go.Figure(go.Bar(x=[v["label"] for v in measured], y=[100 * v["top1_agreement"] for v in measured]))
    fig.update_yaxes(title_text="top-1 agreement (%)", range=[0, 100])
    return fig


def ppl_figure(table):
    import plotly.graph_objects as go

    fig = go.Figure(go.Bar(x=[v["label"] + (" (reference)" if v["role"] == "reference" else "") for v in table],
                           y=[v["ppl"] for v in table]))
    fig.update_yaxes(title_text="perplexity")
    return fig


def value_table(table) -> str:
    head = "".join(f"<th>{h}</th>" for h in ("variant", "against", "KL mean", "KL median", "KL p99", "KL max",
                                             "top-1 agreement", "PPL", "reference PPL"))
    out = [f"<table><tr>{head}</tr>"]
    for v in table:
        cells = [html.escape(v["label"]), html.escape(v["reference"] or "(the reference)")]
        cells += [number(v[m]) if m in v else "" for m in ("kl_mean", "kl_median", "kl_p99", "kl_max")]
        cells.append(f"{100 * v['top1_agreement']:.2f}%" if "top1_agreement" in v else "")
        cells += [number(v["ppl"]), number(v["ppl_reference"]) if v.get("ppl_reference") is not None else ""]
        out.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    out.append("</table>")
    return "".join(out)


def quality_parts(df, div) -> list[str]:
    """Page parts, newest run first; `div(fig, id, title)` is the report's figure wrapper."""
    rows = df[df["suite"] == "quality"] if len(df) else df
    if not len(rows):
        return []
    parts = ["<p>Each format (as <code>moetune quantize</code> writes it) against BF16 on the same checkpoint, "
             "teacher-forced over the shipped text, the second half of each window scored (llama.cpp's "
             "<code>llama-perplexity --kl-divergence</code>); a knob against the same weights at the defaults. "
             "A KL of zero (the BF16 self-check) has no bar on the log axis: see the table.</p>"]
    for i, run in enumerate(sorted(rows["run_id"].unique(), reverse=True)):
        sel = rows[rows["run_id"] == run]
        extra = json.loads(sel["extra"].iloc[0])
        table = run_table(sel)
        suffix = "" if i == 0 else f"-{i}"
        parts.append(f"<h2>{html.escape(f'Run {run}: ' + ', '.join(sel['model'].dropna().unique()))}</h2>"
                     f"<p>{html.escape(workload_label(sel['workload'].iloc[0]))}; backend "
                     f"{html.escape(str(extra.get('backend')))} on {html.escape(str(extra.get('device')))} "
                     f"({html.escape(str(extra.get('cpu_model')))}, hardware key "
                     f"<code>{html.escape(str(sel['hardware_key'].iloc[0]))}</code>)</p>")
        parts.append(div(kl_figure(table), f"quality-kl{suffix}", "KL divergence from the reference, per token"))
        parts.append(div(top1_figure(table), f"quality-top1{suffix}", "Top-1 agreement with the reference"))
        parts.append(div(ppl_figure(table), f"quality-ppl{suffix}", "Perplexity on the scored tokens"))
        parts.append(value_table(table))
    return parts
