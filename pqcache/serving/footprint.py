"""What a document's cache holds beyond the engine's own figures: its bytes before the prefill (the session pool
reserves them), and the prefill queries read on demand for a method that starts from them."""

from __future__ import annotations

import torch
from transformers.cache_utils import get_layer_types_and_kwargs

from pqcache.engine.cache import PQCache
from pqcache.engine.layer.blockcache import holds_copies
from pqcache.engine.layer.sliding import SPARE
from pqcache.engine.layer.window import buffer_dtype
from pqcache.engine.methods import make_method
from pqcache.engine.shapes import head_dim_of
from pqcache.serving.generate import prefill


def document_bytes(model, config, method: str, n_tokens: int, device, keep_queries: bool = False) -> int:
    """Bytes a prefill of n_tokens will hold (an upper bound of DocumentSession.nbytes() after it): full-attention
    layers keep every token's K/V on the host tier, a device buffer of the budget plus the new token's slot (on a
    CPU at the host tier's dtype, its rows being copies of host rows) and a block cache (at most a quarter of the
    tokens; where it holds copies), PQ codes and centroids, and (kept, or for a method that starts from them) the
    prefill's queries; sliding-window layers keep their window at the KV dtype, in a buffer of SPARE more tokens
    once decoding (layer/sliding.py)."""
    text_config = model.config.get_text_config(decoder=True)
    layer_types, kwargs = get_layer_types_and_kwargs(text_config)
    head_dim = head_dim_of(text_config)
    n_kv = getattr(text_config, "num_key_value_heads", None) or text_config.num_attention_heads
    weight = next(model.parameters())
    per_token = 2 * n_kv * head_dim * weight.element_size()  # in the model's dtype
    queries = n_tokens * text_config.num_attention_heads * head_dim * weight.element_size()
    queries *= keep_queries or make_method(method).needs_prefill_queries  # kept at load only then
    cfg = config.for_head_dim(head_dim)
    kv_dtype = cfg.kv_dtype_for(weight.dtype, device)
    host_per_token = 2 * n_kv * head_dim * kv_dtype.itemsize  # host tier, windows
    copies = holds_copies(device, cfg.kernels)  # none held on a CPU
    blocks = min(cfg.block_cache_for(device), n_tokens // 4) if copies else 0
    buffer = 2 * n_kv * head_dim * buffer_dtype(kv_dtype, weight.dtype, device).itemsize
    full = n_tokens * host_per_token + (cfg.budget_tokens(n_tokens) + 1) * buffer + blocks * per_token
    # uint8 codes (m a token), a float32 residual a token, float32 centroids (2^bits x head_dim), and OPQ's rotation,
    # per KV head
    pq = n_kv * ((cfg.m + 4) * n_tokens + (1 << cfg.bits_for(n_tokens, head_dim)) * head_dim * 4)
    pq += n_kv * head_dim * head_dim * 4 if cfg.opq else 0
    window = [(kw.get("sliding_window") or n_tokens + 1) - 1 + SPARE for kw in kwargs]
    return sum(
        full + pq + queries if kind == "full_attention" else w * host_per_token for kind, w in zip(layer_types, window)
    )


@torch.no_grad()
def read_queries(model, config, ids: torch.Tensor, layers) -> None:
    """The document ids (1, S) read once more by a full-attention cache that keeps its prefill queries (no PQ build;
    the same chunks as the load, so the same queries as a load that kept them), handed to the loaded PQ `layers`."""
    reader = PQCache(model, config, method="full", keep_queries=True)
    try:
        prefill(model, ids, reader)
        for mine, theirs in zip(layers, reader.pq_layers, strict=True):
            mine.prefill_q, mine.keep_queries = theirs.prefill_q, True
    finally:
        reader.close()
