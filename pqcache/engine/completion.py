"""Completion: the attention of the middle tokens a step did not select, estimated from what the cache holds, and
merged with the exact attention over the selection by log-sum-exp (issue 64).

    softmax numerator and denominator of an unselected token t:  exp(s~_t) v~_t  and  exp(s~_t)
    s~_t  the step's estimated score (engine/mass.py: the calibrated PQ score, or the exact one where the re-rank
          computed it)
    v~_t  the mean over the m sub-spaces j of mean_value[segment of t, j, code_j(t)]

A value has no centroid of its own: PQ clusters the keys. What is well defined is the mean value of the tokens
whose key fell in a cell: mean_value[g, j, c] = the mean of the values of the tokens of codebook segment g whose
sub-space j code is c. With m = 1 that is the mean per code (a code tuple is one code); with m > 1 the mean per
code tuple would be C^m rows (65536 at m=2, 8 bits: mostly one token or none), so each sub-space's conditional mean
is kept and the m of them averaged: each is the best guess of v from one part of the key. ValueMeans keeps them,
summed as tokens arrive (a new codebook sums them anew): float32 sums and counts, segments x m x C x (D + 1) x 4
bytes per row and KV head of a layer (64 KiB at m=1, 8 bits, D=64), no bytes per token (the codes are the index's).

With config.value_codes = n > 0 (the default: sub-spaces of 16 dims, at most 16: config.for_head_dim), v~_t is
instead the token's own value as PQ codes it: n sub-spaces of the values, VALUE_CENTROIDS centroids each (K-Means on
the prefill's values, in the prefill's PQ build; on the values stored when first needed where the index has none, a
fork's of a cache built without completion), later values coded against them: n bytes a token and KV head, and
VALUE_CENTROIDS x D float32 per row and KV head of a layer (256 KiB at D=256), kept in the layer's PQIndex.
docs/results.md compares the two.

When every middle token is selected, the output is the selection's own, bit for bit: nothing is merged.
Shapes: B rows, H KV heads, S positions, R query rows per KV head, D head size, P = segments x m x C cells.
"""

from __future__ import annotations

import torch

from pqcache.engine import pq

VALUE_MEANS = "value_means"  # the view.state key of a layer's ValueMeans
VALUE_CENTROIDS = 256  # centroids per sub-space of the values' codes: a code is one byte


def token_cells(index, end: int, start: int = 0) -> torch.Tensor:
    """The cell (segment, sub-space, code) of positions [start, end) in each sub-space -> (B, H, m, n) int64."""
    starts = torch.tensor([s for s, _ in index.segments], device=index.device)
    positions = torch.arange(start, end, device=index.device)
    segment = torch.bucketize(positions, starts, right=True) - 1  # (n,)
    m, C = index.codes.shape[2], index.C
    sub = torch.arange(m, device=index.device).view(1, 1, m, 1)
    return (segment.view(1, 1, 1, -1) * m + sub) * C + index.codes[..., start:end].long()


