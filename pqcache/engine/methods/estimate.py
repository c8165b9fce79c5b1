"""PQCache's side of the mass estimate (engine/mass.py): the scores a step knows, put together, and the budget in
mass applied to its picks.

A step knows every middle token's PQ score, the exact scores of the re-rank's candidates, and (read here, a few
dozen keys) the exact scores of the sinks and the window. Shapes as in methods/base.py; n: tokens per head.
"""

from __future__ import annotations

import torch

from pqcache.engine.mass import MassEstimate, calibration_offset, held_share, mass_cut, token_mass, with_exact
from pqcache.engine.methods.base import positions_of


def exact_scores_at(host, q: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """q (B, H, R, D) scaled, pos (B, H, n) positions -> their exact scores (B, H, n, R) on the host, computed where
    the keys live (HostTier.key_scores), or from the keys gathered there."""
    B, H, n = pos.shape
    exact = host.key_scores(pos.to(host.host), q)
    if exact is None:
        bh = torch.arange(B * H).view(B, H, 1).expand(B, H, n).reshape(-1)
        keys = host.key_rows(bh, pos.to(host.host).reshape(-1))  # (B*H*n, D) on the host
        exact = keys.view(B, H, n, -1).float() @ q.to(host.host, torch.float32).transpose(-1, -2)
    return exact


def always_attended(view) -> torch.Tensor:
    """(B, S) bool: the stored tokens every step attends (sinks and window: real, not candidates)."""
    return view.valid & ~view.candidates


def fixed_scores(view, q: torch.Tensor):
    """The sinks' and the window's exact scores: positions (B, H, n), validity (B, H, n), scores (B, H, n, R)."""
    fixed = always_attended(view)[:, None, :].expand(-1, view.H, -1)
    if not bool(fixed.any()):
        pos = torch.zeros((view.B, view.H, 0), dtype=torch.long, device=view.device)
        return pos, pos.bool(), torch.zeros((view.B, view.H, 0, q.shape[2]), device=view.device)
    pos, ok = positions_of(fixed)
    return pos, ok, exact_scores_at(view.host, q, pos).to(view.device)


def estimated_scores(view, q: torch.Tensor, approx: torch.Tensor, known) -> torch.Tensor:
    """approx (B, H, S, R) every token's PQ score; known: the re-rank's candidates (positions (B, H, n), validity,
    exact scores (B, H, n, R)), or None -> the step's scores (B, H, S, R): exact where known, the PQ scores shifted
    by the calibration offset elsewhere (engine/mass.py)."""
    scores = approx.float()
    if known is not None:
        pos, ok, exact = known
        exact = exact.to(scores.device)
        at_known = scores.gather(2, pos[..., None].expand(-1, -1, -1, scores.shape[3]))
        scores = with_exact(scores + calibration_offset(exact, at_known, ok), pos, exact, ok)
    pos, ok, exact = fixed_scores(view, q)
    return with_exact(scores, pos, exact, ok)


def estimate_and_cut(view, q, approx, known, top, valid) -> tuple[torch.Tensor, MassEstimate]:
    """The step's MassEstimate for the picks top, valid (B, H, k), and the picks kept: with config.mass, the fewest
    reaching it (mass_cut: the token budget's k the ceiling, mass_floor_tokens the floor); else all of them."""
    config = view.config
    scores = estimated_scores(view, q, approx, known)
    mass = token_mass(scores, view.valid)  # (B, H, S)
    fixed = always_attended(view)[:, None, :]  # (B, 1, S)
    base = held_share(mass, fixed)  # (B, H)
    pick_mass = mass.gather(2, top)
    if config.mass is not None:
        valid = mass_cut(pick_mass, valid, base, config.mass, config.mass_floor_tokens)
    share = base + (pick_mass * valid).sum(-1)
    tokens = fixed.sum(-1) + valid.sum(-1)
    return valid, MassEstimate(scores=scores, mass=mass, share=share, tokens=tokens)
