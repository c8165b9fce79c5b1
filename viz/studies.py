"""Plotly figures of the studies run apart from an answer: the cost model's memory curves (the Cost model tab), the
recall grid of `eval recall` and the fidelity curve of `eval fidelity` (scripts/render_figure.py). Plain rows in, a
go.Figure out (viz/base.py)."""

from __future__ import annotations

import plotly.graph_objects as go

from viz.base import empty, layout, log_range


def cost_curves(rows: list[dict], context: int | None = None) -> go.Figure:
    """GPU memory against context length (cost model): weights + full KV, weights + PQCache's device tier, and
    the GPU's memory, on a log axis over the data's range; `context`: the one asked about, marked."""
    title = "GPU memory vs context length (cost model, not a measurement)"
    if not rows:
        return empty(title, "no rows")
    fig = go.Figure()
    x = [r["context"] for r in rows]
    weights = [r.get("weights_gib", 0.0) for r in rows]
    full = [w + r["full_gib"] for w, r in zip(weights, rows)]
    pq = [w + r["pqcache_gib"] for w, r in zip(weights, rows)]
    fig.add_trace(go.Scatter(x=x, y=full, name="weights + full KV cache", mode="lines+markers"))
    fig.add_trace(go.Scatter(x=x, y=pq, name="weights + PQCache device tier", mode="lines+markers"))
    values = full + pq
    gpu = rows[0].get("gpu_gib")
    if gpu:
        fig.add_trace(
            go.Scatter(
                x=[x[0], x[-1]],
                y=[gpu, gpu],
                name=f"GPU memory ({gpu:g} GiB)",
                mode="lines",
                line=dict(color="red", dash="dash"),
            )
        )
        values.append(gpu)
    y_range = log_range(values)
    if context:
        fig.add_trace(
            go.Scatter(
                x=[context, context],
                y=[10 ** y_range[0], 10 ** y_range[1]],
                mode="lines",
                name=f"this context ({context:,} tokens)",
                line=dict(color="#888", dash="dot"),
            )
        )
    fig.update_xaxes(type="log", title="context length (tokens)")
    fig.update_yaxes(type="log", title="GiB", range=y_range)
    return layout(fig, title, legend=dict(orientation="h", y=-0.25), margin=dict(l=50, r=10, t=40, b=90), height=360)


def recall_grid(rows: list[dict]) -> go.Figure:
    """Top-k recall of the selection (mean over layers) against the re-rank factor, one line per
    (m, bits, budget) (`eval recall --json` rows); rerank 1 is PQ alone, as in the paper."""
    if not rows:
        return empty("top-k recall vs re-rank factor", "no rows")
    fig = go.Figure()
    lines: dict[tuple, dict[int, list[float]]] = {}
    for r in rows:
        key = (r["m"], r["bits"], r["budget"], bool(r.get("opq")))
        lines.setdefault(key, {}).setdefault(r["rerank"], []).append(r["recall"])
    for (m, bits, budget, opq), cells in sorted(lines.items()):
        xs = sorted(cells)
        fig.add_trace(
            go.Scatter(
                x=xs,
                y=[sum(cells[x]) / len(cells[x]) for x in xs],
                mode="lines+markers",
                name=f"m={m}, bits={bits}{', OPQ' if opq else ''}, budget {budget}",
                hovertemplate="rerank %{x}: %{y:.3f}<extra></extra>",
            )
        )
    fig.update_xaxes(
        title="re-rank factor (PQ picks rerank x k candidates, exact scores pick k)",
        type="log",
        tickvals=sorted({r["rerank"] for r in rows}),
    )
    fig.update_yaxes(title="top-k recall (mean over layers)", range=[0, 1.05])
    return layout(fig, "Top-k recall on the bundled model's keys")


def fidelity_curve(rows: list[dict]) -> go.Figure:
    """The attention output's relative error against full attention's, over the mean tokens attended per KV head
    (log axis), one line per setting through its budgets (`eval fidelity` rows: per layer, averaged here over the
    layers; its summary rows draw the same); rows that failed or lack a measure are left out."""
    title = "Attention output error vs tokens attended"
    points: dict[str, dict] = {}  # method -> budget -> (tokens, errors) over the layers
    for r in rows:
        if r.get("error") is None and r.get("rel_error") is not None and r.get("tokens"):
            cell = points.setdefault(r["method"], {}).setdefault(r["budget"], ([], []))
            cell[0].append(r["tokens"])
            cell[1].append(r["rel_error"])
    if not points:
        return empty(title, "no rows")
    fig = go.Figure()
    for method, cells in points.items():
        line = sorted(
            (sum(t) / len(t), sum(e) / len(e), budget) for budget, (t, e) in cells.items()
        )  # by tokens, so the line runs left to right
        fig.add_trace(
            go.Scatter(
                x=[p[0] for p in line],
                y=[p[1] for p in line],
                mode="lines+markers",
                name=method,
                text=["every token" if p[2] is None else f"budget {p[2]:g}" for p in line],
                hovertemplate="%{text}: %{x:.0f} tokens, error %{y:.3f}<extra>" + method + "</extra>",
            )
        )
    fig.update_xaxes(title="tokens attended per KV head (mean over layers and steps)", type="log")
    fig.update_yaxes(title="||o - o_full|| / ||o_full|| (mean over layers)", rangemode="tozero")
    return layout(fig, title, height=360)