class ValueMeans:
    """The mean value of each cell of a layer's PQ index (see above), kept up to date as tokens arrive."""

    def __init__(self, index, host):
        B, H, D = host.B, host.H, host.D
        self.segments = index.segments  # the codebooks summed under (install() replaces the list)
        n_cells = len(index.segments) * index.codes.shape[2] * index.C
        self.sums = torch.zeros((B, H, n_cells, D), dtype=torch.float32, device=index.device)
        self.counts = torch.zeros((B, H, n_cells), dtype=torch.float32, device=index.device)
        self.done = 0  # positions summed
        self.index = index  # whose codes name each token's cells

    def update(self, index, host) -> None:
        """Sum the values of the positions stored since the last update into their cells."""
        self.index = index
        S = host.S
        if S <= self.done:
            return
        cells = token_cells(index, S, self.done)  # (B, H, m, n)
        real = host.valid[:, self.done : S].to(self.sums.device, torch.float32)[:, None, :]  # (B, 1, n)
        values = host.values(self.done, S, device=self.sums.device, dtype=torch.float32) * real[..., None]
        D = values.shape[-1]
        for j in range(cells.shape[2]):
            self.sums.scatter_add_(2, cells[:, :, j, :, None].expand(-1, -1, -1, D), values)
            self.counts.scatter_add_(2, cells[:, :, j], real.expand_as(cells[:, :, j]))
        self.done = S

    def filed_elsewhere(self, n: int) -> None:
        """The next n positions were summed into sums and counts by another implementation of update (the fused C
        step sums the token it files: native/pq_complete.c's file_value)."""
        self.done += n

    def means(self) -> torch.Tensor:
        """(B, H, P, D): each cell's mean value (0 for a cell no token fell in)."""
        return self.sums / self.counts.clamp(min=1)[..., None]

    def output(self, weights: torch.Tensor) -> torch.Tensor:
        """weights (B, H, S, R) of the stored tokens -> sum_t weights_t v~_t (B, H, R, D)."""
        cells = token_cells(self.index, weights.shape[2])  # (B, H, m, S)
        m, R = cells.shape[2], weights.shape[3]
        per_cell = torch.zeros((*self.counts.shape, R), dtype=weights.dtype, device=weights.device)  # (B, H, P, R)
        for j in range(m):
            per_cell.scatter_add_(2, cells[:, :, j, :, None].expand(-1, -1, -1, R), weights)
        return per_cell.transpose(-1, -2) @ self.means() / m

    def fused_operands(self, t: int) -> dict:
        """What native/pq_step.pq_step reads this summary as (its cells), for a step filing position t."""
        return {"cells": (self.sums[0], self.counts[0])}  # (H, m C, D), (H, m C)

    @property
    def nbytes(self) -> int:
        return (self.sums.numel() + self.counts.numel()) * 4


def value_means(state: dict, index, host) -> ValueMeans:
    """The layer's ValueMeans, made anew when the index's codebooks changed, summed up to the stored tokens."""
    kept = state.get(VALUE_MEANS)
    if kept is None or kept.segments is not index.segments:
        kept = state[VALUE_MEANS] = ValueMeans(index, host)
    kept.update(index, host)
    return kept


