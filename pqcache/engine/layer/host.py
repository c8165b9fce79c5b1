"""The host tier: every token's K and V by position, in host memory (pinned on CUDA), with its flags.

A fork of a prefilled cache (one per question in the app) shares the parent's tokens read-only and
stores only the tokens it appends itself, so a question costs its own tokens, not a copy of the
document. Readers never see the two parts: `keys(start, end)` and `rows(bh, pos)` read across them.

The rows are kept in the storage dtype (PQCacheConfig.kv_dtype: float16 on a CPU by default, half the bytes of
the model's float32) and read in the compute dtype (the model's): `keys`, `values`, `rows` and `gather` widen them,
and the native kernels (key_scores, value_sums, onerow's attend_picks) widen each row as they read it in place.

Shapes: B rows, H KV heads, D head_dim, cap positions of storage; positions are padded positions
shared by the batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pqcache import native
from pqcache.engine.hugepages import huge_empty


class HostTier:
    def __init__(self, B: int, H: int, D: int, dtype: torch.dtype, device: torch.device, compute_dtype=None):
        """dtype: the rows' storage, compute_dtype what readers get (None: dtype); device: the compute device."""
        self.B, self.H, self.D, self.dtype, self.device = B, H, D, dtype, device
        self.compute_dtype = compute_dtype or dtype
        self.host = torch.device("cpu")
        self.pin = device.type == "cuda"
        self.S = 0  # positions stored
        self.cap = 0  # positions the flags can hold
        # shared, read-only prefix of a fork: full (B, H, cap_shared, D) storage and its length
        self.shared_k = self.shared_v = None
        self.S0 = 0
        self.own_k = self.own_v = None  # (B, H, own_cap, D): positions S0.. of this tier
        self.valid = torch.zeros((B, 0), dtype=torch.bool, device=device)  # real (not padding) tokens
        self.searchable = torch.zeros((B, 0), dtype=torch.bool, device=device)  # real and not a sink
        self.ready = None  # CUDA event of the last copy to the host

    # ---- storage ---------------------------------------------------------------------------------
    def reserve(self, n: int):
        """Room for n positions (headroom included, so decoding appends without copying)."""
        own_need = n - self.S0
        own_cap = 0 if self.own_k is None else self.own_k.shape[2]
        if own_need > own_cap:
            cap = max(own_need + own_need // 4 + 256, 2 * own_cap)
            shape = (self.B, self.H, cap, self.D)
            k, v = _new_store(shape, self.dtype, self.pin), _new_store(shape, self.dtype, self.pin)
            if own_cap:
                k[:, :, : self.S - self.S0] = self.own_k[:, :, : self.S - self.S0]
                v[:, :, : self.S - self.S0] = self.own_v[:, :, : self.S - self.S0]
            self.own_k, self.own_v = k, v
        if n > self.cap:
            cap = self.S0 + self.own_k.shape[2]
            self.valid = _grow(self.valid, cap, self.S)
            self.searchable = _grow(self.searchable, cap, self.S)
            self.cap = cap

    def append(self, k: torch.Tensor, v: torch.Tensor) -> int:
        """k, v (B, H, Q, D) on the device -> stored at positions S..S+Q-1; returns the start."""
        Q, start = k.shape[2], self.S
        self.reserve(start + Q)
        lo = start - self.S0
        self.own_k[:, :, lo : lo + Q].copy_(k, non_blocking=True)
        self.own_v[:, :, lo : lo + Q].copy_(v, non_blocking=True)
        self.S += Q
        if self.pin:  # the host reads these later (K-Means, gathers): remember when the copy lands
            self.ready = torch.cuda.Event()
            self.ready.record()
        return start

    def sync(self):
        """Wait for the copies to the host (CUDA); no-op on CPU."""
        if self.ready is not None:
            self.ready.synchronize()

    # ---- reading ---------------------------------------------------------------------------------
    def keys(self, start: int = 0, end: int | None = None, device=None, dtype=None) -> torch.Tensor:
        """Keys of positions [start, end) -> (B, H, n, D) in dtype (None: the compute dtype; a view when no copy is
        needed)."""
        return self._slice(self.shared_k, self.own_k, start, end, device, dtype)

    def values(self, start: int = 0, end: int | None = None, device=None, dtype=None) -> torch.Tensor:
        return self._slice(self.shared_v, self.own_v, start, end, device, dtype)

    def _slice(self, shared, own, start, end, device, dtype):
        end = self.S if end is None else end
        self.sync()
        if end <= self.S0:
            out = shared[:, :, start:end]
        elif start >= self.S0:
            out = own[:, :, start - self.S0 : end - self.S0]
        else:
            out = torch.cat([shared[:, :, start : self.S0], own[:, :, : end - self.S0]], dim=2)
        return out.to(device or out.device, dtype or self.compute_dtype)

    def rows(self, bh: torch.Tensor, pos: torch.Tensor, keys: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of (row * H + head, position) pairs: bh, pos (n,) on the host -> (n, D) each in the compute dtype
        (K None when keys=False)."""
        k = self._rows(self.shared_k, self.own_k, bh, pos) if keys else None
        return k, self._rows(self.shared_v, self.own_v, bh, pos)

    def key_rows(self, bh: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """K alone of (row * H + head, position) pairs -> (n, D) (exact scores need no values)."""
        return self._rows(self.shared_k, self.own_k, bh, pos)

    def _rows(self, shared, own, bh, pos):
        self.sync()
        if self.S0 == 0:
            return _take(own, bh, pos).to(self.compute_dtype)
        out = torch.empty((bh.numel(), self.D), dtype=self.compute_dtype)
        for idx, store, local in self._parts(shared, own, pos):
            out[idx] = _take(store, bh[idx], local).to(self.compute_dtype)
        return out

    def _parts(self, shared, own, pos: torch.Tensor):
        """pos (n,) -> (idx, store, positions in that store) for each part of the tier that pos reaches: the
        shared prefix of a fork (positions < S0) and this tier's own tokens. All of them in the prefix (an answer's
        picks, until it outgrows its window): one part, indexed by a slice (no index tensors, a few ops fewer)."""
        if pos.numel() and int(pos.max()) < self.S0:
            yield slice(None), shared, pos
            return
        old = pos < self.S0
        for part, store, offset in ((old, shared, 0), (~old, own, self.S0)):
            idx = part.nonzero().squeeze(1)
            if idx.numel():
                yield idx, store, pos[idx] - offset

    def query_scores(self, q: torch.Tensor) -> torch.Tensor:
        """q (B, H, R, D) scaled queries -> float32 exact scores over every stored key (B, H, R, S), on q's device.
        Where q is on the host, each part of the tier is read where it lies (a fork's keys are not copied into one
        tensor first); elsewhere the keys are copied to q's device."""
        from pqcache.engine.layer.attention import query_key_dots

        self.sync()
        if q.device != self.host:
            return query_key_dots(q.float(), self.keys(0, self.S, q.device, torch.float32))
        parts = [self.shared_k[:, :, : self.S0]] if self.S0 else []
        parts += [self.own_k[:, :, : self.S - self.S0]] if self.S > self.S0 else []
        scores = [query_key_dots(q.to(self.compute_dtype), part.to(self.compute_dtype)).float() for part in parts]
        return scores[0] if len(scores) == 1 else torch.cat(scores, -1)

    @property
    def reads_in_place(self) -> bool:
        """Whether key_scores and value_sums read rows where they lie: float32 compute over rows of a kind the native
        kernels read (float32, float16, bfloat16), and those kernels built."""
        return self.dtype in native.KV_KINDS and self.compute_dtype == torch.float32 and native.library() is not None

    def value_stores(self) -> tuple[torch.Tensor | None, int, torch.Tensor]:
        """(shared, S0, own): the value rows (B, H, rows, D) of a fork's parent part (None when not a fork) and of
        this tier's own tokens (position S0 + i at row i), for kernels that read the values where they lie."""
        self.sync()
        return (self.shared_v if self.S0 else None), self.S0, self.own_v

    def key_scores(self, pos: torch.Tensor, q: torch.Tensor) -> torch.Tensor | None:
        """pos (B, H, k) positions on the host, q (B, H, R, D) -> exact scores (B, H, k, R) = K[pos] . q, each key
        read where it lies (native.gather_dot: no gathered copy), or None where that kernel is not there or the
        compute is not float32 (the caller gathers and multiplies)."""
        if not self.reads_in_place:
            return None
        self.sync()
        B, H, k = pos.shape
        out = torch.empty((B, H, k, q.shape[2]))
        q = q.to(self.host, torch.float32)
        for b in range(B):
            for h in range(H):
                if self.S0 == 0:  # one part: the scores land in place, no index
                    out[b, h] = native.gather_dot(self.own_k[b, h], pos[b, h], q[b, h])
                    continue
                for idx, store, local in self._parts(self.shared_k, self.own_k, pos[b, h]):
                    out[b, h, idx] = native.gather_dot(store[b, h], local, q[b, h])
        return out

    def value_sums(self, pos: torch.Tensor, p: torch.Tensor) -> torch.Tensor | None:
        """pos (B, H, k) positions on the host, p (B, H, k, R) weights -> (B, H, R, D) = p^T V[pos], each value
        read where it lies (native.gather_weighted_sum), or None where that kernel is not there or the compute is
        not float32 (the caller gathers them)."""
        if not self.reads_in_place:
            return None
        self.sync()
        B, H, k = pos.shape
        out = torch.zeros((B, H, p.shape[3], self.D))
        p = p.to(self.host, torch.float32)
        for b in range(B):
            for h in range(H):
                if self.S0 == 0:
                    out[b, h] = native.gather_weighted_sum(self.own_v[b, h], pos[b, h], p[b, h])
                    continue
                for idx, store, local in self._parts(self.shared_v, self.own_v, pos[b, h]):
                    out[b, h] += native.gather_weighted_sum(store[b, h], local, p[b, h, idx])
        return out

    def gather(self, pos: torch.Tensor, device=None) -> tuple[torch.Tensor, torch.Tensor]:
        """pos (B, n) -> K, V (B, H, n, D): the same positions for every head of a row."""
        B, H, n = self.B, self.H, pos.shape[1]
        pos = pos.to(self.host)
        bh = torch.arange(B * H).view(B, H, 1).expand(B, H, n).reshape(-1)
        flat = pos[:, None, :].expand(B, H, n).reshape(-1)
        k, v = self.rows(bh, flat)
        device = device or self.device
        return k.view(B, H, n, self.D).to(device), v.view(B, H, n, self.D).to(device)

    # ---- forks -----------------------------------------------------------------------------------
    def fork(self) -> HostTier:
        """A tier that reads this one's tokens without copying them and appends its own."""
        new = HostTier(self.B, self.H, self.D, self.dtype, self.device, self.compute_dtype)
        if self.S0 == 0 and self.own_k is not None:
            new.shared_k, new.shared_v = self.own_k, self.own_v
        elif self.S:  # a fork of a fork: its two parts become one shared copy (in the storage dtype)
            new.shared_k = self.keys(0, self.S, dtype=self.dtype).contiguous()
            new.shared_v = self.values(0, self.S, dtype=self.dtype).contiguous()
        new.S0 = new.S = self.S
        new.cap = self.S
        new.valid = self.valid[:, : self.S].clone()
        new.searchable = self.searchable[:, : self.S].clone()
        return new

    @property
    def own_bytes(self) -> int:
        """Bytes this tier holds itself (a fork's shared prefix belongs to its parent)."""
        return 2 * self.B * self.H * (self.S - self.S0) * self.D * self.dtype.itemsize


def _new_store(shape: tuple, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """Host memory for keys or values: page-locked for copies to a GPU; elsewhere on huge pages where it is large
    enough (engine/hugepages.py: a CPU decode step reads scattered rows of it, a TLB miss a row spared)."""
    return torch.empty(shape, dtype=dtype, device="cpu", pin_memory=True) if pin else huge_empty(shape, dtype)


def _grow(flags: torch.Tensor, cap: int, n: int) -> torch.Tensor:
    new = torch.zeros((flags.shape[0], cap), dtype=flags.dtype, device=flags.device)
    new[:, :n] = flags[:, :n]
    return new


def _take(store: torch.Tensor, bh: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """(B, H, cap, D) storage, flat (row * H + head) and positions (n,) -> (n, D)."""
    D, cap = store.shape[3], store.shape[2]
    # embedding's row gather: 15-40% faster than index_select here (6.5K rows of 32K, cold and warm; ad hoc)
    return F.embedding(bh * cap + pos, store.view(-1, D))
