"""PQCache (Zhang et al., SIGMOD 2025): approximate scores from product-quantized keys, top-k."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pqcache.engine import pq
from pqcache.engine.methods.base import Method, positions_of, select_top


@dataclass
class PQCacheMethod(Method):
    name = "pqcache"
    needs_pq = True

    def select(self, layer, q, cand, ks, k_max):
        mode = layer.config.gqa_combine
        if layer.use_tuples and layer.S >= 2 * layer.n_tuples:  # below that, per-tuple work costs more than it saves
            return select_by_tuples(layer, q, cand, ks, k_max, mode)
        return select_top(approx_scores(layer, q), cand, ks, k_max, mode)


def approx_scores(layer, q: torch.Tensor) -> torch.Tensor:
    """q (B, H, R, D), already scaled -> approximate scores (B, H, S, R), segment by segment."""
    S = layer.S
    if len(layer.segments) == 1:
        return pq.approx_scores(pq.lookup_tables(q, layer.segments[0][1]), layer.codes[..., :S])
    out = torch.empty((layer.B, layer.H, S, q.shape[2]), dtype=torch.float32, device=layer.device)
    bounds = [s for s, _ in layer.segments[1:]] + [S]
    for (start, cents), end in zip(layer.segments, bounds):
        out[:, :, start:end] = pq.approx_scores(pq.lookup_tables(q, cents), layer.codes[..., start:end])
    return out



def select_by_tuples(layer, q: torch.Tensor, cand: torch.Tensor, ks: list[int], k_max: int, mode: str):
    """PQ search when the code space is small (C^m <= 2^16): a token's approximate score depends
    only on its code tuple, so everything is computed per tuple, and the tokens are read only
    to count tuples (histogram), look their tuple's score up, and compare with a threshold.

    The combined score of a tuple u over query rows r (GQA group x chunk) is
      softmax_sum: sum_r exp(s_r(u) - M_r) / Z_r,  Z_r = sum_u hist(u) exp(s_r(u) - M_r)
      sum:         sum_r s_r(u)
    which equals the per-token softmax over the candidates followed by the sum over rows. The
    threshold is the score of the tuple where the cumulative count reaches k; ties at it go to
    the earliest positions (the same rule as topk_positions)."""
    B, H, S, P = layer.B, layer.H, layer.S, layer.n_tuples
    bounds = [start for start, _ in layer.segments[1:]] + [S]
    sink = B * H * P
    tup, hist = [], []
    for (start, cents), end in zip(layer.segments, bounds):
        tables = pq.lookup_tables(q, cents)  # (B, H, m, C, R)
        t = tables[:, :, 0]
        for j in range(1, tables.shape[2]):  # scores of all code tuples: (B, H, C^m, R)
            t = (t[:, :, :, None, :] + tables[:, :, j][:, :, None, :, :]).flatten(2, 3)
        tup.append(t)
        idx = torch.where(cand[:, None, start:end], layer.joint[..., start:end], sink)
        hist.append(torch.bincount(idx.reshape(-1), minlength=sink + 1)[:sink].view(B, H, P))
    tup, hist = torch.stack(tup, 2), torch.stack(hist, 2)  # (B, H, n_seg, P, R), (B, H, n_seg, P)
    present = hist > 0
    if mode == "softmax_sum":
        M = tup.masked_fill(~present[..., None], float("-inf")).amax(dim=(2, 3), keepdim=True)
        E = torch.exp(tup - M)
        Z = (E * hist[..., None]).sum(dim=(2, 3), keepdim=True)
        comb = (E / Z).sum(-1)  # (B, H, n_seg, P)
    else:
        comb = tup.sum(-1)
    # threshold per (row, head): walk the tuples from the best down until k tokens are covered
    vals = comb.masked_fill(~present, float("-inf")).flatten(2)
    # every present tuple holds >= 1 token, so the threshold tuple is among the k best tuples
    order = vals.topk(min(k_max, vals.shape[-1]), dim=-1, sorted=True).indices
    cum = hist.flatten(2).gather(-1, order).cumsum(-1)
    kt = torch.tensor(ks, device=layer.device).view(B, 1, 1).expand(B, H, 1).contiguous()
    at = torch.searchsorted(cum, kt).clamp(max=cum.shape[-1] - 1)
    thresh = vals.gather(-1, order.gather(-1, at))  # (B, H, 1)
    thresh = torch.where(cum[..., -1:] <= kt, torch.full_like(thresh, float("-inf")), thresh)

    scores = torch.empty((B, H, S), dtype=comb.dtype, device=layer.device)
    for i, ((start, _), end) in enumerate(zip(layer.segments, bounds)):
        joint = layer.joint[..., start:end]
        scores[..., start:end] = comb[:, :, i].reshape(-1).index_select(0, joint.reshape(-1)).view(joint.shape)
    scores.masked_fill_(~cand[:, None, :], float("-inf"))
    chosen = scores > thresh
    # ties at the threshold (the tokens of the threshold tuple): the earliest `need` of each row
    need = (kt - chosen.sum(-1, keepdim=True)).view(-1)  # (B*H,)
    tied = ((scores == thresh) & cand[:, None, :]).nonzero()  # (n, 3) sorted by row, head, position
    if tied.numel():
        group = tied[:, 0] * H + tied[:, 1]
        sizes = torch.bincount(group, minlength=B * H)
        rank = torch.arange(group.numel(), device=layer.device) - (sizes.cumsum(0) - sizes)[group]
        keep = tied[rank < need[group]]
        chosen[keep[:, 0], keep[:, 1], keep[:, 2]] = True
    return positions_of(chosen)

