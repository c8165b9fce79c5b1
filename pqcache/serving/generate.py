"""Greedy generation, gpt-fast style: prefill / decode_one_token / decode_n_tokens, the one loop used by
the CLI's generate, the document session's answers and the evaluation."""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from pqcache.engine.cache import PQCache, kv_bytes
from pqcache.engine.config import PQCacheConfig
from pqcache.engine.errors import InputError
from pqcache.engine.methods import METHODS


def make_cache(model, method: str, config: PQCacheConfig | None = None):
    """ "full" is transformers' own DynamicCache (the reference); every other method a PQCache."""
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


def eos_token_ids(model, tokenizer=None) -> set[int]:
    """The ids that end a generation: the model's generation_config eos_token_id (an id or a list) and the
    tokenizer's eos_token_id."""
    gen = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    eos = set(gen if isinstance(gen, (list, tuple)) else [gen])
    eos.add(getattr(tokenizer, "eos_token_id", None))
    eos.discard(None)
    return eos


@dataclass
class Decoded:
    tokens: list[int] = field(default_factory=list)
    stopped: bool = False  # `stop` was set before the next token


@torch.no_grad()
def decode_n_tokens(
    model, logits: torch.Tensor, cache, max_new_tokens: int, eos=frozenset(), on_token=None, stop=None, lock=None
) -> Decoded:
    """Greedy decode of one row from the prefill's next-token logits (1, V), at most max_new_tokens tokens.

    Ends at an EOS id (not kept), after max_new_tokens (no forward is run for a token that is not kept), or when
    `stop` (a threading.Event) is set before the next token. on_token(tokens) is called after each token with the
    tokens so far; `lock` (a context manager) is held around each forward."""
    out = Decoded()
    for _ in range(max_new_tokens):
        if stop is not None and stop.is_set():
            out.stopped = True
            break
        token = logits.argmax(-1, keepdim=True)  # (1, 1)
        tid = int(token)
        if tid in eos:
            break
        out.tokens.append(tid)
        if on_token is not None:
            on_token(out.tokens)
        if len(out.tokens) == max_new_tokens:
            break
        with lock if lock is not None else nullcontext():
            logits = decode_one_token(model, token, cache)
    return out


def cache_bytes(cache) -> dict:
    if isinstance(cache, PQCache):
        return cache.stats()
    return {
        "device_kv_bytes": sum(kv_bytes(layer) for layer in cache.layers),
        "host_kv_bytes": 0,
        "pq_bytes": 0,
        "kmeans_iters": None,
    }


@dataclass
class Generation:
    text: str = ""
    tokens: list[int] = field(default_factory=list)
    stats: dict = field(default_factory=dict)


def generate(
    model,
    tokenizer,
    prompt: str,
    method: str = "pqcache",
    config: PQCacheConfig | None = None,
    max_new_tokens: int = 32,
    on_token=None,
) -> Generation:
    """Greedy decode of `prompt`; on_token(text_so_far) is called after each token."""
    if max_new_tokens < 1:
        raise InputError("max_new_tokens must be >= 1")
    device = next(model.parameters()).device
    input_ids = tokenizer(prompt, return_tensors="pt").input_ids.to(device)
    cache = make_cache(model, method, config)
    t0 = time.perf_counter()
    logits = prefill(model, input_ids, cache)
    prefill_s = time.perf_counter() - t0
    out = Generation()
    show = None if on_token is None else (lambda tokens: on_token(tokenizer.decode(tokens, skip_special_tokens=True)))
    t1 = time.perf_counter()
    out.tokens = decode_n_tokens(model, logits, cache, max_new_tokens, eos_token_ids(model, tokenizer), show).tokens
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
