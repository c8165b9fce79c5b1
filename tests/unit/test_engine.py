"""PQCache against exact attention on tiny random models of every supported architecture."""

import pytest
import torch
from transformers import DynamicCache

from pqcache import PQCache, PQCacheConfig
from pqcache.engine.full_attention import full_attention_cache
from tests.tiny import greedy_generate, tiny_model

FULL_BUDGET = PQCacheConfig(token_budget=1.0, n_init=4, n_local=8, kmeans_iters=5, bits=4)


def _batch(seed=1, lengths=(80, 57)):
    g = torch.Generator().manual_seed(seed)
    S = max(lengths)
    ids = torch.zeros(len(lengths), S, dtype=torch.long)
    mask = torch.zeros(len(lengths), S, dtype=torch.long)
    for b, n in enumerate(lengths):  # left padding
        ids[b, S - n :] = torch.randint(1, 96, (n,), generator=g)
        mask[b, S - n :] = 1
    return ids, mask


@pytest.mark.parametrize("batch", [1, 2])
def test_full_budget_equals_full_attention(arch, batch):
    model = tiny_model(arch)
    ids, mask = _batch(lengths=(80, 57)[:batch])
    with torch.no_grad():
        ref_seq, ref_scores = greedy_generate(model, ids, full_attention_cache(model), mask=mask)
        cache = PQCache(model, FULL_BUDGET)
        seq, scores = greedy_generate(model, ids, cache, mask=mask)
    assert cache.pq_layers, "the model must have PQ layers"
    assert all(layer.stats["steps"] == 5 for layer in cache.pq_layers), "decode must run through the PQ path"
    torch.testing.assert_close(scores, ref_scores, rtol=1e-5, atol=1e-5)
    assert torch.equal(seq, ref_seq)


def test_small_budget_really_drops_tokens(arch):
    model = tiny_model(arch)
    ids, mask = _batch(lengths=(200,))
    cfg = PQCacheConfig(token_budget=0.2, n_init=4, kmeans_iters=5, bits=4)
    with torch.no_grad():
        _, ref = greedy_generate(model, ids, full_attention_cache(model), mask=mask)
        cache = PQCache(model, cfg)
        _, scores = greedy_generate(model, ids, cache, mask=mask)
    layer = cache.pq_layers[0]
    top, valid = layer.last_selection
    n_init, n_topk, n_local = cfg.split(layer.window.n_real[0] - 1)
    assert valid.sum(-1).max() <= n_topk + 1
    assert top.shape[-1] < 200 // 2
    assert not torch.allclose(scores, ref, atol=1e-6), "a 1/5 budget attends to fewer tokens than full attention"
    assert not torch.isnan(scores).any()  # (-inf is min_new_tokens masking EOS)


def test_batch_rows_match_rows_alone():
    """Left-padded batch of 2 under a small budget gives each row the answer it gets alone."""
    model = tiny_model("llama")
    lengths = (160, 121)
    ids, mask = _batch(seed=3, lengths=lengths)
    cfg = PQCacheConfig(token_budget=0.25, n_init=4, kmeans_iters=8, bits=4)
    with torch.no_grad():
        seq, scores = greedy_generate(model, ids, PQCache(model, cfg), mask=mask)
        for b, n in enumerate(lengths):
            row_ids = ids[b : b + 1, ids.shape[1] - n :]
            row_seq, row_scores = greedy_generate(model, row_ids, PQCache(model, cfg), mask=torch.ones_like(row_ids))
            assert torch.equal(seq[b, -6:], row_seq[0, -6:])
            torch.testing.assert_close(scores[:, b], row_scores[:, 0], rtol=1e-3, atol=1e-3)


