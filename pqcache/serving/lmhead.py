"""A cheaper LM head whose greedy argmax stays exact: int8 scores first, exact scores for the few that can win.

Gemma 3's head is a 262,144 x 640 projection: one decode step reads all of it (671 MB in float32, 335 MB in
bf16), more than the 18 decoder layers together. Here each step reads an int8 copy (168 MB) and a bound:

    |h . w_i - h . w~_i| <= ||h||_1 * max_j |w_ij - w~_ij| + bf16 rounding of h   (w~: the int8 row, rescaled)

so every token whose approximate logit plus its bound reaches the best approximate logit minus its bound is a
candidate, and only the candidates' logits are computed exactly, with the model's own weights. The argmax of
the returned logits is the argmax of the exact head (up to floating-point summation order); the other
entries are the approximate logits, all below the winner. Rows of a longer forward (prefill without
logits_to_keep, scoring) use the exact head throughout.
"""

from __future__ import annotations

import torch
from torch import nn

from pqcache.serving.int8 import int8_kernel_available, quantize_rows

BF16_UNIT = 2.0**-8  # relative rounding error of bf16 (8 bits of mantissa, round to nearest: 2**-9; doubled)


class ExactArgmaxHead(nn.Module):
    def __init__(self, head: nn.Linear, max_rows: int = 4, max_candidates: int = 16384):
        """head: the model's LM head (weight (V, D), possibly tied to the embedding; kept, not copied).
        max_rows: forwards with more rows than this use the exact head. max_candidates: more candidates
        than this (a flat distribution) and the step computes the exact head instead."""
        super().__init__()
        self.head, self.max_rows, self.max_candidates = head, max_rows, max_candidates
        w = head.weight.detach().float()  # (V, D)
        q, scale = quantize_rows(w)
        self.register_buffer("q", q, persistent=False)  # (V, D) int8
        self.register_buffer("scale", scale, persistent=False)  # (V,) bf16
        # the bound uses the scale the kernel really multiplies by (bf16), so it covers its rounding too
        err = (w - q.float() * self.scale.float()[:, None]).abs().amax(1)  # (V,)
        # per row, what one unit of ||h||_1 can move its logit: the int8 error plus the activations' bf16 rounding
        # (computed once here, so a step spends one multiply on it)
        self.register_buffer("slack", err + w.abs().amax(1) * BF16_UNIT, persistent=False)  # (V,)
        self.stats = {"steps": 0, "candidates": 0, "exact_fallbacks": 0}

    @property
    def weight(self):  # transformers reads lm_head.weight (tying, dtype checks)
        return self.head.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (B, T, D) -> logits (B, T, V)."""
        B, T, D = hidden.shape
        if B * T > self.max_rows or hidden.device.type != "cpu":
            return self.head(hidden)
        x = hidden.reshape(B * T, D)
        xb = x.to(torch.bfloat16)
        approx = torch.ops.aten._weight_int8pack_mm(xb, self.q, self.scale).float()  # (N, V)
        xf = x.float()
        l1 = xf.abs().sum(-1, keepdim=True)  # (N, 1)
        # the weights' int8 error, the activations' bf16 rounding, and the output rounding of the kernel
        # and of the exact head (bf16 each)
        bound = self.slack * l1 + approx.abs() * (2 * BF16_UNIT)  # (N, V)
        floor = (approx - bound).amax(-1, keepdim=True)  # (N, 1): the winner's exact logit is at least this
        maybe = (approx + bound) >= floor  # (N, V)
        n_cand = int(maybe.sum())
        self.stats["steps"] += 1
        self.stats["candidates"] += n_cand
        if n_cand > self.max_candidates * x.shape[0]:
            self.stats["exact_fallbacks"] += 1
            return self.head(hidden)
        out = approx.to(self.head.weight.dtype)
        for r in range(x.shape[0]):
            idx = maybe[r].nonzero().squeeze(1)  # (k,) the tokens that can win row r
            out[r, idx] = (x[r : r + 1] @ self.head.weight[idx].T).squeeze(0)  # exact, the model's weights
        return out.view(B, T, -1)


def install_exact_argmax_head(model) -> ExactArgmaxHead | None:
    """Swap the model's LM head for an ExactArgmaxHead (CPU only; None when the model has no plain head
    or the int8 kernel is missing). The original head is kept inside it."""
    head = getattr(model, "lm_head", None)
    if not isinstance(head, nn.Linear) or head.bias is not None or not int8_kernel_available():
        return None
    fast = ExactArgmaxHead(head)
    model.lm_head = fast
    return fast
