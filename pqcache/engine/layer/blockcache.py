"""Device block cache: hot blocks of host-tier tokens kept on the device, per (row, KV head).

Tokens are grouped in fixed blocks (position // block_size). After each retrieval the complete
blocks holding the most top-k tokens are admitted (up to `admit` per step, and never more than half
the slots, so that what stays is the policy's choice), evicting by LRU (oldest last use) or LFU
(fewest uses, then oldest). A fetch takes hits from the device and only misses
from the host.

On a CPU the device tier is host memory: a copy of a block there is a second copy in the same memory, and copying
two blocks a step cost about 1.2 ms a layer of an 8K decode step of the bundled model (a tenth of the step). There
the cache keeps its books only (holds_values=False): the same look-ups, hits, misses, admissions and evictions, which
are what a device's block cache would serve, and no copies (the step reads every pick in the host tier, as it does
without a block cache). Kernels(block_copies_on_cpu=True) makes it copy anyway (the tests compare the two).

Shapes: B rows, H KV heads, n slots of `bs` tokens, D head_dim, k retrieved tokens.
"""

from __future__ import annotations

import numpy as np
import torch


def holds_copies(device, kernels) -> bool:
    """Whether a block cache on `device` (a torch.device or its type) holds copies of its blocks: not on a CPU,
    unless the kernels ask for them (engine/kernels.py)."""
    return getattr(device, "type", device) != "cpu" or kernels.block_copies_on_cpu


