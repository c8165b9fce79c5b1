"""Product quantization: search = brute force over reconstructed keys, uint8 codes, recall, config errors."""

import pytest
import torch

from pqcache import PQCache, PQCacheConfig, PQCacheConfigError
from pqcache.engine import pq
from pqcache.engine.full_attention import full_attention_cache
from pqcache.engine.layer.standalone import filled_layer
from tests.tiny import tiny_model


def _train(keys, m, bits, metric="l2"):
    B, H, S, D = keys.shape
    cents = torch.stack(
        [torch.stack([pq.train_centroids(keys[b, h], m, 1 << bits, 10, metric, 0) for h in range(H)]) for b in range(B)]
    )
    return cents, pq.encode(keys, cents, metric)


@pytest.mark.parametrize("m,bits", [(2, 6), (4, 8), (8, 3)])
def test_search_scores_equal_brute_force_over_reconstruction(m, bits):
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(2, 3, 700, 32, generator=g)
    cents, codes = _train(keys, m, bits)
    assert codes.dtype == torch.uint8 and codes.shape == (2, 3, m, 700)
    assert int(codes.max()) < (1 << bits)
    q = torch.randn(2, 3, 5, 32, generator=g)
    approx = pq.approx_scores(pq.lookup_tables(q, cents), codes)  # (B, H, S, R)
    recon = pq.reconstruct(codes, cents)  # (B, H, S, D)
    brute = torch.einsum("bhsd,bhrd->bhsr", recon, q)
    torch.testing.assert_close(approx, brute, rtol=1e-4, atol=1e-4)


def test_codes_are_nearest_centroids():
    keys = torch.randn(1, 1, 300, 16, generator=torch.Generator().manual_seed(1))
    cents, codes = _train(keys, 2, 4)
    for j in range(2):
        sub = keys[0, 0, :, j * 8 : (j + 1) * 8]
        nearest = torch.cdist(sub, cents[0, 0, j]).argmin(-1)
        assert torch.equal(codes[0, 0, j].long(), nearest)


def test_ip_metric_codes_maximise_inner_product():
    keys = torch.randn(1, 1, 300, 16, generator=torch.Generator().manual_seed(2))
    cents, codes = _train(keys, 2, 4, metric="ip")
    sub = keys[0, 0, :, :8]
    assert torch.equal(codes[0, 0, 0].long(), (sub @ cents[0, 0, 0].T).argmax(-1))


@pytest.mark.parametrize("metric", ["l2", "ip"])
def test_codes_coded_in_blocks_equal_each_token_coded_alone(monkeypatch, metric):
    """encode codes a long prefill ENCODE_BLOCK tokens at a time (its memory): the same codes as a decode step gets
    coding one key, blocks' edges and a short last block included."""
    monkeypatch.setattr(pq, "ENCODE_BLOCK", 64)
    keys = torch.randn(2, 2, 200, 16, generator=torch.Generator().manual_seed(3))
    cents = torch.randn(2, 2, 2, 16, 8, generator=torch.Generator().manual_seed(4))
    codes = pq.encode(keys, cents, metric)
    alone = torch.cat([pq.encode(keys[:, :, s : s + 1], cents, metric) for s in range(200)], dim=-1)
    assert codes.shape == (2, 2, 2, 200) and torch.equal(codes, alone)


def test_fewer_points_than_centroids_is_exact():
    keys = torch.randn(1, 1, 10, 16)
    cents, codes = _train(keys, 2, 6)
    torch.testing.assert_close(pq.reconstruct(codes, cents), keys)


