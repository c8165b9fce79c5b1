"""A PQ layer's step in general: any batch of left-padded rows, any number of new tokens (a decode step, or a
question's chunk after a cached document), any selection method, any observer.

    select (the method's picks)  ->  fetch them into the device window (block cache first)  ->  assemble
    [ sinks | window ring | picks | new tokens ]  ->  masked attention  ->  observe  ->  append the new tokens

onerow.py computes the same step for one row and one new token in fewer operators; PQLayer.attend picks the path.
"""

from __future__ import annotations

import torch

from pqcache.engine import completion
from pqcache.engine.layer.attention import attend_scores, masked_attention, masked_scores
from pqcache.engine.layer.probe import observe_step
from pqcache.engine.mass import MASS_ESTIMATE
from pqcache.engine.methods.base import PICKED_SCORES, positions_of
from pqcache.engine.sources import add_weights


def attend(layer, query, k_new, v_new, new_valid, scaling: float, softcap=None) -> torch.Tensor:
    """query (B, Hq, Q, D), k_new, v_new (B, H, Q, D), new_valid (B, Q) bool -> attention output (B, Q, Hq, D),
    with the layer's tiers, window and counters updated."""
    B, Hq, Q, D = query.shape
    H = layer.host.H
    q = query.reshape(B, H, Hq // H * Q, D)  # query heads h*G..h*G+G-1 share KV head h

    exact_chunk = Q > 1 and layer.config.chunk_attention == "exact"
    scores = None  # the picks' exact scaled scores (B, H, k, R), when the selection computed them
    estimate = None  # the step's MassEstimate (engine/mass.py), when the selection made one
    if exact_chunk:  # a question after a cached document reads every cached token, as the prefill did
        top, top_valid = positions_of(layer.candidates()[:, None, :].expand(-1, H, -1))
    else:
        top, top_valid = layer.select(q, scaling)
        scores = layer.method_state.pop(PICKED_SCORES, None)
        estimate = layer.method_state.pop(MASS_ESTIMATE, None)
    window = layer.window
    window.ensure(top.shape[2], Q)
    moved = window.fetch(top, top_valid, layer.span, keys=scores is None)
    layer.counters["hits"] += moved["hits"]
    layer.counters["misses"] += moved["misses"]
    keys, values, mask = window.assemble(top_valid, k_new, v_new, new_valid)
    known = None if scores is None else (window.n_init + window.L, scores)
    if estimate is not None and layer.config.completion:
        att = masked_scores(q, keys, mask, scaling, softcap, known)
        out, probs = attend_scores(att, values, Q)
        out = completed(layer, out, att, estimate, top, top_valid, softcap)
    else:
        out, probs = masked_attention(q, keys, values, mask, scaling, softcap, known)
    if estimate is not None and layer.obs is not None:
        layer.obs.record_mass(layer.layer_idx, layer.counters["steps"], estimate.share, estimate.tokens)

    if layer.tally is not None:  # the answer's sources: the weights just computed, by host position
        add_weights(layer, probs, window.positions(top, Q), Q)
    layer.last_selection = (top, top_valid)
    observe_step(layer, q, scaling, top, top_valid, probs, mask, moved)
    append(layer, k_new, v_new, new_valid)
    layer.counters["steps"] += 1
    if Q == 1:  # a decode step (attended_per_step)
        layer.counters["decode_steps"] += 1
        layer.counters["picked"] += int(top_valid.sum())
    if exact_chunk:  # the whole context stays on the device only for the chunk; the next step sizes the top-k part
        window.resize(0, 1)
    return out


def completed(layer, out, att, estimate, top, top_valid, softcap) -> torch.Tensor:
    """out (B, Q, Hq, D) the attention over the selection, att (B, H, R, N) its masked scores -> the output with
    the unselected middle tokens' estimated part merged in (engine/completion.py); out itself when every middle
    token was selected."""
    host = layer.host
    chosen = torch.zeros((host.B, host.H, host.S), dtype=torch.bool, device=top.device).scatter_(2, top, top_valid)
    unselected = layer.candidates()[:, None, :] & ~chosen  # (B, H, S)
    if not bool(unselected.any()):
        return out
    summary = completion.value_summary(layer.method_state, layer.method_state["index"], host, layer.config)
    scores = estimate.scores if softcap is None else torch.tanh(estimate.scores / softcap) * softcap
    part_lse, part_out = completion.unselected_part(scores, unselected, summary)
    B, Q, Hq, D = out.shape
    rows = out.transpose(1, 2).reshape(B, host.H, -1, D)  # (B, H, R, D): R = G*Q, as q's rows
    merged = completion.merge(rows, att.float().logsumexp(-1), part_out, part_lse)
    return merged.view(B, Hq, Q, D).transpose(1, 2)


def append(layer, k_new, v_new, new_valid):
    """The new tokens into the host tier (valid, searchable), the window's ring, and the method's state."""
    start = layer._store(k_new, v_new)
    Q = k_new.shape[2]
    layer.host.valid[:, start : start + Q] = new_valid
    layer.host.searchable[:, start : start + Q] = new_valid
    window = layer.window
    window.ring_write(k_new, v_new, start)
    window.n_real = [n + int(c) for n, c in zip(window.n_real, new_valid.sum(1).tolist(), strict=True)]
    layer.method.on_append(layer.view(), start, k_new)
