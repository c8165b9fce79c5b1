"""Full attention at a KV dtype: the reference PQCache equals when its selection covers every token.

PQCache rounds each key and value of a full-attention layer to its KV dtype as it stores them (PQCacheConfig.kv_dtype:
float16 on a CPU by default). Full attention compared with it, in `generate`, `eval` and the app's "full" method, is
transformers' DynamicCache with the same rounding in its full-attention layers and PQCache's own sliding-window
layers (layer/sliding.py, their windows stored at the KV dtype as PQCache stores them), so "PQCache at a budget past
the document equals full attention" holds token for token at any KV dtype. The rounding happens in the layers'
update, which the fast decode path calls directly too.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from pqcache.engine.config import PQCacheConfig
from pqcache.engine.layer.sliding import AppendSlidingWindowLayer


class RoundedLayer(DynamicLayer):
    """A full-attention layer of a DynamicCache whose keys and values are rounded to kv_dtype as they arrive (kept
    in the model's dtype: the reference's numbers, not its bytes)."""

    def __init__(self, kv_dtype: torch.dtype):
        super().__init__()
        self.kv_dtype = kv_dtype

    def update(self, key_states, value_states, *args, **kwargs):
        key_states = key_states.to(self.kv_dtype).to(key_states.dtype)
        value_states = value_states.to(self.kv_dtype).to(value_states.dtype)
        return super().update(key_states, value_states, *args, **kwargs)


def full_attention_cache(model, config: PQCacheConfig | None = None) -> DynamicCache:
    """transformers' DynamicCache for `model`, its full-attention layers at config's KV dtype (a plain DynamicCache
    where that is the model's own dtype)."""
    cache = DynamicCache(config=model.config)
    weight = next(model.parameters())
    kv_dtype = (config or PQCacheConfig()).kv_dtype_for(weight.dtype, weight.device)
    if kv_dtype != weight.dtype:
        cache.layers = [_rounded(layer, kv_dtype) for layer in cache.layers]
    return cache


def _rounded(layer, kv_dtype: torch.dtype):
    """A DynamicCache layer's counterpart that rounds to kv_dtype (other kinds of layer as they are)."""
    if type(layer) is DynamicLayer:
        return RoundedLayer(kv_dtype)
    if type(layer) is DynamicSlidingWindowLayer:
        return AppendSlidingWindowLayer(layer.sliding_window, kv_dtype_for=lambda *_: kv_dtype)
    return layer
