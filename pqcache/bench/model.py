"""Benchmarks on a whole model's cache: time to first token (full attention against PQCache), the device tier's KV
bytes at a model's shapes, and the block cache's hit rate over a generation. Ratios are measured side by side in
one run (absolute times here are noisy)."""

from __future__ import annotations

import time

import torch

from pqcache.engine.config import PQCacheConfig
from pqcache.engine.shapes import head_dim_of


def _ids(tokenizer, n: int) -> torch.Tensor:
    from pqcache.eval.passkey import passkey_context

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
