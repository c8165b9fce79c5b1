"""A PQ layer's step in general: any batch of left-padded rows, any number of new tokens (a decode step, or a
question's chunk after a cached document), any selection method, any observer.

    select (the method's picks)  ->  fetch them into the device window (block cache first)  ->  assemble
    [ sinks | window ring | picks | new tokens ]  ->  masked attention  ->  observe  ->  append the new tokens

onerow.py computes the same step for one row and one new token in fewer operators; PQLayer.attend picks the path.
"""

from __future__ import annotations

import torch

from pqcache.engine.layer.attention import masked_attention
from pqcache.engine.layer.probe import observe_step
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
    if exact_chunk:  # a question after a cached document reads every cached token, as the prefill did
        top, top_valid = positions_of(layer.candidates()[:, None, :].expand(-1, H, -1))
    else:
        top, top_valid = layer.select(q, scaling)
        scores = layer.method_state.pop(PICKED_SCORES, None)
    window = layer.window
    window.ensure(top.shape[2], Q)
    moved = window.fetch(top, top_valid, layer.span, keys=scores is None)
    layer.counters["hits"] += moved["hits"]
    layer.counters["misses"] += moved["misses"]
    keys, values, mask = window.assemble(top_valid, k_new, v_new, new_valid)
    known = None if scores is None else (window.n_init + window.L, scores)
    out, probs = masked_attention(q, keys, values, mask, scaling, softcap, known)

    if layer.tally is not None:  # the answer's sources: the weights just computed, by host position
        add_weights(layer, probs, window.positions(top, Q), Q)
    layer.last_selection = (top, top_valid)
    observe_step(layer, q, scaling, top, top_valid, probs, mask, moved)
    append(layer, k_new, v_new, new_valid)
    layer.counters["steps"] += 1
    if exact_chunk:  # the whole context stays on the device only for the chunk; the next step sizes the top-k part
        window.resize(0, 1)
    return out


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
