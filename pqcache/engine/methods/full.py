"""Full attention through the tiers: every middle token is attended (the exactness reference)."""

from __future__ import annotations

from dataclasses import dataclass

from pqcache.engine.methods.base import Method, positions_of


@dataclass
class Full(Method):
    name = "full"

    def split(self, config, n_real: int, view) -> tuple[int, int, int]:
        n_init, _, n_local = config.split(n_real)
        return n_init, n_real, n_local  # room for every middle token, whatever the budget

    def select(self, view, q):
        return positions_of(view.candidates[:, None, :].expand(-1, view.H, -1))
