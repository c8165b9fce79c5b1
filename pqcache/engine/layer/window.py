"""The device window: what one step of a layer attends to, in one preallocated device buffer

    [ sinks | local-window ring | fetched top-k | new tokens ]

so a step writes the fetched tokens and the new tokens in place and attends to a prefix. The ring
holds the last L positions (slot = position % L); the top-k part is filled by `fetch`, from the
block cache (hot blocks kept on the device, blockcache.py) where it can and from the host otherwise.

Shapes: B rows, H KV heads, D head_dim, k fetched tokens, Q new tokens, N = n_init + L + k + Q.
"""

from __future__ import annotations

import torch

from pqcache.engine.config import PQCacheConfig
from pqcache.engine.layer.blockcache import BlockCache, holds_copies
from pqcache.engine.layer.host import HostTier


def buffer_dtype(kv_dtype: torch.dtype, compute_dtype: torch.dtype, device) -> torch.dtype:
    """The buffer's rows: on a CPU the tiers are one memory and the buffer holds copies of host rows, kept at their
    dtype (half the bytes with float16 KV; readers widen); elsewhere the compute dtype attention reads."""
    return kv_dtype if getattr(device, "type", device) == "cpu" else compute_dtype


class DeviceWindow:
    def __init__(self, host: HostTier, splits: list[tuple[int, int, int]], config: PQCacheConfig, policy: str):
        """splits: (n_init, n_topk, n_local) of each row, from the method. Marks the sinks as not
        searchable in the host tier, copies sinks and window to the device, sizes the block cache."""
        self.host, self.device = host, host.device
        self.dtype = buffer_dtype(host.dtype, host.compute_dtype, self.device)
        B, S = host.B, host.S
        valid = host.valid[:, :S]
        self.n_real = [int(n) for n in valid.sum(1).tolist()]
        splits = [
            (min(s[0], n), s[1], s[2]) for s, n in zip(splits, self.n_real, strict=True)
        ]  # no more sinks than tokens
        self.n_init = max(s[0] for s in splits)
        self.n_local = [s[2] for s in splits]
        self.L = max(self.n_local)

        rank = valid.long().cumsum(1) - 1  # (B, S) index among real tokens
        n_init_row = torch.tensor([s[0] for s in splits], device=valid.device)
        is_init = valid & (rank < n_init_row[:, None])
        host.searchable[:, :S] = valid & ~is_init
        # Sink positions per row: the first n_init real tokens (sorted key puts them first).
        key = torch.where(is_init, rank, torch.full_like(rank, S + 1))
        self.init_pos = key.argsort(dim=1, stable=True)[:, : self.n_init]  # (B, n_init)
        self.init_valid = is_init.gather(1, self.init_pos)
        self.n_init_valid = [int(n) for n in is_init.sum(1).tolist()]  # sinks of each row (read every step)
        # A row's window starts after its sinks at the earliest: a window past the document would hold them twice.
        sink_end = torch.where(self.init_valid, self.init_pos + 1, 0)  # (B, n_init)
        self.sink_end = (sink_end.amax(1, keepdim=True) if self.n_init else sink_end.new_zeros(B, 1)).to(self.device)

        self.k_cap = self.q_cap = 0
        self.ensure(0, 1)  # the top-k part: made by the first step that copies picks (fetch, onerow's general step)
        self.k[:, :, : self.n_init], self.v[:, :, : self.n_init] = host.gather(self.init_pos)
        self.slot_pos = torch.full((self.L,), -1, dtype=torch.long)  # position held by each ring slot
        first = max(0, S - self.L)
        self.ring_write(host.keys(first, S), host.values(first, S), first)

        self.blocks = None
        # at most a quarter of the prefill: a device tier as large as the context would defeat the purpose
        capacity = min(config.block_cache_for(self.device), S // 4 // config.block_size * config.block_size)
        if capacity >= config.block_size:  # on a CPU its books only (blockcache.py: the tiers are the same memory)
            self.blocks = BlockCache(
                B,
                host.H,
                host.D,
                host.compute_dtype,
                self.device,
                config.block_size,
                capacity,
                config.block_admit,
                policy,
                holds_values=holds_copies(self.device, config.kernels),
            )

    def ensure(self, k: int, q: int):
        """Grow the buffer when the top-k or the chunk outgrows it (the sinks and ring are kept)."""
        if k <= self.k_cap and q <= self.q_cap:
            return
        host = self.host
        k_cap, q_cap = max(k, self.k_cap + self.k_cap // 4), max(q, self.q_cap)
        n = self.n_init + self.L + k_cap + q_cap
        new_k = torch.zeros((host.B, host.H, n, host.D), dtype=self.dtype, device=self.device)
        new_v = torch.zeros_like(new_k)
        if getattr(self, "k", None) is not None:
            keep = self.n_init + self.L
            new_k[:, :, :keep], new_v[:, :, :keep] = self.k[:, :, :keep], self.v[:, :, :keep]
        self.k, self.v, self.k_cap, self.q_cap = new_k, new_v, k_cap, q_cap

    def resize(self, k: int, q: int):
        """Shrink (or grow) the top-k and new-token parts to exactly k and q slots."""
        self.k_cap = self.q_cap = 0
        self.ensure(k, q)  # a new buffer; the sinks and ring are copied over

    def ring_write(self, k: torch.Tensor, v: torch.Tensor, start: int):
        """Tokens at positions start..start+Q-1 into the ring (only the last L can survive)."""
        Q = k.shape[2]
        if self.L == 0 or Q == 0:
            return
        first = max(0, Q - self.L)
        lo = (start + first) % self.L
        if lo + Q - first <= self.L:  # no wrap (a decode step): one slice of slots
            slots = slice(self.n_init + lo, self.n_init + lo + Q - first)
            self.slot_pos[lo : lo + Q - first] = torch.arange(start + first, start + Q)
        else:
            pos = torch.arange(start + first, start + Q)
            slots = self.n_init + pos % self.L
            self.slot_pos[pos % self.L] = pos
        self.k[:, :, slots] = k[:, :, first:].to(self.device, self.dtype, non_blocking=True)
        self.v[:, :, slots] = v[:, :, first:].to(self.device, self.dtype, non_blocking=True)

    def fetch(self, top: torch.Tensor, valid: torch.Tensor, span, keys: bool = True) -> dict:
        """K/V of host positions top (B, H, k) into the top-k part of the buffer: block-cache hits from the
        device (where the cache holds copies), the others from the host. keys=False: values only (the selection
        scored the picks exactly; their key slots keep stale data the attention does not read). Returns hits,
        misses and bytes moved to the device."""
        host = self.host
        B, H, k = top.shape
        D, N, lo = host.D, self.k.shape[2], self.n_init + self.L
        rows = torch.arange(B * H, device=self.device)
        dest = ((rows * N).view(B, H, 1) + lo + torch.arange(k, device=self.device)).reshape(
            -1
        )  # rows of k.view(-1, D)
        out_k, out_v = self.k.view(-1, D), self.v.view(-1, D)
        slot, hit = self.look_up(top, valid)
        served = hit if self.holds_blocks else torch.zeros_like(hit)  # a cache of books only serves no data
        miss_rows = (~served).reshape(-1).nonzero().squeeze(1)
        hit_rows = served.reshape(-1).nonzero().squeeze(1)
        if hit_rows.numel():
            hk, hv = self.blocks.read(slot, top, hit_rows, keys)
            if keys:
                out_k.index_copy_(0, dest[hit_rows], hk.to(self.dtype))
            out_v.index_copy_(0, dest[hit_rows], hv.to(self.dtype))
        with span("copy to device"):
            miss = miss_rows.to(host.host)
            bh = torch.arange(B * H).view(B, H, 1).expand(B, H, k).reshape(-1)[miss]
            mk, mv = host.rows(bh, top.to(host.host).reshape(-1)[miss], keys)
            if keys:
                out_k.index_copy_(0, dest[miss_rows], mk.to(self.device, self.dtype, non_blocking=True))
            out_v.index_copy_(0, dest[miss_rows], mv.to(self.device, self.dtype, non_blocking=True))
            admitted = self.admit(top, valid)
        return self.moved(hit, valid, keys, admitted)

    @property
    def holds_blocks(self) -> bool:
        """Whether a block cache holds copies of its blocks (hits are read there)."""
        return self.blocks is not None and self.blocks.holds_values

    def look_up(self, top: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        """top, valid (B, H, k) -> the block-cache slot of each position (None without a block cache) and
        hit (B, H, k): the valid picks a cached block holds."""
        if self.blocks is None:
            return None, torch.zeros_like(valid)
        slot = self.blocks.lookup(top)
        return slot, (slot >= 0) & valid

    def admit(self, top: torch.Tensor, valid: torch.Tensor) -> int:
        """After a step's look-up: the block cache admits the hottest blocks of its picks (its policy) ->
        bytes copied in. Only blocks older than every row's window: those never change."""
        if self.blocks is None:
            return 0
        admitted = self.blocks.admit(top, valid, self.host, max(0, self.host.S - max(self.n_local)))
        return 2 * admitted * self.host.D * self.k.element_size()

    def moved(self, hit: torch.Tensor, valid: torch.Tensor, keys: bool, admitted: int) -> dict:
        """A step's fetch in figures: hits, misses and bytes to the device (every pick slot not served by the
        block cache, its value and, keys=True, its key; then the blocks admitted)."""
        hits = int(hit.sum())  # hit is within valid
        return self.counted(hits, int(valid.sum()) - hits, hit.numel() - hits, keys, admitted)

    def counted(self, hits: int, misses: int, fetched: int, keys: bool, admitted: int) -> dict:
        """moved()'s figures from counts (a step that knows them without tensors: layer/onerow.py's fused one):
        `fetched` pick slots not served by the block cache, each its value and, keys=True, its key."""
        moved = (2 if keys else 1) * fetched * self.host.D * self.k.element_size() + admitted
        return {"hits": hits, "misses": misses, "moved": moved}

    def assemble(self, top_valid: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, new_valid: torch.Tensor):
        """Write the Q new tokens after the k fetched ones -> keys, values (B, H, N, D) and the mask
        (B, H, Q, N) of what each new token may attend to (real tokens only, causal among the new)."""
        host = self.host
        B, H = host.B, host.H
        k, Q, lo = top_valid.shape[2], k_new.shape[2], self.n_init + self.L
        self.k[:, :, lo + k : lo + k + Q] = k_new
        self.v[:, :, lo + k : lo + k + Q] = v_new
        compute = host.compute_dtype
        keys, values = self.k[:, :, : lo + k + Q].to(compute), self.v[:, :, : lo + k + Q].to(compute)
        ring_valid = self.ring_valid()
        ctx_valid = torch.cat(
            [self.init_valid[:, None, :].expand(B, H, -1), ring_valid[:, None, :].expand(B, H, -1), top_valid], dim=2
        )  # (B, H, n_init + L + k)
        causal = torch.ones(Q, Q, dtype=torch.bool, device=self.device).tril()
        new_mask = causal[None, :, :] & new_valid[:, None, :]  # (B, Q, Q)
        mask = torch.cat(
            [ctx_valid[:, :, None, :].expand(B, H, Q, lo + k), new_mask[:, None].expand(B, H, Q, Q)], dim=3
        )
        return keys, values, mask

    def candidates(self) -> torch.Tensor:
        """(B, S) bool: middle tokens of each row (real, not a sink, older than the row's window)."""
        S = self.host.S
        cand = self.host.searchable[:, :S].clone()
        for b, n in enumerate(self.n_local):  # the row's window: its last n positions
            cand[b, max(0, S - n) :] = False
        return cand

    def ring_valid(self) -> torch.Tensor:
        """(B, L) bool: ring slots holding a real token of the row's window."""
        host = self.host
        slot_pos = self.slot_pos.to(self.device)
        local_start = torch.tensor([host.S - n for n in self.n_local], device=self.device)[:, None]
        ok = (slot_pos[None, :] >= torch.maximum(local_start, self.sink_end)) & (slot_pos[None, :] >= 0)
        return ok & host.valid[:, : host.S].gather(1, slot_pos.clamp(min=0)[None, :].expand(host.B, -1))

    def positions(self, top: torch.Tensor, Q: int) -> torch.Tensor:
        """Host position of every buffer slot of the last step -> (B, H, N); the new tokens are S..S+Q-1."""
        B, H, S = self.host.B, self.host.H, self.host.S
        return torch.cat(
            [
                self.init_pos[:, None, :].expand(B, H, -1),
                self.slot_pos.to(self.device).view(1, 1, -1).expand(B, H, -1),
                top,
                torch.arange(S, S + Q, device=self.device).view(1, 1, Q).expand(B, H, Q),
            ],
            dim=2,
        )

    @property
    def nbytes(self) -> int:
        n = (self.k.numel() + self.v.numel()) * self.k.element_size()
        return n + (self.blocks.nbytes if self.blocks is not None else 0)
