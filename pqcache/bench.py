"""Benchmarks that print ratios measured side by side in one run (absolute times here are noisy)."""
from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

from .config import PQCacheConfig
from .layer import PQLayer


def _median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


class _InlineExecutor:
    """Runs the PQ build in the caller: the benchmark times decode steps, not the build."""

    def submit(self, fn, *args):
        from concurrent.futures import Future

        fut = Future()
        fut.set_result(fn(*args))
        return fut


def filled_layer(keys, values, config: PQCacheConfig, iters: int = 10) -> PQLayer:
    """A PQLayer prefilled with keys/values (B, H, S, D), PQ built."""
    layer = PQLayer(config, 0, _InlineExecutor(), lambda s: iters)
    layer.update(keys, values)
    layer.finish_prefill(torch.ones(keys.shape[0], keys.shape[2], dtype=torch.bool))
    layer.wait_pq()
    return layer


def bench_attention(seq_lens=(4096, 16384, 65536), n_q=32, n_kv=8, head_dim=128, budget=0.1,
                    m=2, bits=6, repeats=15, seed=0) -> list[dict]:
    """One decode step of one layer (Llama-3.1-8B head shapes): dense SDPA over s tokens against the
    PQCache step (PQ search + top-k + gather + attention + appending the new token). The block cache
    is off here: on a CPU the device and host tiers are the same memory (see `bench blockcache`)."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    scaling = head_dim ** -0.5
    for s in seq_lens:
        keys = torch.randn(1, n_kv, s, head_dim, generator=gen)
        values = torch.randn(1, n_kv, s, head_dim, generator=gen)
        cfg = PQCacheConfig(m=m, bits=bits, token_budget=budget, kmeans_iters=10, block_cache_tokens=0)
        layer = filled_layer(keys, values, cfg)
        q = torch.randn(1, n_q, 1, head_dim, generator=gen)
        k_new = torch.randn(1, n_kv, 1, head_dim, generator=gen)
        v_new = torch.randn(1, n_kv, 1, head_dim, generator=gen)
        valid = torch.ones(1, 1, dtype=torch.bool)

        def dense():
            F.scaled_dot_product_attention(q, keys, values, scale=scaling, enable_gqa=True)

        def pq_step():
            layer.update(k_new, v_new)
            layer.attend(q, valid, scaling)

        def search():
            layer.select(q.reshape(1, n_kv, n_q // n_kv, head_dim), scaling)

        for fn in (dense, pq_step, search):  # warm-up
            fn()
        dense_ms, pq_ms, search_ms = [], [], []
        for _ in range(repeats):  # interleaved, so machine noise hits both alike
            dense_ms.append(_median_ms(dense, 1))
            pq_ms.append(_median_ms(pq_step, 1))
            search_ms.append(_median_ms(search, 1))
        d, p, sr = (statistics.median(x) for x in (dense_ms, pq_ms, search_ms))
        rows.append({"seq_len": s, "dense_ms": round(d, 3), "pqcache_ms": round(p, 3),
                     "speedup": round(d / p, 2), "search_share": round(min(sr / p, 1.0), 3)})
    return rows
