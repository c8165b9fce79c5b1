"""PQCache (Zhang et al., SIGMOD 2025): approximate scores from product-quantized keys, top-k.

The method owns each layer's PQ index (layer/index.py): it starts the prefill's K-Means in the
background, installs builds between steps, codes appended tokens, and decides what a failed build
means (`on_pq_failure`: exact attention for that layer from then on, or PQBuildError).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pqcache.engine import pq
from pqcache.engine.completion import VALUE_MEANS
from pqcache.engine.errors import PQBuildError
from pqcache.engine.layer.builds import BuildFault
from pqcache.engine.layer.index import PQIndex
from pqcache.engine.mass import MASS_ESTIMATE
from pqcache.engine.methods.base import (
    PICKED_SCORES,
    ScoreMethod,
    combine_rows,
    positions_of,
    scores_at,
    select_top,
    topk_positions,
)
from pqcache.engine.methods.estimate import estimate_and_cut, exact_scores_at
from pqcache.native import select as native_select


@dataclass
class PQCacheMethod(ScoreMethod):
    name = "pqcache"

    def on_prefill(self, view, query, scaling):
        n_real = int(view.valid.sum(1).max())
        bits = view.config.bits_for(n_real, view.D)
        index = view.state["index"] = PQIndex(
            view.host, view.config, view.executor, view.iters_for, view.closed, view.span, bits
        )
        index.submit(0, view.S, kind="prefill", iters=view.iters_for(n_real))

    def on_fork(self, view, parent_state, query, scaling):
        parent = parent_state.get("index")
        if parent is not None and parent.serves(view.config):  # the parent's codebooks and codes serve the fork
            view.state["index"] = parent.fork(view.host, view.config, view.executor, view.closed, view.span)
        elif parent is None and view.fallback:  # the parent's build failed: stay exact, keep the notice
            view.fall_back(view.fallback)
        else:
            self.on_prefill(view, query, scaling)

    def prepare(self, view, block=False, stop=None):
        index: PQIndex = view.state["index"]
        try:
            index.poll(block=block or not index.segments, stop=stop)  # the first use waits for the prefill's
        except BuildFault as fault:
            view.executor.shutdown(wait=False, cancel_futures=True)  # the cache's other builds stop too
            reason = f"PQ clustering of layer {view.layer_idx} failed ({fault})"
            if view.config.on_pq_failure == "raise":
                raise PQBuildError(reason) from fault.__cause__
            view.fall_back(reason)

    def on_append(self, view, start, k_new):
        view.state["index"].append(start, k_new)

    def score(self, view, q):
        return approx_scores(view.state["index"], q)

    def select(self, view, q):
        """PQ search for rerank x k candidates, then the exact scores of those candidates pick k. The picks'
        exact scores are left in view.state[PICKED_SCORES]: the attention uses them instead of their keys.
        With a budget in mass or completion, the step's mass estimate is left in view.state[MASS_ESTIMATE] and
        a budget in mass keeps the fewest picks that reach it (methods/estimate.py)."""
        ks = view.ks
        wide = first_stage_counts(view)
        top, valid = self.search(view, q, wide)
        estimating = view.config.mass is not None or view.config.completion
        known = None  # the re-rank's candidates and their exact scores, which the estimate uses
        if wide != ks:  # not single stage, and the budget does not cover the candidates
            exact = exact_scores_at(view.host, q, top) if estimating else None
            known = (top, valid, exact)
            picked = rerank_exact(view.host, q, top, valid, ks, view.config, exact)
            top, valid, view.state[PICKED_SCORES] = picked
        if estimating:
            approx = approx_scores(view.state["index"], q)
            valid, view.state[MASS_ESTIMATE] = estimate_and_cut(view, q, approx, known, top, valid)
        return top, valid

    def search(self, view, q, ks: list[int]):
        """The first stage: the ks[b] best candidates of each row by PQ scores (and a margin, before a re-rank)."""
        config = view.config
        return search(view.state["index"], q, view.candidates, ks, config.gqa_combine, first_stage_margin(config))

    def stats(self, view):
        index = view.state.get("index")
        return {} if index is None else dict(index.stats)

    def device_bytes(self, view):
        """The index's codes and centroids (the values' too, where it keeps them), and completion's mean values where
        it keeps them."""
        kept = [view.state.get(key) for key in ("index", VALUE_MEANS)]
        return sum(part.nbytes for part in kept if part is not None)


def search(index: PQIndex, q: torch.Tensor, cand: torch.Tensor, ks: list[int], mode: str, margin: float = 0.0):
    """q (B, H, R, D) scaled, cand (B, S) -> the ks[b] best candidates of each row by PQ scores, each raised by
    margin x its spread (spreads): positions (B, H, k) and validity."""
    k_max = min(max(ks), index.host.S)
    widened = None if margin == 0 else spreads(index, q, margin)
    if searches_natively(index, q.shape[2]):
        q, cents = index.rotate(q, 0), index.segments[0][1]
        # (B, H, m, C, R); pq_codes.c's where q is float32 too (a step's few rows: 0.10 ms a layer less, Zen 3)
        tables = native_select.tables(q, cents) if q.dtype == torch.float32 else pq.lookup_tables(q, cents)
        return native_select.pq_top(tables, index.codes, cand, ks, k_max, mode, widened)
    if widened is None and _by_tuples(index):  # a margin makes a token's score its own, not its tuple's
        return select_by_tuples(index, q, cand, ks, k_max, mode)
    scores = approx_scores(index, q)  # (B, H, S, R)
    return select_top(widen(scores, widened), cand, ks, k_max, mode)


def first_stage_margin(config) -> float:
    """config.search_margin where a re-rank follows the PQ search (rerank > 1), else 0: alone, the search's picks
    are attended, and a margin would only trade a well-scored token for a poorly scored one."""
    return config.search_margin if config.rerank > 1 else 0.0


def spreads(index: PQIndex, q: torch.Tensor, margin: float) -> tuple:
    """What the first stage adds to the PQ score of token t for query row r: row_scale[r] x residuals[t], margin
    spreads of the score's error q.(k - k_hat), whose size is ||q|| ||k - k_hat|| / sqrt(D) for an error of no
    preferred direction. q (B, H, R, D) scaled -> (row_scale (B, H, R) float32, the index's residuals (B, H, S'))."""
    row_scale = q.float().norm(dim=-1) * (margin / q.shape[-1] ** 0.5)
    return row_scale, index.residuals


def widen(scores: torch.Tensor, widened: tuple | None) -> torch.Tensor:
    """PQ scores (B, H, S, R), in place, raised by spreads' margin (widened = its result; None: as they are)."""
    if widened is not None:
        row_scale, residuals = widened
        scores += residuals[..., : scores.shape[2], None] * row_scale[:, :, None, :]
    return scores


