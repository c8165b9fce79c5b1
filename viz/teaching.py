"""The teaching tab's pictures: the token spotlight, and one picture per step of the walkthrough of a decode
step, from the data pqcache/serving/walkthrough.py recorded in this run (plain dicts; no model code here).

Every series has one legend entry; marks (the hidden fact, thresholds) are legend entries too."""

from __future__ import annotations

import plotly.graph_objects as go

from viz.base import empty, layout

FACT_COLOR = "red"
KIND_COLORS = {"sink": "#9D755D", "top-k": "#E45756", "window": "#4C78A8", "new token": "#54A24B"}
WALK_HEIGHT = 360


def _fact_line(fig: go.Figure, x: float | None, y0, y1, name: str = "the hidden fact"):
    if x is not None:
        fig.add_trace(
            go.Scatter(x=[x, x], y=[y0, y1], mode="lines", name=name, line=dict(color=FACT_COLOR, width=2, dash="dot"))
        )


def heat_strip(
    selections: dict[str, list[int]], n_tokens: int, marks: list[int] | None = None, n_bins: int = 200
) -> go.Figure:
    """One row per method: how many attended positions fall in each slice of the document, with a colour
    scale; the positions in `marks` (hidden facts) drawn as a red dotted line with its own legend entry."""
    if not selections:
        return empty(
            "Token spotlight", "Where each method's attention went over the document.\nPress Run side by side."
        )
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
            colorbar=dict(title=dict(text=f"tokens attended<br>per {width} tokens", side="right"), thickness=12),
            hovertemplate="tokens %{x}+: %{z} attended<extra>%{y}</extra>",
            name="attended tokens",
        )
    )
    for m in marks or []:  # across the whole strip, with a legend entry of its own
        fig.add_vline(x=m, line=dict(color=FACT_COLOR, width=2, dash="dot"))
    if marks:
        line = dict(color=FACT_COLOR, width=2, dash="dot")
        # a zero-length line: nothing drawn (the shape is the mark), but a legend entry
        fig.add_trace(go.Scatter(x=[marks[0]] * 2, y=[names[0]] * 2, mode="lines", name="the hidden fact", line=line))
    fig.update_xaxes(title="document position (tokens)")
    legend = dict(orientation="h", y=1.02, x=1, xanchor="right", yanchor="bottom")
    return layout(fig, "Token spotlight: where each method attended (red: the fact)", showlegend=True, legend=legend)


def codebook(w: dict, labels: dict | None = None) -> go.Figure:
    """Step 1: one sub-space's 2^bits centroids (2-D projection) and a few tokens' sub-keys, each joined to the
    centroid its code names."""
    labels = labels or {}
    cb = w["codebook"]
    j = cb.get("subspace", 0)
    fig = go.Figure()
    xs, ys = zip(*cb["centroids"]) if cb["centroids"] else ((), ())
    fig.add_trace(
        go.Scatter(
            x=xs,
            y=ys,
            mode="markers",
            name=f"the {w['C']} centroids of sub-space {j + 1}",
            marker=dict(color="#bbb", size=8),
            text=[f"centroid {i}" for i in range(len(xs))],
            hoverinfo="text",
        )
    )
    lx, ly = [], []
    for t in cb["tokens"]:
        lx += [t["xy"][0], t["centroid"][0], None]
        ly += [t["xy"][1], t["centroid"][1], None]
    fig.add_trace(go.Scatter(x=lx, y=ly, mode="lines", name="code: the nearest centroid", line=dict(color="#E45756")))
    fig.add_trace(
        go.Scatter(
            x=[t["xy"][0] for t in cb["tokens"]],
            y=[t["xy"][1] for t in cb["tokens"]],
            mode="markers+text",
            name="sub-keys of tokens of the fact",
            text=[f"{labels.get(t['pos'], t['pos'])!s} -> {t['codes'][j]}" for t in cb["tokens"]],
            textposition="top center",
            marker=dict(color="#E45756", size=10, symbol="diamond"),
        )
    )
    fig.update_xaxes(title="main axis 1 of the codebook", zeroline=False)
    fig.update_yaxes(title="main axis 2", zeroline=False)
    title = f"1. Codebook of sub-space {j + 1} of {w['m']} (layer {w['layer']}) and the fact's tokens' codes"
    return layout(fig, title, height=WALK_HEIGHT)


def lookup_table(w: dict, label: str = "") -> go.Figure:
    """Step 2: the table q . centroids of the first query head: m rows x 2^bits columns; the cells named by
    one token's codes, whose sum is its approximate score."""
    table = w["table"]
    fig = go.Figure(
        go.Heatmap(
            z=table,
            y=[f"sub-space {j + 1}" for j in range(len(table))],
            x=list(range(len(table[0]))),
            colorscale="RdBu",
            zmid=0,
            colorbar=dict(title=dict(text="q . centroid", side="right"), thickness=12),
            name="q . centroid",
            hovertemplate="%{y}, centroid %{x}: %{z:.3f}<extra></extra>",
        )
    )
    f = w.get("focus")
    if f:
        fig.add_trace(
            go.Scatter(
                x=f["codes"],
                y=[f"sub-space {j + 1}" for j in range(len(f["codes"]))],
                mode="markers",
                name=f"codes of {label or 'token ' + str(f['pos'])}: score {f['score']:.3f}",
                marker=dict(symbol="square-open", size=16, color="black", line=dict(width=3)),
            )
        )
    fig.update_xaxes(title="centroid (code)")
    return layout(
        fig,
        "2. Lookup table: the query against every centroid",
        height=WALK_HEIGHT,
        legend=dict(orientation="h", y=-0.3),
    )


