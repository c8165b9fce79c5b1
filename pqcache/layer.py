"""PQLayer: the KV cache of one full-attention layer under PQCache.

Tiers (per layer):
  host   k_host, v_host (B, H, cap, D)  every token by position; codes (B, H, m, cap) uint8
  device k_init, v_init (B, H, n_init, D)  first real tokens of each row (attention sinks)
         k_ring, v_ring (B, H, L, D)       ring buffer of the most recent tokens (local window)
         centroids      (B, H, m, C, d)    small, stay on the device

A decode step (or a multi-token chunk after the prefill) attends to
  sinks + top-k middle tokens found by PQ search + local window + the new tokens themselves.
A chunk of Q > 1 tokens picks ONE top-k set for the whole chunk: each query row's approximate
scores are softmaxed over the tokens and summed over the chunk (and over the GQA group), so a
question after a document retrieves the document tokens that the question as a whole points to.

Rows of a batch are independent: per-row validity (left padding), per-row sinks, per-row budgets,
per-row K-Means. Positions are the padded positions shared by the batch.
"""
from __future__ import annotations

import math
import time
from concurrent.futures import Executor, Future

import torch
from transformers.cache_utils import CacheLayerMixin

from . import pq
from .config import PQCacheConfig


def _alloc(shape, dtype, device, pin=False):
    return torch.empty(shape, dtype=dtype, device=device, pin_memory=pin)