def _needle_recall(m, bits, seed, S=4096, D=64, n_needles=60):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(D, generator=g)
    keys = torch.randn(S, D, generator=g)
    needles = torch.randperm(S - 100, generator=g)[:n_needles] + 50
    keys[needles] += 6 * q / q.norm()  # 6 sigma above the other keys along q
    keys = keys.view(1, 1, S, D)
    cfg = PQCacheConfig(m=m, bits=bits, token_budget=4 + n_needles + 8, n_init=4, n_local=8, kmeans_iters=20)
    layer = filled_layer(keys, torch.randn_like(keys), cfg)
    top, valid = layer.select(q.view(1, 1, 1, D), scaling=D**-0.5)
    assert int(valid.sum()) == n_needles
    exact = keys[0, 0] @ q
    exact[:4] = exact[S - 8 :] = float("-inf")  # sinks and window are attended anyway
    exact_top = set(exact.topk(n_needles).indices.tolist())
    return len(exact_top & set(top[0, 0][valid[0, 0]].tolist())) / n_needles


@pytest.mark.parametrize("m,bits,threshold", [(2, 6, 0.85), (8, 8, 0.9)])
def test_pq_topk_recall_on_planted_structure(m, bits, threshold):
    """Isotropic random keys (PQ's hardest case) with 60 planted needles: mean recall of the exact
    top-60 over 3 seeds reaches the threshold; a random pick would find 60/4096 = 1.5%."""
    recall = sum(_needle_recall(m, bits, seed) for seed in range(3)) / 3
    assert recall >= threshold, recall


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"m": 0}, "m \\(number of sub-spaces\\)"),
        ({"bits": 9}, "bits must be None or an int in 1..8"),
        ({"bits": 0}, "bits must be None or an int in 1..8"),
        ({"token_budget": 0}, "token_budget must be > 0"),
        ({"token_budget": -0.5}, "token_budget must be > 0"),
        ({"token_budget": 2.5}, "neither a fraction"),
        ({"n_init": -1}, "n_init must be an int >= 0"),
        ({"n_local": 0}, "n_local must be None or an int >= 1"),
        ({"kmeans_iters": 0}, "kmeans_iters must be 'auto' or an int >= 1"),
        ({"kmeans_iters": "fast"}, "kmeans_iters must be 'auto'"),
        ({"metric": "cosine"}, "metric must be one of l2, ip, got 'cosine'"),
        ({"token_budget": 64, "n_init": 32, "n_local": 40}, "cannot hold n_init=32 sinks plus n_local=40"),
    ],
)
def test_bad_config_raises_readable_error(kwargs, match):
    with pytest.raises(PQCacheConfigError, match=match):
        PQCacheConfig(**kwargs)


def test_m_must_divide_head_dim():
    with pytest.raises(PQCacheConfigError, match="m=3 must divide the model's head_dim=16"):
        PQCache(tiny_model("llama"), PQCacheConfig(m=3))


def test_budget_split():
    cfg = PQCacheConfig(token_budget=0.2, n_init=32)
    assert cfg.split(1000) == (32, 84, 84)
    assert sum(cfg.split(1000)) == 200
    assert PQCacheConfig(token_budget=512, n_init=4, n_local=100).split(10_000) == (4, 408, 100)
    assert PQCacheConfig(token_budget=1.0, n_init=4, n_local=8).split(50) == (4, 38, 8)


@pytest.mark.parametrize("on_failure", ["raise", "exact"])
def test_failed_build_in_a_hand_filled_layer_reports_the_real_error(monkeypatch, on_failure):
    """Benchmarks and the recall study fill layers by hand with an inline executor: a build that
    fails there goes through the same fault path as in a cache (the executor is shut down), and
    the error named is the build's own."""
    from pqcache.engine.errors import PQBuildError

    def broken(*args, **kwargs):
        raise ValueError("k-means exploded")

    monkeypatch.setattr(pq, "train_centroids", broken)
    keys = torch.randn(1, 1, 200, 16, generator=torch.Generator().manual_seed(1))
    cfg = PQCacheConfig(token_budget=40, n_init=4, n_local=8, bits=4, block_cache_tokens=0, on_pq_failure=on_failure)
    if on_failure == "raise":
        with pytest.raises(PQBuildError, match="k-means exploded"):
            filled_layer(keys, keys, cfg)
        return
    layer = filled_layer(keys, keys, cfg)
    assert "k-means exploded" in layer.fallback and layer.method.name == "full"
    top, valid = layer.select(keys[:, :, :1], 1.0)
    assert int(valid.sum()) == 200 - 4 - 8  # exact: every middle token


