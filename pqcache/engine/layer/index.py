"""The PQ index of one layer: codebooks (segments), the codes of every stored token, and the
background K-Means builds that produce them.

Codebooks are segments: segment i (start_i, centroids_i) codes positions [start_i, start_i+1).
The prefill is segment 0; a long chunk after it (a new user turn) gets its own K-Means; a rebuild
(every `rebuild_every` generated tokens) re-clusters everything into one segment. Builds run on the
cache's executor and are installed on the decoding thread between steps (`poll`), so the codes a
step reads never change under it. A build that raises or runs past `pq_timeout_s` raises
BuildFault from `poll`; the method decides what follows (pqcache.py: exact attention or raise).

Shapes: B rows, H KV heads, m sub-spaces, C centroids, d = D/m, S positions.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import CancelledError, Executor, Future
from concurrent.futures import wait as wait_futures
from contextlib import nullcontext

import torch

from pqcache.engine import pq
from pqcache.engine.config import PQCacheConfig
from pqcache.engine.errors import Cancelled
from pqcache.engine.layer.host import HostTier


class BuildFault(Exception):
    """A PQ build raised, hung past its timeout, or was cancelled after a fault elsewhere."""


class PQIndex:
    def __init__(
        self,
        host: HostTier,
        config: PQCacheConfig,
        executor: Executor,
        iters_for,
        closed: threading.Event,
        span=None,
        bits: int | None = None,
    ):
        """bits: per code (None: config.bits_for the stored tokens); fixed for the index's life."""
        self.host, self.config, self.executor, self.iters_for = host, config, executor, iters_for
        self.closed = closed  # set when the cache closes: a running build stops at its next head
        self.span = span  # span(lane) -> context manager for the timeline (None: not observed)
        B, H, m = host.B, host.H, config.m
        self.bits = bits or config.bits_for(host.S, host.D)
        self.C = 1 << self.bits  # centroids per sub-space
        self.device = host.device
        self.codes = torch.zeros((B, H, m, 0), dtype=torch.uint8, device=self.device)
        # Small code spaces (C^m <= 2^16, e.g. m=2, bits<=8) are searched tuple by tuple (methods/pqcache.py):
        # joint = (b*H + h) * C^m + the tuple's index, one int32 per token and head.
        self.n_tuples = self.C**m
        self.use_tuples = self.n_tuples <= 1 << 16
        self.joint = torch.zeros((B, H, 0), dtype=torch.int32, device=self.device) if self.use_tuples else None
        self.segments: list[tuple[int, torch.Tensor]] = []  # (start position, centroids (B, H, m, C, d))
        self.jobs: list[Future] = []  # builds in flight, each with a .submitted time
        self.fault: BaseException | None = None  # a submit that found the executor shut down
        self.generated = 0  # decoded tokens since the prefill (for rebuild_every)
        self.stats = {
            "kmeans_iters": None,
            "pq_build_s": None,
            "pq_wait_s": 0.0,
            "pq_ready_before_use": None,
            "rebuilds": 0,
            "turn_segments": 0,
        }

    # ---- builds ----------------------------------------------------------------------------------
    def submit(self, start: int, end: int, kind: str, iters: int | None = None):
        """K-Means of positions [start, end) in the background ("prefill", "turn", "rebuild")."""
        iters = iters or self.iters_for(end - start)
        if kind == "prefill":
            self.stats["kmeans_iters"] = iters
        try:
            fut = self.executor.submit(self.build, start, end, iters, kind)
        except RuntimeError:  # the executor was shut down after a fault in another layer
            self.fault = CancelledError()
            return
        fut.submitted = time.perf_counter()
        self.jobs.append(fut)

    def build(self, start: int, end: int, iters: int, kind: str) -> dict:
        """K-Means over the searchable tokens of [start, end) of each row; codes for [start, end)."""
        t0 = time.perf_counter()
        host, cfg = self.host, self.config
        with self._span("host clustering"):
            keys = host.keys(start, end)  # (B, H, n, D) on the host
            m, C, d = cfg.m, self.C, host.D // cfg.m
            cents = torch.empty((host.B, host.H, m, C, d), dtype=torch.float32)
            searchable = host.searchable[:, start:end].cpu()
            for b in range(host.B):
                rows = searchable[b].nonzero().squeeze(1)
                for h in range(host.H):
                    if self.closed.is_set():  # the cache was closed (stop, session freed): drop the work
                        raise Cancelled("the cache was closed")
                    cents[b, h] = pq.train_centroids(keys[b, h, rows], m, C, iters, cfg.metric, cfg.seed + 97 * h)
            cents = cents.to(self.device)
            codes = pq.encode(keys.to(self.device), cents, cfg.metric)
        return {
            "kind": kind,
            "start": start,
            "end": end,
            "centroids": cents,
            "codes": codes,
            "seconds": time.perf_counter() - t0,
        }

    def poll(self, block: bool, stop=None):
        """Install finished builds (block: wait for all). Raises BuildFault for a build that raised
        or ran past config.pq_timeout_s, Cancelled when `stop` is set while waiting."""
        if self.fault is not None:
            raise BuildFault(self._why(self.fault)) from self.fault
        remaining, timeout = [], self.config.pq_timeout_s
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
                raise BuildFault(self._why(exc)) from exc
            finally:
                self.stats["pq_wait_s"] += time.perf_counter() - t0
            if result["kind"] == "prefill":
                self.stats["pq_ready_before_use"] = ready
            self.install(result)
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

    @staticmethod
    def _why(exc: BaseException) -> str:
        if isinstance(exc, CancelledError):
            return "its build was cancelled after a fault in another layer"
        return f"{type(exc).__name__}: {exc}"

    def install(self, result: dict):
        """Put a finished build in place (on the decoding thread, between steps)."""
        start, end, cents = result["start"], result["end"], result["centroids"]
        self.set_codes(start, end, result["codes"])
        if result["kind"] == "rebuild":
            self.segments = [(0, cents)]
            self.stats["rebuilds"] += 1
        else:
            self.segments = [s for s in self.segments if s[0] < start] + [(start, cents)]
            if result["kind"] == "turn":
                self.stats["turn_segments"] += 1
        S = self.host.S
        if S > end:  # tokens appended while it ran: code them with the segment they now belong to
            self.set_codes(end, S, pq.encode(self.host.keys(end, S, device=self.device), cents, self.config.metric))
        if result["kind"] == "prefill":
            self.stats["pq_build_s"] = result["seconds"]

    # ---- codes -----------------------------------------------------------------------------------
    def set_codes(self, start: int, end: int, codes: torch.Tensor):
        """codes (B, H, m, end - start) uint8 -> the code buffer, and the joint index when used:
        joint = (b*H + h) * C^m + sum_j code_j * C^(m-1-j), the row of the token's code tuple."""
        self._reserve(end)
        self.codes[..., start:end] = codes
        if self.joint is None:
            return
        C, m = self.C, self.config.m
        j = codes[:, :, 0].to(torch.int32)
        for i in range(1, m):
            j = j * C + codes[:, :, i]
        base = torch.arange(self.host.B * self.host.H, device=self.device, dtype=torch.int32) * self.n_tuples
        self.joint[..., start:end] = j + base.view(self.host.B, self.host.H, 1)

    def _reserve(self, n: int):
        cap = self.codes.shape[-1]
        if n <= cap:
            return
        cap = max(n, self.host.cap, 2 * cap)
        codes = torch.zeros((*self.codes.shape[:-1], cap), dtype=torch.uint8, device=self.device)
        codes[..., : self.codes.shape[-1]] = self.codes
        self.codes = codes
        if self.joint is not None:
            joint = torch.zeros((*self.joint.shape[:-1], cap), dtype=torch.int32, device=self.device)
            joint[..., : self.joint.shape[-1]] = self.joint
            self.joint = joint

    def append(self, start: int, k_new: torch.Tensor):
        """Tokens just stored at [start, start + Q): coded with the newest codebook; a long chunk (a
        new user turn) gets its own K-Means, every `rebuild_every` decoded tokens everything is re-clustered."""
        Q, cfg = k_new.shape[2], self.config
        if self.segments:
            self.set_codes(start, start + Q, pq.encode(k_new, self.segments[-1][1], cfg.metric))
        if Q >= cfg.turn_min_tokens:
            self.submit(start, start + Q, kind="turn")
        elif Q == 1:
            self.generated += 1
            if cfg.rebuild_every and self.generated % cfg.rebuild_every == 0:
                self.submit(0, self.host.S, kind="rebuild")

    # ---- the rest ----------------------------------------------------------------------------------
    def _span(self, lane: str):
        return nullcontext() if self.span is None else self.span(lane)

    def serves(self, config: PQCacheConfig) -> bool:
        """Whether this index's codes are what `config` would build (same m, bits and metric)."""
        same = (config.m, config.metric) == (self.config.m, self.config.metric)
        return same and config.bits in (None, self.bits)

    def fork(
        self, host: HostTier, config: PQCacheConfig, executor: Executor, closed: threading.Event, span=None
    ) -> PQIndex:
        """The same codebooks and codes over a forked host tier (the codes are copied: they are small)."""
        self.poll(block=True)
        new = PQIndex(host, config, executor, self.iters_for, closed, span, self.bits)
        S = host.S
        new.codes = self.codes[..., :S].clone()
        new.joint = None if self.joint is None else self.joint[..., :S].clone()
        new.segments, new.generated, new.stats = list(self.segments), self.generated, dict(self.stats)
        return new

    @property
    def nbytes(self) -> int:
        """Codes (m bytes per token and head) and centroids (float32), as stored on the device."""
        B, H, S = self.host.B, self.host.H, self.host.S
        cfg = self.config
        return B * H * (cfg.m * S + len(self.segments or [0]) * self.C * self.host.D * 4)