def test_second_chunk_runs_against_cached_document(arch):
    """A question chunk after the prefill: no re-prefill, exact when the budget covers everything."""
    model = tiny_model(arch)
    g = torch.Generator().manual_seed(5)
    doc = torch.randint(1, 96, (1, 90), generator=g)
    question = torch.randint(1, 96, (1, 12), generator=g)
    with torch.no_grad():
        # full attention at the host tier's KV dtype, over the document and the question in one forward
        ref = model(torch.cat([doc, question], 1), cache=full_attention_cache(model)).logits[:, -12:]
        cache = PQCache(model, FULL_BUDGET)
        model(doc, cache=cache)
        assert cache.get_seq_length() == 90
        out = model(question, cache=cache).logits
        assert cache.get_seq_length() == 102
        assert all(layer.S == 102 for layer in cache.pq_layers)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_second_chunk_shares_one_selection():
    model = tiny_model("llama")
    doc = torch.randint(1, 96, (1, 300), generator=torch.Generator().manual_seed(2))
    cfg = PQCacheConfig(token_budget=0.2, n_init=4, kmeans_iters=5, bits=4, chunk_attention="selected")
    cache = PQCache(model, cfg)
    with torch.no_grad():
        model(doc, cache=cache)
        logits = model(doc[:, :10], cache=cache).logits
    assert torch.isfinite(logits).all()
    layer = cache.pq_layers[0]
    top, valid = layer.last_selection
    assert top.shape[:2] == (1, 2)  # one top-k set per KV head for the whole 10-token chunk
    _, n_topk, _ = cache.pq_config.split(300)  # the budget of the 300 cached tokens
    assert int(valid.sum()) == 2 * n_topk


def test_sliding_layers_keep_exact_window():
    model = tiny_model("gemma3")
    cache = PQCache(model, FULL_BUDGET)
    kinds = [type(layer).__name__ for layer in cache.layers]
    assert kinds[1] == "PQLayer" and kinds[0] != "PQLayer" and kinds[2] != "PQLayer"
    with torch.no_grad():
        model(torch.randint(1, 96, (1, 60)), cache=cache)
    assert cache.layers[0].keys.shape[2] <= 24 + 1  # the sliding window, not the context


def test_memory_accounting_and_tiers():
    model = tiny_model("llama")
    cfg = PQCacheConfig(token_budget=0.2, n_init=4, kmeans_iters=5, bits=4, m=2)
    cache = PQCache(model, cfg)
    with torch.no_grad():
        model(torch.randint(1, 96, (1, 400)), cache=cache)
    cache.wait()
    stats = cache.stats()
    B, H, D, S = 1, 2, 16, 400
    layer = cache.pq_layers[0]
    assert layer.method_state["index"].codes.dtype == torch.uint8
    n_layers = len(cache.pq_layers)
    # a token's m codes and its float32 residual, and the centroids
    assert stats["pq_bytes"] == n_layers * B * H * ((cfg.m + 4) * S + cfg.n_centroids * D * 4)
    assert stats["host_kv_bytes"] == n_layers * 2 * B * H * S * D * 2  # float16: kv_dtype "auto" on a CPU
    n_init, n_topk, n_local = cfg.split(S)
    # device: [sinks | window | 1 new token] at the host tier's float16 on a CPU (its block cache keeps books only);
    # the top-k part of the buffer is made by the first step that copies picks into it
    per_layer_tokens = n_init + n_local + 1
    assert stats["device_kv_bytes"] == n_layers * 2 * B * H * per_layer_tokens * D * 2
    with torch.no_grad():
        model(torch.randint(1, 96, (1, 1)), cache=cache)
    copied = 0 if layer.host.reads_in_place else n_topk  # a CPU's one-row step reads the picks where they lie
    assert cache.stats()["device_kv_bytes"] == n_layers * 2 * B * H * (per_layer_tokens + copied) * D * 2


def test_non_pq_cache_still_exact_after_pqcache_attached():
    model = tiny_model("qwen2")
    ids = torch.randint(1, 96, (1, 40))
    with torch.no_grad():
        before = model(ids).logits
        PQCache(model, FULL_BUDGET)
        after = model(ids, cache=DynamicCache(config=model.config)).logits
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)


def test_pq_layer_rejects_beam_search():
    model = tiny_model("llama")
    ids = torch.randint(1, 96, (1, 30))
    with pytest.raises(NotImplementedError, match="beam"):
        model.generate(ids, num_beams=2, max_new_tokens=2, cache=PQCache(model, FULL_BUDGET), pad_token_id=0)