def _by_tuples(index: PQIndex) -> bool:
    """Whether scoring each code tuple once pays: below 2 tokens a tuple, per-tuple work costs more than it saves."""
    return index.use_tuples and index.host.S >= 2 * index.n_tuples


def searches_natively(index: PQIndex, rows: int) -> bool:
    """Whether search takes pq_select.c (one codebook segment, the kernels usable for `rows` query rows per KV
    head), where torch's per-tuple pass would not serve better: with one sub-space pq_select.c works per code
    itself, faster than that pass (0.10 against 0.24 ms a layer at 2K tokens, 0.32 against 0.36 at 8K: SmolLM2, 3 KV
    heads, ad hoc), and than per token in C. layer/onerow.py's fused step reads the index as this path does."""
    in_c = (
        index.config.kernels.native_select
        and len(index.segments) == 1
        and native_select.usable(index.segments[0][1], rows)
    )
    return in_c and (not _by_tuples(index) or index.codes.shape[2] == 1)


def first_stage_counts(view) -> list[int]:
    """Candidates the PQ search keeps per row: rerank x k, at least rerank_min_tokens (with a re-rank),
    never more than the row's candidates."""
    n_cand = view.candidates.sum(1).tolist()
    return [first_stage_count(view.config, k, n) for k, n in zip(view.ks, n_cand, strict=True)]


def first_stage_count(config, k: int, n_cand: int) -> int:
    """One row's first-stage candidates for k picks out of n_cand (see first_stage_counts)."""
    floor = config.rerank_min_tokens if config.rerank > 1 else 0
    return min(max(config.rerank * k, floor), n_cand)


def rerank_exact(host, q: torch.Tensor, top: torch.Tensor, valid: torch.Tensor, ks: list[int], config, exact=None):
    """The second stage: exact q.k of the PQ candidates top (B, H, k') picks the final k of each row,
    under the same GQA combine. It runs where the keys live (the host tier): only the query goes
    there and only positions and the picks' scores come back -> positions (B, H, k), validity (B, H, k) and
    the picks' exact scores (B, H, k, R) on the device. With those scores the step needs only the picks'
    values: their keys are never fetched (half the bytes host to device). host: the layer's HostTier; config: the
    PQCacheConfig (its GQA combine, and whether the kernels select in C). exact: the candidates' exact scores
    (B, H, k', R) on the host, when the caller has them already."""
    kw = top.shape[2]
    exact = exact_scores_at(host, q, top) if exact is None else exact  # (B, H, k', R) on the host
    ok, mode = valid.to(host.host), config.gqa_combine
    in_c = config.kernels.native_select and native_select.usable(exact, exact.shape[3])
    if in_c:  # ties to the earliest of top, as below
        pick, pick_valid = native_select.combined_top(exact, ok, ks, min(max(ks), kw), mode)
    else:
        combined = combine_rows(exact, ok, mode)  # (B, H, k'); top is in position order, so ties go to the earliest
        pick, pick_valid = topk_positions(combined, ks, min(max(ks), kw))
    scores = scores_at(exact, pick).to(top.device)  # (B, H, k, R)
    pick, pick_valid = pick.to(top.device), pick_valid.to(top.device)
    return top.gather(2, pick), pick_valid & valid.gather(2, pick), scores


