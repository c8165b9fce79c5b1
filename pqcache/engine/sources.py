"""AttentionTally: the attention each cached token receives while an answer is generated, for the answer's sources.

Attach with `cache.tally_sources(AttentionTally(n_tokens))` before the question runs. Each full-attention layer then
adds, at every step, the weights the step already computed over the tokens it attended to (summed over the query
heads; a question chunk adds its last token's, which give the answer's first token): nothing is scored again. For
PQCache these are the weights over what it selected (sinks, window, picks), for Oracle and full attention the
exact weights. Sliding-window layers are not counted: they see only the last few hundred tokens.

Each weight is multiplied by the norm of the token's value in that layer and head: weight times value is what the
token adds to the step's output, and tokens that draw attention with near-zero values (sinks, line breaks,
punctuation) add little (Kobayashi et al., "Attention is not only a weight", EMNLP 2020). On the real-document set
this put the passage holding the answer among the top 3 for 69% of full attention's answers against 58% with the
weights alone (docs/results.md). The norms are read once when the tally is attached: one pass over the values.

At the sampled steps where an observer computes the exact top-k (the recall panel), the tokens of the exact top-k
that the selection did not attend to are counted too (`missed`): the recall panel made concrete for one answer.

Only positions below n_tokens count (the document; the question and the answer come after it). Row 0 only: an
answer is one row. It only reads the step's tensors, so the tokens generated are the same with it or without.
"""

from __future__ import annotations

import torch


class AttentionTally:
    def __init__(self, n_tokens: int, by_value: bool = True):
        self.n_tokens = n_tokens
        self.by_value = by_value  # weigh the attention by the value norms (False: the softmax weights alone)
        self.received = torch.zeros(n_tokens, dtype=torch.float64)  # (S_doc,) attention received
        self.missed = torch.zeros(n_tokens, dtype=torch.int32)  # (S_doc,) times in the exact top-k, not attended
        self.steps = 0  # layer steps added
        self.value_norms: dict[int, torch.Tensor] = {}  # layer index -> (H_kv, S_doc) norm of each token's value

    def read_values(self, layer_idx: int, values: torch.Tensor):
        """values (H_kv, S_doc, D) of one layer's document tokens: their norms weigh that layer's attention."""
        if self.by_value:
            self.value_norms[layer_idx] = values.float().norm(dim=-1).cpu()  # (H_kv, S_doc)

    def add(self, positions: torch.Tensor, weights: torch.Tensor, layer_idx: int | None = None):
        """positions (H_kv, N) host positions (negative: an empty slot), weights (H_kv, N) the attention they
        received in layer layer_idx (its value norms, when read, weigh them)."""
        positions, weights = positions.cpu(), weights.cpu().to(torch.float64)
        if positions.dim() == 1:  # one head
            positions, weights = positions[None], weights[None]
        keep = (positions >= 0) & (positions < self.n_tokens)
        norms = self.value_norms.get(layer_idx)
        if norms is not None:
            heads = torch.arange(positions.shape[0]).view(-1, 1).expand_as(positions)  # (H_kv, N)
            weights = weights * norms[heads % norms.shape[0], positions.clamp(0, self.n_tokens - 1)]
        self.received.index_add_(0, positions[keep], weights[keep])
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
    tally.add(positions[0], last, layer.layer_idx)