def test_question_chunk_attends_exactly_then_decoding_selects():
    """chunk_attention="exact" (default): a question after a cached document sees every cached token,
    so its logits equal full attention's even at a small budget; the next step selects within the
    budget again and the device buffer is back to the budget's size."""
    model = tiny_model("llama")
    g = torch.Generator().manual_seed(12)
    doc, question = torch.randint(1, 96, (1, 300), generator=g), torch.randint(1, 96, (1, 12), generator=g)
    cfg = PQCacheConfig(token_budget=0.2, n_init=4, kmeans_iters=5, bits=4)
    assert cfg.chunk_attention == "exact"
    with torch.no_grad():
        ref_cache = full_attention_cache(model)
        model(doc, cache=ref_cache)
        ref = model(question, cache=ref_cache).logits
        cache = PQCache(model, cfg)
        model(doc, cache=cache)
        out = model(question, cache=cache).logits
        layer = cache.pq_layers[0]
        assert int(layer.last_selection[1].sum()) > 2 * cfg.split(300)[1]  # more than the budget: all of it
        device_after_chunk = cache.stats()["device_kv_bytes"]
        model(torch.tensor([[3]]), cache=cache)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert int(layer.last_selection[1].sum(-1).max()) <= max(layer.topk_counts())  # the budget again
    assert cache.stats()["device_kv_bytes"] <= device_after_chunk
    n_init, n_topk, n_local = cfg.split(300)
    per_layer = n_init + layer.window.L + layer.window.k_cap + layer.window.q_cap
    assert layer.window.k_cap < 300 and per_layer < 300  # the whole context is not kept on the device


def test_append_sliding_layer_returns_what_transformers_layer_returns(monkeypatch):
    """Decode steps append in place (no copy of the window), yet every update returns the same keys and values,
    and the mask sizes stay the same, through buffer moves, a multi-token chunk and a reorder."""
    from transformers.cache_utils import DynamicSlidingWindowLayer

    from pqcache.engine.layer import sliding

    monkeypatch.setattr(sliding, "SPARE", 5)  # move the window every few steps
    g = torch.Generator().manual_seed(0)
    ref, new = DynamicSlidingWindowLayer(sliding_window=8), sliding.AppendSlidingWindowLayer(sliding_window=8)
    steps = [3, 1, 1, 1, 1, 1, 1, 1, 1, 6, 1, 1, 2, 1, 1, 1, 1, 1, 1, 1, 1, 1]
    for i, q in enumerate(steps):
        k, v = torch.randn(2, 2, q, 4, generator=g), torch.randn(2, 2, q, 4, generator=g)
        if i == 15:  # something outside update replaces the window: the next step starts a new buffer
            for layer in (ref, new):
                layer.reorder_cache(torch.tensor([1, 0]))
        want, got = ref.update(k, v), new.update(k, v)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), i
        assert torch.equal(new.keys, ref.keys) and new.get_mask_sizes(1) == ref.get_mask_sizes(1)
    assert new.buf_k is not None  # the last steps ran in place


@pytest.mark.parametrize(
    "settings",
    [
        dict(token_budget=0.1, n_init=4, n_local=5000),  # a window past the document
        dict(token_budget=0.1, n_init=5000, n_local=8),  # sinks past the document
        dict(token_budget=5000, n_init=4, n_local=8),  # a budget past the document, as a count
        dict(token_budget=1.0, n_init=4, n_local=5000),
    ],
)
def test_a_selection_past_the_document_equals_full_attention(arch, settings):
    """Whenever sinks, window or budget cover every cached token, PQCache is full attention: no token twice (a
    window that reaches back over the sinks), no negative block count (the block cache on, as a GPU has it)."""
    model = tiny_model(arch)
    ids, mask = _batch(seed=5, lengths=(300,))
    cfg = PQCacheConfig(kmeans_iters=5, bits=4, block_size=16, block_cache_tokens=64, **settings)
    with torch.no_grad():
        ref_seq, ref_scores = greedy_generate(model, ids, full_attention_cache(model), mask=mask)
        cache = PQCache(model, cfg)
        seq, scores = greedy_generate(model, ids, cache, mask=mask)
    torch.testing.assert_close(scores, ref_scores, rtol=1e-5, atol=1e-5)
    assert torch.equal(seq, ref_seq)