def search(w: dict) -> go.Figure:
    """Step 3: every candidate's approximate (PQ) score against its exact score; the PQ stage keeps the
    rerank x k best by approximate score, the exact re-rank keeps k; both thresholds drawn."""
    s = w["search"]
    names = [
        "not picked",
        f"PQ candidate, dropped by the exact re-rank ({w['n_wide']} candidates)",
        f"top-k: attended (k = {w['k']})",
    ]
    colors = ["#ccc", "#F58518", "#E45756"]
    fig = go.Figure()
    for kind in (0, 1, 2):
        idx = [i for i, k in enumerate(s["kind"]) if k == kind]
        fig.add_trace(
            go.Scattergl(
                x=[s["approx"][i] for i in idx],
                y=[s["exact"][i] for i in idx],
                mode="markers",
                name=names[kind],
                marker=dict(color=colors[kind], size=5 if kind == 0 else 7),
                text=[f"position {s['pos'][i]}" for i in idx],
                hovertemplate="%{text}<br>PQ %{x:.2e}, exact %{y:.2e}<extra></extra>",
            )
        )
    positive = all(v > 0 for v in s["approx"] + s["exact"])
    lo_x, hi_x = min(s["approx"], default=0), max(s["approx"], default=1)
    lo_y, hi_y = min(s["exact"], default=0), max(s["exact"], default=1)
    t = s["thresholds"]
    if t["approx"] is not None:
        fig.add_trace(
            go.Scatter(
                x=[t["approx"]] * 2,
                y=[lo_y, hi_y],
                mode="lines",
                name="PQ stage threshold",
                line=dict(color="#F58518", dash="dash"),
            )
        )
    if t["exact"] is not None:
        fig.add_trace(
            go.Scatter(
                x=[lo_x, hi_x],
                y=[t["exact"]] * 2,
                mode="lines",
                name="top-k threshold (exact)",
                line=dict(color="#E45756", dash="dash"),
            )
        )
    axis = "log" if positive else "linear"
    unit = (
        "softmax share, summed over the query heads"
        if w["combine"] == "softmax_sum"
        else "q . k summed over the query heads"
    )
    widened = ", each PQ score plus its margin" if w.get("margin") else ""
    fig.update_xaxes(type=axis, title=f"approximate score from the codes{widened} ({unit})")
    fig.update_yaxes(type=axis, title="exact score")
    return layout(
        fig,
        "3. Search: approximate vs exact scores of every candidate",
        height=WALK_HEIGHT,
        legend=dict(orientation="h", y=-0.3),
        margin=dict(l=60, r=10, t=40, b=110),
    )


def fetch(w: dict) -> go.Figure:
    """Step 4: per block of the document, the attended tokens by where they came from: already on the device
    (sinks and window), served from the device block cache, fetched from host memory."""
    f = w["fetch"]
    bs = f["block_size"]
    x = [b * bs for b in range(len(f["held"]))]
    fig = go.Figure()
    series = [
        ("held", "sinks + recent window (kept on the device)", "#4C78A8"),
        ("hits", "top-k served from the device block cache", "#54A24B"),
        ("misses", "top-k fetched from host memory", "#E45756"),
    ]
    for key, name, color in series:
        fig.add_trace(go.Bar(x=x, y=f[key], name=name, marker_color=color, width=bs * 0.9, offset=0))
    fig.update_xaxes(title=f"document position (blocks of {bs} tokens)")
    fig.update_yaxes(title="attended tokens in the block")
    return layout(
        fig,
        "4. Fetch: where the attended tokens came from",
        height=WALK_HEIGHT,
        barmode="stack",
        legend=dict(orientation="h", y=-0.3),
    )


def attention(w: dict, fact: int | None = None) -> go.Figure:
    """Step 5: the attention weights of the step (mean over the query heads) over the tokens it attended, on a log
    axis (the first token alone often takes most of it: an attention sink)."""
    a = w["attention"]
    fig = go.Figure()
    for kind, color in KIND_COLORS.items():
        idx = [i for i, k in enumerate(a["kind"]) if k == kind]
        if idx:
            fig.add_trace(
                go.Scatter(
                    x=[a["pos"][i] for i in idx],
                    y=[a["weight"][i] for i in idx],
                    mode="markers",
                    name=kind,
                    marker=dict(color=color, size=6),
                    hovertemplate="position %{x}: %{y:.2e}<extra>" + kind + "</extra>",
                )
            )
    positive = [v for v in a["weight"] if v > 0]
    lo, hi = (min(positive), max(positive)) if positive else (1e-6, 1)
    _fact_line(fig, fact, lo, hi)
    fig.update_xaxes(title="position in the context (document + question)")
    fig.update_yaxes(title="attention weight", type="log")
    n = len(a["pos"])  # the new token among them
    return layout(
        fig,
        f"5. Attention over {n} of {w['n_tokens'] + 1} tokens, the new one included",
        height=WALK_HEIGHT,
        legend=dict(orientation="h", y=-0.3),
    )
