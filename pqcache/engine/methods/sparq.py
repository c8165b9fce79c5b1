"""SparQ attention (Ribar et al., ICML 2024): approximate scores from the r largest-magnitude
components of each query and the matching key columns; exact attention on the top-k."""

from __future__ import annotations

from dataclasses import dataclass

from pqcache.engine.methods.base import ScoreMethod


@dataclass
class SparQ(ScoreMethod):
    name = "sparq"
    r: int | None = None  # query components used; None: head_dim // 4 (32 for head_dim 128)

    def score(self, view, q):
        B, H, R, D = q.shape
        r = min(self.r or max(1, D // 4), D)
        idx = q.abs().topk(r, dim=-1).indices  # (B, H, R, r)
        q_r = q.gather(-1, idx)  # (B, H, R, r)
        keys = view.keys()  # (B, H, S, D)
        # the matching key columns for every query row: (B, H, R, S, r)
        k_r = keys[:, :, None].expand(B, H, R, -1, D).gather(-1, idx[:, :, :, None, :].expand(-1, -1, -1, view.S, -1))
        approx = (k_r @ q_r.float()[..., None]).squeeze(-1)  # (B, H, R, S)
        # SparQ's softmax temperature: sqrt of the share of |q| mass kept (1 when r = head_dim)
        approx = approx / (q_r.abs().sum(-1) / q.abs().sum(-1).clamp(min=1e-12)).sqrt()[..., None]
        return approx.transpose(2, 3)
