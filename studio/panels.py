"""The Q&A tab's five live panels for one user: power law, recall, hit rate, timeline, memory.

A panel is redrawn only when its own data changed since this user's page last drew it (otherwise the update is
gr.skip(), which costs the page nothing), and while tokens stream the answer loop has one panel redrawn at most
every PANEL_EVERY_S seconds: a browser redrawing five Plotly figures four times a second could not keep up."""

from __future__ import annotations

import itertools
import threading
from typing import TYPE_CHECKING

import gradio as gr

from viz import figures

if TYPE_CHECKING:
    from pqcache import Instrumentation
    from pqcache.serving.session import DocumentSession

PANELS = ("power", "recall", "hits", "timeline", "memory")
WINDOWS = {"last 5 s": 5.0, "whole run": None}  # the timeline's choices
PANEL_EVERY_S = 1.0  # while tokens stream: one panel (the one drawn longest ago) at most this often
KEEP = object()  # show(): the panels stay on the document they show


def merged_data(session: DocumentSession | None, obs: Instrumentation | None) -> dict:
    """The prefill's recorded data followed by the question's, on one clock."""
    data = {"lanes": [], "events": [], "attention": [], "recall": [], "blocks": [], "selected": []}
    if session is not None and session.prefill_obs is not None:
        data.update({k: list(v) if isinstance(v, list) else v for k, v in session.prefill_obs.to_dict().items()})
    if obs is not None:
        d = obs.to_dict()
        shift = obs.t0 - session.prefill_obs.t0 if session is not None and session.prefill_obs else 0.0
        data["events"] = data["events"] + [
            {**e, "start": e["start"] + shift, "end": e["end"] + shift} for e in d["events"]
        ]
        for key in ("attention", "recall", "blocks", "selected"):
            data[key] = d[key]
    return data


def block_cache_off(session) -> str | None:
    """Why the document has no device block cache, or None. The device window keeps at most a quarter of the
    document in it, in whole blocks (layer/window.py)."""
    if session is None or session.cache is None:
        return None
    cfg = session.config
    # the app always sets a capacity; a replica's document (cluster/views.py) does not say its device
    setting = cfg.block_cache_for(getattr(session, "device", "cpu"))
    capacity = min(setting, session.n_tokens // 4 // cfg.block_size * cfg.block_size)
    if capacity >= cfg.block_size:
        return None
    if setting < cfg.block_size:
        return "No block cache: its capacity is set\nto less than one block (Settings)."
    return (
        f"No block cache for this document: it holds\nat most a quarter of the {session.n_tokens} tokens,"
        f"\nless than one {cfg.block_size}-token block."
    )


def stats_of(session) -> dict | None:
    if session is None or session.cache is None:
        return None
    return session.last_stats or session.cache.stats()


class PanelFeed:
    """What one user's page shows in the panels: the document, the last answer's data and method, the layer
    and timeline window picked; `figures()` returns a figure for each panel whose data changed, else a skip."""

    def __init__(self, device: str = "cpu"):
        self.device = device
        self.session = None
        self.obs: Instrumentation | None = None
        self.method: str | None = None
        self.layer: int | None = None
        self.window: float | None = WINDOWS["last 5 s"]
        self.drawn: dict[str, tuple] = {}  # panel -> the key of the data it shows
        self.draws = dict.fromkeys(PANELS, 0)  # panels drawn, for the tests
        self.drawn_at: dict[str, int] = {}  # panel -> when it was last drawn (a counter)
        self.clock = itertools.count()
        self.lock = threading.Lock()

    def show(self, session=KEEP, obs=None, method=None, **choices):
        """Point the panels at a document (None: none), an answer's observer and method; or change the layer or
        timeline window only (session left out)."""
        with self.lock:
            if session is not KEEP and (session is not self.session or obs is not None):
                self.session, self.obs = session, obs
                self.method = method or getattr(session, "method", None)
            if "layer" in choices:
                layer = choices["layer"]
                self.layer = int(layer) if layer not in (None, "") else None
            if "window" in choices:
                self.window = WINDOWS.get(choices["window"], choices["window"])

    def figures(self, limit: int | None = None, hold: tuple[str, ...] = ()) -> tuple:
        """The five panels: a figure for each whose data changed since it was drawn, gr.skip() for the others.
        limit: draw at most this many (those drawn longest ago first); the others wait for a later call, so the
        browser never redraws several Plotly figures in one go while tokens stream. hold: panels left as they
        are in this call even if their data changed (drawn by a later call without them)."""
        with self.lock:
            session, obs, method = self.session, self.obs, self.method
            data = merged_data(session, obs)
            stats = stats_of(session)
            layers = sorted({r["layer"] for r in data["attention"]})
            layer = self.layer if self.layer in layers or not layers else layers[0]
            tag = (id(session), id(obs))
            n_power = sum(1 for r in data["attention"] if r["layer"] == layer)
            keys = {
                "power": (tag, layer, n_power),
                "recall": (tag, method == "full", len(data["recall"])),
                "hits": (tag, method == "full", len(data["blocks"])),
                "timeline": (tag, self.window, len(data["events"])),
                "memory": (
                    id(session),
                    tuple(sorted((k, v) for k, v in (stats or {}).items() if k.endswith("_bytes"))),
                ),
            }
            draw = {
                "power": lambda: figures.power_law(data, layer),
                "recall": lambda: figures.recall(data, method),
                "hits": lambda: figures.hit_rate(data, method, block_cache_off(session)),
                "timeline": lambda: figures.timeline(data, self.device, self.window),
                "memory": lambda: figures.memory(stats, self.device),
            }
            changed = [name for name in PANELS if name not in hold and self.drawn.get(name) != keys[name]]
            changed.sort(key=lambda name: self.drawn_at.get(name, -1))
            chosen = set(changed[:limit] if limit is not None else changed)
            out = []
            for name in PANELS:
                if name not in chosen:
                    out.append(gr.skip())
                    continue
                self.drawn[name], self.drawn_at[name] = keys[name], next(self.clock)
                self.draws[name] += 1
                out.append(draw[name]())
            return tuple(out)


def placeholders(device: str = "cpu") -> tuple:
    """The panels of a page with no document yet: each says what it will show."""
    return (
        figures.power_law({}),
        figures.recall({}),
        figures.hit_rate({}),
        figures.timeline({}, device, WINDOWS["last 5 s"]),
        figures.memory(None),
    )


class PanelFeeds:
    """Each user's PanelFeed, made when the user first needs one; gone with the user."""

    def __init__(self, device: str = "cpu"):
        self.device = device  # "cpu" or "cuda": where the model that the panels watch runs
        self.by_user: dict[str, PanelFeed] = {}

    def of(self, user: str) -> PanelFeed:
        if user not in self.by_user:
            self.by_user[user] = PanelFeed(self.device)
        return self.by_user[user]

    def forget(self, user: str):
        self.by_user.pop(user, None)