class BlockCache:
    def __init__(
        self,
        B,
        H,
        D,
        dtype,
        device,
        block_size: int,
        capacity_tokens: int,
        admit: int,
        policy: str,
        holds_values: bool = True,
    ):
        """holds_values=False: the books without the blocks' keys and values (k, v are None; read() is not used)."""
        self.B, self.H, self.D, self.bs, self.policy = B, H, D, block_size, policy
        self.holds_values = holds_values
        self.n_slots = capacity_tokens // block_size
        # at most half the slots change per step: the other half is what the eviction policy keeps
        self.admit_max = max(1, min(admit, self.n_slots // 2))
        self.device = device
        self.k = self.v = None
        if holds_values:
            self.k = torch.zeros((B, H, self.n_slots, block_size, D), dtype=dtype, device=device)
            self.v = torch.zeros_like(self.k)
        self.slot_block = torch.full((B, H, self.n_slots), -1, dtype=torch.long, device=device)
        self.last_used = torch.full((B, H, self.n_slots), -1, dtype=torch.long, device=device)
        self.uses = torch.zeros((B, H, self.n_slots), dtype=torch.long, device=device)
        # block id -> slot (-1: not cached); one spare column is a sink for masked scatters
        self.block_slot = torch.full((B, H, 1), -1, dtype=torch.long, device=device)
        self.step = 0

    @property
    def nbytes(self) -> int:
        return 0 if self.k is None else 2 * self.k.numel() * self.k.element_size()

    def _grow(self, n_blocks: int):
        have = self.block_slot.shape[2] - 1
        if n_blocks > have:
            new = torch.full((self.B, self.H, max(n_blocks, 2 * have) + 1), -1, dtype=torch.long, device=self.device)
            new[..., :have] = self.block_slot[..., :have]
            self.block_slot = new

    def lookup(self, top: torch.Tensor) -> torch.Tensor:
        """top (B, H, k) positions -> slot (B, H, k), -1 for a miss."""
        blk = top // self.bs
        self._grow(int(blk.max()) + 1 if blk.numel() else 0)
        return self.block_slot.gather(2, blk)

    def read(self, slot: torch.Tensor, top: torch.Tensor, rows: torch.Tensor, keys: bool = True):
        """K/V of hits: slot, top (B, H, k); rows: flat indices (into B*H*k) of the hits -> (n, D) each
        (K None when keys=False)."""
        B, H, k = top.shape
        bh = torch.arange(B * H, device=self.device).view(B, H, 1)
        flat = ((bh * self.n_slots + slot.clamp(min=0)) * self.bs + top % self.bs).reshape(-1)[rows]
        k_rows = self.k.view(-1, self.D).index_select(0, flat) if keys else None
        return k_rows, self.v.view(-1, self.D).index_select(0, flat)

    def admit(self, top, valid, host, n_complete_tokens: int) -> int:
        """Update use stats and admit the top blocks of this retrieval. Returns the tokens admitted (copied in where
        it holds values: the bytes a device's cache would copy either way)."""
        self.step += 1
        n_blocks = n_complete_tokens // self.bs  # only full blocks: a partial one would go stale
        if self.n_slots == 0 or n_blocks == 0:
            return 0
        self._grow(n_blocks)
        if self.device.type == "cpu" and top.device.type == "cpu":
            return self._admit_rows(top, valid, host, n_blocks)
        return self._admit_tensors(top, valid, host, n_blocks)

    def _admit_tensors(self, top, valid, host, n_blocks: int) -> int:
        """admit() in torch operations on the device, every (row, head) at once."""
        B, H, _ = top.shape
        blk = torch.where(valid, top // self.bs, torch.full_like(top, self.block_slot.shape[2] - 1))
        counts = torch.zeros((B, H, self.block_slot.shape[2]), dtype=torch.long, device=self.device)
        counts.scatter_add_(2, blk, valid.long())
        counts[..., n_blocks:] = 0

        # cached blocks that served this retrieval: one more use, used now
        served = self.slot_block.clamp(min=0)
        used = (self.slot_block >= 0) & (counts.gather(2, served) > 0)
        self.uses += used.long()
        self.last_used = torch.where(used, torch.full_like(self.last_used, self.step), self.last_used)

        counts = counts.masked_fill(self.block_slot >= 0, 0)  # already cached
        # the most picked blocks, the lower block first among equals (as the numpy path's stable sort)
        ranked = counts[..., :n_blocks] * (n_blocks + 1) - torch.arange(n_blocks, device=self.device)
        cand_blk = ranked.topk(min(self.admit_max, n_blocks), dim=-1).indices
        cand_count = counts.gather(2, cand_blk)
        n = cand_blk.shape[2]
        if self.policy == "lru":
            priority = self.last_used.double()
        else:  # lfu: fewest uses first, the older of equals first
            priority = self.uses.double() * (self.step + 1) + self.last_used.double()
        priority = priority.masked_fill(self.slot_block < 0, -1.0)  # empty slots go first
        priority = priority * self.n_slots + torch.arange(self.n_slots, device=self.device)  # then the lower slot
        victims = priority.topk(n, dim=-1, largest=False).indices  # (B, H, n)
        do = cand_count > 0
        if not bool(do.any()):
            return 0
        sink = self.block_slot.shape[2] - 1
        old = self.slot_block.gather(2, victims)
        self.block_slot.scatter_(2, torch.where(do & (old >= 0), old, torch.full_like(old, sink)), -1)
        self.block_slot.scatter_(2, torch.where(do, cand_blk, torch.full_like(cand_blk, sink)), victims)
        self.block_slot[..., sink] = -1
        self.slot_block.scatter_(2, victims, torch.where(do, cand_blk, old))
        self.uses.scatter_(2, victims, torch.where(do, torch.ones_like(old), self.uses.gather(2, victims)))
        self.last_used.scatter_(
            2, victims, torch.where(do, torch.full_like(old, self.step), self.last_used.gather(2, victims))
        )
        # copy the admitted blocks from the host tier
        b_i, h_i, j_i = do.nonzero(as_tuple=True)
        if b_i.numel() and self.holds_values:
            pos = cand_blk[b_i, h_i, j_i].cpu()[:, None] * self.bs + torch.arange(self.bs)  # (n, bs)
            bh = (b_i.cpu() * H + h_i.cpu())[:, None].expand(-1, self.bs).reshape(-1)
            kk, vv = host.rows(bh, pos.reshape(-1))  # (n * bs, D) each
            kk, vv = kk.view(-1, self.bs, self.D), vv.view(-1, self.bs, self.D)
            s_i = victims[b_i, h_i, j_i]
            self.k[b_i, h_i, s_i] = kk.to(self.device, non_blocking=True)
            self.v[b_i, h_i, s_i] = vv.to(self.device, non_blocking=True)
        return int(b_i.numel()) * self.bs

    def _admit_rows(self, top, valid, host, n_blocks: int) -> int:
        """admit() on a CPU: the same bookkeeping in numpy, a (row, head) at a time, on views of the same tensors
        (about thirty small torch operations cost more than a millisecond a layer there, this a tenth of it).
        Among equal counts the lower block goes first, among equal priorities the lower slot."""
        top_np, valid_np = top.numpy(), valid.numpy()
        slot_block, last_used, uses, block_slot = (
            t.numpy() for t in (self.slot_block, self.last_used, self.uses, self.block_slot)
        )
        copies = []  # (row, head, slot, block)
        for b in range(top.shape[0]):
            for h in range(top.shape[1]):
                blk = top_np[b, h][valid_np[b, h]] // self.bs
                counts = np.bincount(blk[blk < n_blocks], minlength=n_blocks)  # (n_blocks,) picks per block
                slots = slot_block[b, h]
                cached = slots >= 0
                used = cached & (counts[np.where(cached, np.minimum(slots, n_blocks - 1), 0)] > 0)
                used &= slots < n_blocks
                uses[b, h] += used
                last_used[b, h][used] = self.step
                counts[block_slot[b, h, :n_blocks] >= 0] = 0  # already cached
                cand = np.argsort(-counts, kind="stable")[: min(self.admit_max, n_blocks)]
                cand = cand[counts[cand] > 0]
                if not len(cand):
                    continue
                if self.policy == "lru":
                    priority = last_used[b, h].astype(np.float64)
                else:  # lfu: fewest uses first, the older of equals first
                    priority = uses[b, h] * float(self.step + 1) + last_used[b, h]
                priority = np.where(cached, priority, -1.0)  # empty slots go first
                victims = np.argsort(priority, kind="stable")[: len(cand)]
                old = slots[victims]
                block_slot[b, h, old[old >= 0]] = -1
                block_slot[b, h, cand] = victims
                slots[victims] = cand
                uses[b, h, victims] = 1
                last_used[b, h, victims] = self.step
                copies += [(b, h, int(v), int(c)) for v, c in zip(victims, cand)]
        if not copies or not self.holds_values:
            return len(copies) * self.bs
        b_i, h_i, _, blocks = (torch.tensor(col) for col in zip(*copies))
        pos = blocks[:, None] * self.bs + torch.arange(self.bs)  # (n, bs)
        bh = (b_i * top.shape[1] + h_i)[:, None].expand(-1, self.bs).reshape(-1)
        kk, vv = host.rows(bh, pos.reshape(-1))  # (n * bs, D) each
        kk, vv = kk.view(-1, self.bs, self.D), vv.view(-1, self.bs, self.D)
        for i, (b, h, slot, _) in enumerate(copies):  # a copy a block: an indexed put of three index tensors is slower
            self.k[b, h, slot].copy_(kk[i])
            self.v[b, h, slot].copy_(vv[i])
        return len(copies) * self.bs
