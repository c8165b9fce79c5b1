"""PQLayer: the KV cache of one full-attention layer under PQCache, as a transformers cache layer.

It composes these parts, one file each in this folder:
  host.py       HostTier     every token's K/V by position (host memory), validity, gathers
  window.py     DeviceWindow [ sinks | local-window ring | fetched top-k | new tokens ] on the device
  attention.py  masked_attention over that buffer
  index.py      PQIndex      codebooks, codes and background K-Means (owned by the PQCache method)
  general.py    the step for any batch, chunk and method; onerow.py the same step for one row and one token
and asks the selection method (methods/) which middle tokens to fetch, through a read-only view.

A decode step (or a multi-token chunk after the prefill) attends to
  sinks + top-k middle tokens picked by the method + local window + the new tokens themselves.
A chunk of Q > 1 tokens picks ONE top-k set for the whole chunk: each query row's scores are
softmaxed over the tokens and summed over the chunk (and over the GQA group), so a question after
a document retrieves the document tokens that the question as a whole points to.

Rows of a batch are independent: per-row validity (left padding), sinks, budgets and K-Means.
"""

from __future__ import annotations

import threading
from concurrent.futures import Executor
from contextlib import nullcontext

import torch
from transformers.cache_utils import CacheLayerMixin

from pqcache.engine.config import PQCacheConfig
from pqcache.engine.errors import InputError
from pqcache.engine.layer import general, onerow
from pqcache.engine.layer.host import HostTier
from pqcache.engine.layer.view import LayerView
from pqcache.engine.layer.window import DeviceWindow
from pqcache.engine.methods.base import PICKED_SCORES, Method
from pqcache.engine.methods.full import Full


