"""One-layer benchmarks that print ratios measured side by side in one run (absolute times here are noisy): a
decode step's attention, dense SDPA against the PQCache step (and the same step with completion), and its growth
with the context; and the median timing the kernel benchmark shares."""

from __future__ import annotations

import statistics
import time
from dataclasses import replace

import torch
import torch.nn.functional as F

from pqcache.engine.config import PQCacheConfig
from pqcache.engine.layer.standalone import InlineExecutor, filled_layer
from pqcache.engine.methods.pqcache import PQCacheMethod, first_stage_counts, rerank_exact


def median_ms(fn, repeats: int, sync=None) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        if sync is not None:  # CUDA: time the work, not the launch
            sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def bench_attention(
    seq_lens=(4096, 16384, 65536),
    n_q=32,
    n_kv=8,
    head_dim=128,
    budget=0.1,
    m=None,
    bits=None,
    rerank=None,
    repeats=15,
    seed=0,
    device="cpu",
    dtype=torch.float32,
) -> list[dict]:
    """One decode step of one layer (Llama-3.1-8B head shapes): dense SDPA over s tokens against the
    PQCache step (PQ search + exact re-rank + top-k + gather + attention + appending the new token),
    with the search's and the re-rank's share of the step, and the same step with completion and without the first
    stage's margin (search_margin=0). m, bits, rerank: None for the defaults.
    The block cache is off here: on a CPU the device and host tiers are the same memory (see
    `bench blockcache`)."""
    settings = {k: v for k, v in {"m": m, "bits": bits, "rerank": rerank}.items() if v is not None}
    gen = torch.Generator().manual_seed(seed)
    rows = []
    scaling = head_dim**-0.5
    sync = torch.cuda.synchronize if str(device).startswith("cuda") else None

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device, dtype)

    for s in seq_lens:
        keys = rand(1, n_kv, s, head_dim)
        values = rand(1, n_kv, s, head_dim)
        cfg = PQCacheConfig(token_budget=budget, kmeans_iters=10, block_cache_tokens=0, **settings).for_head_dim(
            head_dim
        )
        layer = filled_layer(keys, values, cfg)
        q = rand(1, n_q, 1, head_dim)
        k_new = rand(1, n_kv, 1, head_dim)
        v_new = rand(1, n_kv, 1, head_dim)
        valid = torch.ones(1, 1, dtype=torch.bool, device=device)

        def dense():
            F.scaled_dot_product_attention(q, keys, values, scale=scaling, enable_gqa=True)

        # the same step with completion (the unselected tokens estimated from their codes): a fork of the layer,
        # its codes and codebooks shared, so both steps read the same index
        completed = layer.fork(PQCacheMethod(), InlineExecutor(), replace(cfg, completion=True))
        # and the paper's ranking of the first stage (no margin, search_margin=0), on a fork too
        unwidened = layer.fork(PQCacheMethod(), InlineExecutor(), replace(cfg, search_margin=0.0))

        def pq_step(pq_layer=layer):
            pq_layer.update(k_new, v_new)
            pq_layer.attend(q, valid, scaling)

        def completed_step():
            pq_step(completed)

        def unwidened_step():
            pq_step(unwidened)

        q_rows = q.reshape(1, n_kv, n_q // n_kv, head_dim) * scaling
        view = layer.view()
        ks = view.ks
        wide = first_stage_counts(view)
        qs = layer.method.search(view, q_rows, wide)

        def search():  # both stages
            layer.select(q_rows, 1.0)

        def rerank_stage():
            rerank_exact(view.host, q_rows, *qs, ks, cfg)

        steps = {"dense": dense, "pq": pq_step, "search": search, "rerank": rerank_stage, "completed": completed_step}
        steps["unwidened"] = unwidened_step
        for fn in steps.values():  # warm-up
            fn()
        times = {name: [] for name in steps}
        for _ in range(repeats):  # interleaved, so machine noise hits them all alike
            for name, fn in steps.items():
                times[name].append(median_ms(fn, 1, sync))
        d, p, sr, rr, c, u = (statistics.median(times[x]) for x in steps)
        rows.append(
            {
                "seq_len": s,
                "m": cfg.m,
                "bits": layer.method_state["index"].bits,
                "rerank": cfg.rerank,
                "dense_ms": round(d, 3),
                "pqcache_ms": round(p, 3),
                "speedup": round(d / p, 2),
                "search_share": round(min(sr / p, 1.0), 3),
                "rerank_share": round(min(rr / p, 1.0), 3),
                "completion_ms": round(c, 3),
                "completion_vs_pqcache": round(c / p, 2),
                "no_margin_ms": round(u, 3),
                "margin_vs_none": round(p / u, 2),
            }
        )
    return rows


def bench_decode(
    seq_lens=(4096, 32768), budget_tokens=1024, shapes="llama", repeats=15, device="cpu", dtype=torch.float32
) -> list[dict]:
    """Decode attention cost per step as the context grows, at a fixed token budget: dense grows
    with s, the PQCache step only through the PQ scan over the codes."""
    n_q, n_kv, head_dim = SHAPES[shapes]
    rows = bench_attention(
        seq_lens,
        n_q=n_q,
        n_kv=n_kv,
        head_dim=head_dim,
        budget=budget_tokens,
        repeats=repeats,
        device=device,
        dtype=dtype,
    )
    base = rows[0]
    for r in rows:
        r["dense_growth"] = round(r["dense_ms"] / base["dense_ms"], 2)
        r["pqcache_growth"] = round(r["pqcache_ms"] / base["pqcache_ms"], 2)
    return rows


SHAPES = {"llama": (32, 8, 128), "gemma": (4, 1, 256)}  # (query heads, KV heads, head_dim)
