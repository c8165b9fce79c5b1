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
) -> tuple[torch.Tensor, torch.Tensor]:
    """q (B, H, G*Q, D) with the G query heads of each KV head stacked; keys, values (B, H, N, D);
    mask (B, H, Q, N) bool -> output (B, Q, H*G, D) and probabilities (B, H, G*Q, N)."""
    B, H, R, D = q.shape
    Q = mask.shape[2]
    G = R // Q
    att = (q @ keys.transpose(-1, -2)).view(B, H, G, Q, -1) * scaling
    if softcap is not None:  # Gemma 2 style logit soft-capping
        att = torch.tanh(att / softcap) * softcap
    att = att.masked_fill(~mask[:, :, None], float("-inf"))
    probs = att.float().softmax(dim=-1).to(values.dtype).view(B, H, R, -1)
    out = probs @ values  # (B, H, G*Q, D)
    return out.view(B, H * G, Q, D).transpose(1, 2), probs
