"""Plotly figures from instrumentation data (Instrumentation.to_dict(), PQCache.stats()).

No model code here: every function takes plain dicts/lists and returns a go.Figure with a fixed
height and a constant `uirevision`, so live updates keep the user's zoom and do not flicker.
"""

from __future__ import annotations

import plotly.graph_objects as go

HEIGHT = 300
LANE_COLORS = {
    "device compute": "#4C78A8",
    "host clustering": "#F58518",
    "copy to host": "#54A24B",
    "copy to device": "#B279A2",
}


def _layout(fig: go.Figure, title: str, **kw) -> go.Figure:
    fig.update_layout(
        title=dict(text=title, font=dict(size=14)),
        height=HEIGHT,
        margin=dict(l=50, r=10, t=40, b=40),
        uirevision="keep",
        template="plotly_white",
        **kw,
    )
    return fig


def _empty(title: str, note: str) -> go.Figure:
    fig = _layout(go.Figure(), title)
    fig.add_annotation(text=note, showarrow=False, x=0.5, y=0.5, xref="paper", yref="paper", font=dict(color="#888"))
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    return fig


def power_law(data: dict, layer: int | None = None) -> go.Figure:
    """Sorted attention probabilities (rank vs probability, log-log) at the sampled steps of a layer."""
    rows = [r for r in data.get("attention", []) if layer is None or r["layer"] == layer]
    title = f"Attention power law (layer {layer})" if layer is not None else "Attention power law"
    if not rows:
        return _empty(title, "no sampled step yet")
    fig = go.Figure()
    for r in rows[-6:]:  # the latest sampled steps
        fig.add_trace(go.Scatter(x=r["rank"], y=r["prob"], mode="lines", name=f"step {r['step']}"))
    fig.update_xaxes(type="log", title="rank of token")
    fig.update_yaxes(type="log", title="attention probability")
    return _layout(fig, title)


def recall(data: dict) -> go.Figure:
    """PQ top-k recall of the exact top-k (mean over KV heads) per layer over decode steps."""
    rows = data.get("recall", [])
    if not rows:
        return _empty("PQ vs exact top-k recall", "no sampled step yet")
    fig = go.Figure()
    for layer in sorted({r["layer"] for r in rows}):
        pts = [r for r in rows if r["layer"] == layer]
        fig.add_trace(
            go.Scatter(
                x=[r["step"] for r in pts],
                y=[sum(r["topk_recall"]) / len(r["topk_recall"]) for r in pts],
                mode="lines+markers",
                name=f"layer {layer}",
            )
        )
    fig.update_xaxes(title="decode step")
    fig.update_yaxes(title="recall", range=[0, 1.05])
    return _layout(fig, "PQ vs exact top-k recall")


def hit_rate(data: dict) -> go.Figure:
    """Block-cache hit rate per layer (per step) and cumulative over all layers."""
    rows = data.get("blocks", [])
    if not rows:
        return _empty("Block-cache hit rate", "no retrieval yet")
    fig = go.Figure()
    for layer in sorted({r["layer"] for r in rows}):
        pts = [r for r in rows if r["layer"] == layer]
        fig.add_trace(
            go.Scatter(
                x=[r["step"] for r in pts],
                y=[r["hits"] / max(1, r["hits"] + r["misses"]) for r in pts],
                mode="lines",
                name=f"layer {layer}",
                opacity=0.6,
            )
        )
    steps = sorted({r["step"] for r in rows})
    hits = misses = 0
    cum = []
    for s in steps:
        hits += sum(r["hits"] for r in rows if r["step"] == s)
        misses += sum(r["misses"] for r in rows if r["step"] == s)
        cum.append(hits / max(1, hits + misses))
    fig.add_trace(go.Scatter(x=steps, y=cum, mode="lines", name="cumulative", line=dict(width=3, color="black")))
    fig.update_xaxes(title="decode step")
    fig.update_yaxes(title="hit rate", range=[0, 1.05])
    return _layout(fig, "Block-cache hit rate")


def timeline(data: dict, max_events: int = 4000) -> go.Figure:
    """Gantt lanes of the recorded events: device compute, host clustering, copies."""
    events = data.get("events", [])[-max_events:]
    if not events:
        return _empty("CPU/GPU overlap timeline", "no events yet")
    fig = go.Figure()
    for lane in data.get("lanes", list(LANE_COLORS)):
        ev = [e for e in events if e["lane"] == lane]
        if not ev:
            continue
        fig.add_trace(
            go.Bar(
                base=[e["start"] for e in ev],
                x=[max(e["end"] - e["start"], 1e-5) for e in ev],
                y=[lane] * len(ev),
                orientation="h",
                name=lane,
                marker_color=LANE_COLORS.get(lane),
                customdata=[e["layer"] for e in ev],
                hovertemplate="layer %{customdata}<br>%{base:.3f}s + %{x:.4f}s<extra></extra>",
            )
        )
    fig.update_xaxes(title="seconds")
    return _layout(fig, "CPU/GPU overlap timeline", barmode="overlay", showlegend=False)


