"""AttentionTally: the attention each cached token receives while an answer is generated, for the answer's sources.

Attach with `cache.tally_sources(AttentionTally(n_tokens))` before the question runs. Each full-attention layer then
adds, at every step, the weights the step already computed over the tokens it attended to (summed over the query
heads; a question chunk adds its last token's, which give the answer's first token): nothing is scored again. For
PQCache these are the weights over what it selected (sinks, window, picks), for Oracle and full attention the
exact weights. Sliding-window layers are not counted: they see only the last few hundred tokens.

At the sampled steps where an observer computes the exact top-k (the recall panel), the tokens of the exact top-k
that the selection did not attend to are counted too (`missed`): the recall panel made concrete for one answer.

Only positions below n_tokens count (the document; the question and the answer come after it). Row 0 only: an
answer is one row. It only reads the step's tensors, so the tokens generated are the same with it or without.
"""

from __future__ import annotations

import torch


class AttentionTally:
    def __init__(self, n_tokens: int):
        self.n_tokens = n_tokens
        self.received = torch.zeros(n_tokens, dtype=torch.float64)  # (S_doc,) attention received
        self.missed = torch.zeros(n_tokens, dtype=torch.int32)  # (S_doc,) times in the exact top-k, not attended
        self.steps = 0  # layer steps added

    def add(self, positions: torch.Tensor, weights: torch.Tensor):
        """positions (N,) host positions (negative: an empty slot), weights (N,) the attention they received."""
        positions, weights = positions.reshape(-1).cpu(), weights.reshape(-1).cpu()
        keep = (positions >= 0) & (positions < self.n_tokens)
        self.received.index_add_(0, positions[keep], weights[keep].to(torch.float64))
        self.steps += 1

    def add_missed(self, positions: torch.Tensor):
        """positions (N,) of exact top-k tokens that the step did not attend to."""
        positions = positions.reshape(-1).cpu()
        positions = positions[(positions >= 0) & (positions < self.n_tokens)]
        self.missed.index_add_(0, positions, torch.ones_like(positions, dtype=torch.int32))


def add_weights(layer, probs: torch.Tensor, positions: torch.Tensor, n_new: int = 1):
    """A step's attention into the layer's tally (when one is attached). probs (B, H, G*Q, N) over the buffer,
    rows (query head, token) as PQLayer reshapes them; positions (B, H, N) the buffer's host positions."""
    tally = getattr(layer, "tally", None)
    if tally is None:
        return
    B, H, R, N = probs.shape
    last = probs[0].view(H, R // n_new, n_new, N)[:, :, -1].sum(1)  # (H, N): the last new token's query heads
    tally.add(positions[0], last)
