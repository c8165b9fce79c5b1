"""Attention over the assembled device buffer: a masked softmax, nothing else.

Kept separate from the layer so that what a step computes can be read (and tested) on its own:
given the queries, the buffer's keys and values and the mask of what each query may see, it is
exact attention restricted to those tokens.
"""

from __future__ import annotations

import torch


def masked_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    scaling: float,
    softcap: float | None = None,
    known: tuple[int, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q (B, H, G*Q, D) with the G query heads of each KV head stacked; keys, values (B, H, N, D);
    mask (B, H, Q, N) bool -> output (B, Q, H*G, D) and probabilities (B, H, G*Q, N).
    known: (start, scores (B, H, k, G*Q)): the scaled scores of buffer slots start..start+k-1, already computed
    exactly by the selection (PQCache's re-rank); those slots' keys are not read (they need not be there)."""
    return attend_scores(masked_scores(q, keys, mask, scaling, softcap, known), values, mask.shape[2])


def masked_scores(q, keys, mask, scaling: float, softcap=None, known=None) -> torch.Tensor:
    """masked_attention's scaled (and soft-capped) scores (B, H, G*Q, N), -inf where the mask hides a slot."""
    B, H, R, D = q.shape
    Q = mask.shape[2]
    G = R // Q
    if known is None:
        att = query_key_dots(q, keys) * scaling
    else:
        lo, scores = known
        hi = lo + scores.shape[2]
        parts = [query_key_dots(q, keys[:, :, :lo]) * scaling, scores.transpose(-1, -2).to(q.dtype)]
        att = torch.cat(parts + [query_key_dots(q, keys[:, :, hi:]) * scaling], dim=-1)
    att = att.view(B, H, G, Q, -1)
    if softcap is not None:  # Gemma 2 style logit soft-capping
        att = torch.tanh(att / softcap) * softcap
    return att.masked_fill(~mask[:, :, None], float("-inf")).view(B, H, R, -1)


def attend_scores(att: torch.Tensor, values: torch.Tensor, Q: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores (B, H, G*Q, N) from masked_scores, values (B, H, N, D) -> output (B, Q, H*G, D), probabilities."""
    B, H, R, _ = att.shape
    D = values.shape[-1]
    probs = att.float().softmax(dim=-1).to(values.dtype)
    out = probs @ values  # (B, H, G*Q, D)
    return out.view(B, H * (R // Q), Q, D).transpose(1, 2), probs


def query_key_dots(q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """q (B, H, R, D), keys (B, H, n, D) -> q.k (B, H, R, n), contiguous."""
    if q.shape[2] <= 16:  # a decode step: keys (n, D) @ q^T (D, R) streams the keys once; q @ keys^T was 3x slower
        return (keys @ q.transpose(-1, -2)).transpose(-1, -2).contiguous()
    return q @ keys.transpose(-1, -2)