class PQLayer(CacheLayerMixin):
    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(
        self,
        config: PQCacheConfig,
        layer_idx: int,
        executor: Executor,
        iters_for,
        method: Method | None = None,
        depth: tuple[int, int] = (0, 1),
    ):
        super().__init__()
        from pqcache.engine.methods.pqcache import PQCacheMethod

        self.config, self.layer_idx, self.executor = config, layer_idx, executor
        self.iters_for = iters_for  # s -> K-Means iterations
        self.method = method or PQCacheMethod()
        self.depth, self.n_depth = depth  # index among the full-attention layers, and their count
        self.keep_queries = False  # keep the prefill queries (a cache that will be forked into methods)
        self.prefill_q, self.scaling = None, 1.0
        self.host: HostTier | None = None
        self.window: DeviceWindow | None = None
        self.method_state: dict = {}  # per-layer state of the method (a method is shared by the layers)
        self.prefilled = False
        # A prefill in chunks (generate.prefill): the tiers split once the layer holds this many tokens;
        # until then each chunk attends exactly to every token stored so far. 0: after the first forward.
        self.prefill_until = 0
        self.prefill_queries: list[torch.Tensor] = []  # the chunks' queries, kept until the prefill ends
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None
        self.closed = threading.Event()  # set by PQCache.close(): background work stops
        self.fallback: str | None = None  # why this layer attends to every token (a failed PQ build)
        self.obs = None  # Instrumentation, when attached
        self.tally = None  # AttentionTally (sources.py), when an answer's sources are wanted
        self.last_selection = None
        self._one_row = None  # onerow.py's knowledge of the device window
        # one-token steps, and the retrieved tokens they attended summed over the steps, rows and KV heads
        # (attended_per_step: a question's chunk, which may read every token, is not a decode step)
        self.counters = {"steps": 0, "hits": 0, "misses": 0, "decode_steps": 0, "picked": 0, "fallback": None}

    # ---- transformers Cache layer protocol -------------------------------------------------------
    def lazy_initialization(self, key_states, value_states):
        B, H, _, D = key_states.shape
        self.config = self.config.for_head_dim(D)  # m chosen for the head size when unset
        kv_dtype = self.config.kv_dtype_for(key_states.dtype, key_states.device)
        self.host = HostTier(B, H, D, kv_dtype, key_states.device, compute_dtype=key_states.dtype)
        self.device, self.dtype = key_states.device, key_states.dtype
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.host.dtype != key_states.dtype:  # rounded to the KV dtype once, here: every tier reads these numbers
            key_states = key_states.to(self.host.dtype).to(key_states.dtype)
            value_states = value_states.to(self.host.dtype).to(value_states.dtype)
        if key_states.shape[0] != self.host.B:
            raise InputError(f"PQCache was filled with batch size {self.host.B}, got {key_states.shape[0]}")
        if not self.prefilled:  # prefill: exact attention over what is returned; the tiers split in finish_prefill
            start = self._store(key_states, value_states)
            if start > 0:  # a later chunk of a chunked prefill attends to the earlier chunks too
                return self.host.keys(0, self.S, self.device), self.host.values(0, self.S, self.device)
        else:
            self.pending = (key_states, value_states)
        return key_states, value_states

    def get_seq_length(self) -> int:
        return self.S

    def get_max_length(self) -> int:
        return -1

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.S + query_length, 0

    def reset(self):
        self.wait_pq()
        obs, tally, keep = self.obs, self.tally, self.keep_queries
        self.__init__(
            self.config, self.layer_idx, self.executor, self.iters_for, self.method, (self.depth, self.n_depth)
        )
        self.obs, self.tally, self.keep_queries = obs, tally, keep

    def reorder_cache(self, beam_idx):
        raise NotImplementedError("PQCache does not support beam search; use greedy or sampling")

    def batch_repeat_interleave(self, repeats: int):
        if repeats != 1:
            raise NotImplementedError("PQCache does not support num_return_sequences > 1 or beam search")

    # ---- the parts ---------------------------------------------------------------------------------
    @property
    def S(self) -> int:
        return 0 if self.host is None else self.host.S

    @property
    def stats(self) -> dict:
        return {**self.counters, **self.method.stats(self.view())}

    def attended_per_step(self) -> float | None:
        """Stored tokens attended a decode step by each KV head, on average: the sinks and the window held now, and
        the retrieved picks of the one-token steps so far (None before one)."""
        steps, w = self.counters["decode_steps"], self.window
        if not steps or w is None:
            return None
        fixed = float((w.init_valid.sum(-1) + w.ring_valid().sum(-1)).float().mean())
        return fixed + self.counters["picked"] / (steps * self.host.B * self.host.H)

    def view(self) -> LayerView:
        return LayerView(self)

    def span(self, lane: str):
        return nullcontext() if self.obs is None else self.obs.span(lane, self.layer_idx)

    def _store(self, k, v) -> int:
        with self.span("copy to host"):
            if self.prefill_until > self.S + k.shape[2]:  # a chunked prefill of known length: its room at once
                self.host.reserve(self.prefill_until)
            start = self.host.append(k, v)
        if self.obs is not None:
            self.obs.moved("to_host", 2 * k.numel() * k.element_size())
        return start

    def end_prefill_chunk(self, valid: torch.Tensor, query: torch.Tensor | None, scaling: float):
        """After a prefill forward: valid (B, S) bool of every token so far, query (B, Hq, Q, D) the chunk's
        queries (None when not kept). The last chunk (S >= prefill_until) finishes the prefill."""
        if query is not None:
            self.prefill_queries.append(query)
        if self.S >= self.prefill_until:
            queries, self.prefill_queries = self.prefill_queries, []
            query = None if not queries else queries[0] if len(queries) == 1 else torch.cat(queries, dim=2)
            self.finish_prefill(valid, query, scaling)

    def finish_prefill(self, valid: torch.Tensor, query: torch.Tensor | None = None, scaling: float = 1.0):
        """valid (B, S) bool: real (not padding) tokens of the prefill; query (B, Hq, S, D) its queries.
        Splits the tiers and lets the method start its work (PQ: K-Means in the background)."""
        start_layer(self, valid, query, scaling)

    def split_tiers(self):
        """Sinks, window ring and block cache for the current method and tokens; the top-k part of the buffer is
        made by the first step that copies picks into it (a CPU's one-row step reads them in place: none)."""
        valid = self.host.valid[:, : self.S]
        splits = [self.method.split(self.config, int(n), self.view()) for n in valid.sum(1).tolist()]
        self.window = DeviceWindow(self.host, splits, self.config, self.method.cache_policy or self.config.cache_policy)

    def topk_counts(self) -> list[int]:
        """Middle tokens each row fetches per step: the method's budget less what sinks and window hold."""
        w, view = self.window, self.view()
        out = []
        for b, n_real in enumerate(w.n_real):  # real tokens of each row, kept by the window as they arrive
            n_init, n_topk, n_local = self.method.split(self.config, n_real, view)
            out.append(max(0, n_init + n_topk + n_local - w.n_init_valid[b] - w.n_local[b]))
        return out

    def candidates(self) -> torch.Tensor:
        """(B, S) bool: middle tokens of each row (real, not a sink, older than the row's window)."""
        return self.window.candidates()

    def fall_back(self, reason: str):
        """Attend to every token of this layer from now on (exact attention through the tiers)."""
        suffix = "; this layer now uses exact attention"
        self.fallback = self.counters["fallback"] = reason if reason.endswith(suffix) else reason + suffix
        self.method, self.method_state = Full(), {}
        if self.prefilled:
            self.split_tiers()

    def wait_pq(self, stop=None):
        """Block until the method's background work on this layer is in place (or has failed)."""
        if self.prefilled:
            self.method.prepare(self.view(), block=True, stop=stop)

    # ---- a step ------------------------------------------------------------------------------------
    def select(self, q: torch.Tensor, scaling: float):
        """q (B, H, R, D) -> positions (B, H, k) and their validity (B, H, k) on the host tier."""
        view = self.view()
        self.method_state.pop(PICKED_SCORES, None)  # a method sets them anew with each selection, or not at all
        if view.k_max == 0 or not bool(view.candidates.any()):
            empty = torch.zeros((self.host.B, self.host.H, 0), dtype=torch.long, device=self.device)
            return empty, empty.bool()
        return self.method.select(view, q * scaling)

    def attend(self, query, new_valid, scaling, softcap=None):
        """query (B, Hq, Q, D); new_valid (B, Q) bool -> attention output (B, Q, Hq, D)."""
        k_new, v_new = self.pending
        self.pending = None
        self.method.prepare(self.view())  # install finished background work (the first use waits)
        if onerow.ready(self, query):  # a decode step of one row: the same step in few operators (onerow.py)
            out = onerow.attend(self, query, k_new, v_new, new_valid, scaling, softcap)
            if out is not None:  # (None: a step with completion the fused call cannot take)
                return out
        self._one_row = None  # what onerow.py knew of the window may not hold after this step
        return general.attend(self, query, k_new, v_new, new_valid, scaling, softcap)

    # ---- forks and accounting ------------------------------------------------------------------------
    def fork(self, method: Method, executor: Executor, config: PQCacheConfig | None = None) -> PQLayer:
        """A copy continuing with `method` (see PQCache.fork): the host tier is shared, not copied."""
        return fork_layer(self, method, executor, config or self.config)

    def memory(self) -> dict:
        """Bytes per tier. Device: the [sinks | window | top-k | new] buffer and block cache; PQ codes
        and centroids. Host: every token's K/V (a fork counts the shared document too) and, kept for methods that
        start from them (keep_queries), the prefill's queries: Hq/H times the keys' bytes."""
        q, h = self.prefill_q, self.host
        queries = 0 if q is None else q.numel() * q.element_size()
        if not self.prefilled:
            return {"device_kv_bytes": 0, "host_kv_bytes": 0, "pq_bytes": 0, "query_bytes": queries}
        return {
            "device_kv_bytes": self.window.nbytes,
            "host_kv_bytes": 2 * h.B * h.H * h.S * h.D * h.dtype.itemsize,
            "pq_bytes": self.method.device_bytes(self.view()),
            "query_bytes": queries,
        }


