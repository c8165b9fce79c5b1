"""Plotly figures from instrumentation data (Instrumentation.to_dict(), PQCache.stats()).

No model code here: every function takes plain dicts/lists and returns a go.Figure with a fixed height and a
constant `uirevision` (viz/base.py). Before there is data, each panel says what it will show; for a method it
does not apply to (recall and hit rate under `full`), it says so. The teaching tab's pictures are in
viz/teaching.py (re-exported here: heat_strip); the offline studies' (cost model, recall grid) in viz/studies.py.
"""

from __future__ import annotations

import plotly.graph_objects as go

from viz.base import HEIGHT, empty, layout, step_axis
from viz.teaching import heat_strip

__all__ = ["HEIGHT", "power_law", "recall", "hit_rate", "timeline", "memory", "heat_strip"]

LANE_COLORS = {
    "device compute": "#4C78A8",
    "host clustering": "#F58518",
    "copy to host": "#54A24B",
    "copy to device": "#B279A2",
}
# what each recorded lane is on the machine that ran it: a CPU-only run has no GPU to name
LANE_NAMES = {
    # on a CPU both tiers are the same memory: the "device" tier is the working set attention reads each step
    # (sinks, window, block cache), the host tier every token's keys and values
    "cpu": {
        "device compute": "compute (CPU)",
        "host clustering": "K-Means (CPU, background thread)",
        "copy to host": "new tokens' KV to the host tier (RAM)",
        "copy to device": "picked tokens' KV gathered for attention (RAM)",
    },
    "cuda": {
        "device compute": "compute (GPU)",
        "host clustering": "K-Means (CPU, background thread)",
        "copy to host": "copy GPU -> host memory",
        "copy to device": "copy host memory -> GPU",
    },
}
NOT_FOR_FULL = "Does not apply to full attention:\nit reads every token, so nothing\nis selected or fetched."
TIMELINE_BARS = 1500  # the whole run is drawn with at most about this many bars per lane
IDLE_S = 2.0  # on the whole-run timeline, a pause longer than this is drawn this long (and labelled with its length)
LAYER_LINES = 8  # a model with more layers gets its layers' range and mean instead of a line (and a legend entry) each


def per_layer_lines(rows: list[dict], value, **style) -> go.Figure:
    """One line per layer over decode steps (x = the row's step, y = value(row)); past LAYER_LINES layers, their
    range (a band) and their mean per step."""
    fig = go.Figure()
    layers = sorted({r["layer"] for r in rows})
    if len(layers) <= LAYER_LINES:
        for layer in layers:
            pts = [r for r in rows if r["layer"] == layer]
            x, y = [r["step"] for r in pts], [value(r) for r in pts]
            fig.add_trace(go.Scatter(x=x, y=y, name=f"layer {layer}", **style))
        return fig
    by_step: dict = {}
    for r in rows:
        by_step.setdefault(r["step"], []).append(value(r))
    steps = sorted(by_step)
    low, high = [min(by_step[s]) for s in steps], [max(by_step[s]) for s in steps]
    band = dict(mode="lines", line=dict(width=0, color="#4C78A8"), hoverinfo="skip")
    fig.add_trace(go.Scatter(x=steps, y=low, showlegend=False, **band))
    fig.add_trace(go.Scatter(x=steps, y=high, fill="tonexty", name=f"range over {len(layers)} layers", **band))
    mean = [sum(by_step[s]) / len(by_step[s]) for s in steps]
    fig.add_trace(
        go.Scatter(x=steps, y=mean, mode="lines", name=f"mean of {len(layers)} layers", line=dict(color="#4C78A8"))
    )
    return fig


def power_law(data: dict, layer: int | None = None) -> go.Figure:
    """Sorted attention probabilities (rank vs probability, log-log) at the sampled steps of one layer."""
    rows = data.get("attention", [])
    if layer is None and rows:
        layer = rows[0]["layer"]
    rows = [r for r in rows if r["layer"] == layer]
    title = f"Attention power law (layer {layer})" if layer is not None else "Attention power law"
    if not rows:
        return empty(
            title,
            "How attention concentrates: a few tokens\ncarry most of it (rank vs weight, log-log).\n"
            "Drawn while an answer streams.",
        )
    fig = go.Figure()
    for r in rows[-6:]:  # the latest sampled steps
        fig.add_trace(go.Scatter(x=r["rank"], y=r["prob"], mode="lines", name=f"step {r['step']}"))
    fig.update_xaxes(type="log", title="rank of token")
    fig.update_yaxes(type="log", title="attention probability")
    return layout(fig, title)


