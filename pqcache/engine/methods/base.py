"""The selection interface shared by every method.

A method decides, at each decode step (or chunk) of a full-attention layer, which middle tokens of
the host tier are attended besides the sinks, the local window and the new tokens. The layer owns
the tiers and the attention; a method sees a read-only view of the layer (layer/view.py) and only
scores and picks (kvpress style: one small dataclass per method):

  - score-based methods (oracle, sparq, pqcache) subclass ScoreMethod and return per-token scores;
    one shared top-k (`select_top`) turns them into positions;
  - rule-based methods (full, streaming, h2o, snapkv, pyramidkv, infllm) implement `select`.

A method whose selection computed the exact scaled q.k of what it picked (PQCache's re-rank; a ScoreMethod with
`exact = True`, the oracle) leaves them in view.state[PICKED_SCORES] (B, H, k, R), aligned with the positions it
returns: the layer then fetches only those tokens' values and attends with these scores.

Shapes: B rows, H KV heads, S positions, R query rows per KV head (GQA group x chunk).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch

PICKED_SCORES = "picked_scores"  # the view.state key of a selection's exact scores (see above)


@dataclass
class Method(ABC):
    name: ClassVar[str] = ""
    observes: ClassVar[bool] = False  # wants each step's attention probabilities (H2O)
    needs_prefill_queries: ClassVar[bool] = False  # computes statistics from the prefill queries
    cache_policy: ClassVar[str | None] = None  # block-cache eviction it runs with (None: the config's)

    def split(self, config, n_real: int, view) -> tuple[int, int, int]:
        """(n_init, n_topk, n_local) for a row with n_real tokens; the budget's meaning is shared."""
        return config.split(n_real)

    def on_prefill(self, view, query: torch.Tensor | None, scaling: float) -> None:
        """After the prefill. query (B, Hq, S, D): the prefill queries (only when needs_prefill_queries)."""

    def on_fork(self, view, parent_state: dict, query: torch.Tensor | None, scaling: float) -> None:
        """A fork of a prefilled layer starts with this method; parent_state is the parent method's."""
        self.on_prefill(view, query, scaling)

    def prepare(self, view, block: bool = False, stop=None) -> None:
        """Before a step (block=False) or when the cache waits for background work (block=True)."""

    def on_append(self, view, start: int, k_new: torch.Tensor) -> None:
        """Tokens k_new (B, H, Q, D) were just stored at positions start..start+Q-1."""

    @abstractmethod
    def select(self, view, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q (B, H, R, D) scaled queries -> positions (B, H, k) among view.candidates, and validity."""

    def observe(self, view, probs: torch.Tensor, positions: torch.Tensor) -> None:
        """probs (B, H, R, N) of the step over the attended tokens at positions (B, H, N)."""

    def stats(self, view) -> dict:
        """Figures of the method's own work on this layer (PQ builds)."""
        return {}

    def device_bytes(self, view) -> int:
        """Device bytes of the method's own state on this layer (PQ codes and centroids)."""
        return 0


@dataclass
class ScoreMethod(Method):
    """A method that scores every stored token; the shared top-k picks the best candidates."""

    exact: ClassVar[bool] = False  # score() is the exact q.k: the picks' scores go to the attention (see above)

    @abstractmethod
    def score(self, view, q: torch.Tensor) -> torch.Tensor:
        """q (B, H, R, D) scaled -> scores (B, H, S, R), one per token and query row."""

    def select(self, view, q):
        scores = self.score(view, q)
        top, valid = select_top(scores, view.candidates, view.ks, view.k_max, view.config.gqa_combine)
        if self.exact:
            view.state[PICKED_SCORES] = scores_at(scores, top)
        return top, valid


def scores_at(scores: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """scores (B, H, S, R), indices pos (B, H, k) along S -> their scores (B, H, k, R)."""
    return scores.gather(2, pos[..., None].expand(-1, -1, -1, scores.shape[3]))


def exact_scores(view, q: torch.Tensor) -> torch.Tensor:
    """q (B, H, R, D) scaled -> exact q.k (B, H, S, R) over every stored token (float32)."""
    return view.keys() @ q.float().transpose(-1, -2)


def combine_rows(scores: torch.Tensor, cand: torch.Tensor, mode: str) -> torch.Tensor:
    """scores (B, H, S, R) -> (B, H, S): query rows combined ("softmax_sum": softmax over the
    candidates per row, then summed, as the official PQCache code; "sum": raw sum); others -inf.
    cand: (B, S) candidates shared by the heads, or (B, H, S) per head."""
    cand = cand[:, None, :] if cand.dim() == 2 else cand  # (B, 1 or H, S)
    if mode == "softmax_sum":
        neg = torch.finfo(scores.dtype).min
        # softmax along the last dim of the (B, H, R, S) view: 4x faster than along dim 2 of (B, H, S, R)
        scores = scores.transpose(-1, -2).masked_fill(~cand[..., None, :], neg).softmax(dim=-1).sum(-2)
    else:
        scores = scores.sum(-1)
    return scores.masked_fill_(~cand, float("-inf"))


def topk_positions(scores: torch.Tensor, ks: list[int], k_max: int):
    """Top-k_b positions of each row b of scores (B, H, S) -> (B, H, k_max) positions and validity.

    Tokens with identical PQ codes get identical scores, so ties at the k-th score are common; they
    go to the earliest positions, which makes the choice independent of padding and of the sort
    algorithm (a left-padded row selects what it selects alone). The tie pass runs only when the
    boundary is ambiguous.
    """
    B, H, S = scores.shape
    ks = [min(k, k_max) for k in ks]  # a budget larger than the context picks what there is
    even = min(ks) == k_max
    vals, top = scores.topk(k_max, dim=-1, sorted=not even)
    if even:
        thresh = vals.min(-1, keepdim=True).values
        tied = scores == thresh
        if B * H == 1:  # a decode step's one row and KV head
            return _earliest_ties(top, vals, thresh, tied)
        in_rank = torch.ones_like(vals, dtype=torch.bool)
        tied_in = (vals == thresh).sum(-1)
    else:
        kt = torch.tensor(ks, device=scores.device).view(B, 1, 1)
        thresh = vals.gather(-1, (kt - 1).clamp(min=0).expand(B, H, 1))
        tied = scores == thresh
        in_rank = torch.arange(k_max, device=scores.device).view(1, 1, -1) < kt
        tied_in = ((vals == thresh) & in_rank).sum(-1)
    if not bool((tied.sum(-1) > tied_in).any()):
        return top, in_rank
    strict = scores > thresh
    need = torch.tensor(ks, device=scores.device).view(B, 1) - strict.sum(-1)  # (B, H)
    chosen = strict | (tied & (tied.cumsum(-1) <= need[..., None]))
    return positions_of(chosen)


def _earliest_ties(top: torch.Tensor, vals: torch.Tensor, thresh: torch.Tensor, tied: torch.Tensor):
    """topk_positions' rule for one row (1, 1, k) whose top-k took all k, in fewer operators than the general pass:
    when positions at the k-th score were left out, the picks above it, then the earliest positions at it (the set
    the general pass's mask chooses, in that order instead of by position)."""
    k = top.shape[-1]
    above = vals > thresh  # (1, 1, k)
    n_above = above.sum()
    if int(tied.sum() + n_above) == k:  # every position at the k-th score is in the top-k: unambiguous
        return top, torch.ones_like(top, dtype=torch.bool)
    earliest = tied.view(-1).nonzero().squeeze(1)[: k - int(n_above)]  # in position order
    picks = torch.cat([top.masked_select(above), earliest]).view(1, 1, k)
    return picks, torch.ones_like(picks, dtype=torch.bool)


def positions_of(chosen: torch.Tensor):
    """chosen (B, H, S) bool -> positions (B, H, n) in increasing order and validity (n = max count)."""
    counts = chosen.sum(-1)
    if bool((counts == counts.flatten()[0]).all()):
        top = chosen.nonzero()[:, 2].view(*chosen.shape[:2], -1)
        return top, torch.ones_like(top, dtype=torch.bool)
    n = int(counts.max())
    pos = torch.arange(chosen.shape[-1], device=chosen.device, dtype=torch.float32)
    key = torch.where(chosen, -pos, torch.full_like(pos, float("-inf")))  # earliest first
    flag, top = key.topk(n, dim=-1)
    return top, flag > float("-inf")


def select_top(scores_srh: torch.Tensor, cand, ks, k_max, mode: str):
    """Per-token scores (B, H, S, R) -> combined -> top-k positions, restricted to candidates (B, S)."""
    scores = combine_rows(scores_srh, cand, mode)
    # the candidates end where the local window starts: torch's top-k selection over a row ending in a block of
    # equal values (the window's -inf) costs 4x more than over the candidates alone (0.44 against 0.11 ms at 32K)
    S = cand.shape[-1]
    end = max(k_max, S - int(cand.any(0).flip(-1).int().argmax()))
    top, valid = topk_positions(scores[..., :end], ks, k_max)
    return top, valid & torch.gather(cand[:, None, :].expand(-1, scores.shape[1], -1), 2, top)
