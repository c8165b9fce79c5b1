"""PQCache: a transformers Cache whose full-attention layers attend to PQ-retrieved tokens.

Integration: `PQCache(model, config)` registers an attention function named "pqcache" and sets the
model to it. Cache.update() runs right before the attention call of the same layer on the same
thread, so update() leaves the layer in a thread-local slot and the attention function picks it up.
Calls that find no PQ layer there (sliding-window layers, other caches, prefill) run exact SDPA.
"""

from __future__ import annotations

import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import torch
from transformers import AttentionInterface
from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING, Cache, get_layer_types_and_kwargs
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from pqcache.engine.config import PQCacheConfig
from pqcache.engine.instrument import Instrumentation
from pqcache.engine.iters import kmeans_iters_for, load_fit
from pqcache.engine.layer.layer import PQLayer
from pqcache.engine.layer.sliding import AppendSlidingWindowLayer
from pqcache.engine.methods import Method, make_method
from pqcache.engine.prefill_attention import prefill_attention
from pqcache.engine.shapes import head_dim_of
from pqcache.engine.threads import torch_on_this_thread_only

ATTN_NAME = "pqcache"
OBSERVER_HOOK = "pqcache_observer"  # marks instrument()'s hooks: pqcache/fastpath/step.py times the layers itself
_active = threading.local()


def _valid_from_mask(mask: torch.Tensor | None, batch: int, kv_len: int, device) -> torch.Tensor:
    """(B, kv_len) bool of real tokens, read off the last query row of a 4D mask (None: all real)."""
    if mask is None:
        return torch.ones(batch, kv_len, dtype=torch.bool, device=device)
    row = mask[:, 0, -1, :kv_len]
    if row.dtype != torch.bool:
        row = row > torch.finfo(row.dtype).min / 2
    return row.expand(batch, kv_len)


def pqcache_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention interface "pqcache": query (B, Hq, Q, D) -> (B, Q, Hq, D)."""
    layer = getattr(_active, "layer", None)
    _active.layer = None
    if layer is None or layer.layer_idx != getattr(module, "layer_idx", None):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    B, _, Q, _ = query.shape
    if not layer.prefilled:
        out = prefill_attention(module, query, key, value, attention_mask, scaling, dropout, **kwargs), None
        layer.end_prefill_chunk(
            _valid_from_mask(attention_mask, B, key.shape[2], key.device),
            query if layer.keep_queries else None,
            scaling,
        )
        return out
    new_valid = _valid_from_mask(attention_mask, B, layer.S + Q, query.device)[:, layer.S :]
    return layer.attend(query, new_valid, scaling, softcap=kwargs.get("softcap")), None


def kmeans_executor() -> ThreadPoolExecutor:
    """The cache's background builder: one thread, whose torch operators run without OpenMP helpers (threads.py:
    helpers of a second thread would slow every decode step down)."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="pqcache-kmeans", initializer=torch_on_this_thread_only)


def kv_bytes(layer) -> int:
    """Bytes of K and V held by a plain transformers cache layer (DynamicLayer, sliding window: the decode steps'
    buffer its window is a view of, where it has one)."""
    keys = getattr(layer, "buf_k", None)
    keys = getattr(layer, "keys", None) if keys is None else keys
    return 0 if keys is None else 2 * keys.numel() * keys.element_size()


def decoder_layers(model):
    """(layer_idx, module) of each decoder layer of a transformers model (the modules with a self_attn)."""
    for module in model.modules():
        idx = getattr(getattr(module, "self_attn", None), "layer_idx", None)
        if idx is not None:
            yield idx, module


def register_attention():
    if ATTN_NAME not in AttentionInterface._global_mapping:
        AttentionInterface.register(ATTN_NAME, pqcache_attention)
        AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)