def recall(data: dict, method: str | None = None) -> go.Figure:
    """Top-k recall of the selection against the exact top-k (mean over KV heads) per layer over decode steps."""
    title = "Selected vs exact top-k (recall)" + (f": {method}" if method else "")
    if method == "full":
        return empty(title, NOT_FOR_FULL)
    rows = data.get("recall", [])
    if not rows:
        return empty(
            title, "How many of the exact top-k tokens\nthe method selected, per layer.\nDrawn while an answer streams."
        )
    fig = per_layer_lines(rows, lambda r: sum(r["topk_recall"]) / len(r["topk_recall"]), mode="lines+markers")
    step_axis(fig, [r["step"] for r in rows])
    fig.update_yaxes(title="recall", range=[0, 1.05])
    return layout(fig, title)


def hit_rate(data: dict, method: str | None = None, off: str | None = None) -> go.Figure:
    """Block-cache hit rate per layer and of all layers together, per step; `off`: why this document has no
    block cache (the panel says so instead of drawing zeros)."""
    title = "Block-cache hit rate" + (f": {method}" if method else "")
    if method == "full":
        return empty(title, NOT_FOR_FULL)
    if off:
        return empty(title, off)
    rows = data.get("blocks", [])
    if not rows:
        return empty(title, HIT_RATE_NOTE + "\nDrawn while an answer streams.")
    fig = per_layer_lines(rows, lambda r: r["hits"] / max(1, r["hits"] + r["misses"]), mode="lines", opacity=0.6)
    steps = sorted({r["step"] for r in rows})
    every = []  # each step, all layers together: their hits over their fetched tokens
    for s in steps:
        hits = sum(r["hits"] for r in rows if r["step"] == s)
        every.append(hits / max(1, hits + sum(r["misses"] for r in rows if r["step"] == s)))
    fig.add_trace(go.Scatter(x=steps, y=every, mode="lines", name=ALL_LAYERS, line=dict(width=3, color="black")))
    step_axis(fig, steps)
    fig.update_yaxes(title="hit rate (of the fetched tokens)", range=[0, 1.05])
    return layout(fig, title)


HIT_RATE_NOTE = (
    "Of the tokens each step fetched from the host tier,\nthe share found in the block cache: per layer,\n"
    "and all layers together (the thick line)."
)
ALL_LAYERS = "all layers, each step"


def coalesce(events: list[dict], resolution: float) -> list[dict]:
    """Events of one lane merged where they are closer than `resolution` seconds (a whole run stays drawable)."""
    out: list[dict] = []
    for e in sorted(events, key=lambda e: e["start"]):
        if out and e["start"] - out[-1]["end"] < resolution:
            last = out[-1]
            last["end"] = max(last["end"], e["end"])
            last["n"] = last.get("n", 1) + 1
        else:
            out.append(dict(e))
    return out


