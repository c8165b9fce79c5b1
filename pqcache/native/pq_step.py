"""A PQ layer's decode step for one token in one C call (pq_step.c): the selection and attention, then the new token
filed; and the filing alone (pq_append). Tensors in, tensors out; layer/fused.py decides when to use them."""

from __future__ import annotations

import ctypes

import torch

from pqcache import native
from pqcache.native.select import MODES


class _Index(ctypes.Structure):
    """pq_step.h's Index: a layer's centroids (Hk, m, C, d), codes and residuals, by address."""

    _fields_ = [("centroids", ctypes.c_void_p), ("codes", ctypes.c_void_p), ("residuals", ctypes.c_void_p)]
    _fields_ += [(name, ctypes.c_int64) for name in ("m", "C", "code_head", "code_sub", "residual_head")]


class _Values(ctypes.Structure):
    """pq_step.h's Values: what completion reads the values left out from (a PQ cell's sums and counts, or the
    values' own codes and centroids), by address."""

    _fields_ = [(name, ctypes.c_void_p) for name in ("sums", "counts", "codes", "centroids", "half_norm")]
    _fields_ += [(name, ctypes.c_int64) for name in ("n", "C", "code_head", "code_sub")]


class _Stores(ctypes.Structure):
    """pq_step.c's Stores: the host tier's key and value rows, a fork's parent part and its own, by address."""

    _fields_ = [(name, ctypes.c_void_p) for name in ("shared_k", "shared_v", "own_k", "own_v")]
    _fields_ += [(name, ctypes.c_int64) for name in ("shared_head", "own_head", "S0", "kind")]


class _Token(ctypes.Structure):
    """pq_step.h's Token: where a decode step's new token goes, by address."""

    _fields_ = [(name, ctypes.c_void_p) for name in ("own_k", "own_v", "ring_k", "ring_v", "valid", "searchable")]
    _fields_ += [("slot_pos", ctypes.c_void_p), ("joint", ctypes.c_void_p)]
    _fields_ += [(name, ctypes.c_int64) for name in ("own_head", "own_kind", "ring_head", "ring_kind", "joint_head")]


