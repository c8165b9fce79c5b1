"""SnapKV (Li et al., 2024): at the end of the prefill, each prompt token is scored by the attention
it gets from the last `window` prompt queries (summed over them and over the GQA group), smoothed
by pooling along positions; the top tokens are kept with the recent window, and that selection is
frozen for the rest of the generation (generated tokens are all kept, as SnapKV keeps them)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pqcache.engine.methods.base import Method, positions_of, topk_positions


def observation_scores(view, query, scaling: float, window: int, kernel: int, pooling: str) -> torch.Tensor:
    """Pooled attention from the last `window` prefill queries -> (B, H, S_prefill)."""
    B, Hq, S, D = query.shape
    H, G = view.H, Hq // view.H
    w = min(window, S)
    keys = view.keys(0, S)
    q = query[:, :, S - w :].to(view.device, torch.float32).reshape(B, H, G * w, D)
    logits = (q @ keys.transpose(-1, -2)) * scaling  # (B, H, G*w, S)
    q_pos = torch.arange(S - w, S, device=view.device).repeat(G)  # position of each query row
    allowed = (torch.arange(S, device=view.device)[None, :] <= q_pos[:, None])[None, None]
    allowed = allowed & view.valid[:, None, None, :S]
    probs = logits.masked_fill(~allowed, float("-inf")).softmax(-1).nan_to_num(0.0)
    scores = probs.sum(2)  # (B, H, S)
    pool = F.avg_pool1d if pooling == "avgpool" else F.max_pool1d
    return pool(scores.view(B * H, 1, S), kernel, stride=1, padding=kernel // 2).view(B, H, S)


@dataclass
class SnapKV(Method):
    name = "snapkv"
    needs_prefill_queries = True
    window: int = 32
    kernel: int = 7
    pooling: str = "avgpool"

    def on_prefill(self, view, query, scaling):
        scores = observation_scores(view, query, scaling, self.window, self.kernel, self.pooling)
        S = scores.shape[-1]
        cand = view.candidates[:, :S]
        ks = view.ks
        k_max = min(max(ks), S)
        # the observation window (the prompt's last tokens) stays, as in SnapKV, also once it has
        # left the local window of decoding
        frozen = (~cand)[:, None, :].expand(-1, view.H, -1).clone()
        if k_max > 0 and bool(cand.any()):
            top, valid = topk_positions(scores.masked_fill(~cand[:, None, :], float("-inf")), ks, k_max)
            frozen.scatter_(2, top, valid & torch.gather(cand[:, None, :].expand(-1, view.H, -1), 2, top))
        view.state.update(scores=scores, frozen=frozen)

    def select(self, view, q):
        cand = view.candidates
        frozen = view.state["frozen"]
        S0 = frozen.shape[-1]
        chosen = cand[:, None, :].expand(-1, view.H, -1).clone()  # generated tokens: all kept
        chosen[..., :S0] &= frozen
        return positions_of(chosen)
