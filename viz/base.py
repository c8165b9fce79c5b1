"""What every figure shares: a fixed height, a constant `uirevision` (live updates keep the user's zoom and do
not flicker), the white template, placeholders that say what a panel will show, whole-number step axes."""

from __future__ import annotations

import math

import plotly.graph_objects as go
import plotly.io as pio

HEIGHT = 300
TEMPLATE = "plotly_white"
# A template passed to a figure is validated and copied into it: about 9 ms a figure here, two to three times the
# rest of a small panel's cost (scripts/decode_probe.py panels), paid while the answer decodes beside it. Plotly
# applies its default template without that, so viz makes the white one the default once, unless the process already
# chose another.
if pio.templates.default == "plotly":
    pio.templates.default = TEMPLATE


def layout(fig: go.Figure, title: str, **kw) -> go.Figure:
    kw.setdefault("height", HEIGHT)
    kw.setdefault("margin", dict(l=50, r=10, t=40, b=40))
    fig.update_layout(title=dict(text=title, font=dict(size=14)), uirevision="keep", **kw)
    return fig


def empty(title: str, note: str, height: int = HEIGHT) -> go.Figure:
    """A placeholder: the title, and in the middle what the panel shows or why it has nothing to show."""
    fig = layout(go.Figure(), title, height=height)
    fig.add_annotation(
        text=note.replace("\n", "<br>"),
        showarrow=False,
        x=0.5,
        y=0.5,
        xref="paper",
        yref="paper",
        font=dict(color="#777", size=12),
    )
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    return fig


def step_axis(fig: go.Figure, steps, title: str = "decode step") -> go.Figure:
    """An x axis of decode steps with whole-number ticks only (no 0.5, 1.5)."""
    steps = list(steps) or [0]
    span = max(steps) - min(steps)
    nice = [m * 10**e for e in range(0, 7) for m in (1, 2, 5)]  # 1, 2, 5, 10, 20, 50, ...
    dtick = next(d for d in nice if d >= span / 8)
    fig.update_xaxes(title=title, tick0=0, dtick=dtick, tickformat="d")
    return fig


def log_range(values, pad: float = 1.3) -> list[float]:
    """The log10 range [lo, hi] of a log axis that covers `values` (positive ones) with some room."""
    positive = [v for v in values if v and v > 0]
    if not positive:
        return [0.0, 1.0]
    return [math.log10(min(positive) / pad), math.log10(max(positive) * pad)]