def pq_step(
    q,
    scaling: float,
    index: tuple,
    cand,
    counts: tuple,
    mode: str,
    stores: tuple,
    window: tuple,
    token=None,
    cells=None,
    row_scale=None,
    mass=None,
    value_codes=None,
):
    """A PQ layer's selection and attention for one token in one C call: pq_top's search for `wide` candidates, the
    re-rank's exact scores and combined_top's k picks (counts = (k, wide)), then attend_picks, with the same kernels
    (native/select.py); where token is given, the new token is then filed as pq_append files it.

    q (Hq, D) float32, the query rows unscaled. index: (centroids (Hk, m, C, d) float32, codes (Hk, m, S') uint8,
    joint (Hk, S') int32 or None). cand (n,) bool: the candidates among tokens 0..n-1, at least `wide` of them, and
    k < wide. stores: (shared_k, shared_v, S0, own_k, own_v), the host tier's rows (Hk, rows, D) of one kind of
    native.KV_KINDS (shared None when not a fork, own None when the tier has none yet). window: (keys, values, n,
    k_new, v_new): the window's buffer (Hk, N, D) of one kind, its first n slots attended, the last of them the new
    token's, written here from k_new, v_new (Hk, D) float32 -> the picks' positions (Hk, k) in position order and
    the output (1, Hq * D). cells: (sums (Hk, m C, D), counts (Hk, m C)) float32 and contiguous, each PQ cell's
    values summed and how many (engine/completion.ValueMeans), or None: with them the candidates not picked are
    estimated and merged into the output (completion), and a token filed here is summed into its cells in place.
    value_codes: (codes (Hk, n, S'') uint8, centroids (Hk, n, C, D/n), their half norms (Hk, n, C) float32), the
    values' own PQ codes
    (engine/completion.ValueCodes), instead of cells: the same, each value read as its codes give it, and a token
    filed here has its value's codes written at its position (S'' past it).
    row_scale (Hq,) float32, or None: the search ranks each token by its PQ score + row_scale x its residual
    (methods/pqcache.spreads; index's residuals (Hk, S') float32). mass: (target, floor) a budget in mass (the
    fewest picks whose estimated share reaches target, at least floor: methods/estimate.estimate_and_cut), or None
    -> (pos, out, kept): kept (Hk, k) bool, the picks attended (all of them without a budget in mass)."""
    k, wide = counts
    shared_k, shared_v, S0, own_k, own_v = stores
    keys, values, n_slots, k_new, v_new = window
    Hq, D = q.shape
    Hk = keys.shape[0]
    parts = [t for t in (shared_k, shared_v, own_k, own_v) if t is not None]
    kind = parts[0].dtype
    if any(t.dtype != kind or t.stride()[1:] != (D, 1) for t in parts) or keys.stride() != values.stride():
        raise ValueError("pq_step: the stores' rows must be of one kind, the window's keys and values alike")
    if keys.dtype not in native.KV_KINDS or keys.stride(2) != 1 or not 0 < n_slots <= keys.shape[1]:
        raise ValueError(f"pq_step: a window of {keys.dtype} {tuple(keys.shape)}, {n_slots} slots attended")
    codes = index[1]
    stored = S0 + (0 if own_k is None else own_k.shape[1])
    if not 0 < k < wide <= cand.shape[0] <= min(codes.shape[-1], stored) or q.dtype != torch.float32:
        raise ValueError(f"pq_step: k {k}, wide {wide}, {cand.shape[0]} tokens, q {q.dtype}")
    P = index[0].shape[1] * index[0].shape[2]  # m C: the key cells
    V = _values(cells, value_codes, (Hk, P, D), Hq, 0 if token is None else token[1])
    X, keep = _index(index, D)
    q, cand, new = q.contiguous(), cand.contiguous(), _rows(k_new, v_new, Hk, D)
    if row_scale is not None:
        row_scale = row_scale.float().contiguous()
        if row_scale.shape != (Hq,) or index[3] is None:
            raise ValueError(f"pq_step: a margin of {tuple(row_scale.shape)} for {Hq} query rows, or no residuals")

    def address(t):
        return 0 if t is None else t.data_ptr()

    heads = [t.stride(0) if t is not None else 0 for t in (shared_k, shared_v, own_k, own_v)]
    if heads[0] != heads[1] or heads[2] != heads[3]:
        raise ValueError("pq_step: keys and values of a store must lie alike")
    S = _Stores(*map(address, (shared_k, shared_v, own_k, own_v)), heads[0], heads[2], S0, native.KV_KINDS[kind])
    T, norms, t = _token(token, index, Hk, D) if token is not None else (None, None, 0)
    pos = torch.empty((Hk, k), dtype=torch.int64)
    out = torch.empty(1, Hq * D)
    kept = torch.ones((Hk, k), dtype=torch.bool)
    target, floor = (0.0, 0) if mass is None else mass
    if mass is not None and Hq // Hk > 64:
        raise ValueError(f"pq_step: a budget in mass takes at most 64 query rows a KV head, not {Hq // Hk}")
    args = (q.data_ptr(), Hq, Hk, D, scaling, ctypes.byref(X), cand.data_ptr(), cand.shape[0], MODES[mode], wide, k)
    args += (
        address(row_scale),
        ctypes.byref(S),
        keys.data_ptr(),
        values.data_ptr(),
        native.KV_KINDS[keys.dtype],
        keys.stride(0),
        n_slots,
    )
    args += (pos.data_ptr(), out.data_ptr(), new[0].data_ptr(), new[1].data_ptr(), address(norms), t)
    args += (None if T is None else ctypes.byref(T), None if V is None else ctypes.byref(V), target, floor)
    args += (kept.data_ptr(),)
    if native.library().pq_step(*args):
        raise MemoryError("pq_step: no scratch memory")
    del keep  # the centroids the C call read (a copy where they were not contiguous)
    return pos, out, kept


def pq_append(new: tuple, index: tuple, token: tuple):
    """A decode step's new token filed in one C call, as layer/onerow.py's _append files it: new = (k, v) (Hk, D)
    float32; index as pq_step's; token: (half_norm, t, rows, flags): half_norm (Hk, m, C) float32 of the centroids
    (None: the inner-product metric), the codes (and the residual, where index has residuals) written at position
    t; rows (own_k, own_v, ring_k, ring_v): the (Hk, D) rows the token's key and value go to, views of the host tier's
    own store and of the window's ring slot, each of one kind of native.KV_KINDS (keys and values alike); flags
    (valid, searchable, slot_pos): one-element views set to True, True and t."""
    Hk, D = new[0].shape
    X, keep = _index(index, D)
    k, v = _rows(*new, Hk, D)
    T, norms, t = _token(token, index, Hk, D)
    address = 0 if norms is None else norms.data_ptr()
    native.library().pq_append(k.data_ptr(), v.data_ptr(), Hk, D, ctypes.byref(X), address, t, ctypes.byref(T))
    del keep


