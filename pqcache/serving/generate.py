"""Greedy generation with a prefill / decode_one_token split, timed, for the CLI and the app."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from pqcache.engine.cache import PQCache, kv_bytes
from pqcache.engine.config import PQCacheConfig
from pqcache.engine.errors import InputError
from pqcache.engine.methods import METHODS


def make_cache(model, method: str, config: PQCacheConfig | None = None):
    """"full" is transformers' own DynamicCache (the reference); every other method a PQCache."""
    if method == "full":
        return DynamicCache(config=model.config)
    if method not in METHODS:
        raise InputError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    return PQCache(model, config or PQCacheConfig(), method=method)


def build_prompt(tokenizer, context: str, question: str) -> str:
    return f"{context.rstrip()}\n\n{question.strip()}" if context else question.strip()


@torch.no_grad()
def prefill(model, input_ids: torch.Tensor, cache) -> torch.Tensor:
    """input_ids (B, S) -> next-token logits (B, V)."""
    return model(input_ids=input_ids, cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1]


@torch.no_grad()
def decode_one_token(model, token: torch.Tensor, cache) -> torch.Tensor:
    """token (B, 1) -> next-token logits (B, V)."""
    return model(input_ids=token, cache=cache, use_cache=True).logits[:, -1]


def cache_bytes(cache) -> dict:
    if isinstance(cache, PQCache):
        return cache.stats()
    return {"device_kv_bytes": sum(kv_bytes(layer) for layer in cache.layers), "host_kv_bytes": 0, "pq_bytes": 0, "kmeans_iters": None}


@dataclass
class Generation:
    text: str = ""
    tokens: list[int] = field(default_factory=list)
    stats: dict = field(default_factory=dict)


def generate(model, tokenizer, prompt: str, method: str = "pqcache", config: PQCacheConfig | None = None,
             max_new_tokens: int = 32, on_token=None) -> Generation:
    """Greedy decode of `prompt`; on_token(text_so_far) is called after each token."""
    if max_new_tokens < 1:
        raise InputError("max_new_tokens must be >= 1")
    device = next(model.parameters()).device
    input_ids = tokenizer(prompt, return_tensors="pt").input_ids.to(device)
    cache = make_cache(model, method, config)
    gen_eos = model.generation_config.eos_token_id
    eos = set(gen_eos if isinstance(gen_eos, list) else [gen_eos]) | {tokenizer.eos_token_id}
    eos.discard(None)
    t0 = time.perf_counter()
    logits = prefill(model, input_ids, cache)
    prefill_s = time.perf_counter() - t0
    out = Generation()
    t1 = time.perf_counter()
    for _ in range(max_new_tokens):
        token = logits.argmax(-1, keepdim=True)  # (1, 1)
        tid = int(token)
        if tid in eos:
            break
        out.tokens.append(tid)
        if on_token is not None:
            on_token(tokenizer.decode(out.tokens, skip_special_tokens=True))
        if len(out.tokens) == max_new_tokens:
            break
        logits = decode_one_token(model, token, cache)
    decode_s = time.perf_counter() - t1
    out.text = tokenizer.decode(out.tokens, skip_special_tokens=True)
    mem = cache_bytes(cache)
    out.stats = {
        "method": method,
        "prompt_tokens": int(input_ids.shape[1]),
        "new_tokens": len(out.tokens),
        "prefill_s": round(prefill_s, 4),
        "s_per_token": round(decode_s / max(1, len(out.tokens)), 5),
        "device_kv_bytes": mem["device_kv_bytes"],
        "host_kv_bytes": mem["host_kv_bytes"],
        "pq_bytes": mem["pq_bytes"],
        "kmeans_iters": mem.get("kmeans_iters"),
    }
    if isinstance(cache, PQCache):
        out.stats["config"] = cache.pq_config.to_dict()
        cache.close()
    return out
