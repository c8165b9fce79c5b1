"""Instrumentation: an observer that records what the cache does, as plain data for viz/.

Attach with `cache.instrument(Instrumentation(...))`. Off by default; when attached it only reads
tensors (exact scores are computed only at the sampled steps that ask for them), so generated
tokens are the same with it on or off.

Records
  events     timeline spans: lane ("device compute", "host clustering", "copy to host",
             "copy to device"), layer, start, end (seconds since the observer started)
  attention  per layer at sampled steps: sorted attention probabilities (mean over heads), log-sampled
  recall     per layer and KV head at sampled steps: PQ top-k recall of the exact top-k, and the
             share of the exact attention mass that the attended tokens carry
  blocks     per layer and step: block-cache hits and misses of the retrieved tokens
  selected   (selections=True) per layer and step: the positions each row and KV head attended to
  mass       per layer and step, where the selection estimated it (a budget in mass, completion): the estimated
             share of the attention mass the attended tokens hold, and the tokens attended, per KV head
  bytes      bytes moved to the host tier and to the device tier
  cost_s     the seconds its own recording took (probe.py adds them): the price of watching, beside the work
"""

from __future__ import annotations

import functools
import threading
import time
from contextlib import contextmanager
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

LANES = ("device compute", "host clustering", "copy to host", "copy to device")
RECORDS = ("events", "attention", "recall", "blocks", "selected", "mass")  # the kinds of records, each a list


@functools.lru_cache(maxsize=64)
def log_ranks(n: int, n_sorted: int) -> tuple[int, ...]:
    """Up to n_sorted log-spaced ranks (1-based) of n tokens (cached: every sampled step of a layer asks for the
    same n, or one more)."""
    ranks = np.unique(np.rint(np.logspace(0, np.log10(max(n, 1)), n_sorted)).astype(np.int64))
    return tuple(int(rank) for rank in ranks if rank <= n)


