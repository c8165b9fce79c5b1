"""StreamingLLM (Xiao et al., ICLR 2024): attention sinks + the most recent tokens, nothing else."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pqcache.engine.methods.base import Method, positions_of


@dataclass
class StreamingLLM(Method):
    name = "streaming"
    n_sink: int = 4

    def split(self, config, n_real, view):
        budget = config.budget_tokens(n_real)
        n_init = min(self.n_sink, budget)
        n_local = config.n_local or max(1, (budget - n_init) // 2)
        return n_init, max(0, budget - n_init - n_local), n_local

    def select(self, view, q):
        """The window continues past the device ring: the k_b most recent candidates of each row."""
        cand = view.candidates
        newest_first = cand.flip(-1).long().cumsum(-1).flip(-1)  # rank from the end among candidates
        kt = torch.tensor(view.ks, device=cand.device).view(-1, 1)
        return positions_of((cand & (newest_first <= kt))[:, None, :].expand(-1, view.H, -1))
