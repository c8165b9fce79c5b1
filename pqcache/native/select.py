"""PQCache's selection in C (pq_select.c): the PQ search's scores, combine and top-k in one call per (row, KV head),
and the re-rank's combine and top-k; and the attention over what it selected (layer_step.c's attend_picks). Tensors
in, tensors out; methods/pqcache.py and layer/onerow.py decide when to use them.

Both return what methods/base.select_top and topk_positions return, (B, H, k_max) positions and their validity,
with the same picks up to float rounding of the combine (pq_select.c says how): row b takes min(ks[b], k_max) picks
in position order, the rest of its k_max slots are position 0 and not valid."""

from __future__ import annotations

import torch

from pqcache import native

MODES = {"softmax_sum": 0, "sum": 1}
MAX_ROWS = 16  # query rows per KV head the kernel combines (pq_select.c's MAX_ROWS)


def usable(operand: torch.Tensor, rows: int) -> bool:
    """Whether the kernels take this operand (the centroids, or the re-rank's exact scores) for `rows` query rows per
    KV head: the library built, float32 on the CPU, at most MAX_ROWS rows."""
    return (
        native.library() is not None
        and operand.device.type == "cpu"
        and operand.dtype == torch.float32
        and rows <= MAX_ROWS
    )


def pq_top(
    tables: torch.Tensor,
    codes: torch.Tensor,
    cand: torch.Tensor,
    ks: list[int],
    k_max: int,
    mode: str,
    widened: tuple | None = None,
):
    """tables (B, H, m, C, R) float32, codes (B, H, m, S') uint8 (tokens 0..n-1 scored), cand (B, n) bool ->
    positions (B, H, k_max) and validity (B, H, k_max): picks among the candidates; a row with fewer candidates
    than its k also takes the earliest others, not valid (as select_top does). widened: (row_scale (B, H, R),
    residuals (B, H, S')) float32, the scores raised by row_scale[r] x residuals[t] (methods/pqcache.spreads), or
    None."""
    B, H, m, C, R = tables.shape
    n = cand.shape[1]
    if codes.stride(-1) != 1 or codes.dtype != torch.uint8 or codes.shape[-1] < n:
        raise ValueError(f"pq_top: codes {tuple(codes.shape)} {codes.dtype} for {n} tokens")
    tables, cand, lib = tables.contiguous(), cand.contiguous(), native.library()
    row_scale, residuals = (None, None) if widened is None else _widened(widened, B, H, R, n)

    def kernel(b: int, h: int, k: int, out: int) -> int:
        row = codes[b, h]  # (m, S'): sub-space j's codes at row.stride(0) * j
        args = (tables[b, h].data_ptr(), m, C, R, row.data_ptr(), row.stride(0), n, cand[b].data_ptr())
        margin = (None, None) if widened is None else (row_scale[b, h].data_ptr(), residuals[b, h].data_ptr())
        return lib.pq_search(*args, MODES[mode], k, *margin, out)

    top, in_rank = _each_row(B, H, ks, k_max, n, kernel, "pq_search")
    return top, in_rank & torch.gather(cand[:, None, :].expand(B, H, n), 2, top)


def _widened(widened: tuple, B: int, H: int, R: int, n: int) -> tuple:
    """pq_top's margin operands, checked, as the kernel reads them: float32 rows with unit stride."""
    row_scale, residuals = widened
    row_scale = row_scale.float().contiguous()
    if row_scale.shape != (B, H, R) or residuals.shape[:2] != (B, H) or residuals.shape[2] < n:
        raise ValueError(f"pq_top: a margin of {tuple(row_scale.shape)}, {tuple(residuals.shape)} for {n} tokens")
    if residuals.dtype != torch.float32 or residuals.stride(-1) != 1:
        raise ValueError(f"pq_top: residuals {residuals.dtype} with stride {residuals.stride(-1)}")
    return row_scale, residuals