class PQLayer(CacheLayerMixin):
    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, config: PQCacheConfig, layer_idx: int, executor: Executor, iters_for: callable):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.executor = executor
        self.iters_for = iters_for  # s -> K-Means iterations
        self.S = 0  # positions stored (padded coordinates)
        self.prefilled = False
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None
        self.pq_future: Future | None = None
        self.stats = {"kmeans_iters": None, "pq_build_s": None, "pq_wait_s": 0.0, "steps": 0}

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
        self.k_host = self.v_host = self.codes = self.valid = self.searchable = None
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if key_states.shape[0] != self.B:
            raise ValueError(f"PQCache was filled with batch size {self.B}, got {key_states.shape[0]}")
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
        self.__init__(self.config, self.layer_idx, self.executor, self.iters_for)

    def reorder_cache(self, beam_idx):
        raise NotImplementedError("PQCache does not support beam search; use greedy or sampling")

    def batch_repeat_interleave(self, repeats: int):
        if repeats != 1:
            raise NotImplementedError("PQCache does not support num_return_sequences > 1 or beam search")

    # ---- host tier ---------------------------------------------------------------------------------
    def _ensure_capacity(self, n: int):
        if n <= self.cap:
            return
        cap = max(n + n // 4 + 256, 2 * self.cap)  # headroom: decoding appends without copying
        B, H, D, m = self.B, self.H, self.D, self.config.m
        k = _alloc((B, H, cap, D), self.dtype, self.host, self.pin)
        v = _alloc((B, H, cap, D), self.dtype, self.host, self.pin)
        codes = torch.zeros((B, H, m, cap), dtype=torch.uint8, device=self.device)
        valid = torch.zeros((B, cap), dtype=torch.bool, device=self.device)
        searchable = torch.zeros((B, cap), dtype=torch.bool, device=self.device)
        if self.cap:
            S = self.S
            k[:, :, :S] = self.k_host[:, :, :S]
            v[:, :, :S] = self.v_host[:, :, :S]
            codes[..., :S] = self.codes[..., :S]
            valid[:, :S] = self.valid[:, :S]
            searchable[:, :S] = self.searchable[:, :S]
        self.k_host, self.v_host, self.codes, self.valid, self.searchable = k, v, codes, valid, searchable
        self.cap = cap

    def _write_host(self, k, v):
        Q = k.shape[2]
        self._ensure_capacity(self.S + Q)
        self.k_host[:, :, self.S:self.S + Q].copy_(k, non_blocking=True)
        self.v_host[:, :, self.S:self.S + Q].copy_(v, non_blocking=True)
        self.S += Q
        if self.pin:  # the host reads these later (K-Means, gathers): remember when the copy lands
            self.host_ready = torch.cuda.Event()
            self.host_ready.record()

    def _sync_host(self):
        if self.pin and getattr(self, "host_ready", None) is not None:
            self.host_ready.synchronize()

    # ---- prefill -----------------------------------------------------------------------------------
    def finish_prefill(self, valid: torch.Tensor):
        """valid (B, S) bool: real (not padding) tokens of the prefill. Splits the tiers, starts PQ."""
        B, S = valid.shape
        cfg = self.config
        self._sync_host()
        self.valid[:, :S] = valid.to(self.device)
        self.n_real = [int(n) for n in valid.sum(1).tolist()]
        splits = [cfg.split(n) for n in self.n_real]
        self.n_init = max(s[0] for s in splits)
        self.n_local = [s[2] for s in splits]
        self.L = max(self.n_local)

        rank = valid.long().cumsum(1) - 1  # (B, S) index among real tokens
        n_init_row = torch.tensor([s[0] for s in splits], device=valid.device)
        is_init = valid & (rank < n_init_row[:, None])
        self.searchable[:, :S] = (valid & ~is_init).to(self.device)
        # Sink positions per row: the first n_init real tokens (sorted key puts them first).
        big = S + 1
        key = torch.where(is_init, rank, torch.full_like(rank, big))
        init_pos = key.argsort(dim=1, stable=True)[:, : self.n_init]  # (B, n_init)
        self.init_valid = is_init.gather(1, init_pos).to(self.device)
        self.k_init = self._gather_rows(self.k_host, init_pos).to(self.device)
        self.v_init = self._gather_rows(self.v_host, init_pos).to(self.device)

        # Local window ring: slot = position % L, slot_pos = -1 while empty.
        self.slot_pos = torch.full((self.L,), -1, dtype=torch.long)
        self.k_ring = torch.zeros((self.B, self.H, self.L, self.D), dtype=self.dtype, device=self.device)
        self.v_ring = torch.zeros_like(self.k_ring)
        self._ring_write(self.k_host[:, :, :S], self.v_host[:, :, :S], 0)

        self.prefilled = True
        iters = self.iters_for(max(self.n_real))
        self.stats["kmeans_iters"] = iters
        self.pq_future = self.executor.submit(self._build_pq, S, iters)

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
        slots = pos % self.L
        self.k_ring[:, :, slots] = k[:, :, first:].to(self.device, non_blocking=True)
        self.v_ring[:, :, slots] = v[:, :, first:].to(self.device, non_blocking=True)
        self.slot_pos[slots] = pos

    def _build_pq(self, S: int, iters: int):
        t0 = time.perf_counter()
        cfg = self.config
        m, C, d = cfg.m, cfg.n_centroids, self.D // cfg.m
        cents = torch.empty((self.B, self.H, m, C, d), dtype=torch.float32)
        searchable = self.searchable[:, :S].cpu()
        for b in range(self.B):
            rows = searchable[b].nonzero().squeeze(1)
            for h in range(self.H):
                keys = self.k_host[b, h, rows]
                cents[b, h] = pq.train_centroids(keys, m, C, iters, cfg.metric, cfg.seed + 97 * h)
        self.centroids = cents.to(self.device)
        self.codes[..., :S] = pq.encode(self.k_host[:, :, :S].to(self.device), self.centroids, cfg.metric)
        self.stats["pq_build_s"] = time.perf_counter() - t0

    def wait_pq(self):
        if self.pq_future is not None:
            t0 = time.perf_counter()
            self.pq_future.result()
            self.stats["pq_wait_s"] += time.perf_counter() - t0
            self.pq_future = None

    # ---- decode / chunk ----------------------------------------------------------------------------
    def topk_counts(self) -> list[int]:
        out = []
        for b in range(self.B):
            budget = self.config.budget_tokens(self.n_real[b])
            n_init_b = int(self.init_valid[b].sum())
            out.append(max(0, budget - n_init_b - self.n_local[b]))
        return out

    def select(self, q: torch.Tensor, scaling: float):
        """q (B, H, R, D) -> positions (B, H, k) and their validity (B, H, k) on the host tier."""
        S, cfg = self.S, self.config
        ks = self.topk_counts()
        k_max = min(max(ks), S)
        pos = torch.arange(S, device=self.device)
        local_start = torch.tensor([S - n for n in self.n_local], device=self.device)
        cand = self.searchable[:, :S] & (pos[None, :] < local_start[:, None])  # (B, S)
        if k_max == 0 or not bool(cand.any()):
            empty = torch.zeros((self.B, self.H, 0), dtype=torch.long, device=self.device)
            return empty, empty.bool()
        tables = pq.lookup_tables(q * scaling, self.centroids)  # (B, H, m, C, R)
        scores = pq.approx_scores(tables, self.codes[..., :S])  # (B, H, S, R)
        if cfg.gqa_combine == "softmax_sum":
            neg = torch.finfo(scores.dtype).min
            scores = scores.masked_fill_(~cand[:, None, :, None], neg).softmax(dim=2).sum(-1)
        else:
            scores = scores.sum(-1)
        scores.masked_fill_(~cand[:, None, :], float("-inf"))  # (B, H, S)
        top, sel_valid = topk_positions(scores, ks, k_max)
        sel_valid = sel_valid & torch.gather(cand[:, None, :].expand(-1, self.H, -1), 2, top)
        return top, sel_valid

    def fetch(self, top: torch.Tensor):
        """Gather K/V of host positions top (B, H, k) -> (B, H, k, D) each, on the device."""
        B, H, k = top.shape
        self._sync_host()
        flat = (top.to(self.host) + (torch.arange(B * H) * self.cap).view(B, H, 1)).reshape(-1)
        kk = self.k_host.view(B * H * self.cap, self.D).index_select(0, flat).view(B, H, k, self.D)
        vv = self.v_host.view(B * H * self.cap, self.D).index_select(0, flat).view(B, H, k, self.D)
        return kk.to(self.device, non_blocking=True), vv.to(self.device, non_blocking=True)

    def attend(self, query, new_valid, scaling, softcap=None):
        """query (B, Hq, Q, D); new_valid (B, Q) bool -> attention output (B, Q, Hq, D)."""
        k_new, v_new = self.pending
        self.pending = None
        self.wait_pq()
        B, Hq, Q, D = query.shape
        H, G, S = self.H, Hq // self.H, self.S
        q = query.reshape(B, H, G * Q, D)  # query heads h*G..h*G+G-1 share KV head h

        top, top_valid = self.select(q, scaling)
        k_mid, v_mid = self.fetch(top)

        slot_pos = self.slot_pos.to(self.device)
        local_start = torch.tensor([S - n for n in self.n_local], device=self.device)
        ring_valid = (slot_pos[None, :] >= local_start[:, None]) & (slot_pos[None, :] >= 0)
        ring_valid &= self.valid[:, :S].gather(1, slot_pos.clamp(min=0)[None, :].expand(B, -1))

        keys = torch.cat([self.k_init, k_mid, self.k_ring, k_new], dim=2)  # (B, H, N, D)
        values = torch.cat([self.v_init, v_mid, self.v_ring, v_new], dim=2)
        n_ctx = self.n_init + top.shape[2] + self.L
        ctx_valid = torch.cat(
            [self.init_valid[:, None, :].expand(B, H, -1), top_valid, ring_valid[:, None, :].expand(B, H, -1)], dim=2
        )  # (B, H, n_ctx)
        causal = torch.ones(Q, Q, dtype=torch.bool, device=self.device).tril()
        new_mask = causal[None, :, :] & new_valid[:, None, :]  # (B, Q, Q)
        mask = torch.cat(
            [ctx_valid[:, :, None, :].expand(B, H, Q, n_ctx), new_mask[:, None].expand(B, H, Q, Q)], dim=3
        )  # (B, H, Q, N)

        att = (q @ keys.transpose(-1, -2)).view(B, H, G, Q, -1) * scaling
        if softcap is not None:
            att = torch.tanh(att / softcap) * softcap
        att = att.masked_fill(~mask[:, :, None], float("-inf"))
        probs = att.float().softmax(dim=-1).to(values.dtype)
        out = probs.view(B, H, G * Q, -1) @ values  # (B, H, G*Q, D)
        out = out.view(B, Hq, Q, D).transpose(1, 2)

        self.last_selection = (top, top_valid)
        self._append(k_new, v_new, new_valid)
        self.stats["steps"] += 1
        return out

    def _append(self, k_new, v_new, new_valid):
        Q, start = k_new.shape[2], self.S
        self._write_host(k_new, v_new)
        self.valid[:, start:start + Q] = new_valid
        self.searchable[:, start:start + Q] = new_valid
        self.codes[..., start:start + Q] = pq.encode(k_new, self.centroids, self.config.metric)
        self._ring_write(k_new, v_new, start)
        self.n_real = [n + int(c) for n, c in zip(self.n_real, new_valid.sum(1).tolist())]

    # ---- accounting ----------------------------------------------------------------------------------
    def memory(self) -> dict:
        """Bytes per tier: device (sinks + window + centroids + codes) and host (all K/V)."""
        if not self.prefilled:
            return {"device_kv_bytes": 0, "host_kv_bytes": 0, "pq_bytes": 0}
        el = torch.finfo(self.dtype).bits // 8
        device_kv = (self.k_init.numel() + self.v_init.numel() + self.k_ring.numel() + self.v_ring.numel()) * el
        host_kv = 2 * self.B * self.H * self.S * self.D * el
        cfg = self.config
        pq_bytes = self.B * self.H * (cfg.m * self.S + cfg.n_centroids * self.D * 4)
        return {"device_kv_bytes": device_kv, "host_kv_bytes": host_kv, "pq_bytes": pq_bytes}


def topk_positions(scores: torch.Tensor, ks: list[int], k_max: int):
    """Top-k_b positions of each row b of scores (B, H, S) -> (B, H, k_max) positions and validity.

    Tokens with identical PQ codes get identical scores, so ties at the k-th score are common; they
    go to the earliest positions, which makes the choice independent of padding and of the sort
    algorithm (a left-padded row selects what it selects alone). The tie pass runs only when the
    boundary is ambiguous.
    """
    B, H, S = scores.shape
    kt = torch.tensor(ks, device=scores.device).view(B, 1, 1)
    even = min(ks) == k_max
    vals, top = scores.topk(k_max, dim=-1, sorted=not even)
    if even:
        thresh = vals.min(-1, keepdim=True).values
        in_rank = torch.ones_like(vals, dtype=torch.bool)
    else:
        thresh = vals.gather(-1, (kt - 1).clamp(min=0).expand(B, H, 1))
        in_rank = torch.arange(k_max, device=scores.device).view(1, 1, -1) < kt
    tied_all = (scores == thresh).sum(-1)
    tied_in = ((vals == thresh) & in_rank).sum(-1)
    if not bool((tied_all > tied_in).any()):
        return top, in_rank
    strict = scores > thresh
    ties = scores == thresh
    need = kt.view(B, 1) - strict.sum(-1)  # (B, H)
    chosen = strict | (ties & (ties.cumsum(-1) <= need[..., None]))
    flag, top = chosen.to(torch.float32).topk(k_max, dim=-1, sorted=True)
    return top, flag > 0