class PQCache(Cache):
    """PQ-retrieval KV cache. Use as `model.generate(ids, cache=PQCache(model, PQCacheConfig(...)))`."""

    def __init__(
        self, model, config: PQCacheConfig | None = None, method: str | Method = "pqcache", keep_queries: bool = False
    ):
        """model: a transformers causal LM (switched to the "pqcache" attention function), or just its
        config (a cache filled by hand, e.g. in benchmarks). method: how the middle tokens are picked
        (methods/: pqcache, oracle, full, streaming, h2o, snapkv, pyramidkv, sparq, infllm).
        keep_queries: keep the prefill queries so that `fork()` can start any method later."""
        self.pq_config = config or PQCacheConfig()  # m resolved for the model below
        self.method = make_method(method)
        model_config = getattr(model, "config", model)
        text_config = model_config.get_text_config(decoder=True)
        self.pq_config = self.pq_config.for_head_dim(head_dim_of(text_config))
        self.executor = kmeans_executor()
        fit = load_fit() if self.pq_config.kmeans_iters == "auto" else None  # read once per cache
        iters_for = partial(kmeans_iters_for, self.pq_config.kmeans_iters, fit=fit)
        layer_types, per_layer_kwargs = get_layer_types_and_kwargs(text_config)
        n_full = layer_types.count("full_attention")
        layers = []
        for idx, (kind, kw) in enumerate(zip(layer_types, per_layer_kwargs)):
            if kind == "full_attention":
                layer = PQLayer(
                    self.pq_config,
                    idx,
                    self.executor,
                    iters_for,
                    self.method,
                    depth=(sum(isinstance(x, PQLayer) for x in layers), n_full),
                )
                layer.keep_queries = keep_queries or self.method.needs_prefill_queries
                layers.append(layer)
            elif kind == "sliding_attention":
                layers.append(AppendSlidingWindowLayer(**kw, kv_dtype_for=self.pq_config.kv_dtype_for))
            else:
                layers.append(DYNAMIC_LAYER_TYPE_MAPPING[kind](**kw))
        super().__init__(layers=layers)
        self.observer: Instrumentation | None = None
        self._hooks = []
        self._model = None
        if hasattr(model, "set_attn_implementation"):
            self._model = weakref.ref(model)
            register_attention()
            if model.config._attn_implementation != ATTN_NAME:
                model.set_attn_implementation(ATTN_NAME)

    def instrument(self, observer: Instrumentation | None = None, **kwargs) -> Instrumentation | None:
        """Attach an observer (or make one from Instrumentation's kwargs); `instrument(None)` detaches.
        Decoder layers of the model get "device compute" spans through forward hooks."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        if observer is None and not kwargs:
            self.observer = None
            for layer in self.pq_layers:
                layer.obs = None
            return None
        obs = observer or Instrumentation(**kwargs)
        self.observer = obs
        for layer in self.pq_layers:
            layer.obs = obs
        model = self._model() if self._model is not None else None
        if model is not None:
            if next(model.parameters()).device.type == "cuda":
                obs.sync = torch.cuda.synchronize
            starts = {}
            for idx, module in decoder_layers(model):

                def pre(mod, args, kwargs, idx=idx):
                    if self._is_mine(kwargs):
                        starts[idx] = obs.now()

                def post(mod, args, kwargs, out, idx=idx):
                    if self._is_mine(kwargs) and idx in starts:
                        if obs.sync is not None:
                            obs.sync()
                        obs.event("device compute", idx, starts.pop(idx), obs.now())

                setattr(pre, OBSERVER_HOOK, True)
                setattr(post, OBSERVER_HOOK, True)
                self._hooks += [
                    module.register_forward_pre_hook(pre, with_kwargs=True),
                    module.register_forward_hook(post, with_kwargs=True),
                ]
        return obs

    def tally_sources(self, tally=None):
        """Attach an AttentionTally (pqcache.engine.sources) to the full-attention layers, giving it their document
        tokens' values to weigh the attention with; None detaches."""
        for layer in self.pq_layers:
            layer.tally = tally
            if tally is not None and layer.host is not None and layer.host.S >= tally.n_tokens:
                tally.read_values(layer.layer_idx, layer.host.values(0, tally.n_tokens)[0])
        return tally

    def _is_mine(self, kwargs) -> bool:
        """A decoder layer's forward belongs to this cache (the model may serve several caches at once)."""
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        return cache is None or cache is self

    @property
    def pq_layers(self) -> list[PQLayer]:
        return [layer for layer in self.layers if isinstance(layer, PQLayer)]

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        layer = self.layers[layer_idx]
        _active.layer = layer if isinstance(layer, PQLayer) else None
        return layer.update(key_states, value_states, *args, **kwargs)

    def expect_prefill(self, n_tokens: int):
        """A prefill of n_tokens is coming in several forwards (chunks): each layer keeps attending exactly to
        everything stored and splits its tiers (PQ: starts K-Means) only once it holds all n_tokens."""
        for layer in self.pq_layers:
            layer.prefill_until = n_tokens

    def wait(self, stop=None):
        """Block until every layer's PQ is built or has failed (a set `stop` event raises Cancelled)."""
        for layer in self.pq_layers:
            layer.wait_pq(stop)

    def stats(self) -> dict:
        """Bytes per tier (sliding-window layers count as device KV) and per-layer PQ build figures."""
        total = {"device_kv_bytes": 0, "host_kv_bytes": 0, "pq_bytes": 0, "query_bytes": 0}
        for layer in self.layers:
            if isinstance(layer, PQLayer):
                for k, v in layer.memory().items():
                    total[k] += v
            else:
                total["device_kv_bytes"] += kv_bytes(layer)
        total["layers"] = [
            {"layer": layer.layer_idx, **{k: v for k, v in layer.stats.items()}} for layer in self.pq_layers
        ]
        iters = [layer.stats.get("kmeans_iters") for layer in self.pq_layers]
        iters = [i for i in iters if i is not None]
        total["kmeans_iters"] = max(iters) if iters else None
        total["notices"] = [layer.fallback for layer in self.pq_layers if layer.fallback]
        return total

    def attended_per_step(self) -> float | None:
        """Stored tokens attended a step by each KV head of the PQ layers, on average over the layers (sinks, window
        and picks: PQLayer.attended_per_step); None before a step. The budget's count for a fixed top-k; fewer
        with a budget in mass."""
        counts = [n for n in (layer.attended_per_step() for layer in self.pq_layers) if n is not None]
        return sum(counts) / len(counts) if counts else None

    def fork(self, method: str | Method, config: PQCacheConfig | None = None) -> PQCache:
        """A copy of this prefilled cache that continues with another method (and optionally other
        settings): comparing N methods costs one prefill. The host tier is shared read-only, the rest
        is copied, so the forks decode independently. Create the cache with keep_queries=True for
        methods that need prefill statistics (H2O, SnapKV, PyramidKV, InfLLM)."""
        import copy

        self.wait()
        new = copy.copy(self)
        new.method = make_method(method)
        if config is not None:
            new.pq_config = config.for_head_dim(self.layers[self.pq_layers[0].layer_idx].host.D)
        new.executor = kmeans_executor()
        new.observer, new._hooks = None, []
        new.layers = [
            layer.fork(new.method, new.executor, new.pq_config) if isinstance(layer, PQLayer) else copy.deepcopy(layer)
            for layer in self.layers
        ]
        return new

    def close(self):
        """Detach the observer and stop background work: queued builds are cancelled, a running one
        stops at its next head; returns without waiting for it (a hung worker cannot block close)."""
        self.instrument(None)
        self.tally_sources(None)
        for layer in self.pq_layers:
            layer.closed.set()
        self.executor.shutdown(wait=False, cancel_futures=True)
