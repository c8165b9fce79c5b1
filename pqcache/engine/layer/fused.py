"""A PQ layer's one-row decode step in one C call (native/pq_step.py, pq_step.c), for layer/onerow.py: whether a
step can take it, its counts, the call, and the new token filed in it (its rows, flags, codes, and with completion
its value in the values' summary). The tiers, codes and counters it leaves are those onerow._append leaves
(tests/unit/test_pq_step.py)."""

from __future__ import annotations

import torch

from pqcache.engine import completion
from pqcache.engine.layer.probe import observe_picks
from pqcache.engine.methods import pqcache as pq_method
from pqcache.engine.methods.pqcache import first_stage_count
from pqcache.native import KV_KINDS
from pqcache.native import pq_step as native_step
from pqcache.native import select as native_select


def counts(layer) -> tuple:
    """The fused step's candidates (window.candidates() less its tail, the window's last tokens that are never
    candidates: a view), its k picks and the re-rank's `wide` first-stage candidates, and how many candidates."""
    host = layer.host
    cand = host.searchable[0, : max(0, host.S - layer.window.n_local[0])]
    k, n_cand = layer.topk_counts()[0], int(torch.count_nonzero(cand))
    return cand, k, first_stage_count(layer.config, k, n_cand), n_cand


def applies(layer, query, softcap, new_valid) -> bool:
    """Whether the step's selection and attention can be one C call (native/pq_step): the kernels onerow.attend's
    steps call one by one, on the same operands (methods/pqcache.search's and rerank_exact's native paths,
    onerow._attend_in_place's), with nothing recorded per token and no block cache to keep books for."""
    host, window, index = layer.host, layer.window, layer.method_state["index"]
    kernels = layer.config.kernels
    return (
        kernels.native_attention
        and kernels.values_in_place
        and softcap is None
        and layer.tally is None
        and window.blocks is None
        and bool(new_valid.view(-1)[0])
        and host.reads_in_place
        and query.dtype == torch.float32
        and window.k.device.type == "cpu"
        and window.k.dtype in KV_KINDS
        and pq_method.searches_natively(index, query.shape[1] // host.H)
        and layer.config.gqa_combine in native_select.MODES
    )


def step(layer, index, query, cand, counts, k_new, v_new, scaling: float) -> tuple:
    """onerow.attend's step in one C call (native/pq_step.pq_step) for k picks re-ranked from `wide` PQ candidates
    (counts = (k, wide)), the new token filed in the same call (under an observer, in a call of its own, timed as
    _store's copy is), an observer's records of the picks -> (top, top_valid, moved, out (1, 1, Hq, D)): the picks
    and bytes for the step's books, which onerow keeps for both its paths."""
    host, window = layer.host, layer.window
    _, Hq, _, D = query.shape
    H = host.H
    lo = window.n_init + window.L
    window.ensure(0, 1)  # the new token goes into the buffer's first free slot, after the sinks and ring
    observed = layer.obs is not None
    alone = observed or not layer.config.kernels.file_in_step
    token = None if alone else _token(layer, index)  # (the room it makes may move the stores: first)
    host.sync()
    S0, own = host.S0, host.own_k is not None
    stores = (host.shared_k[0] if S0 else None, host.shared_v[0] if S0 else None, S0)
    stores += (host.own_k[0, :, : host.S - S0] if own else None, host.own_v[0, :, : host.S - S0] if own else None)
    new = (k_new[0, :, 0], v_new[0, :, 0])
    slots = (window.k[0], window.v[0], lo + 1, *new)
    args = (query.reshape(Hq, D), scaling, _index(index), cand, counts, layer.config.gqa_combine, stores, slots)
    summary, operands = None, {}
    if layer.config.completion:  # the values' summary: the candidates left out estimated in the same call
        summary = completion.value_summary(layer.method_state, index, host, layer.config)
        operands = summary.fused_operands(host.S)  # the filed token goes at host.S
    margin = pq_method.first_stage_margin(layer.config)
    row_scale = None
    if margin:  # the first stage's margin (methods/pqcache.spreads), per query row
        row_scale = pq_method.spreads(index, query.reshape(1, H, Hq // H, D) * scaling, margin)[0].view(Hq)
    config = layer.config
    mass = None if config.mass is None else (config.mass, config.mass_floor_tokens)
    top, out, kept = native_step.pq_step(*args, token, row_scale=row_scale, mass=mass, **operands)
    if summary is not None and not alone:  # the call filed the token's value in the summary
        summary.filed_elsewhere(1)
    top, top_valid = top[None], kept[None]  # (1, H, k): the picks (candidates, in the re-rank's k), those attended
    n_read = int(top_valid.sum())
    moved = window.counted(0, n_read, n_read, False, 0)  # no block cache: every pick attended read in the host tier
    if observed:
        observe_picks(layer, query.reshape(1, H, Hq // H, D), scaling, top, top_valid, moved)
    if alone:
        with layer.span("copy to host"):  # the span _store's copy has (the codes and ring slot are in it too)
            token = _token(layer, index)  # first: the room it makes may move the index's buffers
            native_step.pq_append(new, _index(index), token)
    if observed:
        layer.obs.moved("to_host", 2 * k_new.numel() * k_new.element_size())
    _filed(layer, index)
    return top, top_valid, moved, out.view(1, 1, Hq, D)


def _index(index) -> tuple:
    """The index as native/pq_step reads it: (centroids (H, m, C, d), codes (H, m, S'), joint (H, S') or None,
    residuals (H, S'))."""
    joint = None if index.joint is None else index.joint[0]
    return index.segments[0][1][0], index.codes[0], joint, index.residuals[0]


def _token(layer, index) -> tuple:
    """Room for the new token at position t = host.S, and where it goes (native/pq_step.pq_append's token): the
    host tier's own rows, the ring slot of the oldest ring token (ring_write's for one token), its flags."""
    host, window = layer.host, layer.window
    t = host.S
    host.reserve(t + 1)
    index.reserve(t + 1)
    slot = t % window.L
    rows = (host.own_k[0, :, t - host.S0], host.own_v[0, :, t - host.S0])
    rows += (window.k[0, :, window.n_init + slot], window.v[0, :, window.n_init + slot])
    flags = (host.valid[0, t], host.searchable[0, t], window.slot_pos[slot])
    half_norm = None if index.config.metric == "ip" else index.half_norms()[0]
    return half_norm, t, rows, flags


def _filed(layer, index):
    """The counts kept in Python once the new token is filed: the tier's length, the ring's real tokens, the index's
    decoded tokens (and a rebuild when they are due)."""
    t = layer.host.S
    layer.host.S += 1
    layer.window.n_real[0] += 1
    index.appended(t, 1)