class ValueCodes:
    """The values' own PQ codes (config.value_codes sub-spaces; see above), kept up to date as tokens arrive."""

    def __init__(self, host, n_sub: int, iters: int, seed: int, end: int | None = None):
        """K-Means of the real values of positions [0, end) (None: every stored one) and their codes."""
        B, H, end = host.B, host.H, host.S if end is None else end
        self.n = n_sub
        values = host.values(0, end, device="cpu", dtype=torch.float32)  # (B, H, S, D)
        real = host.valid[:, :end].to("cpu")
        per_head = [
            pq.train_centroids(values[b, h, real[b]], n_sub, VALUE_CENTROIDS, iters, "l2", seed)
            for b in range(B)
            for h in range(H)
        ]
        self.centroids = torch.stack(per_head).view(B, H, *per_head[0].shape).to(host.device)  # (B, H, n, C, d)
        self.half_norms = pq.centroid_half_norms(self.centroids)  # (B, H, n, C): coding a value reads them
        self.codes = torch.zeros((B, H, n_sub, end), dtype=torch.uint8, device=host.device)  # room for S'' >= done
        self.done = 0  # positions coded
        self.update(host, end)

    def update(self, host, end: int | None = None) -> None:
        """Code the values of the positions stored since the last update (up to end; None: every stored one)."""
        end = host.S if end is None else end
        if end > self.done:
            self.reserve(end)
            values = host.values(self.done, end, device=self.centroids.device, dtype=torch.float32)
            self.codes[..., self.done : end] = pq.encode(values, self.centroids, "l2", self.half_norms)
            self.done = end

    @classmethod
    def of(cls, centroids: torch.Tensor, codes: torch.Tensor) -> ValueCodes:
        """Codes made before: centroids (B, H, n, C, d), the codes (B, H, n, S) of positions [0, S) (kept, not
        copied)."""
        new = cls.__new__(cls)
        new.n, new.centroids, new.codes, new.done = codes.shape[2], centroids, codes, codes.shape[-1]
        new.half_norms = pq.centroid_half_norms(centroids)
        return new

    def fork(self, S: int) -> ValueCodes:
        """A copy for a fork holding S of these positions: the centroids shared, the codes copied (small)."""
        return ValueCodes.of(self.centroids, self.codes[..., : min(S, self.done)].clone())

    def reserve(self, n: int) -> None:
        """Room for the codes of n positions (doubling: a decode step codes one)."""
        if n > self.codes.shape[-1]:
            grown = torch.zeros((*self.codes.shape[:3], max(n, 2 * self.codes.shape[-1])), dtype=torch.uint8)
            grown[..., : self.done] = self.codes[..., : self.done]
            self.codes = grown.to(self.codes.device)

    def filed_elsewhere(self, n: int) -> None:
        """The next n positions were coded by another implementation of update (the fused C step codes the value of
        the token it files: native/pq_complete.c's file_value)."""
        self.done += n

    def output(self, weights: torch.Tensor) -> torch.Tensor:
        """weights (B, H, S, R) of the stored tokens -> sum_t weights_t v~_t (B, H, R, D): per sub-space, the
        weight of each code times its centroid."""
        B, H, S, R = weights.shape
        n, C, d = self.centroids.shape[-3:]
        codes = self.codes[..., :S].long()[..., None].expand(-1, -1, -1, -1, R)  # (B, H, n, S, R)
        per_code = torch.zeros((B, H, n, C, R), dtype=weights.dtype, device=weights.device)
        per_code.scatter_add_(3, codes, weights[:, :, None].expand(-1, -1, n, -1, -1))
        out = per_code.transpose(-1, -2) @ self.centroids  # (B, H, n, R, d)
        return out.transpose(2, 3).reshape(B, H, R, n * d)

    def fused_operands(self, t: int) -> dict:
        """What native/pq_step.pq_step reads these codes as, for a step filing position t (room made for its
        codes)."""
        self.reserve(t + 1)
        return {"value_codes": (self.codes[0], self.centroids[0], self.half_norms[0])}  # (H, n, S''), .., (H, n, C)

    @property
    def nbytes(self) -> int:
        return self.codes[..., : self.done].numel() + self.centroids.numel() * 4


def value_summary(state: dict, index, host, config):
    """What completion reads the unselected tokens' values from: the index's ValueCodes where config.value_codes
    asks for them (trained here where the index has none of that size), else the layer's ValueMeans; either up to
    date with the stored tokens."""
    if not config.value_codes:
        return value_means(state, index, host)
    kept = index.value_codes
    if kept is None or kept.n != config.value_codes:
        kept = index.value_codes = ValueCodes(host, config.value_codes, index.iters_for(host.S), config.seed)
    kept.update(host)
    return kept


def unselected_part(scores: torch.Tensor, unselected: torch.Tensor, summary):
    """scores (B, H, S, R) the estimated scores, unselected (B, H, S) bool, summary the values' (value_summary)
    -> the unselected tokens' log-sum-exp (B, H, R) (-inf where none) and their estimated output (B, H, R, D):
    sum_t softmax_t(s~) v~_t over them (0 where none)."""
    hidden = ~unselected[..., None]
    lse = scores.masked_fill(hidden, float("-inf")).logsumexp(2)  # (B, H, R)
    weights = (scores - lse[:, :, None, :]).exp().masked_fill(hidden, 0.0)  # (B, H, S, R); 0 where lse is -inf
    return lse, summary.output(weights)


def merge(out: torch.Tensor, lse: torch.Tensor, part_out: torch.Tensor, part_lse: torch.Tensor) -> torch.Tensor:
    """Two parts of one softmax: out (B, H, R, D) normalised over its tokens whose log-sum-exp is lse (B, H, R),
    and another such part -> the attention over both. Rows where the other part is empty keep out as it is."""
    total = torch.logaddexp(lse, part_lse)
    merged = (lse - total).exp()[..., None] * out.float() + (part_lse - total).exp()[..., None] * part_out
    return torch.where(torch.isfinite(part_lse)[..., None], merged.to(out.dtype), out)
