"""Half-precision keys and values in the host tier (PQCacheConfig.kv_dtype), against full attention at the same KV
dtype (engine/full_attention.py), on tiny random models."""

import pytest
import torch
from transformers import DynamicCache

from pqcache import PQCache, PQCacheConfig
from pqcache.engine.cache import kv_bytes
from pqcache.engine.full_attention import RoundedLayer, full_attention_cache
from pqcache.engine.snapshot import restore, snapshot
from pqcache.serving.footprint import document_bytes
from pqcache.serving.generate import make_cache, prefill
from tests.tiny import greedy_generate, tiny_model

FULL = dict(token_budget=1.0, n_init=4, n_local=8, kmeans_iters=5, bits=4)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("kv", ["auto", "float16", "bfloat16", "model"])
def test_a_full_budget_equals_full_attention_at_the_same_kv_dtype(arch, kv):
    """Both paths: the question in the prompt (one prefill, then decoding) and the document first (a prefill, then
    the question as a chunk, then decoding): PQCache's tokens and logits are full attention's at its KV dtype."""
    model = tiny_model(arch)
    g = torch.Generator().manual_seed(4)
    doc, question = torch.randint(1, 96, (1, 200), generator=g), torch.randint(1, 96, (1, 9), generator=g)
    cfg = PQCacheConfig(**FULL, kv_dtype=kv)
    with torch.no_grad():
        ref_seq, ref_scores = greedy_generate(model, torch.cat([doc, question], 1), full_attention_cache(model, cfg))
        seq, scores = greedy_generate(model, torch.cat([doc, question], 1), PQCache(model, cfg))
        assert torch.equal(seq, ref_seq)
        torch.testing.assert_close(scores, ref_scores, rtol=1e-5, atol=1e-5)
        cache, ref_cache = PQCache(model, cfg), full_attention_cache(model, cfg)
        for c in (cache, ref_cache):
            prefill(model, doc, c)
        out, ref = model(question, cache=cache).logits, model(question, cache=ref_cache).logits
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    want = {"auto": torch.float16, "model": torch.float32}.get(kv) or getattr(torch, kv)
    assert all(layer.host.dtype == want for layer in cache.pq_layers)
    rounded = [type(layer) is RoundedLayer for layer in ref_cache.layers]
    assert any(rounded) == (want != torch.float32)


def test_the_rounding_is_real_and_halves_the_host_tiers_bytes():
    """float16 keys and values are not float32's (the logits move by float16's rounding), the host tier and the
    step's buffer hold half the bytes, and kv_dtype "model" keeps the model's float32 (the plain DynamicCache is its
    reference)."""
    model = tiny_model("llama")
    ids = torch.randint(1, 96, (1, 150), generator=torch.Generator().manual_seed(9))
    runs = {}
    with torch.no_grad():
        for kv in ("float16", "model"):
            cache = PQCache(model, PQCacheConfig(**FULL, kv_dtype=kv))
            runs[kv] = (greedy_generate(model, ids, cache)[1], cache.stats())
        _, plain = greedy_generate(model, ids, DynamicCache(config=model.config))
    half, wide = runs["float16"], runs["model"]
    torch.testing.assert_close(wide[0], plain, rtol=1e-5, atol=1e-5)
    assert not torch.equal(half[0], wide[0])
    torch.testing.assert_close(half[0], wide[0], rtol=0.02, atol=0.02)  # float16's rounding, not another model
    assert half[1]["host_kv_bytes"] * 2 == wide[1]["host_kv_bytes"]
    # on a CPU the step's buffer holds copies of host rows, at their dtype too
    assert half[1]["device_kv_bytes"] * 2 == wide[1]["device_kv_bytes"]


def test_generate_and_evals_full_method_run_at_the_configs_kv_dtype():
    """make_cache("full"), what `generate` and `eval` run for full attention, rounds as the config says."""
    model = tiny_model("qwen2")
    assert any(type(layer) is RoundedLayer for layer in make_cache(model, "full", PQCacheConfig()).layers)
    assert not any(
        type(layer) is RoundedLayer for layer in make_cache(model, "full", PQCacheConfig(kv_dtype="model")).layers
    )