class Instrumentation:
    def __init__(
        self,
        timeline: bool = True,
        attention_every: int = 0,
        recall_every: int = 0,
        selections: bool = False,
        max_events: int = 50_000,
        n_sorted: int = 64,
        max_share: float | None = None,
    ):
        """attention_every, recall_every: sample every Nth step for the power law and the recall (0: never); those
        steps score every stored token exactly. max_share: skip a due sample while the recording has cost more than
        this share of the time since the first step it saw, so watching costs at most about that much whatever the
        context length (None: every due step is sampled)."""
        self.timeline = timeline
        self.selections = selections
        self.attention_every = attention_every
        self.recall_every = recall_every
        self.max_share = max_share
        self._sampled: dict[int, bool] = {}  # step -> whether it is sampled (every layer of a step alike)
        self._first = None  # when the first step was seen (max_share's clock)
        self.max_events = max_events
        self.n_sorted = n_sorted
        self.t0 = time.perf_counter()
        self.sync = None  # set by the cache: makes device spans end when the device work ends
        self._lock = threading.Lock()
        self.events: list[dict] = []
        self.attention: list[dict] = []
        self.recall: list[dict] = []
        self.blocks: list[dict] = []
        self.selected: list[dict] = []
        self.mass: list[dict] = []
        self.bytes = {"to_host": 0, "to_device": 0}
        self.cost_s = 0.0  # seconds spent recording (the sampled steps' exact scores included): what observing costs

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def event(self, lane: str, layer: int, start: float, end: float, **extra):
        if not self.timeline:
            return
        with self._lock:
            if len(self.events) < self.max_events:
                self.events.append({"lane": lane, "layer": layer, "start": start, "end": end, **extra})

    @contextmanager
    def span(self, lane: str, layer: int, **extra):
        start = self.now()
        try:
            yield
        finally:
            if self.sync is not None and lane != "host clustering":
                self.sync()
            self.event(lane, layer, start, self.now(), **extra)

    def moved(self, direction: str, nbytes: int):
        with self._lock:
            self.bytes[direction] += int(nbytes)

    def wants_attention(self, step: int) -> bool:
        return self.attention_every > 0 and step % self.attention_every == 0 and self._within_share(step)

    def wants_recall(self, step: int) -> bool:
        return self.recall_every > 0 and step % self.recall_every == 0 and self._within_share(step)

    def _within_share(self, step: int) -> bool:
        """Whether a due step is sampled under max_share (decided once per step, for all its layers)."""
        if self.max_share is None:
            return True
        if step not in self._sampled:
            now = time.perf_counter()
            self._first = self._first or now
            self._sampled[step] = self.cost_s <= self.max_share * (now - self._first)
        return self._sampled[step]

    def ranks(self, n: int) -> list[int]:
        """The log-spaced ranks (1-based, at most n_sorted) the power law keeps of n tokens."""
        return list(log_ranks(n, self.n_sorted))  # a list of its own: the records are plain data

    def record_attention(self, layer: int, step: int, n_tokens: int, ranks: list[int], probs: list[float]):
        """The attention probabilities at the given ranks (descending order, mean over heads) of n_tokens tokens,
        for a power-law plot."""
        self.attention.append({"layer": layer, "step": step, "n_tokens": n_tokens, "rank": ranks, "prob": probs})

    def record_recall(
        self,
        layer: int,
        step: int,
        topk_recall: list[float],
        mass_recall: list[float],
        k: int,
        qhead_recall: list[float] | None = None,
    ):
        """topk_recall, mass_recall per KV head; qhead_recall per query head (its own exact top-k)."""
        self.recall.append(
            {
                "layer": layer,
                "step": step,
                "k": k,
                "topk_recall": topk_recall,
                "mass_recall": mass_recall,
                "qhead_recall": qhead_recall,
            }
        )

    def record_selection(self, layer: int, step: int, positions: list[list[list[int]]]):
        """positions[b][h]: the token positions that row b, KV head h attended to at this step."""
        self.selected.append({"layer": layer, "step": step, "positions": positions})

    def record_mass(self, layer: int, step: int, share: torch.Tensor, tokens: torch.Tensor):
        """share (B, H) the estimated share of the attention mass held, tokens (B, H) the tokens attended: their
        means over the rows, per KV head (engine/mass.py)."""
        self.mass.append(
            {
                "layer": layer,
                "step": step,
                "estimated_share": share.float().mean(0).tolist(),
                "tokens": tokens.float().mean(0).tolist(),
            }
        )

    def mean_tokens(self, layer: int) -> float | None:
        """The tokens attended per KV head and step, averaged over the layer's mass records (None: none)."""
        rows = [t for r in self.mass if r["layer"] == layer for t in r["tokens"]]
        return sum(rows) / len(rows) if rows else None

    def record_blocks(self, layer: int, step: int, hits: int, misses: int):
        self.blocks.append({"layer": layer, "step": step, "hits": hits, "misses": misses})

    def hit_rate(self, layer: int | None = None) -> float | None:
        rows = [b for b in self.blocks if layer is None or b["layer"] == layer]
        total = sum(b["hits"] + b["misses"] for b in rows)
        return sum(b["hits"] for b in rows) / total if total else None

    def to_dict(self) -> dict:
        with self._lock:
            return {
                "lanes": list(LANES),
                "events": list(self.events),
                "attention": list(self.attention),
                "recall": list(self.recall),
                "blocks": list(self.blocks),
                "selected": list(self.selected),
                "mass": list(self.mass),
                "bytes": dict(self.bytes),
            }

    def since(self, counts: dict) -> dict:
        """What was recorded after `counts` (records per kind, updated in place): to_dict()'s lists cut to
        their new items, the byte counts and this recording's t0. A Ray replica streams these to the app."""
        with self._lock:
            out = {"bytes": dict(self.bytes), "t0": self.t0}
            for key in RECORDS:
                rows = getattr(self, key)
                out[key] = rows[counts.get(key, 0) :]
                counts[key] = len(rows)
            return out

    def merge(self, part: dict):
        """Append a part from since() (recorded in another process): the panels read this copy as they read the
        original. t0 is the recording's, so its times line up with others from the same process."""
        with self._lock:
            for key in RECORDS:
                getattr(self, key).extend(part.get(key, []))
            self.bytes = dict(part.get("bytes", self.bytes))
            self.t0 = part.get("t0", self.t0)