@pytest.mark.parametrize("S,D", [(2048, 256), (8192, 256), (4096, 128), (16384, 128)])
def test_default_codes_and_centroids_within_a_sixteenth_of_the_fp16_keys(S, D):
    """m from head_dim (sub-spaces of at most 64 dims), bits from the length: the index on the device
    (uint8 codes + float32 centroids) stays within 1/16 of the fp16 keys it indexes."""
    cfg = PQCacheConfig(token_budget=0.1, kmeans_iters=1, block_cache_tokens=0).for_head_dim(D)
    assert cfg.m == D // 64
    bits = cfg.bits_for(S, D)
    assert 4 <= bits <= 8
    keys = torch.randn(1, 1, S, D, generator=torch.Generator().manual_seed(S))
    layer = filled_layer(keys, keys, cfg, iters=1)
    index = layer.method_state["index"]
    assert index.bits == bits and index.codes.dtype == torch.uint8
    assert layer.memory()["pq_bytes"] <= S * D * 2 / 16
    expected = {(2048, 256): 5, (8192, 256): 7, (4096, 128): 6, (16384, 128): 8}[(S, D)]
    assert bits == expected  # the most bits that fit: longer contexts afford more centroids


def test_opq_rotates_keys_and_queries_consistently():
    """With opq=True the codebooks quantize R k for a learned orthogonal R: PQ scores equal
    (R q) . reconstruct(codes), new tokens are coded in the rotated space, and a full budget is
    still exact attention."""
    from pqcache.engine.methods.pqcache import approx_scores

    g = torch.Generator().manual_seed(0)
    keys = torch.randn(1, 1, 2000, 32, generator=g) * torch.linspace(0.1, 3, 32)  # anisotropic
    cfg = PQCacheConfig(m=2, bits=5, token_budget=0.1, kmeans_iters=5, block_cache_tokens=0, opq=True)
    layer = filled_layer(keys, keys, cfg, iters=5)
    index = layer.method_state["index"]
    R = index.rotations[0][0, 0]
    assert torch.allclose(R @ R.T, torch.eye(32), atol=1e-4) and not torch.allclose(R, torch.eye(32))
    q = torch.randn(1, 1, 3, 32, generator=g)
    recon = pq.reconstruct(index.codes[..., :2000], index.segments[0][1])  # (1, 1, S, 32) in rotated space
    expected = recon @ (q @ R.T).transpose(-1, -2)  # (1, 1, S, 3)
    torch.testing.assert_close(approx_scores(index, q), expected, rtol=1e-4, atol=1e-4)
    k_new = torch.randn(1, 1, 1, 32, generator=g)
    assert torch.equal(index.encode(k_new)[0], pq.encode(k_new @ R.T, index.segments[0][1], "l2"))


def test_opq_at_full_budget_equals_full_attention():
    model = tiny_model("qwen2")
    ids = torch.randint(1, 96, (1, 1200), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = model(ids, cache=full_attention_cache(model)).logits[:, -1]  # full attention at the same KV dtype
        cache = PQCache(model, PQCacheConfig(token_budget=1.0, n_init=4, bits=4, kmeans_iters=3, opq=True))
        model(ids[:, :-1], cache=cache)
        out = model(ids[:, -1:], cache=cache).logits[:, -1]
    assert cache.pq_layers[0].method_state["index"].rotations  # 1199 keys: enough to train a rotation
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_default_m_gives_subspaces_of_at_most_64_dims():
    for head_dim, m in [(16, 1), (64, 1), (80, 2), (96, 2), (128, 2), (256, 4), (192, 3), (320, 5)]:
        assert PQCacheConfig().for_head_dim(head_dim).m == m
        assert head_dim // m <= 64 and head_dim % m == 0
    assert PQCacheConfig(m=8).for_head_dim(256).m == 8  # a setting is kept
    with pytest.raises(PQCacheConfigError, match="must divide the model's head_dim"):
        PQCacheConfig(m=3).for_head_dim(128)
