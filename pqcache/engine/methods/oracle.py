"""Oracle top-k: the exact scores of the current query, PQCache's budget (its upper bound)."""

from __future__ import annotations

from dataclasses import dataclass

from pqcache.engine.methods.base import ScoreMethod, exact_scores


@dataclass
class Oracle(ScoreMethod):
    name = "oracle"
    exact = True  # the attention reuses the picks' scores instead of fetching their keys

    def score(self, view, q):
        return exact_scores(view, q)
