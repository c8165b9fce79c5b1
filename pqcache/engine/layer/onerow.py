"""A PQ layer's decode step for one row and one new token, in few operators (the CPU decode path).

PQLayer.attend serves every case: batches of left-padded rows, question chunks, forks, selections recorded
for the instrumentation and nine selection methods, through a read-only view and per-row lists. On a CPU that
generality costs more than the arithmetic: about 250 top-level operators and about a millisecond of Python per
layer and step at 8K tokens, where the step's real work (PQ search, re-rank, fetch, attention) is about as much.

The step a user's answer takes (one row, one token, PQCache's own selection) is computed here with the same
functions on the same tensors for everything that is arithmetic (PQ scores, the GQA combine, top-k with its tie
rule, the re-rank, the masked attention, the codes of the new key), so its output and picks are those of
PQLayer.attend (tests/unit/test_onerow.py); only the bookkeeping is shorter: the picks' values are copied into the
buffer from the host tier directly, and the mask of a window whose sinks and ring are all real tokens is known.
The device block cache keeps its books as in PQLayer.attend (the same look-up, hits and misses, admissions and
bytes): the values it holds are copies of the host tier's, so where a pick is read from does not change the
output. An observer gets the same records (timeline spans, block-cache hits, bytes, the sampled steps' power law
and recall). Anything else (a padded row, a new token that is not real, a second codebook segment, OPQ, an
observer that records every step's positions) takes PQLayer.attend.

Where pqcache/native built and the host tier holds float32 (a CPU), the picks' values are not copied at all: the
attention's weighted sum over them reads each where it lies in the host tier (HostTier.value_sums), and the
window's part and the new token's are added; on a CPU the whole attention is one C call (native/select.attend_picks:
the window's scores, one softmax with the re-rank's scores, the weighted sums). The same softmax, another summation
order: within float32 rounding of PQLayer.attend's output, the same picks (tests/unit/test_onerow.py). Then the timeline
shows no copy of the picks to the device (none happens); the block cache's admissions are copies, and shown.
Where nothing is recorded per token and no block cache keeps books, the selection joins it in that call, and the new
token is filed there too (layer/fused.py: native/pq_step.py); the tiers, codes and counters are those _append leaves.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from pqcache.engine.layer import fused
from pqcache.engine.layer.attention import masked_attention, query_key_dots
from pqcache.engine.layer.probe import observe_picks
from pqcache.engine.methods.pqcache import PQCacheMethod, first_stage_count, first_stage_margin, rerank_exact, search
from pqcache.engine.sources import add_weights
from pqcache.native import KV_KINDS
from pqcache.native import select as native_select


def ready(layer, query: torch.Tensor) -> bool:
    """Whether `layer`'s step for query (B, Hq, Q, D) can take this path (checked after the method's prepare)."""
    if query.shape[0] != 1 or query.shape[2] != 1 or type(layer.method) is not PQCacheMethod:
        return False
    if layer.obs is not None and layer.obs.selections:  # the position of every buffer slot: PQLayer.attend's
        return False
    index = layer.method_state.get("index")
    if index is None or len(index.segments) != 1 or index.rotations:
        return False
    return _state(layer).real


class _State:
    """What the path knows about a layer's device window between steps (rebuilt when the window is replaced)."""

    def __init__(self, window):
        self.window = window
        # every sink is a real token and the ring holds only real tokens of the window: then the mask is ones
        # there, and stays so while each new token is real (it takes the slot of the oldest ring token)
        self.real = bool(window.init_valid.all()) and bool(window.ring_valid().all()) and window.L > 0
        self.ones = None  # (1, H, 1, n_init + L) bool


def _state(layer) -> _State:
    state = getattr(layer, "_one_row", None)
    if state is None or state.window is not layer.window:
        state = layer._one_row = _State(layer.window)
    return state


