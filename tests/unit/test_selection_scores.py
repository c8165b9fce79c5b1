"""A selection's exact scores (PQCache's re-rank, the oracle) stand in for the picks' keys: a step fetches only
the picks' values."""

import pytest
import torch

import pqcache.engine.methods.pqcache as pqcache_method
from pqcache import PQCache, PQCacheConfig
from pqcache.engine.layer import onerow
from pqcache.engine.layer.attention import masked_attention
from pqcache.engine.methods.oracle import Oracle
from tests.tiny import greedy_generate, tiny_model

SMALL = dict(n_init=4, kmeans_iters=5, bits=4, block_size=16, block_cache_tokens=64, block_admit=2)


def test_known_scores_replace_the_keys_of_their_slots():
    """Slots whose scaled scores are given: their keys are not read (garbage there changes nothing), and the
    result is the attention over the true keys."""
    g = torch.Generator().manual_seed(0)
    B, H, G, N, D, lo, k = 1, 2, 3, 40, 8, 10, 12
    q, keys, values = (torch.randn(B, H, n, D, generator=g) for n in (G, N, N))
    mask = torch.rand(B, H, 1, N, generator=g) > 0.2
    scaling = D**-0.5
    ref, ref_probs = masked_attention(q, keys, values, mask, scaling)
    scores = (keys[:, :, lo : lo + k] @ (q * scaling).transpose(-1, -2)).contiguous()  # (B, H, k, G)
    stale = keys.clone()
    stale[:, :, lo : lo + k] = torch.randn(B, H, k, D, generator=g) * 100
    out, probs = masked_attention(q, stale, values, mask, scaling, known=(lo, scores))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(probs, ref_probs, rtol=1e-5, atol=1e-6)
    wrong, _ = masked_attention(q, stale, values, mask, scaling)  # the check can fail: the stale keys matter
    assert not torch.allclose(wrong, ref, atol=1e-3)


def _moved_to_device(model, ids, cfg, method):
    cache = PQCache(model, cfg, method=method)
    obs = cache.instrument(attention_every=0, recall_every=0)
    seq, scores = greedy_generate(model, ids, cache, n=10)
    return seq, scores, obs.bytes["to_device"], cache


@pytest.mark.parametrize("method", ["pqcache", "oracle"])
def test_attention_with_selection_scores_equals_attention_over_fetched_keys(monkeypatch, method):
    """Same prompt and settings (budget 1/5, re-rank on, block cache on): the selection's exact scores (PQCache's
    re-rank, the oracle's) used by the attention give the tokens and scores of the same steps with the picks' keys
    fetched and scored by the attention, and move fewer bytes to the device."""
    model = tiny_model("qwen2")
    ids = torch.randint(1, 96, (1, 600), generator=torch.Generator().manual_seed(5))
    cfg = PQCacheConfig(token_budget=0.2, **SMALL)
    monkeypatch.setattr(onerow, "ready", lambda layer, query: False)  # PQLayer.attend (onerow.py always re-ranks)
    with torch.no_grad():
        seq, scores, moved, cache = _moved_to_device(model, ids, cfg, method)
        # the scores path off: PQCache leaves its scores under a key the layer does not read, the oracle keeps them
        # to itself; the keys are fetched as before
        if method == "pqcache":
            monkeypatch.setattr(pqcache_method, "PICKED_SCORES", "not read by the layer")
        else:
            monkeypatch.setattr(Oracle, "exact", False)
        seq_keys, scores_keys, moved_keys, _ = _moved_to_device(model, ids, cfg, method)
    assert torch.equal(seq, seq_keys)
    torch.testing.assert_close(scores, scores_keys, rtol=1e-5, atol=1e-5)
    layer = cache.pq_layers[0]
    assert layer.stats["misses"] > 0  # picks came from the host: their keys' bytes are what was saved
    assert moved < moved_keys
