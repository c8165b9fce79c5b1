"""What every probe starts from: the bundled model with one prompt (the passkey filler) prefilled, then greedy decode
steps."""

from __future__ import annotations

import torch

from pqcache.bench.e2e import prompt_ids
from pqcache.engine.config import PQCacheConfig
from pqcache.serving.generate import decode_one_token, make_cache, prefill
from pqcache.serving.loading import load_model


def prefilled(seq_len: int, method: str, config: PQCacheConfig | None = None, decode_weights: str = "int8"):
    model, tok = load_model("default", device="cpu", progress=lambda *_: None, decode_weights=decode_weights)
    cache = make_cache(model, method, config or PQCacheConfig())
    logits = prefill(model, torch.tensor([prompt_ids(tok, seq_len)]), cache)
    if method != "full":
        cache.wait()
    return model, tok, cache, logits.argmax(-1, keepdim=True)


def steps(model, cache, token, n: int):
    for _ in range(n):
        token = decode_one_token(model, token, cache).argmax(-1, keepdim=True)
    return token