def start_layer(layer: PQLayer, valid: torch.Tensor, query, scaling: float, parent_state: dict | None = None):
    """A layer holding its prefill's tokens, made ready to decode: flags, tiers, the method started. parent_state:
    a method state these tokens already have (a cache read back from the store, engine/snapshot.py), which the
    method starts from as a fork's does (PQ: the saved codes, no K-Means); None: from scratch."""
    layer.host.valid[:, : valid.shape[1]] = valid.to(layer.device)
    layer.scaling, layer.method_state, layer.prefilled = scaling, {}, True
    layer.split_tiers()
    if layer.keep_queries and query is not None:
        layer.prefill_q = query.to("cpu")
    if parent_state is None:
        layer.method.on_prefill(layer.view(), query, scaling)
    else:
        layer.method.on_fork(layer.view(), parent_state, query, scaling)


def fork_layer(layer: PQLayer, method: Method, executor: Executor, config: PQCacheConfig) -> PQLayer:
    """A new layer over `layer`'s tokens (host tier shared read-only) that continues with `method`:
    its own device window, and the method's state started from the parent's (PQ reuses the codes)."""
    layer.wait_pq()
    new = PQLayer(config, layer.layer_idx, executor, layer.iters_for, method, (layer.depth, layer.n_depth))
    new.keep_queries, new.prefill_q, new.scaling = layer.keep_queries, layer.prefill_q, layer.scaling
    if layer.host is None:
        return new
    new.host, new.device, new.dtype, new.is_initialized = layer.host.fork(), layer.device, layer.dtype, True
    if not layer.prefilled:
        return new
    new.fallback = layer.fallback  # the method decides whether it can work without what failed
    new.prefilled = True
    new.split_tiers()
    if method.needs_prefill_queries and layer.prefill_q is None:
        raise InputError(
            f"method {method.name!r} needs the prefill queries: create the cache with "
            "keep_queries=True before the prefill to fork into it"
        )
    new.method.on_fork(new.view(), layer.method_state, layer.prefill_q, layer.scaling)
    return new