def tables(q: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """q (B, H, R, D) float32, centroids (B, H, m, C, d) float32 (m d = D) -> lookup tables (B, H, m, C, R), as
    pq.lookup_tables computes them, within float32 rounding (pq_codes.c)."""
    B, H, R, D = q.shape
    m, C, d = centroids.shape[-3:]
    q, centroids, lib = q.contiguous(), centroids.contiguous(), native.library()
    out = torch.empty((B, H, m, C, R))
    for b in range(B):
        for h in range(H):
            lib.pq_tables(q[b, h].data_ptr(), R, centroids[b, h].data_ptr(), m, C, d, out[b, h].data_ptr())
    return out


def encode_one(
    key: torch.Tensor,
    centroids: torch.Tensor,
    half_norm: torch.Tensor | None,
    codes: torch.Tensor,
    residuals: torch.Tensor | None = None,
):
    """key (B, H, 1, D) float32, centroids (B, H, m, C, d) float32, half_norm (B, H, m, C) float32 (None: the
    inner-product metric) -> codes[b, h, :] (the (B, H, m) view given, uint8) = the key's nearest centroids, as
    pq.encode picks them, within float32 rounding (pq_codes.c); and where residuals (B, H) float32 is given,
    residuals[b, h] = ||key - its codes' centroids||."""
    B, H, _, D = key.shape
    m, C, d = centroids.shape[-3:]
    key, centroids, lib = key.contiguous(), centroids.contiguous(), native.library()
    half_norm = None if half_norm is None else half_norm.contiguous()
    for b in range(B):
        for h in range(H):
            norms = 0 if half_norm is None else half_norm[b, h].data_ptr()
            args = (key[b, h].data_ptr(), centroids[b, h].data_ptr(), norms, m, C, d)
            residual = 0 if residuals is None else residuals[b, h].data_ptr()
            lib.pq_encode(*args, codes[b, h].data_ptr(), codes.stride(2), residual)
    return codes


def combined_top(scores: torch.Tensor, valid: torch.Tensor, ks: list[int], k_max: int, mode: str):
    """scores (B, H, n, R) float32, valid (B, H, n) bool -> indices along n (B, H, k_max) and whether each is in
    its row's k (topk_positions of combine_rows(scores, valid, mode)); the caller checks what they point at."""
    B, H, n, R = scores.shape
    scores, valid, lib = scores.contiguous(), valid.contiguous(), native.library()

    def kernel(b: int, h: int, k: int, out: int) -> int:
        return lib.combine_top(scores[b, h].data_ptr(), n, R, valid[b, h].data_ptr(), MODES[mode], k, out)

    return _each_row(B, H, ks, k_max, n, kernel, "combine_top")


def _each_row(B: int, H: int, ks: list[int], k_max: int, n: int, kernel, name: str):
    """kernel(b, h, k, out) writes k = min(ks[b], k_max, n) positions of (row b, KV head h) at the address out ->
    positions (B, H, k_max) (position 0 after a row's k) and whether each is among its row's k."""
    top = torch.zeros((B, H, k_max), dtype=torch.int64)
    in_rank = torch.zeros((B, H, k_max), dtype=torch.bool)
    for b in range(B):
        k = min(ks[b], k_max, n)
        for h in range(H):
            if kernel(b, h, k, top[b, h].data_ptr()):
                raise MemoryError(f"{name}: no memory for its working space")
        in_rank[b, :, :k] = True
    return top, in_rank


def attend_picks(q, keys, values, n: int, scaling: float, picks, stores, weights: bool = False):
    """One token's attention over a PQ layer's first n buffer slots and its picks, in one softmax.

    q (Hq, D) float32; keys, values (1, Hk, N, D) of one kind of native.KV_KINDS with rows of D elements (the
    layer's device window, at the host tier's dtype on a CPU): slots 0..n-1 attended.
    picks: pos (Hk, k) int64 host positions, valid (Hk, k) bool, scores (Hk, k, G) their scaled
    exact scores (the re-rank's). stores: (shared, S0, own), the host tier's value rows (1, Hk, rows, D) of a fork's
    parent (None when not a fork: S0 = 0) and its own (None when it has none yet), float32, float16 or bfloat16
    (both of one kind), read where they lie ->
    (1, Hq * D); with weights=True also (Hk, n + k): the attention each slot and pick received, summed over the query
    heads of its KV head."""
    pos, valid, scores = picks
    shared, S0, own = stores
    Hq, D = q.shape
    Hk, k = pos.shape
    stores_ = [t for t in (own, shared) if t is not None]
    kind = stores_[0].dtype if stores_ else torch.float32
    rows = [(t, keys.dtype) for t in (keys, values)] + [(t, kind) for t in stores_]
    if any(t.dtype != dtype or t.stride()[2:] != (D, 1) for t, dtype in rows) or values.stride() != keys.stride():
        raise ValueError("attend_picks: keys and values must be rows of D elements of one kind, the stores too")
    if kind not in native.KV_KINDS or keys.dtype not in native.KV_KINDS:
        raise ValueError(f"attend_picks: keys of {keys.dtype}, stores of {kind}: not read in place")
    stored = S0 + (0 if own is None else own.shape[2])  # a fork that has stored nothing of its own: own is None
    if k and int(pos.max()) >= stored:
        raise IndexError(f"attend_picks: position {int(pos.max())} outside {stored} stored")
    q, pos, valid = q.contiguous(), pos.contiguous(), valid.contiguous()
    scores = scores.to(torch.float32).contiguous()
    out = torch.empty(1, Hq * D)
    received = torch.empty(Hk, n + k) if weights else None
    args = (q.data_ptr(), Hq, keys.data_ptr(), values.data_ptr(), native.KV_KINDS[keys.dtype], Hk, keys.stride(1))
    args += (n, D, scaling, k)
    args += (scores.data_ptr(), valid.data_ptr(), pos.data_ptr())
    args += (0, 0, 0) if shared is None else (shared.data_ptr(), shared.stride(1), S0)
    args += (0, 0) if own is None else (own.data_ptr(), own.stride(1))
    args += (native.KV_KINDS[kind], out.data_ptr(), 0 if received is None else received.data_ptr())
    if native.library().attend_picks(*args):
        raise MemoryError("attend_picks: no scratch memory")
    return (out, received) if weights else out
