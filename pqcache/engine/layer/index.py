"""The PQ index of one layer: codebooks (segments), the codes of every stored token, and the
background K-Means builds that produce them (computed by training.py, run and collected by builds.py).

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
from concurrent.futures import Executor
from contextlib import nullcontext

import torch

from pqcache.engine import completion, pq
from pqcache.engine.config import PQCacheConfig
from pqcache.engine.layer.builds import Builds
from pqcache.engine.layer.host import HostTier
from pqcache.engine.layer.training import train
from pqcache.native import select as native_select


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
        # each token's quantization error ||k - k_hat|| (k_hat: its key as its codes give it), float32: the first
        # stage's margin (config.search_margin) widens a score by it
        self.residuals = torch.zeros((B, H, 0), dtype=torch.float32, device=self.device)
        self.segments: list[tuple[int, torch.Tensor]] = []  # (start position, centroids (B, H, m, C, d))
        # completion's codes of the values (engine/completion.ValueCodes), trained with the prefill's codebooks
        # under config.completion, or where completion first needs them
        self.value_codes: completion.ValueCodes | None = None
        # OPQ rotations (B, H, D, D) by segment start, kept on the host: keys and queries are rotated
        # before the codebooks see them (q.k = Rq.Rk for an orthogonal R)
        self.rotations: dict[int, torch.Tensor] = {}
        self._half_norms: tuple = (None, None)  # (centroids, their |c|^2 / 2) of the newest segment
        self.builds = Builds(executor, config.pq_timeout_s)
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
        self.builds.submit(self.build, start, end, iters, kind)

    def build(self, start: int, end: int, iters: int, kind: str) -> dict:
        """K-Means over the searchable tokens of [start, end) of each row; codes for [start, end) (on the worker)."""
        return train(self, start, end, iters, kind)

    def poll(self, block: bool, stop=None):
        """Install finished builds (block: wait for all). Raises BuildFault for a build that raised
        or ran past config.pq_timeout_s, Cancelled when `stop` is set while waiting."""
        try:
            for result, ready in self.builds.collect(block, stop):
                if result["kind"] == "prefill":
                    self.stats["pq_ready_before_use"] = ready
                self.install(result)
        finally:
            self.stats["pq_wait_s"] = self.builds.wait_s

    def install(self, result: dict):
        """Put a finished build in place (on the decoding thread, between steps)."""
        start, end, cents = result["start"], result["end"], result["centroids"]
        if result["kind"] == "rebuild":
            self.segments, self.rotations = [(0, cents)], {}
            self.stats["rebuilds"] += 1
        else:
            self.segments = [s for s in self.segments if s[0] < start] + [(start, cents)]
            self.rotations = {s: r for s, r in self.rotations.items() if s < start}
            if result["kind"] == "turn":
                self.stats["turn_segments"] += 1
        if result.get("rotation") is not None:
            self.rotations[self.segments[-1][0]] = result["rotation"]
        if result.get("value_codes") is not None:
            self.value_codes = result["value_codes"]
        self.set_codes(start, end, result["codes"], result["residuals"])
        S = self.host.S
        if S > end:  # tokens appended while it ran: code them with the segment they now belong to
            self.set_codes(end, S, *self.encode(self.host.keys(end, S, device=self.device)))
        if result["kind"] == "prefill":
            self.stats["pq_build_s"] = result["seconds"]

    # ---- codes -----------------------------------------------------------------------------------
    def set_codes(self, start: int, end: int, codes: torch.Tensor, residuals: torch.Tensor | None = None):
        """codes (B, H, m, end - start) uint8 -> the code buffer, the tokens' residuals, and the joint index when
        used: joint = (b*H + h) * C^m + sum_j code_j * C^(m-1-j), the row of the token's code tuple. The segments
        holding [start, end) are in place; residuals (B, H, end - start): theirs, where the caller has them."""
        self.reserve(end)
        self.codes[..., start:end] = codes
        if residuals is None:
            self.note_residuals(start, end)
        else:
            self.residuals[..., start:end] = residuals
        if self.joint is None:
            return
        C, m = self.C, self.config.m
        j = codes[:, :, 0].to(torch.int32)
        for i in range(1, m):
            j = j * C + codes[:, :, i]
        base = torch.arange(self.host.B * self.host.H, device=self.device, dtype=torch.int32) * self.n_tuples
        self.joint[..., start:end] = j + base.view(self.host.B, self.host.H, 1)

    def note_residuals(self, start: int, end: int):
        """The residuals of tokens [start, end), whose keys and codes are stored, segment by segment."""
        bounds = [s for s, _ in self.segments[1:]] + [max(end, self.host.S)]
        for (lo, cents), hi in zip(self.segments, bounds, strict=True):
            a, b = max(start, lo), min(end, hi)
            if a < b:
                keys = self.rotate(self.host.keys(a, b, device=self.device, dtype=torch.float32), lo)
                self.residuals[..., a:b] = pq.residual_norms(keys, self.codes[..., a:b], cents)

    def reserve(self, n: int):
        """Room for codes (and their residuals and the joint index) of n positions."""
        cap = self.codes.shape[-1]
        if n <= cap:
            return
        cap = max(n, self.host.cap, 2 * cap)
        codes = torch.zeros((*self.codes.shape[:-1], cap), dtype=torch.uint8, device=self.device)
        codes[..., : self.codes.shape[-1]] = self.codes
        self.codes = codes
        residuals = torch.zeros((*self.residuals.shape[:-1], cap), dtype=torch.float32, device=self.device)
        residuals[..., : self.residuals.shape[-1]] = self.residuals
        self.residuals = residuals
        if self.joint is not None:
            joint = torch.zeros((*self.joint.shape[:-1], cap), dtype=torch.int32, device=self.device)
            joint[..., : self.joint.shape[-1]] = self.joint
            self.joint = joint

    def append(self, start: int, k_new: torch.Tensor):
        """Tokens just stored at [start, start + Q): coded with the newest codebook; a long chunk (a
        new user turn) gets its own K-Means, every `rebuild_every` decoded tokens everything is re-clustered."""
        Q = k_new.shape[2]
        if self.segments:
            self.set_codes(start, start + Q, *self.encode(k_new))
        self.appended(start, Q)

    def appended(self, start: int, Q: int):
        """Q tokens at [start, start + Q) stored and coded (append's last part, which layer/onerow.py's filing of
        a token in C calls): a new turn's K-Means, or a decoded token counted towards the next rebuild."""
        cfg = self.config
        if Q >= cfg.turn_min_tokens:
            self.submit(start, start + Q, kind="turn")
        elif Q == 1:
            self.generated += 1
            if cfg.rebuild_every and self.generated % cfg.rebuild_every == 0:
                self.submit(0, self.host.S, kind="rebuild")

    def encode(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Codes (B, H, m, n) of keys (B, H, n, D) under the newest segment's codebook (and rotation), and their
        residuals (B, H, n)."""
        start, cents = self.segments[-1]
        return _encode(self.rotate(keys, start), cents, self.config.metric, self.half_norms())

    def half_norms(self) -> torch.Tensor:
        """|c|^2 / 2 (B, H, m, C) of the newest segment's centroids c, kept per codebook: a decode step codes one
        key against all of them."""
        cents = self.segments[-1][1]
        if self._half_norms[0] is not cents:
            self._half_norms = (cents, pq.centroid_half_norms(cents))
        return self._half_norms[1]

    def rotate(self, x: torch.Tensor, start: int) -> torch.Tensor:
        """Keys or queries (B, H, n, D) in the coordinates of the segment starting at `start`: R x with
        its OPQ rotation (applied on the host, where the rotations live), x itself without OPQ."""
        rotation = self.rotations.get(start)
        if rotation is None:
            return x
        return (x.to(rotation.device, torch.float32) @ rotation.transpose(-1, -2)).to(x.device)

    # ---- the rest ----------------------------------------------------------------------------------
    def _span(self, lane: str):
        return nullcontext() if self.span is None else self.span(lane)

    def serves(self, config: PQCacheConfig) -> bool:
        """Whether this index's codes are what `config` would build (same m, bits and metric)."""
        same = (config.m, config.metric, config.opq) == (self.config.m, self.config.metric, self.config.opq)
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
        new.residuals = self.residuals[..., :S].clone()
        new.segments, new.generated, new.stats = list(self.segments), self.generated, dict(self.stats)
        new.rotations = dict(self.rotations)
        if config.completion and self.value_codes is not None:
            new.value_codes = self.value_codes.fork(S)
        return new

    @property
    def nbytes(self) -> int:
        """Codes (m bytes per token and head), residuals (4 bytes) and centroids (float32), as stored on the
        device; completion's value codes and their centroids where it keeps them."""
        B, H, S = self.host.B, self.host.H, self.host.S
        cfg = self.config
        values = 0 if self.value_codes is None else self.value_codes.nbytes
        return B * H * ((cfg.m + 4) * S + len(self.segments or [0]) * self.C * self.host.D * 4) + values


def _encode(keys: torch.Tensor, cents: torch.Tensor, metric: str, half_norms: torch.Tensor) -> tuple:
    """pq.encode and the keys' residuals ||k - k_hat|| -> (codes (B, H, m, n), residuals (B, H, n)); a decode step's
    one key in pq_codes.c where it runs (0.17 ms a layer less, Zen 3), as the fused step codes the key it files."""
    if keys.shape[2] != 1 or not native_select.usable(cents, 1):
        codes = pq.encode(keys, cents, metric, half_norms)
        return codes, pq.residual_norms(keys, codes, cents)
    codes = torch.empty(keys.shape[:2] + cents.shape[2:3] + (1,), dtype=torch.uint8, device=keys.device)
    residuals = torch.empty(keys.shape[:3], dtype=torch.float32, device=keys.device)
    native_select.encode_one(
        keys.float(), cents, None if metric == "ip" else half_norms, codes[..., 0], residuals[..., 0]
    )
    return codes, residuals