def timeline(data: dict, device: str = "cpu", window_s: float | None = None) -> go.Figure:
    """Gantt lanes of the recorded events (compute, background K-Means, copies), named for the machine that ran
    them. window_s: only the last window_s seconds (a decode step is visible); None: the whole run."""
    where = "GPU" if device.startswith("cuda") else "CPU"
    span = f"last {window_s:g} s" if window_s else "whole run"
    title = f"Timeline ({span}): compute on the {where}, K-Means in the background"
    events = data.get("events", [])
    if not events:
        return empty(
            title,
            "What ran where and when: compute, background K-Means\nand copies between the tiers. "
            "Drawn when a document loads.",
        )
    pauses = []
    if not window_s:  # the whole run: the pauses between bursts of work drawn short, so the work stays visible
        events, pauses = squeeze_pauses(events)
    t_end = max(e["end"] for e in events)
    t_start = t_end - window_s if window_s else min(e["start"] for e in events)
    names = LANE_NAMES["cuda" if where == "GPU" else "cpu"]
    min_width = (t_end - t_start) / 800  # a span shorter than a pixel or so is drawn a pixel wide
    fig = go.Figure()
    for lane in data.get("lanes", list(LANE_COLORS)):
        ev = [e for e in events if e["lane"] == lane and e["end"] >= t_start]
        if not ev:
            continue
        if len(ev) > TIMELINE_BARS:
            ev = coalesce(ev, (t_end - t_start) / TIMELINE_BARS)
        # one thick line per lane, broken between spans: one SVG path, cheap for the browser to redraw
        xs, text = [], []
        for e in ev:
            xs += [e["start"], max(e["end"], e["start"] + min_width), None]
            what = f"layer {e['layer']}" + (f", {e['n']} spans" if e.get("n", 1) > 1 else "")
            text += [what, what, None]
        name = names.get(lane, lane)
        fig.add_trace(
            go.Scatter(
                x=xs,
                y=[name if x is not None else None for x in xs],
                mode="lines",
                line=dict(width=16, color=LANE_COLORS.get(lane)),
                name=name,
                text=text,
                hovertemplate="%{text}: %{x:.3f} s<extra></extra>",
                connectgaps=False,
            )
        )
    axis = "seconds since the document started loading"
    for at, idle in pauses:
        fig.add_vline(x=at, line=dict(dash="dot", color="#888"), annotation_text=f"idle {idle:.0f} s")
    if pauses:
        axis = f"seconds of work since the document started loading (pauses over {IDLE_S:g} s drawn {IDLE_S:g} s)"
    fig.update_xaxes(title=axis, range=[t_start, t_end])
    return layout(fig, title, showlegend=False, margin=dict(l=230, r=10, t=40, b=40))


def squeeze_pauses(events: list[dict]) -> tuple[list[dict], list[tuple[float, float]]]:
    """The events with every pause longer than IDLE_S between bursts of work (no event running) shortened to IDLE_S,
    later events moved earlier; and the pauses as (where the shortened pause sits, its real length in seconds)."""
    moved, pauses, shift, busy_until = [], [], 0.0, None
    for e in sorted(events, key=lambda e: e["start"]):
        if busy_until is not None and e["start"] - busy_until > IDLE_S:
            idle = e["start"] - busy_until
            pauses.append((busy_until - shift + IDLE_S / 2, idle))
            shift += idle - IDLE_S
        moved.append({**e, "start": e["start"] - shift, "end": e["end"] - shift})
        busy_until = e["end"] if busy_until is None else max(busy_until, e["end"])
    return moved, pauses


TIER_NAMES = {  # the memory panel's bars, as they are on the machine that ran them
    "cpu": ["working KV (RAM)", "all tokens' KV (RAM)"],
    "cuda": ["device KV (GPU)", "host KV (CPU memory)"],
}


def memory(stats: dict | None, device: str = "cpu") -> go.Figure:
    """Bytes per tier from PQCache.stats() (or a generate() stats dict); on a CPU the device tier is the working set
    attention reads each step (sinks, window, block cache), the host tier every token's keys and values."""
    if not stats:
        return empty(
            "Memory per tier",
            "Bytes on the device tier, the host tier\nand in the PQ index.\nDrawn when a document loads.",
        )
    names = [*TIER_NAMES["cuda" if device.startswith("cuda") else "cpu"], "PQ codes + centroids"]
    values = [stats.get("device_kv_bytes", 0), stats.get("host_kv_bytes", 0), stats.get("pq_bytes", 0)]
    colors = ["#4C78A8", "#54A24B", "#F58518"]
    if stats.get("query_bytes"):  # kept on the host so that a question can start SnapKV, PyramidKV, H2O or InfLLM
        names, values, colors = names + ["prefill queries"], values + [stats["query_bytes"]], colors + ["#B279A2"]
    fig = go.Figure(
        go.Bar(
            x=names,
            y=[v / 2**20 for v in values],
            marker_color=colors,
            text=[f"{v / 2**20:.1f} MiB" for v in values],
            textposition="auto",
        )
    )
    fig.update_yaxes(title="MiB")
    return layout(fig, "Memory per tier")