def attend(layer, query, k_new, v_new, new_valid, scaling: float, softcap=None) -> torch.Tensor | None:
    """query (1, Hq, 1, D), k_new, v_new (1, H, 1, D), new_valid (1, 1) -> attention output (1, 1, Hq, D), with
    the layer's tiers, index and counters updated as PQLayer.attend updates them. None, before anything is changed,
    for a step with completion or a budget in mass that the fused C call cannot take (which makes the estimate in
    the same pass, native/pq_complete.c) and that needs it (completion: picks that are not every candidate; a budget in
    mass: any), or that is observed (the general step records the estimate's share): PQLayer.attend's general step
    then takes it."""
    host, window, config, state = layer.host, layer.window, layer.config, _state(layer)
    index = layer.method_state["index"]
    _, Hq, _, D = query.shape
    H, S = host.H, host.S
    q = query.reshape(1, H, Hq // H, D)  # (1, H, G, D): query heads h*G..h*G+G-1 share KV head h

    # the step's budget and candidates (what PQLayer.select's view reads)
    k = layer.topk_counts()[0]
    estimating = config.completion or config.mass is not None
    if estimating and layer.obs is not None:
        return None
    if config.kernels.fused and fused.applies(layer, query, softcap, new_valid):
        cand, k, wide, n_cand = fused.counts(layer)
        if 0 < k < wide:
            top, top_valid, moved, out = fused.step(layer, index, query, cand, (k, wide), k_new, v_new, scaling)
            _books(layer, top, top_valid, moved)
            return out
        if estimating and (config.mass is not None or n_cand > k):
            return None
    elif estimating:
        return None
    cand = window.candidates()  # (1, S): real tokens that are not sinks, older than the window
    n_cand = int(cand.sum())
    k_max = min(k, S)
    scores = None
    if k_max == 0 or n_cand == 0:
        top = torch.zeros((1, H, 0), dtype=torch.long, device=layer.device)
        top_valid = top.bool()
    else:
        qs = q * scaling
        wide = first_stage_count(config, k, n_cand)
        mode = config.gqa_combine
        top, top_valid = search(index, qs, cand, [wide], mode, first_stage_margin(config))
        if wide != k:
            top, top_valid, scores = rerank_exact(host, qs, top, top_valid, [k], config)

    kk, lo = top.shape[2], window.n_init + window.L
    _, hit = window.look_up(top, top_valid)  # the block cache's books (it holds copies of host values)
    in_place = config.kernels.values_in_place and scores is not None and softcap is None and host.reads_in_place
    with layer.span("copy to device") if not in_place or window.holds_blocks else nullcontext():
        if not in_place:  # the picks into the buffer after the sinks and ring (values only when re-ranked)
            window.ensure(kk, 1)
            bh = torch.arange(H).repeat_interleave(kk)
            picked_k, picked_v = host.rows(bh, top.to(host.host).reshape(-1), keys=scores is None)
            window.v[0, :, lo : lo + kk] = picked_v.view(H, kk, D)
            if scores is None:
                window.k[0, :, lo : lo + kk] = picked_k.view(H, kk, D)
        admitted = window.admit(top, top_valid)
    # the bytes the general step copies from the host tier; read in place, the attention reads as many from there
    moved = window.moved(hit, top_valid, scores is None, admitted)
    if in_place:
        out = _attend_in_place(layer, q, lo, (top, top_valid, scores), k_new, v_new, new_valid, scaling)
    else:
        window.k[:, :, lo + kk : lo + kk + 1] = k_new
        window.v[:, :, lo + kk : lo + kk + 1] = v_new
        if state.ones is None or state.ones.shape[1] != H or state.ones.shape[3] != lo:
            state.ones = torch.ones((1, H, 1, lo), dtype=torch.bool, device=layer.device)
        new_mask = new_valid.view(1, 1, 1, 1).expand(1, H, 1, 1)
        mask = torch.cat([state.ones, top_valid[:, :, None, :], new_mask], dim=3)
        keys, values = window.k[:, :, : lo + kk + 1].to(q.dtype), window.v[:, :, : lo + kk + 1].to(q.dtype)
        known = None if scores is None else (lo, scores)
        out, probs = masked_attention(q, keys, values, mask, scaling, softcap, known)
        if layer.tally is not None:  # the buffer is [sinks | ring | picks | new], as window.positions lists it
            add_weights(layer, probs, window.positions(top, 1))
    if layer.obs is not None:
        observe_picks(layer, q, scaling, top, top_valid, moved)
    return _append(layer, state, index, top, top_valid, moved, k_new, v_new, new_valid, out)


def _attend_in_place(layer, q, lo: int, picks, k_new, v_new, new_valid, scaling: float) -> torch.Tensor:
    """masked_attention's softmax over the window's sinks and ring (keys and values in the buffer), the picks
    (their exact scores from the re-rank, their values read in the host tier) and the new token -> (1, 1, Hq, D)."""
    top, top_valid, scores = picks  # (1, H, k), (1, H, k), (1, H, k, G)
    window, host = layer.window, layer.host
    _, H, G, D = q.shape
    kk = top.shape[2]
    if (
        layer.config.kernels.native_attention
        and window.k.device.type == "cpu"
        and window.k.dtype in KV_KINDS
        and q.dtype == torch.float32
    ):
        # one C call: the new token goes into the buffer's first free slot, after the sinks and ring
        window.ensure(0, 1)
        window.k[:, :, lo], window.v[:, :, lo] = k_new[:, :, 0], v_new[:, :, 0]
        n = lo + int(new_valid.view(-1)[0])
        stores = host.value_stores()
        picks, tally = (top[0], top_valid[0], scores[0]), layer.tally is not None
        out = native_select.attend_picks(q.view(H * G, D), window.k, window.v, n, scaling, picks, stores, tally)
        if tally:  # its weights are (H, n + k): the window's slots, the new token, then the picks
            out, received = out
            slots = window.positions(top, 1)[0, :, :lo]  # (H, lo): the sinks' and ring's positions
            layer.tally.add(
                torch.cat([slots, top[0]], 1), torch.cat([received[:, :lo], received[:, n:]], 1), layer.layer_idx
            )
        return out.view(1, 1, H * G, D)
    window_scores = query_key_dots(q, window.k[:, :, :lo].to(q.dtype)) * scaling  # (1, H, G, lo)
    att = torch.cat([window_scores, scores.transpose(-1, -2), query_key_dots(q, k_new) * scaling], -1)
    hidden = torch.cat([~top_valid, ~new_valid.view(1, 1, 1).expand(1, H, 1)], -1)  # (1, H, k + 1)
    att[..., lo:].masked_fill_(hidden[:, :, None, :], float("-inf"))
    probs = att.softmax(dim=-1)  # (1, H, G, lo + k + 1)
    if layer.tally is not None:  # [sinks | ring | picks | new], as window.positions lists them
        add_weights(layer, probs.view(1, H, G, -1), window.positions(top, 1))
    out = probs[..., :lo] @ window.v[:, :, :lo].to(q.dtype) + probs[..., lo + kk :] @ v_new  # (1, H, G, D)
    out += host.value_sums(top.to(host.host), probs[..., lo : lo + kk].transpose(-1, -2)).to(out.device)
    return out.view(1, H * G, 1, D).transpose(1, 2)


def _append(layer, state, index, top, top_valid, moved, k_new, v_new, new_valid, out) -> torch.Tensor:
    """The new token into the host tier, flags, its ring slot, its codes (general.append); the step's
    selection and counters. Returns out."""
    host, window = layer.host, layer.window
    start = layer._store(k_new, v_new)  # (a "copy to host" span and its bytes when observed)
    host.valid[:, start : start + 1] = new_valid
    host.searchable[:, start : start + 1] = new_valid
    window.ring_write(k_new, v_new, start)
    real = int(new_valid.sum())
    window.n_real[0] += real
    state.real = real == 1  # a token that is not real would change the ring's mask: PQLayer.attend from now on
    index.append(start, k_new)
    _books(layer, top, top_valid, moved)
    return out


def _books(layer, top, top_valid, moved: dict):
    """The step's selection and counters, as PQLayer.attend keeps them."""
    layer.last_selection = (top, top_valid)
    layer.counters["hits"] += moved["hits"]
    layer.counters["misses"] += moved["misses"]
    layer.counters["steps"] += 1
    layer.counters["decode_steps"] += 1
    layer.counters["picked"] += int(top_valid.sum())
