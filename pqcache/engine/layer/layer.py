"""PQLayer: the KV cache of one full-attention layer under PQCache.

Tiers (per layer):
  host   k_host, v_host (B, H, cap, D)   every token by position (pinned on CUDA)
  device codes (B, H, m, cap) uint8, centroids per segment (B, H, m, C, d): small, stay on the device
         dev_k, dev_v (B, H, n_init + L + k_cap + q_cap, D), one preallocated buffer laid out as
             [ sinks | local-window ring | fetched top-k | new tokens ]
         so a step writes the fetched tokens and the new tokens in place and attends to a prefix.
         block cache (blockcache.py): hot blocks of host tokens.

A decode step (or a multi-token chunk after the prefill) attends to
  sinks + top-k middle tokens found by PQ search + local window + the new tokens themselves.
A chunk of Q > 1 tokens picks ONE top-k set for the whole chunk: each query row's approximate
scores are softmaxed over the tokens and summed over the chunk (and over the GQA group), so a
question after a document retrieves the document tokens that the question as a whole points to.

Codebooks are segments: segment i (start_i, centroids_i) codes positions [start_i, start_i+1).
The prefill is segment 0; a long chunk after it (a new user turn) gets its own K-Means; a rebuild
(every `rebuild_every` generated tokens) re-clusters everything into one segment.

Rows of a batch are independent: per-row validity (left padding), per-row sinks, per-row budgets,
per-row K-Means. Positions are the padded positions shared by the batch.
"""
from __future__ import annotations

import time
from concurrent.futures import CancelledError, Executor, Future
from concurrent.futures import wait as wait_futures
from contextlib import nullcontext

import torch
from transformers.cache_utils import CacheLayerMixin

from pqcache.engine import pq
from pqcache.engine.layer.blockcache import BlockCache
from pqcache.engine.config import PQCacheConfig
from pqcache.engine.errors import Cancelled, InputError, PQBuildError
from pqcache.engine.methods.base import Method, combine_rows, topk_positions
from pqcache.engine.methods.full import Full