def memory(stats: dict | None) -> go.Figure:
    """Bytes per tier from PQCache.stats() (or a generate() stats dict)."""
    if not stats:
        return _empty("Memory per tier", "no document loaded")
    names = ["device KV", "host KV", "PQ codes + centroids"]
    values = [stats.get("device_kv_bytes", 0), stats.get("host_kv_bytes", 0), stats.get("pq_bytes", 0)]
    fig = go.Figure(
        go.Bar(
            x=names,
            y=[v / 2**20 for v in values],
            marker_color=["#4C78A8", "#54A24B", "#F58518"],
            text=[f"{v / 2**20:.1f} MiB" for v in values],
            textposition="auto",
        )
    )
    fig.update_yaxes(title="MiB")
    return _layout(fig, "Memory per tier")


def heat_strip(
    selections: dict[str, list[int]], n_tokens: int, marks: list[int] | None = None, n_bins: int = 200
) -> go.Figure:
    """One row per method: how many attended positions fall in each slice of the document; the
    positions in `marks` (hidden facts) drawn as vertical lines."""
    if not selections:
        return _empty("Token spotlight", "run the methods first")
    width = max(1, -(-n_tokens // n_bins))
    z, names = [], []
    for name, positions in selections.items():
        row = [0] * (-(-n_tokens // width))
        for p in positions:
            if 0 <= p < n_tokens:
                row[p // width] += 1
        z.append(row)
        names.append(name)
    fig = go.Figure(
        go.Heatmap(
            z=z,
            y=names,
            x=[i * width for i in range(len(z[0]))],
            colorscale="Viridis",
            showscale=False,
            hovertemplate="tokens %{x}+: %{z} attended<extra>%{y}</extra>",
        )
    )
    for m in marks or []:
        fig.add_vline(x=m, line=dict(color="red", width=2, dash="dot"))
    fig.update_xaxes(title="document position (tokens)")
    return _layout(fig, "Token spotlight: attended positions per method (red: the fact)")


def cost_curves(rows: list[dict]) -> go.Figure:
    """KV memory on the device against context length: full attention vs PQCache (cost model)."""
    if not rows:
        return _empty("Device KV memory (model)", "no rows")
    fig = go.Figure()
    x = [r["context"] for r in rows]
    fig.add_trace(go.Scatter(x=x, y=[r["full_gib"] for r in rows], name="full KV cache", mode="lines+markers"))
    fig.add_trace(go.Scatter(x=x, y=[r["pqcache_gib"] for r in rows], name="PQCache device tier", mode="lines+markers"))
    if rows[0].get("gpu_gib"):
        fig.add_hline(y=rows[0]["gpu_gib"], line=dict(color="red", dash="dash"), annotation_text="GPU memory")
    fig.update_xaxes(type="log", title="context length (tokens)")
    fig.update_yaxes(type="log", title="GiB")
    return _layout(fig, "KV memory vs context length (cost model, not a measurement)")


def recall_grid(rows: list[dict]) -> go.Figure:
    """Top-k recall of the selection (mean over layers) against the re-rank factor, one line per
    (m, bits, budget) (`eval recall --json` rows); rerank 1 is PQ alone, as in the paper."""
    if not rows:
        return _empty("top-k recall vs re-rank factor", "no rows")
    fig = go.Figure()
    lines: dict[tuple, dict[int, list[float]]] = {}
    for r in rows:
        lines.setdefault((r["m"], r["bits"], r["budget"]), {}).setdefault(r["rerank"], []).append(r["recall"])
    for (m, bits, budget), cells in sorted(lines.items()):
        xs = sorted(cells)
        fig.add_trace(
            go.Scatter(
                x=xs,
                y=[sum(cells[x]) / len(cells[x]) for x in xs],
                mode="lines+markers",
                name=f"m={m}, bits={bits}, budget {budget}",
                hovertemplate="rerank %{x}: %{y:.3f}<extra></extra>",
            )
        )
    fig.update_xaxes(
        title="re-rank factor (PQ picks rerank x k candidates, exact scores pick k)",
        type="log",
        tickvals=sorted({r["rerank"] for r in rows}),
    )
    fig.update_yaxes(title="top-k recall (mean over layers)", range=[0, 1.05])
    return _layout(fig, "Top-k recall on the bundled model's keys")
