"""One decode step of PQCache, recorded for the teaching walkthrough as plain data (lists and numbers) that
viz/teaching.py draws: the five steps of the step on one layer, from the run itself.

`StepRecorder` is the PQCache method unchanged (the same search, re-rank and selections: it subclasses
PQCacheMethod and only reads) that keeps, for the first layer that selects, its first single-token step (the
first generated token's step: the question before it attends exactly, PQCacheConfig.chunk_attention="exact"):
the query, the codebook and codes, the PQ candidates and the final top-k, the block cache's map before the
fetch. `StepRecorder.describe(focus)` turns that into the pictures' data:

  codebook   one sub-space's centroids and a few tokens' sub-keys, projected to 2-D, with their codes
  table      the lookup table q . centroids (m x 2^bits) of the group's first query head
  search     approximate against exact scores of every candidate, the PQ stage's and the top-k's thresholds
  fetch      per block of the document: attended tokens already on the device (sinks, window, block cache)
             and those fetched from host memory
  attention  the step's attention weights over the tokens it attended (sinks + top-k + window + itself)

It reads the layer's parts (the device window's block map) between the search and the fetch, and the new
token's key from the host tier after the step; nothing is written.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pqcache.engine import pq
from pqcache.engine.methods.base import combine_rows
from pqcache.engine.methods.pqcache import PQCacheMethod, approx_scores, first_stage_margin, spreads, widen


@dataclass
class StepRecorder(PQCacheMethod):
    snap: dict | None = field(default=None, repr=False)  # the recorded step's tensors (row 0)
    _wide: tuple | None = field(default=None, repr=False)

    def search(self, view, q, ks):
        top, valid = super().search(view, q, ks)
        self._wide = (top, valid)
        return top, valid

    def select(self, view, q):
        self._wide = None
        top, valid = super().select(view, q)
        # the first step that selects, on the first layer; a chunk (chunk_attention="selected") gives way to the
        # single-token step after it (fewer query rows)
        first = self.snap is None or (view.layer_idx == self.snap["layer"] and q.shape[2] < self.snap["q"].shape[1])
        if first and "index" in view.state:
            self.snap = snapshot(view, q, top, valid, self._wide or (top, valid))
        return top, valid

    def describe(self, focus: list[int] | None = None, head: int = 0) -> dict | None:
        """The pictures' data for KV head `head`; focus: a few positions to show with their codes."""
        return None if self.snap is None else describe(self.snap, focus or [], head)


def snapshot(view, q, top, valid, wide) -> dict:
    """What the step read, for row 0: tensors on the CPU (a few MB for a few thousand tokens)."""
    index = view.state["index"]
    S, cfg = view.S, view.config
    cand = view.candidates[:1]
    qf = q[:1].float()
    approx = approx_scores(index, q)[:1]  # (1, H, S, R)
    margin = first_stage_margin(cfg)
    if margin:  # what the first stage ranked: each PQ score raised by its margin (methods/pqcache.spreads)
        row_scale, residuals = spreads(index, q[:1], margin)
        approx = widen(approx.clone(), (row_scale, residuals[:1]))
    exact = (view.keys()[:1] @ qf.transpose(-1, -2)).float()  # (1, H, S, R)
    start, cents = index.segments[0]
    keys = view.keys()[:1]
    rotate = getattr(index, "rotate", None)  # OPQ: the codebooks see rotated keys and queries
    blocks = view.block_map()  # (block size, block -> slot map) or None
    return {
        "layer": view.layer_idx,
        "S": S,
        "config": cfg,
        "bits": index.bits,
        "q": qf[0].cpu(),  # (H, R, D), scaled
        "pq_q": (rotate(qf, start) if rotate else qf)[0].float().cpu(),  # the query as the codebook sees it
        "centroids": cents[0].cpu(),  # (H, m, C, d) of the prefill's codebook
        "codes": index.codes[0, :, :, :S].cpu(),  # (H, m, S)
        "pq_keys": (rotate(keys, start) if rotate else keys)[0].float().cpu(),  # (H, S, D), as the codebook sees them
        "host": view.host,  # the new token's key is stored at position S once the step is done
        "approx": combine_rows(approx, cand, cfg.gqa_combine)[0].cpu(),  # (H, S), -inf off the candidates
        "exact": combine_rows(exact, cand, cfg.gqa_combine)[0].cpu(),
        "exact_rows": exact[0].cpu(),  # (H, S, R) raw q.k
        "cand": cand[0].cpu(),
        "valid": view.valid[0].cpu(),
        "wide": [w[0].cpu() for w in wide],
        "top": [top[0].cpu(), valid[0].cpu()],
        "k": view.ks[0],
        "block_size": None if blocks is None else blocks[0],
        "block_slot": None if blocks is None else blocks[1][0].cpu(),  # (H, n_blocks + 1)
        "n_local": view.n_local[0],
    }