def _values(cells, value_codes, shape: tuple, Hq: int, t: int):
    """pq_step's cells or value_codes (at most one), for (Hk KV heads, P key cells, rows of D) -> the C Values, or
    None."""
    if cells is None and value_codes is None:
        return None
    Hk, P, D = shape
    if Hq // Hk > 64 or (cells is not None and value_codes is not None):
        raise ValueError("pq_step: completion takes at most 64 query rows a KV head, and cells or codes, not both")
    if cells is not None:
        sums, counts = cells
        alike = sums.shape == (Hk, P, D) and counts.shape == (Hk, P) and sums.is_contiguous() and counts.is_contiguous()
        if not alike or {sums.dtype, counts.dtype} != {torch.float32}:
            raise ValueError(f"pq_step: cells {tuple(sums.shape)}, {tuple(counts.shape)}: not ({Hk}, {P}, {D}) float32")
        return _Values(sums.data_ptr(), counts.data_ptr(), 0, 0, 0, 0, 0, 0, 0)
    codes, centroids, half_norm = value_codes
    _, n, C, d = centroids.shape
    if (
        codes.dtype != torch.uint8
        or codes.stride(-1) != 1
        or codes.shape[:2] != (Hk, n)
        or not t < codes.shape[-1]
        or centroids.dtype != torch.float32
        or not centroids.is_contiguous()
        or centroids.shape[0] != Hk
        or half_norm.shape != centroids.shape[:3]
        or half_norm.dtype != torch.float32
        or not half_norm.is_contiguous()
        or n * d != D
        or C > 256
    ):
        shapes = f"{tuple(codes.shape)}, centroids {tuple(centroids.shape)}"
        raise ValueError(f"pq_step: value codes {shapes} for {Hk} heads of {D}")
    addresses = (codes.data_ptr(), centroids.data_ptr(), half_norm.data_ptr())
    return _Values(0, 0, *addresses, n, C, codes.stride(0), codes.stride(1))


def _index(index: tuple, D: int):
    """(centroids, codes, joint, residuals or None) -> the C Index and the tensors it points into (kept alive by the
    caller)."""
    centroids, codes, _, residuals = index
    if codes.dtype != torch.uint8 or codes.stride(-1) != 1 or centroids.dtype != torch.float32:
        raise ValueError(f"pq_step: codes {codes.dtype}, centroids {centroids.dtype}")
    centroids = centroids.contiguous()
    _, m, C, d = centroids.shape
    if m * d != D or codes.shape[:2] != (centroids.shape[0], m):
        raise ValueError(f"pq_step: centroids {tuple(centroids.shape)}, codes {tuple(codes.shape)} for rows of {D}")
    if residuals is not None and (
        residuals.dtype != torch.float32 or residuals.stride(-1) != 1 or residuals.shape[0] != codes.shape[0]
    ):
        raise ValueError(f"pq_step: residuals {residuals.dtype} {tuple(residuals.shape)}")
    residual_ptr, residual_head = (0, 0) if residuals is None else (residuals.data_ptr(), residuals.stride(0))
    X = _Index(
        centroids.data_ptr(), codes.data_ptr(), residual_ptr, m, C, codes.stride(0), codes.stride(1), residual_head
    )
    return X, centroids


def _rows(k, v, Hk: int, D: int):
    if k.shape != (Hk, D) or v.shape != (Hk, D):
        raise ValueError(f"pq_step: a new token of {tuple(k.shape)}, {tuple(v.shape)}, not ({Hk}, {D})")
    return k.float().contiguous(), v.float().contiguous()


def _token(token: tuple, index: tuple, Hk: int, D: int):
    """pq_append's token tuple -> the C Token, the half norms (contiguous: the caller keeps them alive) and t."""
    half_norm, t, rows, flags = token
    codes, joint = index[1], index[2]
    own_k, own_v, ring_k, ring_v = rows
    valid, searchable, slot_pos = flags
    for a, b in ((own_k, own_v), (ring_k, ring_v)):
        if a.dtype != b.dtype or a.dtype not in native.KV_KINDS or a.stride() != b.stride() or a.shape != (Hk, D):
            raise ValueError("pq_append: each store's key and value rows (Hk, D) of one kind, lying alike")
        if a.stride(1) != 1:
            raise ValueError("pq_append: rows of D elements")
    if not t < codes.shape[-1] or (valid.dtype, searchable.dtype, slot_pos.dtype) != (torch.bool,) * 2 + (torch.int64,):
        raise ValueError(f"pq_append: position {t} of {codes.shape[-1]} coded; flags (bool, bool, int64)")
    if joint is not None and (joint.dtype != torch.int32 or joint.stride(-1) != 1 or not t < joint.shape[-1]):
        raise ValueError(f"pq_append: a joint index of {joint.dtype}, {tuple(joint.shape)}")
    residuals = index[3]
    if residuals is not None and not t < residuals.shape[-1]:
        raise ValueError(f"pq_append: position {t} of {residuals.shape[-1]} residuals")
    if half_norm is not None:
        half_norm = half_norm.contiguous()
    T = _Token(*(x.data_ptr() for x in (own_k, own_v, ring_k, ring_v, valid, searchable, slot_pos)))
    T.joint, T.joint_head = (0, 0) if joint is None else (joint.data_ptr(), joint.stride(0))
    T.own_head, T.own_kind = own_k.stride(0), native.KV_KINDS[own_k.dtype]
    T.ring_head, T.ring_kind = ring_k.stride(0), native.KV_KINDS[ring_k.dtype]
    return T, half_norm, t
