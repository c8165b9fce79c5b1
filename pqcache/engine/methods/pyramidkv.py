"""PyramidKV (Cai et al., 2024): SnapKV's scoring with per-layer budgets that shrink linearly with
depth (more tokens in lower layers), summing to the same total as a uniform budget."""

from __future__ import annotations

import math
from dataclasses import dataclass

from pqcache.engine.methods.snapkv import SnapKV


def pyramid_budgets(k_avg: int, n_layers: int, beta: float, cap: int) -> list[int]:
    """Top-k counts per depth: linear from 2k - k/beta (first) down to k/beta (last), summing to
    n_layers * k_avg, none above `cap` (what a layer can select); the excess goes to the layers
    with room, so a budget that covers everything gives every layer everything."""
    total = min(n_layers * k_avg, n_layers * cap)
    if n_layers == 1:
        return [min(k_avg, cap)]
    k_last = k_avg / beta
    k_first = 2 * k_avg - k_last
    raw = [k_first - d * (k_first - k_last) / (n_layers - 1) for d in range(n_layers)]
    out = [min(cap, math.floor(x)) for x in raw]
    left = total - sum(out)
    while left > 0:  # round-off and clipped excess, to the lowest layers that have room
        room = [d for d in range(n_layers) if out[d] < cap]
        for d in room[:left]:
            out[d] += 1
        left = total - sum(out)
    return out


@dataclass
class PyramidKV(SnapKV):
    name = "pyramidkv"
    beta: float = 20.0

    def split(self, config, n_real, view):
        n_init, k, n_local = config.split(n_real)
        cap = max(0, n_real - n_init - n_local)
        return n_init, pyramid_budgets(k, view.n_depth, self.beta, cap)[view.depth], n_local