def approx_scores(index: PQIndex, q: torch.Tensor) -> torch.Tensor:
    """q (B, H, R, D), already scaled -> approximate scores (B, H, S, R), segment by segment."""
    S, segments, codes = index.host.S, index.segments, index.codes
    if len(segments) == 1:
        return pq.approx_scores(pq.lookup_tables(index.rotate(q, 0), segments[0][1]), codes[..., :S])
    out = torch.empty((index.host.B, index.host.H, S, q.shape[2]), dtype=torch.float32, device=index.device)
    bounds = [s for s, _ in segments[1:]] + [S]
    for (start, cents), end in zip(segments, bounds, strict=True):
        out[:, :, start:end] = pq.approx_scores(pq.lookup_tables(index.rotate(q, start), cents), codes[..., start:end])
    return out


def select_by_tuples(index: PQIndex, q: torch.Tensor, cand: torch.Tensor, ks: list[int], k_max: int, mode: str):
    """PQ search when the code space is small (C^m <= 2^16): a token's approximate score depends
    only on its code tuple, so everything is computed per tuple, and the tokens are read only
    to count tuples (histogram), look their tuple's score up, and compare with a threshold.

    The combined score of a tuple u over query rows r (GQA group x chunk) is
      softmax_sum: sum_r exp(s_r(u) - M_r) / Z_r,  Z_r = sum_u hist(u) exp(s_r(u) - M_r)
      sum:         sum_r s_r(u)
    which equals the per-token softmax over the candidates followed by the sum over rows. The
    threshold is the score of the tuple where the cumulative count reaches k; ties at it go to
    the earliest positions (the same rule as topk_positions)."""
    B, H, S, P = index.host.B, index.host.H, index.host.S, index.n_tuples
    bounds = [start for start, _ in index.segments[1:]] + [S]
    sink = B * H * P
    tup, hist = [], []
    for (start, cents), end in zip(index.segments, bounds):
        tables = pq.lookup_tables(index.rotate(q, start), cents)  # (B, H, m, C, R)
        t = tables[:, :, 0]
        for j in range(1, tables.shape[2]):  # scores of all code tuples: (B, H, C^m, R)
            t = (t[:, :, :, None, :] + tables[:, :, j][:, :, None, :, :]).flatten(2, 3)
        tup.append(t)
        idx = torch.where(cand[:, None, start:end], index.joint[..., start:end], sink)
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
    kt = torch.tensor(ks, device=index.device).view(B, 1, 1).expand(B, H, 1).contiguous()
    at = torch.searchsorted(cum, kt).clamp(max=cum.shape[-1] - 1)
    thresh = vals.gather(-1, order.gather(-1, at))  # (B, H, 1)
    thresh = torch.where(cum[..., -1:] <= kt, torch.full_like(thresh, float("-inf")), thresh)

    scores = torch.empty((B, H, S), dtype=comb.dtype, device=index.device)
    for i, ((start, _), end) in enumerate(zip(index.segments, bounds)):
        joint = index.joint[..., start:end]
        scores[..., start:end] = comb[:, :, i].reshape(-1).index_select(0, joint.reshape(-1)).view(joint.shape)
    scores.masked_fill_(~cand[:, None, :], float("-inf"))
    chosen = scores > thresh
    # ties at the threshold (the tokens of the threshold tuple): the earliest `need` of each row
    need = (kt - chosen.sum(-1, keepdim=True)).view(-1)  # (B*H,)
    tied = ((scores == thresh) & cand[:, None, :]).nonzero()  # (n, 3) sorted by row, head, position
    if tied.numel():
        group = tied[:, 0] * H + tied[:, 1]
        sizes = torch.bincount(group, minlength=B * H)
        rank = torch.arange(group.numel(), device=index.device) - (sizes.cumsum(0) - sizes)[group]
        keep = tied[rank < need[group]]
        chosen[keep[:, 0], keep[:, 1], keep[:, 2]] = True
    return positions_of(chosen)
