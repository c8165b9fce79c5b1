"""A prefill chunk's exact attention in a PQ layer: its Q queries over every key cached so far and its own.

transformers hands the chunk a boolean mask of (B, 1, Q, K) and SDPA on a CPU packs the grouped query heads by KV
head, so the mask becomes a float one of (G Q, K) per KV head: 512 MB for a 1,024-token chunk at 32K keys of the
bundled model (4 query heads, 1 KV head). Where the mask is the usual one of a chunked prefill (every earlier key
visible, causal within the chunk), no mask is needed at all: the attention splits into the chunk's queries over the
earlier keys, grouped heads packed and unmasked, and over the chunk's own keys, causal from the top left, as
torch's flash kernel computes each; the two are merged by their log-sum-exps. Each query row's softmax is the same
sum, in another order (within float32 rounding of one SDPA call: tests/unit/test_prefill_attention.py). A
1,024-row chunk over 32K keys: 0.83-0.88 s here against 1.10-1.23 s in query blocks (Zen 3, ad hoc), and no
mask in memory.
Any other mask (padded rows of a batch, a sliding window, a bidirectional span) goes through SDPA with the mask,
the queries in blocks of PREFILL_QUERY_BLOCK rows, which caps the mask's float copy to a quarter of the chunk's. A
chunk of at most one block (short prompts, the tests' tiny models) is one SDPA call with its mask, as full
attention's layers compute it: the same bits, so PQCache at a full budget stays within float noise of full
attention through decode linears that round their inputs (tests/unit/test_decode_layer.py).
"""

from __future__ import annotations

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

# Queries per SDPA call where the mask must be passed: SDPA's scores for 1,024 queries over 9K keys of the bundled
# model's 4 query heads take 290 MB at once (measured), a block of 256 a quarter of that. Each query row's attention
# is its own, so the blocks give what one call gives.
PREFILL_QUERY_BLOCK = 256

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def prefill_attention(module, query, key, value, attention_mask, scaling, dropout, **kwargs) -> torch.Tensor:
    """query (B, Hq, Q, D), key, value (B, Hk, K, D): every key the chunk attends to, its own last -> (B, Q, Hq, D)."""
    Q = query.shape[2]
    # one SDPA call for a chunk of one block (its mask is small), as full attention's layers compute it to the bit;
    # and without a mask of a row per query (none: causal from the top-left, which a block's rows would misread)
    if Q <= PREFILL_QUERY_BLOCK or attention_mask is None or attention_mask.dim() != 4 or attention_mask.shape[2] != Q:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )[0]
    plain = not dropout and kwargs.get("softcap") is None and kwargs.get("s_aux") is None
    if plain and query.device.type == "cpu" and _chunk_mask(attention_mask, key.shape[2]):
        return split_causal(query, key, value, scaling)
    outs = []
    for r in range(0, Q, PREFILL_QUERY_BLOCK):
        rows = slice(r, r + PREFILL_QUERY_BLOCK)
        block, mask = query[:, :, rows], attention_mask[:, :, rows]
        out, _ = sdpa_attention_forward(module, block, key, value, mask, scaling=scaling, dropout=dropout, **kwargs)
        outs.append(out)
    return torch.cat(outs, 1)


def _chunk_mask(mask: torch.Tensor, K: int) -> bool:
    """Whether mask (B, 1, Q, K') is a chunked prefill's: every one of the first K - Q keys visible to every query,
    the last Q causal (query i sees chunk keys 0..i). Read whole (about 3 ms for a chunk of 1,024 at 32K)."""
    B, _, Q, width = mask.shape
    if mask.dtype != torch.bool or width != K or Q > K or mask.shape[1] != 1:
        return False
    own = torch.ones(Q, Q, dtype=torch.bool, device=mask.device).tril()
    return bool(mask[..., : K - Q].all()) and torch.equal(mask[..., K - Q :], own.expand(B, 1, Q, Q))


def split_causal(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float) -> torch.Tensor:
    """The chunk's attention under _chunk_mask's mask, in two flash calls merged by log-sum-exp: query (B, Hq, Q, D),
    key, value (B, Hk, K, D), the chunk's own keys last -> (B, Q, Hq, D)."""
    B, Hq, Q, D = query.shape
    Hk, K = key.shape[1], key.shape[2]
    G, earlier = Hq // Hk, K - Q
    own_k, own_v = key[:, :, earlier:], value[:, :, earlier:]
    if G > 1:  # a causal mask cannot be packed by KV head: the chunk's own keys (Q of them) repeated instead
        own_k, own_v = own_k.repeat_interleave(G, 1), own_v.repeat_interleave(G, 1)
    out, lse = _flash(query, own_k, own_v, is_causal=True, scale=scaling)  # (B, Hq, Q, D), (B, Hq, Q)
    if earlier == 0:
        return out.transpose(1, 2).contiguous()
    # query heads h*G..h*G+G-1 share KV head h: (B, Hk, G Q, D), one unmasked pass over each KV head's keys
    packed = query.reshape(B, Hk, G * Q, D)
    out_early, lse_early = _flash(packed, key[:, :, :earlier], value[:, :, :earlier], scale=scaling)
    out_early, lse_early = out_early.reshape(B, Hq, Q, D), lse_early.reshape(B, Hq, Q)
    total = torch.logaddexp(lse, lse_early)
    weight, weight_early = torch.exp(lse - total)[..., None], torch.exp(lse_early - total)[..., None]
    merged = out.float() * weight + out_early.float() * weight_early
    return merged.to(query.dtype).transpose(1, 2).contiguous()
