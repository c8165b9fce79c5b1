"""H2O (Zhang et al., NeurIPS 2023): a key's score is the attention it has received, accumulated
over every query so far (prefill and decoding); the heavy hitters are kept with a recent window,
and a token that drops out of the heavy set is evicted for good."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pqcache.engine.methods.base import Method, positions_of, topk_positions


def prefill_attention_received(view, query, scaling: float, chunk: int = 256) -> torch.Tensor:
    """Column sums of the causal prefill attention, over all query heads of each KV head -> (B, H, S)."""
    B, Hq, S, D = query.shape
    H, G = view.H, Hq // view.H
    keys = view.keys(0, S)
    acc = torch.zeros((B, H, S), dtype=torch.float32, device=view.device)
    pos = torch.arange(S, device=view.device)
    for start in range(0, S, chunk):
        end = min(S, start + chunk)
        q = query[:, :, start:end].to(view.device, torch.float32).reshape(B, H, G, end - start, D)
        logits = (q @ keys[:, :, None].transpose(-1, -2)) * scaling  # (B, H, G, c, S)
        allowed = (pos[None, :] <= pos[start:end, None])[None, None, None] & view.valid[:, None, None, None, :S]
        probs = logits.masked_fill(~allowed, float("-inf")).softmax(-1).nan_to_num(0.0)
        acc += probs.sum((2, 3))
    return acc


@dataclass
class H2O(Method):
    name = "h2o"
    needs_prefill_queries = True
    observes = True
    recent_ratio: float = 0.5  # share of the budget for the recent window, the rest for heavy hitters

    def split(self, config, n_real, view):
        budget = config.budget_tokens(n_real)
        n_local = max(1, round(budget * self.recent_ratio))
        return 0, max(0, budget - n_local), n_local

    def on_prefill(self, view, query, scaling):
        acc = prefill_attention_received(view, query, scaling)
        view.state.update(acc=acc, kept=torch.ones_like(acc, dtype=torch.bool))

    def _grow(self, view, n: int):
        st = view.state
        have = st["acc"].shape[-1]
        if n > have:
            pad = (view.B, view.H, n - have)
            st["acc"] = torch.cat([st["acc"], torch.zeros(pad, device=view.device)], -1)
            st["kept"] = torch.cat([st["kept"], torch.ones(pad, dtype=torch.bool, device=view.device)], -1)

    def select(self, view, q):
        self._grow(view, view.S)
        st = view.state
        S, cand, ks, k_max = view.S, view.candidates, view.ks, view.k_max
        eligible = cand[:, None, :] & st["kept"][..., :S]
        top, valid = topk_positions(st["acc"][..., :S].masked_fill(~eligible, float("-inf")), ks, k_max)
        valid = valid & eligible.gather(2, top)
        heavy = torch.zeros_like(eligible).scatter_(2, top, valid)
        st["kept"][..., :S] &= ~(eligible & ~heavy)  # evicted for good
        return positions_of(heavy)

    def observe(self, view, probs, positions):
        self._grow(view, int(positions.max()) + 1)
        view.state["acc"].scatter_add_(2, positions.clamp(min=0), probs.float().sum(2))
