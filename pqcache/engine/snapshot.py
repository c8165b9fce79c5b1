"""A loaded document's cache as plain tensors, and back: what the document store keeps (pqcache/serving/store.py).

snapshot(cache) -> (tensors, meta): each full-attention layer's keys, values and flags, its PQ index (the codes, each
segment's centroids and OPQ rotation; completion's value codes and their centroids where it keeps them) and, where
kept, the prefill's queries; each sliding-window layer's window.
restore(model, config, tensors, meta) -> a PQCache holding the same tokens, codes and centroids, with no prefill and
no K-Means, so every answer is token for token what the saved cache gives. A snapshot made for another model shape
raises SnapshotError with what differs.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from pqcache.engine import completion
from pqcache.engine.cache import PQCache
from pqcache.engine.config import PQCacheConfig
from pqcache.engine.errors import InputError
from pqcache.engine.layer.index import PQIndex
from pqcache.engine.layer.layer import PQLayer, start_layer
from pqcache.engine.shapes import head_dim_of

FORMAT = 1  # the layout below; a snapshot of another format is refused


class SnapshotError(InputError):
    """A snapshot that does not fit this model or this code: the document is read from its text instead."""


def snapshot(cache: PQCache) -> tuple[dict[str, torch.Tensor], dict]:
    """A prefilled cache -> (tensors by name, meta). Raises SnapshotError for a cache that should not be kept (not
    prefilled, or a layer whose PQ build failed: a degraded cache is not worth reading back)."""
    cache.wait()
    tensors, layers = {}, []
    for i, layer in enumerate(cache.layers):
        p = f"{i}."
        if isinstance(layer, PQLayer):
            if not layer.prefilled or layer.fallback:
                raise SnapshotError(f"layer {i} is {'not prefilled' if not layer.prefilled else 'degraded'}")
            host = layer.host  # (B, H, S, D) keys and values on the host, in their storage dtype (kv_dtype)
            kv = host.dtype
            tensors[p + "keys"], tensors[p + "values"] = (
                host.keys(0, host.S, dtype=kv),
                host.values(0, host.S, dtype=kv),
            )
            tensors[p + "valid"] = host.valid[:, : host.S].cpu()
            if layer.prefill_q is not None:  # (B, Hq, S, D): SnapKV and its kin start from them
                tensors[p + "queries"] = layer.prefill_q
            entry = {"kind": "pq", "scaling": layer.scaling}
            index = layer.method_state.get("index")
            if index is not None:
                entry["index"] = {"bits": index.bits, "starts": [s for s, _ in index.segments], "stats": index.stats}
                tensors[p + "codes"] = index.codes[..., : host.S].cpu()  # (B, H, m, S) uint8
                for j, (start, centroids) in enumerate(index.segments):  # (B, H, m, C, d) each
                    tensors[f"{p}centroids.{j}"] = centroids.cpu()
                    if start in index.rotations:
                        tensors[f"{p}rotation.{j}"] = index.rotations[start]
                if index.value_codes is not None:  # completion's: (B, H, n, S) uint8, (B, H, n, C, D/n)
                    tensors[p + "value_codes"] = index.value_codes.codes[..., : host.S].cpu()
                    tensors[p + "value_centroids"] = index.value_codes.centroids.cpu()
        elif isinstance(layer, DynamicSlidingWindowLayer):
            entry = {"kind": "sliding", "seen": int(layer.cumulative_length)}  # tokens seen, beyond the window
            tensors[p + "keys"], tensors[p + "values"] = layer.keys, layer.values
        elif isinstance(layer, DynamicLayer):
            entry = {"kind": "dynamic"}
            tensors[p + "keys"], tensors[p + "values"] = layer.keys, layer.values
        else:
            raise SnapshotError(f"layer {i} is a {type(layer).__name__}, which a snapshot does not hold")
        layers.append(entry)
    tensors = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
    return tensors, {"format": FORMAT, "method": cache.method.name, "layers": layers}


def restore(model, config: PQCacheConfig, tensors: dict, meta: dict, keep_queries: bool = False) -> PQCache:
    """The cache `snapshot` saw, for `model` (its weights must be the ones the snapshot was made with: the store's
    manifest checks that). Any method can continue from it (PQCache.fork)."""
    if meta.get("format") != FORMAT:
        raise SnapshotError(f"a snapshot of format {meta.get('format')}, this code reads {FORMAT}")
    cache = PQCache(model, config, method=meta["method"], keep_queries=keep_queries)
    if len(cache.layers) != len(meta["layers"]):
        raise SnapshotError(f"made for a model of {len(meta['layers'])} layers, this one has {len(cache.layers)}")
    text = model.config.get_text_config(decoder=True)
    device, dtype = next(model.parameters()).device, next(model.parameters()).dtype
    want = (getattr(text, "num_key_value_heads", None) or text.num_attention_heads, head_dim_of(text))
    try:
        for i, (layer, entry) in enumerate(zip(cache.layers, meta["layers"], strict=True)):
            p = f"{i}."
            keys, values = tensors[p + "keys"].to(device), tensors[p + "values"].to(device)
            if (keys.shape[1], keys.shape[3]) != want:
                raise SnapshotError(f"layer {i} has {keys.shape[1]} KV heads of {keys.shape[3]}, the model {want}")
            if entry["kind"] == "pq" and isinstance(layer, PQLayer):
                # stored as a prefill stores them (the host tier), in the model's dtype as the model gives them:
                # rounded to the KV dtype again there, which changes nothing when the snapshot's was the same
                layer.update(keys.to(dtype), values.to(dtype))
                queries = tensors.get(p + "queries")
                parent = {} if "index" not in entry else {"index": _index(layer, entry["index"], tensors, p)}
                start_layer(layer, tensors[p + "valid"], queries, entry["scaling"], parent)
            elif entry["kind"] == "sliding" and isinstance(layer, DynamicSlidingWindowLayer):
                layer.update(keys, values)
                layer.cumulative_length = entry["seen"]
            elif entry["kind"] == "dynamic" and type(layer) is DynamicLayer:
                layer.update(keys, values)
            else:
                raise SnapshotError(f"layer {i} was a {entry['kind']} layer, the model's is {type(layer).__name__}")
    except BaseException:
        cache.close()
        raise
    return cache


def _index(layer: PQLayer, entry: dict, tensors: dict, p: str) -> PQIndex:
    """The saved PQ index over the restored host tier: its codes, segments and rotations as they were."""
    index = PQIndex(layer.host, layer.config, layer.executor, layer.iters_for, layer.closed, layer.span, entry["bits"])
    device = layer.device
    index.segments = [(start, tensors[f"{p}centroids.{j}"].to(device)) for j, start in enumerate(entry["starts"])]
    index.rotations = {
        s: tensors[f"{p}rotation.{j}"] for j, s in enumerate(entry["starts"]) if f"{p}rotation.{j}" in tensors
    }
    index.set_codes(0, layer.S, tensors[p + "codes"].to(device))
    index.stats.update(entry["stats"])
    if p + "value_codes" in tensors:
        centroids, codes = tensors[p + "value_centroids"].to(device), tensors[p + "value_codes"].to(device)
        index.value_codes = completion.ValueCodes.of(centroids, codes.clone())
    return index
