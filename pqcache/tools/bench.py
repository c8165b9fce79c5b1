"""Benchmarks that print ratios measured side by side in one run (absolute times here are noisy)."""

from __future__ import annotations

import statistics
import time
from concurrent.futures import Future

import torch
import torch.nn.functional as F

from pqcache.engine.config import PQCacheConfig
from pqcache.engine.layer.layer import PQLayer
from pqcache.engine.methods.pqcache import first_stage_counts, rerank_exact
from pqcache.engine.shapes import head_dim_of


def _median_ms(fn, repeats: int, sync=None) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        if sync is not None:  # CUDA: time the work, not the launch
            sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


class InlineExecutor:
    """Runs a PQ build in the caller (benchmarks time decode steps, not the build). A fault in a
    build shuts the executor down, as it does the cache's thread pool: later submits raise."""

    def __init__(self):
        self.is_shutdown = False

    def submit(self, fn, *args):
        if self.is_shutdown:
            raise RuntimeError("cannot schedule new futures after shutdown")
        fut = Future()
        try:
            fut.set_result(fn(*args))
        except Exception as exc:  # the build's own error reaches the layer through the future
            fut.set_exception(exc)
        return fut

    def shutdown(self, wait: bool = True, cancel_futures: bool = False):
        self.is_shutdown = True


