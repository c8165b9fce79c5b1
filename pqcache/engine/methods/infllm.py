"""InfLLM (Xiao et al., 2024): the context is cut into blocks of `block_size` tokens, each stored
with `n_rep` representative keys (the keys its own queries attend to most); a step scores every
block by q . representatives and attends to the tokens of the top blocks. InfLLM keeps hot blocks
on the device with LRU, so this method runs the block cache with LRU."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from pqcache.engine.methods.base import Method, positions_of


@dataclass
class InfLLM(Method):
    name = "infllm"
    needs_prefill_queries = True
    block_size: int = 128
    n_rep: int = 4
    cache_policy = "lru"

    def _representatives(self, view, start_block: int, n_blocks: int, queries: torch.Tensor):
        """Representative keys of blocks [start_block, start_block + n_blocks) -> (B, H, n, n_rep, D).
        queries: (B, H, n, R, D), each block's own queries (prefill), or (B, H, R, D), the current
        query, standing in for blocks completed while decoding."""
        bs = self.block_size
        keys = view.keys(start_block * bs, (start_block + n_blocks) * bs)
        B, H, _, D = keys.shape
        keys = keys.view(B, H, n_blocks, bs, D)
        q = queries.to(view.device, torch.float32)
        if q.dim() == 4:
            q = q[:, :, None].expand(-1, -1, n_blocks, -1, -1)
        score = (keys @ q.transpose(-1, -2)).sum(-1)  # (B, H, n, bs): attention logits received
        idx = score.topk(min(self.n_rep, bs), dim=-1).indices  # (B, H, n, n_rep)
        return keys.gather(3, idx[..., None].expand(-1, -1, -1, -1, D))

    def on_prefill(self, view, query, scaling):
        B, Hq, S, D = query.shape
        H, G, bs = view.H, Hq // view.H, self.block_size
        n = S // bs
        reps = torch.zeros((B, H, 0, self.n_rep, D), device=view.device)
        if n:
            q = query[:, :, : n * bs].reshape(B, H, G, n, bs, D).permute(0, 1, 3, 2, 4, 5).reshape(B, H, n, G * bs, D)
            reps = self._representatives(view, 0, n, q)
        view.state["reps"] = reps

    def select(self, view, q):
        bs, cand, ks = self.block_size, view.candidates, view.ks
        reps = view.state["reps"]
        n_done = reps.shape[2]
        n_complete = view.S // bs
        if n_complete > n_done:  # blocks completed while decoding
            new = self._representatives(view, n_done, n_complete - n_done, q)
            reps = view.state["reps"] = torch.cat([reps, new], 2)
        B, H, S = view.B, view.H, view.S
        if n_complete == 0:  # no finished block yet: the unfinished one is always read
            return positions_of(cand[:, None, :].expand(-1, H, -1))
        block_of = torch.arange(S, device=view.device) // bs  # (S,), at most n_complete
        in_block = cand & (block_of < n_complete)[None, :]
        # a block holds candidates if any of its positions is one (amax: a plain indexed |= would
        # let the block's last position decide, as repeated indices keep the last write)
        has_cand = torch.zeros((B, n_complete + 1), dtype=torch.uint8, device=view.device)
        has_cand.scatter_reduce_(1, block_of[None, :].expand(B, -1), in_block.to(torch.uint8), reduce="amax")
        has_cand = has_cand.bool()
        score = (reps.reshape(B, H, -1, reps.shape[-1]) @ q.float().transpose(-1, -2)).sum(-1)
        score = score.view(B, H, n_complete, -1).sum(-1)  # (B, H, n_blocks): q . representatives
        score = score.masked_fill(~has_cand[:, None, :n_complete], float("-inf"))
        chosen = cand[:, None, :].expand(-1, H, -1).clone()
        for b in range(B):
            n_cand = int(cand[b].sum())
            if ks[b] >= n_cand:
                continue  # the budget covers every candidate
            n_sel = min(n_complete, math.ceil(ks[b] / bs))
            top_blocks = score[b].topk(n_sel, dim=-1).indices  # (H, n_sel)
            picked = torch.zeros((H, n_complete + 1), dtype=torch.bool, device=view.device)
            picked.scatter_(1, top_blocks, True)
            tail = ~(block_of < n_complete)  # candidates of the unfinished block are always read
            chosen[b] &= picked[:, block_of] | tail[None, :]
        return positions_of(chosen)