def _pca2(points: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """points (n, d) projected on the two main axes of `basis` (C, d)."""
    mean = basis.mean(0, keepdim=True)
    _, _, v = torch.linalg.svd(basis - mean, full_matrices=False)
    return (points - mean) @ v[:2].T


def describe(snap: dict, focus: list[int], head: int = 0) -> dict:
    S, cfg = snap["S"], snap["config"]
    cents, codes = snap["centroids"][head], snap["codes"][head]  # (m, C, d), (m, S)
    m, C, d = cents.shape
    focus = [p for p in focus if 0 <= p < S][:8]
    # 1. the codebook of the sub-space where the focus tokens' codes differ most, and their sub-keys with the
    # centroid their code names
    j = max(range(m), key=lambda j: (len({int(codes[j, p]) for p in focus}), -j))
    sub = snap["pq_keys"][head, focus, j * d : (j + 1) * d] if focus else torch.zeros((0, d))
    xy_c, xy_t = _pca2(cents[j], cents[j]), _pca2(sub, cents[j])
    tokens = [
        {"pos": p, "xy": xy_t[i].tolist(), "codes": codes[:, p].tolist(), "centroid": xy_c[int(codes[j, p])].tolist()}
        for i, p in enumerate(focus)
    ]
    # 2. the lookup table of the group's first query head: table[j, c] = q_j . centroid_jc
    table = pq.lookup_tables(snap["pq_q"][None, head : head + 1, :1], cents[None, None])[0, 0, :, :, 0]  # (m, C)
    f0 = focus[0] if focus else None
    focus_cell = None
    if f0 is not None:
        cells = codes[:, f0].tolist()
        focus_cell = {"pos": f0, "codes": cells, "score": float(sum(table[j, c] for j, c in enumerate(cells)))}
    # 3. search: approximate vs exact (combined over the group), the PQ stage and the final top-k
    cand = snap["cand"]
    pos = cand.nonzero().squeeze(1)
    wide_top, wide_ok = snap["wide"]
    top, ok = snap["top"]
    picked_wide = set(wide_top[head][wide_ok[head]].tolist())
    picked = set(top[head][ok[head]].tolist())
    approx, exact = snap["approx"][head], snap["exact"][head]
    kind = [2 if p in picked else 1 if p in picked_wide else 0 for p in pos.tolist()]
    thresholds = {
        "approx": min((float(approx[p]) for p in picked_wide), default=None),
        "exact": min((float(exact[p]) for p in picked), default=None),
    }
    # 4. fetch, per block of the document: where each attended token came from
    valid = snap["valid"]
    sinks = (valid & ~cand).nonzero().squeeze(1)
    window_lo = S - snap["n_local"]
    on_device = sinks.tolist()  # sinks and the local window: always on the device
    bs = snap["block_size"] or 128
    n_blocks = -(-S // bs)
    held = [0] * n_blocks
    hits = [0] * n_blocks
    misses = [0] * n_blocks
    slot = snap["block_slot"]
    for p in on_device:
        held[p // bs] += 1
    for p in sorted(picked):
        b = p // bs
        cached = slot is not None and b < slot.shape[1] - 1 and int(slot[head, b]) >= 0
        (hits if cached else misses)[b] += 1
    cached_blocks = [] if slot is None else [b for b in range(min(n_blocks, slot.shape[1] - 1)) if slot[head, b] >= 0]
    # 5. attention over what the step attended: sinks, top-k, window, and the new token itself
    att = sorted(set(on_device) | picked)
    logits = snap["exact_rows"][head, att, :]  # (n, R)
    k_new = snap["host"].keys(S, S + 1, dtype=torch.float32)[0, head, 0]  # (D,): stored after the step
    self_score = (snap["q"][head] @ k_new)[None, :]  # (1, R)
    probs = torch.cat([logits, self_score]).softmax(0).mean(1)  # mean over the group's query heads
    kinds = ["window" if p >= window_lo else "sink" if p not in picked else "top-k" for p in att] + ["new token"]
    return {
        "layer": snap["layer"],
        "kv_head": head,
        "n_tokens": S,
        "m": m,
        "bits": snap["bits"],
        "C": C,
        "d": d,
        "group": int(snap["q"].shape[1]),
        "k": snap["k"],
        "n_wide": len(picked_wide),
        "rerank": cfg.rerank,
        "rerank_min": cfg.rerank_min_tokens,
        "combine": cfg.gqa_combine,
        "margin": first_stage_margin(cfg),
        "n_sinks": int(sum(1 for p in on_device if p < window_lo)),
        "window": [window_lo, S],
        "codebook": {"subspace": j, "centroids": xy_c.tolist(), "tokens": tokens},
        "table": table.tolist(),
        "focus": focus_cell,
        "search": {
            "pos": pos.tolist(),
            "approx": approx[pos].tolist(),
            "exact": exact[pos].tolist(),
            "kind": kind,
            "thresholds": thresholds,
        },
        "fetch": {
            "block_size": bs,
            "held": held,
            "hits": hits,
            "misses": misses,
            "cached_blocks": cached_blocks,
            "has_block_cache": slot is not None,
        },
        "attention": {"pos": att + [S], "weight": probs.tolist(), "kind": kinds},
    }
