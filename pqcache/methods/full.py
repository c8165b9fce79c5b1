"""Full attention through the tiers: every middle token is attended (the exactness reference)."""
from __future__ import annotations

from dataclasses import dataclass

from .base import Method, positions_of


@dataclass
class Full(Method):
    name = "full"

    def select(self, layer, q, cand, ks, k_max):
        return positions_of(cand[:, None, :].expand(-1, layer.H, -1))
