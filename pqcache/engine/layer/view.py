"""What a selection method sees of a layer: a read-only view, built fresh for each call.

A method reads keys on demand, the candidates and budgets of this step, and keeps its own
per-layer state in `state`. Methods with background work of their own (PQCache's K-Means) also get
the cache's executor, its closed event, the timeline span and `fall_back`. Nothing here lets a
method change the tiers: the layer composes them.
"""

from __future__ import annotations

from functools import cached_property

import torch


class LayerView:
    def __init__(self, layer):
        self._layer = layer
        self.config = layer.config
        self.host = layer.host
        self.B, self.H, self.D, self.S = layer.host.B, layer.host.H, layer.host.D, layer.host.S
        self.device = layer.host.device
        self.layer_idx, self.depth, self.n_depth = layer.layer_idx, layer.depth, layer.n_depth
        self.state: dict = layer.method_state
        self.executor, self.closed, self.iters_for = layer.executor, layer.closed, layer.iters_for

    def keys(self, start: int = 0, end: int | None = None) -> torch.Tensor:
        """Exact keys of positions [start, end) -> (B, H, n, D) float32 on the device."""
        return self.host.keys(start, end, device=self.device, dtype=torch.float32)

    @property
    def valid(self) -> torch.Tensor:
        """(B, S) bool: real (not padding) tokens."""
        return self.host.valid[:, : self.S]

    @cached_property
    def candidates(self) -> torch.Tensor:
        """(B, S) bool: the middle tokens a method picks from (real, not a sink, older than the window)."""
        return self._layer.candidates()

    @cached_property
    def ks(self) -> list[int]:
        """Top-k count of each row at this step."""
        return self._layer.topk_counts()

    @property
    def k_max(self) -> int:
        return min(max(self.ks), self.S)

    @property
    def n_local(self) -> list[int]:
        """Recent-window length of each row at this step (0 before the window is laid out)."""
        window = self._layer.window
        return [0] * self.B if window is None else list(window.n_local)

    def block_map(self) -> tuple[int, torch.Tensor] | None:
        """The device block cache's (block size, a copy of its block -> slot map (B, H, n_blocks + 1), -1: not
        cached), for pictures of what it holds; None without a block cache."""
        window = self._layer.window
        blocks = None if window is None else window.blocks
        return None if blocks is None else (blocks.bs, blocks.block_slot.clone())

    def span(self, lane: str):
        """A timeline span of this layer (a no-op when no observer is attached)."""
        return self._layer.span(lane)

    @property
    def fallback(self) -> str | None:
        """Why this layer (or the one it was forked from) gave up its method, if it did."""
        return self._layer.fallback

    def fall_back(self, reason: str):
        """Give up this method for the layer: exact attention over every token from now on."""
        self._layer.fall_back(reason)
