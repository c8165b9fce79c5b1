"""Oracle top-k: the exact scores of the current query, PQCache's budget (its upper bound)."""
from __future__ import annotations

from dataclasses import dataclass

from pqcache.engine.methods.base import Method, exact_scores, select_top


@dataclass
class Oracle(Method):
    name = "oracle"

    def select(self, layer, q, cand, ks, k_max):
        return select_top(exact_scores(layer, q), cand, ks, k_max, layer.config.gqa_combine)
