"""What a step shows the outside: the method's observer hook and the instrumentation (observe_step);
and the probe of sampled steps: exact scores of the step's last token's queries over every stored token,
for the attention power law and for the top-k recall of the selection against the exact top-k
chosen by the same rule (same candidates, same GQA combine, same k). It only reads."""

from __future__ import annotations

import time

import numpy as np
import torch

from pqcache.engine.methods.base import combine_rows, topk_positions


def observe_step(layer, q, scaling, top, top_valid, probs, mask, moved):
    """After a step: the method's observer hook (H2O) and the instrumentation. Reads only.
    q (B, H, G*Q, D) unscaled; probs (B, H, G*Q, N) over the buffer; mask (B, H, Q, N)."""
    obs, step, host = layer.obs, layer.counters["steps"], layer.host
    want_positions = obs is not None and obs.selections
    if layer.method.observes or want_positions:
        positions = layer.window.positions(top, mask.shape[2])
        if layer.method.observes:
            layer.method.observe(layer.view(), probs, positions)
        if want_positions:
            attended = mask[:, :, -1, :]  # what the last new token attended to
            chosen = [[sorted(positions[b, h][attended[b, h]].tolist()) for h in range(host.H)] for b in range(host.B)]
            obs.record_selection(layer.layer_idx, step, chosen)
    if obs is None:
        return
    n_new = mask.shape[2]
    if n_new > 1 and (obs.wants_attention(step) or obs.wants_recall(step)):
        # a chunk (a question): its last token, as a decode step's one (each sorts S scores a row)
        B, H, R, D = q.shape
        q = q.view(B, H, R // n_new, n_new, D)[:, :, :, -1]  # (B, H, G, D): rows are (query head, token)
    observe_picks(layer, q, scaling, top, top_valid, moved)


def observe_picks(layer, q, scaling, top, top_valid, moved):
    """The instrumentation's records of a step (the layer has an observer): block-cache hits, bytes moved, and at
    the sampled steps the power law and recall. q (B, H, G, D): the step's (last) token's unscaled queries."""
    obs, step = layer.obs, layer.counters["steps"]
    t0 = time.perf_counter()
    obs.record_blocks(layer.layer_idx, step, moved["hits"], moved["misses"])
    obs.moved("to_device", moved["moved"])
    if obs.wants_attention(step) or obs.wants_recall(step):
        probe(layer, obs, step, q, scaling, top, top_valid)
    obs.cost_s += time.perf_counter() - t0


def probe(layer, obs, step: int, q: torch.Tensor, scaling: float, top: torch.Tensor, top_valid: torch.Tensor):
    """q (B, H, G, D) unscaled queries of the step's (last) token; top, top_valid (B, H, k) what the method
    picked. Scores every stored token exactly once, for both records."""
    host = layer.host
    S, B, H = host.S, host.B, host.H
    exact = host.query_scores(q.float() * scaling)  # (B, H, R, S)
    valid = host.valid[:, :S]
    probs = exact.masked_fill(~valid[:, None, None, :], float("-inf")).softmax(-1)  # (B, H, R, S)
    if obs.wants_attention(step):
        ranks = obs.ranks(S)
        obs.record_attention(layer.layer_idx, step, S, ranks, values_at_ranks(probs, ranks))
    if not obs.wants_recall(step) or top.shape[2] == 0:
        return
    chosen = torch.zeros((B, H, S), dtype=torch.bool, device=layer.device).scatter_(2, top, top_valid)
    cand, ks, mode = layer.candidates(), layer.topk_counts(), layer.config.gqa_combine
    exact_set = exact_topk_set(exact, cand, ks, top.shape[2], mode)
    if layer.tally is not None:  # the answer's sources: the exact top-k tokens this step did not attend to
        layer.tally.add_missed((exact_set[0] & ~chosen[0]).nonzero()[:, 1])
    topk_recall, mass, qhead = selection_recall(
        exact, valid, cand, chosen, ks, top.shape[2], mode, q.shape[2], exact_set, probs
    )
    obs.record_recall(
        layer.layer_idx,
        step,
        topk_recall.mean(0).tolist(),
        mass.mean(0).tolist(),
        int(top_valid.sum(-1).max()),
        qhead.tolist(),
    )


def values_at_ranks(probs: torch.Tensor, ranks: list[int]) -> list[float]:
    """probs (..., S) -> the mean over the leading dims of each row's rank-r largest value, for each r (1-based).
    numpy sorts float32 rows about 10x faster than torch.sort on a CPU (SIMD sorting: 0.18 against 2.5 ms for four
    rows of 8K)."""
    rows = np.sort(-probs.reshape(-1, probs.shape[-1]).float().cpu().numpy(), axis=-1)
    return (-rows[:, [r - 1 for r in ranks]]).mean(0).tolist()


def exact_topk_set(exact, cand, ks: list[int], k: int, mode: str) -> torch.Tensor:
    """The exact top-k under the selection's rule (same candidates, GQA combine and ks): exact (B, H, G*Q, S)
    scaled scores, cand (B, S) -> (B, H, S) bool."""
    H = exact.shape[1]
    combined = combine_rows(exact.transpose(2, 3), cand, mode)  # (B, H, S); a view: combine_rows transposes back
    etop, evalid = topk_positions(combined, ks, k)
    in_cand = torch.gather(cand[:, None, :].expand(-1, H, -1), 2, etop)
    return torch.zeros(combined.shape, dtype=torch.bool, device=exact.device).scatter_(2, etop, evalid & in_cand)


def selection_recall(exact, valid, cand, chosen, ks: list[int], k: int, mode: str, G: int, exact_set=None, probs=None):
    """How well a selection covers exact attention. exact (B, H, G*Q, S) scaled scores; valid, cand (B, S);
    chosen (B, H, S) the selected middle tokens, k the selection's width -> (top-k recall (B, H): the share of
    the exact top-k under the same rule (same candidates, same GQA combine, same ks) that was chosen; mass recall
    (B, H): the share of the exact attention on the attended tokens (chosen + sinks + window); per-query-head
    recall (H*G,)). exact_set, probs: exact_topk_set's result and the masked softmax of exact, when the caller has
    them."""
    if exact_set is None:
        exact_set = exact_topk_set(exact, cand, ks, k, mode)
    topk_recall = (chosen & exact_set).sum(-1).float() / exact_set.sum(-1).clamp(min=1)
    if probs is None:
        probs = exact.masked_fill(~valid[:, None, None, :], float("-inf")).softmax(-1)
    attended = chosen | (~cand[:, None, :] & valid[:, None, :])  # sinks and window are attended too
    mass = (probs * attended[:, :, None, :]).sum(-1).mean(-1)
    return topk_recall, mass, per_query_head_recall(exact, cand, chosen, k, G)


def per_query_head_recall(exact: torch.Tensor, cand: torch.Tensor, chosen: torch.Tensor, k: int, G: int):
    """Share of each query head's own exact top-k (among the candidates) in the shared selection:
    exact (B, H, G*Q, S), chosen (B, H, S) -> (H*G,), averaged over rows and the step's tokens."""
    B, H, R, S = exact.shape
    k = min(k, int(cand.sum(1).min()))
    if k == 0:
        return torch.ones(H * G)
    masked = exact.masked_fill(~cand[:, None, None, :], float("-inf")).reshape(-1, S).float().cpu().numpy()
    # each row's k largest, in no order: numpy's partition is a fifth of torch.topk's time for four rows of 8K
    own = torch.from_numpy(np.argpartition(-masked, k - 1, axis=-1)[:, :k]).view(B, H, R, k).to(chosen.device)
    hit = chosen[:, :, None, :].expand(B, H, R, S).gather(3, own).float().mean(-1)  # (B, H, R)
    return hit.view(B, H, G, R // G).mean((0, 3)).reshape(-1)
