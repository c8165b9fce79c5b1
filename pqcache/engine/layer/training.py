"""What a PQ build computes (PQIndex.build, on the cache's executor): the K-Means of a layer's keys over a span of
positions, their codes and residuals, and under completion the prefill's value codes. The index (layer/index.py)
submits it and installs what it returns; builds.py keeps the deadline.

Shapes: B rows, H KV heads, m sub-spaces, C centroids, d = D/m, n positions.
"""

from __future__ import annotations

import time

import torch

from pqcache.engine import completion, pq
from pqcache.engine.errors import Cancelled


def train(index, start: int, end: int, iters: int, kind: str) -> dict:
    """PQIndex.build: the K-Means of index's codebooks over the searchable tokens of [start, end) of each row, and
    their codes -> the result PQIndex.install puts in place. Runs on the cache's executor: it reads the host tier
    and changes nothing the decoding thread reads."""
    t0 = time.perf_counter()
    host, cfg = index.host, index.config
    with index._span("host clustering"):
        # (B, H, n, D) on the host as stored: each sub-space is widened alone (train_centroids), each block of
        # tokens as it is coded (pq.encode), never all of the keys at once
        keys = host.keys(start, end, dtype=host.dtype)
        m, C, d = cfg.m, index.C, host.D // cfg.m
        cents = torch.empty((host.B, host.H, m, C, d), dtype=torch.float32)
        rotation = torch.empty((host.B, host.H, host.D, host.D)) if cfg.opq else None
        searchable = host.searchable[:, start:end].cpu()
        for b in range(host.B):
            rows = searchable[b].nonzero().squeeze(1)
            for h in range(host.H):
                if index.closed.is_set():  # the cache was closed (stop, session freed): drop the work
                    raise Cancelled("the cache was closed")
                x = keys[b, h, rows]
                if rotation is not None:  # OPQ: rotate so that the sub-spaces quantize best
                    rotation[b, h] = pq.train_rotation(x, m, index.bits, iters, cfg.seed + 97 * h)
                    x = x.float() @ rotation[b, h].T
                cents[b, h] = pq.train_centroids(x, m, C, iters, cfg.metric, cfg.seed + 97 * h)
        if rotation is not None:
            keys = keys.float() @ rotation.transpose(-1, -2)
        cents, keys = cents.to(index.device), keys.to(index.device)
        codes = pq.encode(keys, cents, cfg.metric)
        residuals = pq.residual_norms(keys, codes, cents)
        value_codes = None
        if kind == "prefill" and cfg.completion and cfg.value_codes:  # completion's, trained with the prefill's
            value_codes = completion.ValueCodes(host, cfg.value_codes, iters, cfg.seed, end=end)
    return {
        "kind": kind,
        "start": start,
        "end": end,
        "centroids": cents,
        "codes": codes,
        "residuals": residuals,
        "rotation": rotation,
        "value_codes": value_codes,
        "seconds": time.perf_counter() - t0,
    }