class PQLayer(CacheLayerMixin):
    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, config: PQCacheConfig, layer_idx: int, executor: Executor, iters_for: callable,
                 method: Method | None = None, depth: tuple[int, int] = (0, 1)):
        super().__init__()
        from pqcache.engine.methods.pqcache import PQCacheMethod

        self.config = config
        self.method = method or PQCacheMethod()
        self.depth, self.n_depth = depth  # index among the full-attention layers, and their count
        self.keep_queries = False  # keep the prefill queries (a cache that will be forked into methods)
        self.prefill_q = None
        self.layer_idx = layer_idx
        self.executor = executor
        self.iters_for = iters_for  # s -> K-Means iterations
        self.S = 0  # positions stored (padded coordinates)
        self.prefilled = False
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None
        self.jobs: list[Future] = []  # PQ builds in flight (each with a .submitted time)
        self.fallback: str | None = None  # why this layer attends to every token (a failed PQ build)
        self.closed = False  # set by PQCache.close(): a running build stops at the next head
        self.segments: list[tuple[int, torch.Tensor]] = []  # (start position, centroids)
        self.obs = None  # Instrumentation, when attached
        self.method_state: dict = {}
        self.blocks = None
        self.S_prefill = 0
        self.generated = 0
        self.stats = {"kmeans_iters": None, "pq_build_s": None, "pq_wait_s": 0.0, "pq_ready_before_use": None,
                      "steps": 0, "hits": 0, "misses": 0, "rebuilds": 0, "turn_segments": 0, "fallback": None}

    # ---- transformers Cache layer protocol -------------------------------------------------------
    def lazy_initialization(self, key_states, value_states):
        self.device = key_states.device
        self.dtype = key_states.dtype
        self.host = torch.device("cpu")
        self.pin = self.device.type == "cuda"
        B, H, _, D = key_states.shape
        self.B, self.H, self.D = B, H, D
        self.config.check_head_dim(D)
        self.cap = 0
        self.k_host = self.v_host = self.codes = self.valid = self.searchable = self.joint = None
        # Small code spaces (C^m <= 2^16, e.g. m=2, bits<=8) are searched tuple by tuple: see select().
        self.n_tuples = self.config.n_centroids ** self.config.m
        self.use_tuples = self.n_tuples <= 1 << 16
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if key_states.shape[0] != self.B:
            raise InputError(f"PQCache was filled with batch size {self.B}, got {key_states.shape[0]}")
        if not self.prefilled:
            # Prefill: exact attention over what is returned; the tiers are split in finish_prefill.
            self._write_host(key_states, value_states)
            return key_states, value_states
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
        obs, keep = self.obs, self.keep_queries
        self.__init__(self.config, self.layer_idx, self.executor, self.iters_for, self.method,
                      (self.depth, self.n_depth))
        self.obs, self.keep_queries = obs, keep

    def reorder_cache(self, beam_idx):
        raise NotImplementedError("PQCache does not support beam search; use greedy or sampling")

    def batch_repeat_interleave(self, repeats: int):
        if repeats != 1:
            raise NotImplementedError("PQCache does not support num_return_sequences > 1 or beam search")

    # ---- host tier ---------------------------------------------------------------------------------
    def _ensure_capacity(self, n: int):
        if n <= self.cap:
            return
        self._wait_jobs()  # background builds write codes: never swap buffers under them
        cap = max(n + n // 4 + 256, 2 * self.cap)  # headroom: decoding appends without copying
        B, H, D, m = self.B, self.H, self.D, self.config.m
        k = torch.empty((B, H, cap, D), dtype=self.dtype, device=self.host, pin_memory=self.pin)
        v = torch.empty((B, H, cap, D), dtype=self.dtype, device=self.host, pin_memory=self.pin)
        codes = torch.zeros((B, H, m, cap), dtype=torch.uint8, device=self.device)
        valid = torch.zeros((B, cap), dtype=torch.bool, device=self.device)
        searchable = torch.zeros((B, cap), dtype=torch.bool, device=self.device)
        joint = torch.zeros((B, H, cap), dtype=torch.int32, device=self.device) if self.use_tuples else None
        if self.cap:
            S = self.S
            k[:, :, :S] = self.k_host[:, :, :S]
            v[:, :, :S] = self.v_host[:, :, :S]
            codes[..., :S] = self.codes[..., :S]
            valid[:, :S] = self.valid[:, :S]
            searchable[:, :S] = self.searchable[:, :S]
            if joint is not None:
                joint[..., :S] = self.joint[..., :S]
        self.k_host, self.v_host, self.codes, self.valid, self.searchable = k, v, codes, valid, searchable
        self.joint = joint
        self.cap = cap

    def _write_host(self, k, v):
        Q = k.shape[2]
        self._ensure_capacity(self.S + Q)
        with self._span("copy to host"):
            self.k_host[:, :, self.S:self.S + Q].copy_(k, non_blocking=True)
            self.v_host[:, :, self.S:self.S + Q].copy_(v, non_blocking=True)
        if self.obs is not None:
            self.obs.moved("to_host", 2 * k.numel() * k.element_size())
        self.S += Q
        if self.pin:  # the host reads these later (K-Means, gathers): remember when the copy lands
            self.host_ready = torch.cuda.Event()
            self.host_ready.record()

    def _sync_host(self):
        if self.pin and getattr(self, "host_ready", None) is not None:
            self.host_ready.synchronize()

    def _span(self, lane):
        return nullcontext() if self.obs is None else self.obs.span(lane, self.layer_idx)

    # ---- prefill -----------------------------------------------------------------------------------
    def finish_prefill(self, valid: torch.Tensor, query: torch.Tensor | None = None, scaling: float = 1.0):
        """valid (B, S) bool: real (not padding) tokens of the prefill; query (B, Hq, S, D) its queries.
        Splits the tiers, starts PQ, lets the method compute its prefill statistics."""
        self._sync_host()
        S = valid.shape[1]
        self.valid[:, :S] = valid.to(self.device)
        self.S_prefill = S
        self.scaling = scaling
        self.method_state = {}  # per-layer state of the method (methods are shared by the layers)
        self.split_tiers()
        self.prefilled = True
        if self.keep_queries and query is not None:
            self.prefill_q = query.to(self.host)
        if self.method.needs_pq:
            self.start_pq()
        self.method.on_prefill(self, query, scaling)

    def split_tiers(self):
        """Sinks, window ring, top-k buffer and block cache for the current method and tokens."""
        S, cfg = self.S, self.config
        valid = self.valid[:, :S]
        self.n_real = [int(n) for n in valid.sum(1).tolist()]
        splits = [self.method.split(cfg, n, self) for n in self.n_real]
        splits = [(min(s[0], n), s[1], s[2]) for s, n in zip(splits, self.n_real)]  # no more sinks than tokens
        self.n_init = max(s[0] for s in splits)
        self.n_local = [s[2] for s in splits]
        self.L = max(self.n_local)

        rank = valid.long().cumsum(1) - 1  # (B, S) index among real tokens
        n_init_row = torch.tensor([s[0] for s in splits], device=valid.device)
        is_init = valid & (rank < n_init_row[:, None])
        self.searchable[:, :S] = valid & ~is_init
        # Sink positions per row: the first n_init real tokens (sorted key puts them first).
        key = torch.where(is_init, rank, torch.full_like(rank, S + 1))
        self.init_pos = key.argsort(dim=1, stable=True)[:, : self.n_init]  # (B, n_init)
        self.init_valid = is_init.gather(1, self.init_pos)

        self.k_cap, self.q_cap = 0, 0
        self._ensure_device_buffer(max(self.topk_counts()), 1)
        self.dev_k[:, :, : self.n_init] = self._gather_rows(self.k_host, self.init_pos).to(self.device)
        self.dev_v[:, :, : self.n_init] = self._gather_rows(self.v_host, self.init_pos).to(self.device)
        # Local window ring: slot = position % L, slot_pos = -1 while empty.
        self.slot_pos = torch.full((self.L,), -1, dtype=torch.long)
        self._ring_write(self.k_host[:, :, :S], self.v_host[:, :, :S], 0)

        self.blocks = None
        # at most a quarter of the prefill: a device tier as large as the context would defeat the purpose
        capacity = min(cfg.block_cache_tokens, S // 4 // cfg.block_size * cfg.block_size)
        if capacity >= cfg.block_size:
            policy = getattr(self.method, "cache_policy", None) or cfg.cache_policy
            self.blocks = BlockCache(self.B, self.H, self.D, self.dtype, self.device, cfg.block_size,
                                     capacity, cfg.block_admit, policy)

    def start_pq(self):
        """K-Means of the prefill in the background (no-op when it is built or building)."""
        if self.segments or self.jobs:
            return
        iters = self.iters_for(max(self.n_real))
        self.stats["kmeans_iters"] = iters
        self._submit(0, self.S_prefill, iters, kind="prefill")

    def _ensure_device_buffer(self, k: int, q: int):
        """Grow the [sinks | ring | top-k | new] buffer when the top-k or chunk outgrows it."""
        if k <= self.k_cap and q <= self.q_cap:
            return
        k_cap, q_cap = max(k, self.k_cap + self.k_cap // 4), max(q, self.q_cap)
        n = self.n_init + self.L + k_cap + q_cap
        dev_k = torch.zeros((self.B, self.H, n, self.D), dtype=self.dtype, device=self.device)
        dev_v = torch.zeros_like(dev_k)
        if self.k_cap or self.q_cap:
            keep = self.n_init + self.L
            dev_k[:, :, :keep] = self.dev_k[:, :, :keep]
            dev_v[:, :, :keep] = self.dev_v[:, :, :keep]
        self.dev_k, self.dev_v, self.k_cap, self.q_cap = dev_k, dev_v, k_cap, q_cap

    def _gather_rows(self, t, pos):
        """t (B, H, cap, D) host, pos (B, n) -> (B, H, n, D)."""
        B, H, cap, D = t.shape
        n = pos.shape[1]
        idx = pos.to(t.device).view(B, 1, n, 1).expand(B, H, n, D)
        return torch.gather(t, 2, idx)

    def _ring_write(self, k, v, start: int):
        """Write tokens at positions start..start+Q-1 into the ring (only the last L can survive)."""
        Q = k.shape[2]
        if self.L == 0 or Q == 0:
            return
        first = max(0, Q - self.L)
        pos = torch.arange(start + first, start + Q)
        slots = self.n_init + pos % self.L
        self.dev_k[:, :, slots] = k[:, :, first:].to(self.device, non_blocking=True)
        self.dev_v[:, :, slots] = v[:, :, first:].to(self.device, non_blocking=True)
        self.slot_pos[pos % self.L] = pos

    # ---- PQ builds (background) ----------------------------------------------------------------------
    def _submit(self, start: int, end: int, iters: int, kind: str):
        try:
            fut = self.executor.submit(self._build, start, end, iters, kind)
        except RuntimeError:  # the executor was shut down after a fault in another layer
            self._fault(CancelledError())
            return
        fut.submitted = time.perf_counter()
        self.jobs.append(fut)

    def _build(self, start: int, end: int, iters: int, kind: str):
        """K-Means over the searchable tokens of [start, end) of each row; codes for [start, end)."""
        t0 = time.perf_counter()
        with self._span("host clustering"):
            self._sync_host()
            cfg = self.config
            m, C, d = cfg.m, cfg.n_centroids, self.D // cfg.m
            cents = torch.empty((self.B, self.H, m, C, d), dtype=torch.float32)
            searchable = self.searchable[:, start:end].cpu()
            for b in range(self.B):
                rows = searchable[b].nonzero().squeeze(1) + start
                for h in range(self.H):
                    if self.closed:  # the cache was closed (stop, session freed): drop the work
                        raise Cancelled("the cache was closed")
                    keys = self.k_host[b, h, rows]
                    cents[b, h] = pq.train_centroids(keys, m, C, iters, cfg.metric, cfg.seed + 97 * h)
            cents = cents.to(self.device)
            codes = pq.encode(self.k_host[:, :, start:end].to(self.device), cents, cfg.metric)
        return {"kind": kind, "start": start, "end": end, "centroids": cents, "codes": codes,
                "seconds": time.perf_counter() - t0}

    def _set_codes(self, start: int, end: int, codes: torch.Tensor):
        """codes (B, H, m, end - start) uint8 -> the code buffer, and the joint index when used:
        joint = (b*H + h) * C^m + sum_j code_j * C^(m-1-j), the row of the token's code tuple."""
        self.codes[..., start:end] = codes
        if self.joint is None:
            return
        C, m = self.config.n_centroids, self.config.m
        j = codes[:, :, 0].to(torch.int32)
        for i in range(1, m):
            j = j * C + codes[:, :, i]
        base = (torch.arange(self.B * self.H, device=self.device, dtype=torch.int32) * self.n_tuples)
        self.joint[..., start:end] = j + base.view(self.B, self.H, 1)

    def _install(self, result: dict):
        """Put a finished build in place (on the decoding thread, between steps)."""
        start, end, cents = result["start"], result["end"], result["centroids"]
        self._set_codes(start, end, result["codes"])
        if result["kind"] == "rebuild":
            self.segments = [(0, cents)]
            self.stats["rebuilds"] += 1
        else:
            self.segments = [s for s in self.segments if s[0] < start] + [(start, cents)]
            if result["kind"] == "turn":
                self.stats["turn_segments"] += 1
        if self.S > end:  # tokens appended while it ran: code them with the segment they now belong to
            last = self.segments[-1][1]
            self._set_codes(end, self.S, pq.encode(self.k_host[:, :, end:self.S].to(self.device), last,
                                                   self.config.metric))
        if result["kind"] == "prefill":
            self.stats["pq_build_s"] = result["seconds"]

    def _wait_jobs(self, block: bool = True, stop=None):
        """Install finished builds (block: wait for all). A build that raised or ran past
        config.pq_timeout_s is a fault (see _fault); a set `stop` event raises Cancelled."""
        remaining = []
        timeout = self.config.pq_timeout_s
        for i, fut in enumerate(self.jobs):
            overdue = timeout is not None and time.perf_counter() - fut.submitted > timeout
            if not block and not fut.done() and not overdue:  # still within its time: check next step
                remaining.append(fut)
                continue
            ready = fut.done()
            t0 = time.perf_counter()
            try:
                result = self._result(fut, stop)
            except Cancelled:
                self.jobs = remaining + self.jobs[i:]
                raise
            except Exception as exc:  # the worker raised, hung, or was shut down
                self.jobs = []
                self._fault(exc)
                return
            finally:
                self.stats["pq_wait_s"] += time.perf_counter() - t0
            if result["kind"] == "prefill":
                self.stats["pq_ready_before_use"] = ready
            self._install(result)
        self.jobs = remaining

    def _result(self, fut: Future, stop=None) -> dict:
        timeout = self.config.pq_timeout_s
        deadline = None if timeout is None else fut.submitted + timeout
        while not fut.done():  # a build that finished, however late, is used
            left = None if deadline is None else deadline - time.perf_counter()
            if left is not None and left <= 0:
                raise TimeoutError(f"not finished {timeout:g} s after it was submitted")
            if stop is not None and stop.is_set():
                raise Cancelled("stopped while clustering")
            wait_futures([fut], timeout=left if stop is None else 0.1 if left is None else min(0.1, left))
        return fut.result()

    def _fault(self, exc: BaseException):
        """A PQ build failed: stop the cache's other builds, then raise or attend exactly from now on."""
        if isinstance(exc, CancelledError):
            why = "its build was cancelled after a fault in another layer"
        else:
            why = f"{type(exc).__name__}: {exc}"
        reason = f"PQ clustering of layer {self.layer_idx} failed ({why})"
        self.executor.shutdown(wait=False, cancel_futures=True)
        if self.config.on_pq_failure == "raise":
            raise PQBuildError(reason) from exc
        self.fall_back(reason)

    def fall_back(self, reason: str):
        """Attend to every token of this layer from now on (exact attention through the tiers)."""
        self.fallback = self.stats["fallback"] = reason + "; this layer now uses exact attention"
        self.method, self.method_state, self.segments = Full(), {}, []
        if self.prefilled:
            self.split_tiers()

    def wait_pq(self, stop=None):
        """Block until every PQ build of this layer is in place (or has failed, see _fault)."""
        self._wait_jobs(block=True, stop=stop)

    # ---- decode / chunk ----------------------------------------------------------------------------
    def topk_counts(self) -> list[int]:
        out = []
        for b in range(self.B):
            n_init, n_topk, n_local = self.method.split(self.config, self.n_real[b], self)
            n_init_b = int(self.init_valid[b].sum())
            out.append(max(0, n_init + n_topk + n_local - n_init_b - self.n_local[b]))
        return out

    def candidates(self) -> torch.Tensor:
        """(B, S) bool: middle tokens of each row (real, not a sink, older than the row's window)."""
        S = self.S
        pos = torch.arange(S, device=self.device)
        local_start = torch.tensor([S - n for n in self.n_local], device=self.device)
        return self.searchable[:, :S] & (pos[None, :] < local_start[:, None])

    def select(self, q: torch.Tensor, scaling: float):
        """q (B, H, R, D) -> positions (B, H, k) and their validity (B, H, k) on the host tier."""
        ks = self.topk_counts()
        k_max = min(max(ks), self.S)
        cand = self.candidates()
        if k_max == 0 or not bool(cand.any()):
            empty = torch.zeros((self.B, self.H, 0), dtype=torch.long, device=self.device)
            return empty, empty.bool()
        return self.method.select(self, q * scaling, cand, ks, k_max)

    def fetch(self, top: torch.Tensor, valid: torch.Tensor, lo: int):
        """K/V of host positions top (B, H, k) into the device buffer at [lo, lo + k):
        block-cache hits from the device, misses from the host."""
        B, H, k = top.shape
        self._sync_host()
        N = self.dev_k.shape[2]
        dest = ((torch.arange(B * H, device=self.device) * N).view(B, H, 1) + lo
                + torch.arange(k, device=self.device)).reshape(-1)  # rows of dev_k.view(-1, D)
        ok, ov = self.dev_k.view(-1, self.D), self.dev_v.view(-1, self.D)
        if self.blocks is not None:
            slot = self.blocks.lookup(top)
            hit = (slot >= 0) & valid
        else:
            slot, hit = None, torch.zeros_like(valid)
        miss_rows = (~hit).reshape(-1).nonzero().squeeze(1)
        hit_rows = hit.reshape(-1).nonzero().squeeze(1)
        if hit_rows.numel():
            hk, hv = self.blocks.read(slot, top, hit_rows)
            ok[dest[hit_rows]], ov[dest[hit_rows]] = hk, hv
        with self._span("copy to device"):
            flat = (top.to(self.host) + (torch.arange(B * H) * self.cap).view(B, H, 1)).reshape(-1)
            flat = flat[miss_rows.to(self.host)]
            mk = self.k_host.view(-1, self.D).index_select(0, flat)
            mv = self.v_host.view(-1, self.D).index_select(0, flat)
            ok[dest[miss_rows]] = mk.to(self.device, non_blocking=True)
            ov[dest[miss_rows]] = mv.to(self.device, non_blocking=True)
        n_hits, n_miss = int(hit.sum()), int((valid & ~hit).sum())
        self.stats["hits"] += n_hits
        self.stats["misses"] += n_miss
        el = self.dev_k.element_size()
        moved = 2 * miss_rows.numel() * self.D * el
        if self.blocks is not None:
            admitted = self.blocks.admit(top, valid, self.k_host, self.v_host, self.S - max(self.n_local))
            moved += 2 * admitted * self.D * el
        if self.obs is not None:
            self.obs.record_blocks(self.layer_idx, self.stats["steps"], n_hits, n_miss)
            self.obs.moved("to_device", moved)

    def attend(self, query, new_valid, scaling, softcap=None):
        """query (B, Hq, Q, D); new_valid (B, Q) bool -> attention output (B, Q, Hq, D)."""
        k_new, v_new = self.pending
        self.pending = None
        self._wait_jobs(block=not self.segments)  # the first use waits; later builds swap in when done
        B, Hq, Q, D = query.shape
        H, G, S = self.H, Hq // self.H, self.S
        q = query.reshape(B, H, G * Q, D)  # query heads h*G..h*G+G-1 share KV head h

        top, top_valid = self.select(q, scaling)
        k = top.shape[2]
        self._ensure_device_buffer(k, Q)
        lo = self.n_init + self.L  # [sinks | ring | top-k | new]
        self.fetch(top, top_valid, lo)
        self.dev_k[:, :, lo + k:lo + k + Q] = k_new
        self.dev_v[:, :, lo + k:lo + k + Q] = v_new
        keys, values = self.dev_k[:, :, :lo + k + Q], self.dev_v[:, :, :lo + k + Q]

        slot_pos = self.slot_pos.to(self.device)
        local_start = torch.tensor([S - n for n in self.n_local], device=self.device)
        ring_valid = (slot_pos[None, :] >= local_start[:, None]) & (slot_pos[None, :] >= 0)
        ring_valid &= self.valid[:, :S].gather(1, slot_pos.clamp(min=0)[None, :].expand(B, -1))
        ctx_valid = torch.cat(
            [self.init_valid[:, None, :].expand(B, H, -1), ring_valid[:, None, :].expand(B, H, -1), top_valid], dim=2
        )  # (B, H, n_init + L + k)
        causal = torch.ones(Q, Q, dtype=torch.bool, device=self.device).tril()
        new_mask = causal[None, :, :] & new_valid[:, None, :]  # (B, Q, Q)
        mask = torch.cat(
            [ctx_valid[:, :, None, :].expand(B, H, Q, lo + k), new_mask[:, None].expand(B, H, Q, Q)], dim=3
        )  # (B, H, Q, N)

        att = (q @ keys.transpose(-1, -2)).view(B, H, G, Q, -1) * scaling
        if softcap is not None:
            att = torch.tanh(att / softcap) * softcap
        att = att.masked_fill(~mask[:, :, None], float("-inf"))
        probs = att.float().softmax(dim=-1).to(values.dtype)
        out = probs.view(B, H, G * Q, -1) @ values  # (B, H, G*Q, D)
        out = out.view(B, Hq, Q, D).transpose(1, 2)

        self.last_selection = (top, top_valid)
        want_positions = self.obs is not None and self.obs.selections
        if self.method.observes or want_positions:
            positions = torch.cat([self.init_pos[:, None, :].expand(B, H, -1), slot_pos.view(1, 1, -1).expand(B, H, -1),
                                   top, torch.arange(S, S + Q, device=self.device).view(1, 1, Q).expand(B, H, Q)], dim=2)
            if self.method.observes:
                self.method.observe(self, probs.view(B, H, G * Q, -1), positions)
            if want_positions:
                attended = mask[:, :, -1, :]  # what the last new token attended to
                self.obs.record_selection(self.layer_idx, self.stats["steps"], [
                    [sorted(positions[b, h][attended[b, h]].tolist()) for h in range(H)] for b in range(B)])
        if self.obs is not None and (self.obs.wants_attention(self.stats["steps"])
                                     or self.obs.wants_recall(self.stats["steps"])):
            self._probe(q, scaling, top, top_valid, ring_valid)
        self._append(k_new, v_new, new_valid)
        self.stats["steps"] += 1
        return out

    def _append(self, k_new, v_new, new_valid):
        Q, start = k_new.shape[2], self.S
        self._write_host(k_new, v_new)
        self.valid[:, start:start + Q] = new_valid
        self.searchable[:, start:start + Q] = new_valid
        if self.segments:
            self._set_codes(start, start + Q, pq.encode(k_new, self.segments[-1][1], self.config.metric))
        self._ring_write(k_new, v_new, start)
        self.n_real = [n + int(c) for n, c in zip(self.n_real, new_valid.sum(1).tolist())]
        cfg = self.config
        if not self.method.needs_pq:
            return
        if Q >= cfg.turn_min_tokens:  # a new user turn: K-Means of its own, in the background
            self._submit(start, start + Q, self.iters_for(Q), kind="turn")
        elif Q == 1:
            self.generated += 1
            if cfg.rebuild_every and self.generated % cfg.rebuild_every == 0:
                self._submit(0, self.S, self.iters_for(self.S), kind="rebuild")

    # ---- instrumentation probe (sampled steps only) ------------------------------------------------
    def _probe(self, q, scaling, top, top_valid, ring_valid):
        """Exact scores of this step's queries: attention power law, and PQ top-k recall against the
        exact top-k chosen by the same rule (same candidates, same combine, same k)."""
        S, B, H = self.S, self.B, self.H
        self._sync_host()
        keys = self.k_host[:, :, :S].to(self.device, torch.float32)
        exact = (q.float() * scaling) @ keys.transpose(-1, -2)  # (B, H, R, S)
        valid = self.valid[:, :S]
        probs = exact.masked_fill(~valid[:, None, None, :], float("-inf")).softmax(-1)  # (B, H, R, S)
        step = self.stats["steps"]
        if self.obs.wants_attention(step):
            self.obs.record_attention(self.layer_idx, step, probs.sort(-1, descending=True).values.mean((0, 1, 2)))
        if not self.obs.wants_recall(step) or top.shape[2] == 0:
            return
        cand = self.candidates()
        exact_comb = combine_rows(exact.transpose(2, 3).contiguous(), cand, self.config.gqa_combine)  # (B, H, S)
        ks = self.topk_counts()
        etop, evalid = topk_positions(exact_comb, ks, top.shape[2])
        chosen = torch.zeros((B, H, S), dtype=torch.bool, device=self.device)
        chosen.scatter_(2, top, top_valid)
        exact_set = torch.zeros_like(chosen).scatter_(2, etop, evalid & torch.gather(
            cand[:, None, :].expand(-1, H, -1), 2, etop))
        inter = (chosen & exact_set).sum(-1).float()
        topk_recall = (inter / exact_set.sum(-1).clamp(min=1)).mean(0)  # (H,)
        attended = chosen.clone()
        attended |= ~cand[:, None, :] & valid[:, None, :]  # sinks and window are attended too
        mass = (probs * attended[:, :, None, :]).sum(-1).mean(-1).mean(0)  # (H,)
        self.obs.record_recall(self.layer_idx, step, topk_recall.tolist(), mass.tolist(), int(top_valid.sum(-1).max()))

    def fork(self, method: Method, executor: Executor) -> "PQLayer":
        """A deep copy continuing with `method` (see PQCache.fork)."""
        import copy

        self.wait_pq()
        new = copy.copy(self)
        new.__dict__ = {k: (v.clone() if isinstance(v, torch.Tensor) else copy.copy(v) if isinstance(v, (list, dict))
                            else v) for k, v in self.__dict__.items()}
        new.method, new.executor, new.obs, new.jobs = method, executor, None, []
        new.method_state = {}
        if self.fallback and method.needs_pq:  # no codebooks to search: stay exact, keep the notice
            new.method = method = Full()
        if self.prefilled:
            new.split_tiers()
            if method.needs_pq:
                new.start_pq()
            if method.needs_prefill_queries and self.prefill_q is None:
                raise InputError(f"method {method.name!r} needs the prefill queries: create the cache with "
                                 "keep_queries=True before the prefill to fork into it")
            method.on_prefill(new, self.prefill_q, self.scaling)
        return new

    # ---- accounting ----------------------------------------------------------------------------------
    def memory(self) -> dict:
        """Bytes per tier. Device: the [sinks | window | top-k | new] buffer, block cache, codes and
        centroids (PQ). Host: all K/V."""
        if not self.prefilled:
            return {"device_kv_bytes": 0, "host_kv_bytes": 0, "pq_bytes": 0}
        el = torch.finfo(self.dtype).bits // 8
        device_kv = (self.dev_k.numel() + self.dev_v.numel()) * el
        if self.blocks is not None:
            device_kv += self.blocks.nbytes
        host_kv = 2 * self.B * self.H * self.S * self.D * el
        cfg = self.config
        pq_bytes = self.B * self.H * (cfg.m * self.S + len(self.segments or [0]) * cfg.n_centroids * self.D * 4)
        return {"device_kv_bytes": device_kv, "host_kv_bytes": host_kv, "pq_bytes": pq_bytes}