def _answer(model, cache, n=5):
    """A 3-token question, then n - 1 greedy tokens -> (tokens (1, n), the last logits)."""
    tok, out = torch.tensor([[7, 8, 9]]), []
    for _ in range(n):
        logits = model(tok, cache=cache).logits[:, -1]
        tok = logits.argmax(-1, keepdim=True)
        out.append(tok)
    return torch.cat(out, 1), logits


def test_a_snapshot_keeps_half_rows_and_answers_as_the_prefill_did():
    """The store's tensors hold the float16 rows as they are (half the bytes on disk), and a cache read back from
    them answers token for token as the prefilled one did."""
    model = tiny_model("gemma3")
    ids = torch.randint(1, 96, (1, 180), generator=torch.Generator().manual_seed(2))
    cfg = PQCacheConfig(token_budget=0.3, n_init=4, kmeans_iters=3, bits=4)
    with torch.no_grad():
        cache = PQCache(model, cfg)
        prefill(model, ids, cache)
        tensors, meta = snapshot(cache)
        pq_keys = [tensors[f"{i}.keys"] for i, entry in enumerate(meta["layers"]) if entry["kind"] == "pq"]
        assert pq_keys and all(t.dtype == torch.float16 for t in pq_keys)
        back = restore(model, cfg, tensors, meta)
        (a, a_logits), (b, b_logits) = _answer(model, cache.fork("pqcache")), _answer(model, back.fork("pqcache"))
    assert torch.equal(a, b)
    torch.testing.assert_close(a_logits, b_logits, rtol=1e-5, atol=1e-5)
    assert all(layer.host.dtype == torch.float16 for layer in back.pq_layers)


def test_the_pools_reservation_counts_the_host_tier_at_its_kv_dtype():
    """The bytes the session pool reserves for a document: the host tier's share and, on a CPU, the step's buffer
    (copies of host rows) halve with float16 rows; the PQ codes and centroids do not. A model whose every layer is a
    full-attention layer (as SmolLM2's 30) then holds 1.9 times the documents under one cap."""
    model = tiny_model("llama")
    n = 8192
    half = document_bytes(model, PQCacheConfig(), "pqcache", n, "cpu")
    wide = document_bytes(model, PQCacheConfig(kv_dtype="float32"), "pqcache", n, "cpu")
    text = model.config
    host_wide = text.num_hidden_layers * 2 * text.num_key_value_heads * (text.hidden_size // text.num_attention_heads)
    buffer_wide = host_wide * (PQCacheConfig().budget_tokens(n) + 1) * 4  # the budget plus the new token's slot
    host_wide *= n * 4
    assert wide - half == host_wide // 2 + buffer_wide // 2
    cap = 64 * wide  # 64 documents of float32 rows; of float16 rows 124 here (the PQ index stays)
    assert cap // half >= 112


def test_sliding_windows_keep_the_kv_dtype_and_hand_the_model_its_own():
    """Gemma 3's sliding-window layers store their window at the KV dtype (half the bytes of float32's, the decode
    steps' buffer included) and hand the model float32 keys and values, in prefill chunks and decode steps."""
    model = tiny_model("gemma3")
    ids = torch.randint(1, 96, (1, 60), generator=torch.Generator().manual_seed(5))
    caches = {}
    with torch.no_grad():
        for kv in ("float16", "model"):
            caches[kv] = cache = PQCache(model, PQCacheConfig(**FULL, kv_dtype=kv))
            greedy_generate(model, ids, cache)
    half, wide = caches["float16"].layers[0], caches["model"].layers[0]
    assert half.keys.dtype == torch.float16 and wide.keys.dtype == torch.float32
    assert half.buf_k is not None and kv_bytes(half) * 2 == kv_bytes(wide) > 0  # the decode buffer is counted
    k = torch.randn(1, 2, 1, 16)
    keys, values = half.update(k, k)
    assert keys.dtype == values.dtype == torch.float32 and torch.equal(keys[:, :, -1:], k.half().float())
