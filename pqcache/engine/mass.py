"""The attention mass a selection holds, estimated from every token's PQ score (issue 64).

PQ gives every middle token an approximate score each step; the sinks and the window are scored exactly, and so
are the candidates of the re-rank. The softmax of those scores (exact where known, approximate elsewhere) is an
estimate of the step's attention over every stored token, and from it:
  - the share of the mass a selection holds (recorded for the instrumentation: it only reads);
  - a budget in mass: the fewest of the top-k picks whose estimated share reaches a target (mass_cut);
  - completion's scores of the tokens left out (engine/completion.py).

Exponentiating a noisy score over-weights the tokens whose noise is positive (E[exp(s + e)] > exp(s)), so the
approximate scores are first shifted by a per-(row, KV head, query row) offset calibrated on the tokens whose exact
and approximate scores are both known (the re-rank's candidates): log sum exp(exact) - log sum exp(approx).

Shapes: B rows, H KV heads, S positions, R query rows per KV head (GQA group x chunk), n or k tokens per head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MASS_ESTIMATE = "mass_estimate"  # the view.state key of a step's MassEstimate, set by the selection


@dataclass
class MassEstimate:
    """A step's estimate of one layer's attention, left by the selection for the attention and the observer."""

    scores: torch.Tensor  # (B, H, S, R) scaled scores: exact where known, calibrated PQ scores elsewhere
    mass: torch.Tensor  # (B, H, S) each token's estimated share of the attention, mean over the query rows
    share: torch.Tensor  # (B, H) the estimated share the attended tokens hold (sinks, window and picks)
    tokens: torch.Tensor  # (B, H) stored tokens attended (sinks, window and valid picks)


def calibration_offset(exact: torch.Tensor, approx: torch.Tensor, known: torch.Tensor) -> torch.Tensor:
    """exact, approx (B, H, n, R): the two scores of the same n tokens; known (B, H, n) bool: the tokens that count
    -> the offset (B, H, 1, R) that makes the approximate scores' sum of exponentials the exact one's over them
    (0 where no token counts)."""
    hidden = ~known[..., None]
    exact_lse = exact.float().masked_fill(hidden, float("-inf")).logsumexp(2, keepdim=True)
    approx_lse = approx.float().masked_fill(hidden, float("-inf")).logsumexp(2, keepdim=True)
    return torch.where(known.any(2)[:, :, None, None], exact_lse - approx_lse, 0.0)


def with_exact(scores: torch.Tensor, pos: torch.Tensor, exact: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
    """scores (B, H, S, R); exact (B, H, n, R) the exact scores of positions pos (B, H, n) where ok (B, H, n) ->
    a copy of scores with those written in (the slots not ok write nothing, whatever position they name)."""
    B, H, S, R = scores.shape
    spill = torch.zeros((B, H, 1, R), dtype=scores.dtype, device=scores.device)  # where the slots not ok go
    out = torch.cat([scores, spill], dim=2)
    where = pos.masked_fill(~ok, S)[..., None].expand(-1, -1, -1, R)
    return out.scatter_(2, where, exact.to(scores.dtype))[:, :, :S]


def token_mass(scores: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """scores (B, H, S, R), valid (B, S) the stored real tokens -> each token's share (B, H, S) of the softmax
    over them, averaged over the query rows (a KV head serves its query heads alike: the GQA group's mean)."""
    hidden = ~valid[:, None, :, None]
    return scores.masked_fill(hidden, float("-inf")).transpose(2, 3).softmax(-1).mean(2)


def held_share(mass: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
    """mass (B, H, S), attended (B, H, S) bool -> the estimated share (B, H) of the attended tokens."""
    return (mass * attended).sum(-1)


def mass_cut(pick_mass: torch.Tensor, valid: torch.Tensor, base: torch.Tensor, target: float, floor: int):
    """The budget in mass. pick_mass (B, H, k) the picks' estimated shares, valid (B, H, k) the picks made, base
    (B, H) the share of what is attended anyway (sinks, window) -> the picks kept (B, H, k): by descending share,
    each pick while the share held before it is short of the target (the fewest that reach it), at least `floor`
    of them (all when fewer). A target of 1 keeps every pick: a float sum of shares may reach 1 early."""
    if target >= 1:
        return valid
    ranked = pick_mass.masked_fill(~valid, -1.0)  # the picks not made sort last
    order = torch.sort(ranked, dim=-1, descending=True, stable=True).indices
    shares = ranked.gather(-1, order).clamp(min=0)
    before = base[..., None] + shares.cumsum(-1) - shares  # the share held before each pick (B, H, k)
    rank = torch.arange(valid.shape[-1], device=valid.device)
    keep = ((before < target) | (rank < floor)) & (rank < valid.sum(-1, keepdim=True))
    return torch.zeros_like(valid).scatter_(-1, order, keep) & valid