def filled_layer(keys, values, config: PQCacheConfig, iters: int = 10, method=None) -> PQLayer:
    """A PQLayer prefilled with keys/values (B, H, S, D) (on the compute device), PQ built."""
    layer = PQLayer(config.for_head_dim(keys.shape[-1]), 0, InlineExecutor(), lambda s: iters, method)
    layer.update(keys, values)
    layer.finish_prefill(torch.ones(keys.shape[0], keys.shape[2], dtype=torch.bool, device=keys.device))
    layer.wait_pq()
    return layer


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
    with the search's and the re-rank's share of the step. m, bits, rerank: None for the defaults.
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

        def pq_step():
            layer.update(k_new, v_new)
            layer.attend(q, valid, scaling)

        q_rows = q.reshape(1, n_kv, n_q // n_kv, head_dim) * scaling
        view = layer.view()
        ks = view.ks
        wide = first_stage_counts(view)
        qs = layer.method.search(view, q_rows, wide)

        def search():  # both stages
            layer.select(q_rows, 1.0)

        def rerank_stage():
            rerank_exact(view.host, q_rows, *qs, ks, cfg.gqa_combine)

        for fn in (dense, pq_step, search, rerank_stage):  # warm-up
            fn()
        times = {"dense": [], "pq": [], "search": [], "rerank": []}
        for _ in range(repeats):  # interleaved, so machine noise hits both alike
            for name, fn in (("dense", dense), ("pq", pq_step), ("search", search), ("rerank", rerank_stage)):
                times[name].append(_median_ms(fn, 1, sync))
        d, p, sr, rr = (statistics.median(times[x]) for x in ("dense", "pq", "search", "rerank"))
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


def _ids(tokenizer, n: int) -> torch.Tensor:
    from pqcache.tools.passkey import passkey_context

    text = passkey_context("68422", n_filler=max(1, n // 22))
    ids = tokenizer(text, return_tensors="pt").input_ids
    while ids.shape[1] < n:
        ids = torch.cat([ids, ids[:, 1:]], 1)
    return ids[:, :n]


@torch.no_grad()
def bench_ttft(model, tokenizer, seq_lens=(8192,), config: PQCacheConfig | None = None, repeats: int = 1):
    """Time to first token, full attention against PQCache (prefill, then until every layer's PQ
    is built: the cache is ready for the next token). Run alternately, best of `repeats`."""
    from transformers import DynamicCache

    from pqcache.engine.cache import PQCache
    from pqcache.serving.generate import prefill

    config = config or PQCacheConfig()
    device = next(model.parameters()).device
    model(_ids(tokenizer, 64).to(device), logits_to_keep=1)  # warm-up
    rows = []
    for s in seq_lens:
        ids = _ids(tokenizer, s).to(device)
        full, pqs, info = [], [], {}
        for _ in range(repeats):
            t0 = time.perf_counter()
            prefill(model, ids, DynamicCache(config=model.config)).argmax(-1)
            full.append(time.perf_counter() - t0)
            cache = PQCache(model, config)
            t0 = time.perf_counter()
            prefill(model, ids, cache).argmax(-1)
            prefill_s = time.perf_counter() - t0
            cache.wait()
            pqs.append(time.perf_counter() - t0)
            st = cache.stats()
            info = {
                "kmeans_iters": st["kmeans_iters"],
                "pq_prefill_only_s": round(prefill_s, 3),
                "pq_ready_before_use": all(r["pq_ready_before_use"] for r in st["layers"]),
            }
            cache.close()
        f, p = min(full), min(pqs)
        rows.append({"seq_len": s, "full_s": round(f, 3), "pqcache_s": round(p, 3), "ratio": round(p / f, 3), **info})
    return rows


def _config_for(name: str):
    from transformers import AutoConfig, LlamaConfig

    if name == "llama-3.1-8b":
        return LlamaConfig(
            hidden_size=4096,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            num_hidden_layers=32,
            intermediate_size=14336,
            vocab_size=128256,
        ), torch.bfloat16
    from pqcache.serving.loading import prepare_default_model

    return AutoConfig.from_pretrained(prepare_default_model(lambda *_: None)), torch.float32


def bench_memory(seq_lens=(16384,), budgets=(0.2, 0.1), models=("gemma3-270m", "llama-3.1-8b")) -> list[dict]:
    """Device-tier KV bytes of PQCache against full attention's, measured on caches filled through
    their update() with tensors of the model's shapes (no weights needed)."""
    from transformers import DynamicCache

    from pqcache.engine.cache import PQCache, kv_bytes

    rows = []
    for name in models:
        mconf, dtype = _config_for(name)
        text = mconf.get_text_config(decoder=True)
        H, D = text.num_key_value_heads, head_dim_of(text)
        for s in seq_lens:
            k = torch.randn(1, H, s, D, dtype=dtype)
            full = DynamicCache(config=mconf)
            for i in range(len(full.layers)):
                full.update(k, k, i)
            full_bytes = sum(kv_bytes(layer) for layer in full.layers)
            del full
            for budget in budgets:
                cache = PQCache(mconf, PQCacheConfig(token_budget=budget, kmeans_iters=1))
                for i, layer in enumerate(cache.layers):
                    cache.update(k, k, i)
                    if hasattr(layer, "finish_prefill"):
                        layer.finish_prefill(torch.ones(1, s, dtype=torch.bool))
                cache.wait()
                st = cache.stats()
                cache.close()
                rows.append(
                    {
                        "model": name,
                        "budget": budget,
                        "seq_len": s,
                        "full_device_bytes": full_bytes,
                        "pqcache_device_bytes": st["device_kv_bytes"],
                        "pq_bytes": st["pq_bytes"],
                        "host_bytes": st["host_kv_bytes"],
                        "ratio": round(st["device_kv_bytes"] / full_bytes, 4),
                    }
                )
                del cache
    return rows


@torch.no_grad()
def bench_blockcache(
    model, tokenizer, seq_len=4096, new_tokens=256, capacities=(512, 1024), policies=("lru", "lfu"), budget=0.2
) -> list[dict]:
    """Block-cache hit rate over a generation on a long document, per policy and capacity."""
    from pqcache.engine.cache import PQCache
    from pqcache.serving.generate import decode_one_token, prefill

    device = next(model.parameters()).device
    ids = _ids(tokenizer, seq_len).to(device)
    rows = []
    for capacity in capacities:
        for policy in policies:
            cfg = PQCacheConfig(token_budget=budget, block_cache_tokens=capacity, cache_policy=policy)
            cache = PQCache(model, cfg)
            obs = cache.instrument(timeline=False)
            logits = prefill(model, ids, cache)
            for _ in range(new_tokens):
                logits = decode_one_token(model, logits.argmax(-1, keepdim=True), cache)
            per_layer = {layer.layer_idx: round(obs.hit_rate(layer.layer_idx) or 0.0, 4) for layer in cache.pq_layers}
            rows.append(
                {
                    "policy": policy,
                    "capacity_tokens": capacity,
                    "seq_len": seq_len,
                    "new_tokens": new_tokens,
                    "hit_rate": round(obs.hit_rate() or 0.0, 4),
                    "per_layer": per_layer,
                }
            )
            cache.close()
    return rows
