"""A prefill chunk's attention in a PQ layer (engine/prefill_attention.py): the split into the earlier keys and the
chunk's own, merged by log-sum-exp, against SDPA with the chunk's mask; the mask check that decides it."""

import pytest
import torch
import torch.nn.functional as F

from pqcache.engine import prefill_attention as pa


def _chunk_mask(B: int, Q: int, K: int) -> torch.Tensor:
    """A chunked prefill's mask (B, 1, Q, K): the first K - Q keys visible, the chunk's own causal."""
    mask = torch.ones(B, 1, Q, K, dtype=torch.bool)
    mask[..., K - Q :] = torch.ones(Q, Q, dtype=torch.bool).tril()
    return mask


def _reference(query, key, value, mask, scaling):
    """SDPA with the mask, the KV heads repeated for the grouped query heads -> (B, Q, Hq, D)."""
    G = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(G, 1), value.repeat_interleave(G, 1)
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling).transpose(1, 2)


class _Module:  # what sdpa_attention_forward reads off the attention module
    is_causal = True
    num_key_value_groups = 1


@pytest.mark.parametrize(
    "B, Hq, Hk, D, Q, K",
    [
        (1, 4, 1, 256, 96, 96),  # Gemma 3 270M's heads, the first chunk: its own keys only
        (1, 4, 1, 256, 96, 400),  # ... and a later chunk
        (1, 9, 3, 64, 33, 130),  # SmolLM2's heads
        (2, 2, 2, 16, 5, 9),  # two rows, no grouping
    ],
)
def test_the_split_equals_sdpa_with_the_chunks_mask(B, Hq, Hk, D, Q, K):
    g = torch.Generator().manual_seed(Q + K)
    query = torch.randn(B, Hq, Q, D, generator=g) * 2  # sharp softmaxes: the merge's weights far from 1/2
    key, value = torch.randn(B, Hk, K, D, generator=g), torch.randn(B, Hk, K, D, generator=g)
    scaling = D**-0.5
    out = pa.split_causal(query, key, value, scaling)
    assert out.shape == (B, Q, Hq, D) and out.is_contiguous()
    torch.testing.assert_close(out, _reference(query, key, value, _chunk_mask(B, Q, K), scaling), rtol=1e-5, atol=1e-5)


def test_only_a_chunks_own_mask_takes_the_split(monkeypatch):
    """Every other mask (a padded row, a sliding window, a key hidden anywhere) goes to SDPA with the mask, and both
    paths give SDPA's output."""
    B, Hq, Hk, D, Q, K = 1, 4, 2, 16, 300, 700  # more queries than a block: the blocked path runs several calls
    g = torch.Generator().manual_seed(0)
    query = torch.randn(B, Hq, Q, D, generator=g)
    key, value = torch.randn(B, Hk, K, D, generator=g), torch.randn(B, Hk, K, D, generator=g)
    module = _Module()
    module.num_key_value_groups = Hq // Hk
    split = []
    real = pa.split_causal
    monkeypatch.setattr(pa, "split_causal", lambda *a: split.append(1) or real(*a))

    padded = _chunk_mask(B, Q, K)
    padded[..., :7] = False  # a left-padded row's pads
    window = _chunk_mask(B, Q, K)
    window[..., :, : K - Q - 50] = False  # keys out of a sliding window
    hole = _chunk_mask(B, Q, K)
    hole[0, 0, 5, K - Q + 2] = False  # one key a causal mask would show
    for mask, takes_split in [(_chunk_mask(B, Q, K), True), (padded, False), (window, False), (hole, False)]:
        split.clear()
        out = pa.prefill_attention(module, query, key, value, mask, D**-0.5, 0.0)
        assert bool(split) == takes_split
        torch.testing.assert_close(out, _reference(query, key, value, mask, D**-0.5), rtol=1e-5, atol=1e-5)

    split.clear()  # a chunk of one block: one SDPA call with its mask, as full attention's layers make it
    short = (query[:, :, :40], key[:, :, :440], value[:, :, :440], _chunk_mask(B, 40, 440), D**-0.5)
    out = pa.prefill_attention(module, *short, 0.0)
    assert not split
    torch.testing.assert_close(out, _reference(*short), rtol=1e-5, atol=1e-5)

    assert not pa._chunk_mask(_chunk_mask(B, Q, K).float(), K)  # an additive float mask: not read as booleans
    assert not pa._chunk_mask(_chunk_mask(B, Q, K), K + 1)  # keys the mask does not cover


def test_the_split_keeps_a_bfloat16_models_dtype():
    g = torch.Generator().manual_seed(3)
    query = torch.randn(1, 4, 40, 32, generator=g)
    key, value = torch.randn(1, 2, 100, 32, generator=g), torch.randn(1, 2, 100, 32, generator=g)
    out = pa.split_causal(query.bfloat16(), key.bfloat16(), value.bfloat16(), 32**-0.5)
    assert out.dtype == torch.bfloat16
    reference = _reference(query, key, value, _chunk_mask(1, 40, 100), 32**-0.5)
    torch.testing.assert_close(out.float(), reference, rtol=3e-2, atol=3e-2)
