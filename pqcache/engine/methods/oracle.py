"""Oracle top-k: the exact scores of the current query, PQCache's budget (its upper bound)."""

from __future__ import annotations

from dataclasses import dataclass

from pqcache.engine.methods.base import PICKED_SCORES, ScoreMethod, exact_scores, select_top


@dataclass
class Oracle(ScoreMethod):
    name = "oracle"

    def score(self, view, q):
        return exact_scores(view, q)

    def select(self, view, q):
        """The exact top-k; their exact scores go to the attention in place of their keys (base.py)."""
        scores = self.score(view, q)  # (B, H, S, R)
        top, valid = select_top(scores, view.candidates, view.ks, view.k_max, view.config.gqa_combine)
        view.state[PICKED_SCORES] = scores.gather(2, top[..., None].expand(-1, -1, -1, scores.shape[3]))
        return top, valid
