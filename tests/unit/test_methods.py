"""Every selection method under one interface: exact at full budget, each rule on a case with a known answer."""

import pytest
import torch

from pqcache import PQCache, PQCacheConfig
from pqcache.engine.full_attention import full_attention_cache
from pqcache.engine.methods import METHODS, make_method
from pqcache.engine.methods.pyramidkv import pyramid_budgets
from tests.tiny import greedy_generate, tiny_model

ALL = list(METHODS)
SMALL = dict(n_init=4, kmeans_iters=5, bits=4, block_size=16, block_cache_tokens=64)


def test_registry_names():
    """Each of the nine names builds the method of that name; an unknown name is refused with the choices."""
    assert len(ALL) == 9 and [make_method(name).name for name in ALL] == ALL
    with pytest.raises(ValueError, match="unknown method 'nope'; choose one of full, oracle"):
        make_method("nope")


@pytest.mark.parametrize("method", ALL)
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_every_method_at_full_budget_equals_full_attention(method, arch):
    model = tiny_model(arch)
    ids = torch.randint(1, 96, (2, 150), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :30] = 0
    ids[1, :30] = 0
    with torch.no_grad():
        _, ref = greedy_generate(model, ids, full_attention_cache(model), mask=mask)
        cache = PQCache(model, PQCacheConfig(token_budget=1.0, **SMALL), method=method)
        _, scores = greedy_generate(model, ids, cache, mask=mask)
    torch.testing.assert_close(scores, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("method", ALL)
def test_fork_after_one_prefill_matches_a_fresh_cache(method):
    """Comparing N methods costs one prefill: a fork continues exactly like a cache of that method."""
    model = tiny_model("llama")
    ids = torch.randint(1, 96, (1, 300), generator=torch.Generator().manual_seed(1))
    cfg = PQCacheConfig(token_budget=0.2, **SMALL)
    with torch.no_grad():
        base = PQCache(model, cfg, keep_queries=True)
        model(ids, cache=base)
        fork = base.fork(method)
        fresh = PQCache(model, cfg, method=method)
        model(ids, cache=fresh)
        fork.wait(), fresh.wait()
        tok = torch.tensor([[5]])
        out_fork = model(tok, cache=fork).logits
        out_fresh = model(tok, cache=fresh).logits
        out_base = model(tok, cache=base).logits  # the base goes on with its own method, untouched
    torch.testing.assert_close(out_fork, out_fresh, rtol=1e-5, atol=1e-5)
    assert fork.layers[0] is not base.layers[0] and fork.pq_layers[0].S == base.pq_layers[0].S == 301
    assert torch.isfinite(out_base).all()


def _one_step(method, ids, cfg, model=None, **kw):
    model = model or tiny_model("llama")
    cache = PQCache(model, cfg, method=make_method(method, **kw))
    with torch.no_grad():
        model(ids, cache=cache)
        cache.wait()
        model(torch.tensor([[7]]), cache=cache)
    return cache, cache.pq_layers[0]


def _selected(layer):
    top, valid = layer.last_selection
    return [set(top[0, h][valid[0, h]].tolist()) for h in range(top.shape[1])]


def test_oracle_equals_exact_ranking_on_planted_keys():
    """A layer filled by hand: the oracle picks exactly the k keys with the largest q.k."""
    from pqcache.engine.layer.standalone import filled_layer

    g = torch.Generator().manual_seed(3)
    keys = torch.randn(1, 1, 500, 16, generator=g)
    layer = filled_layer(
        keys,
        torch.randn_like(keys),
        PQCacheConfig(token_budget=60, n_init=4, n_local=6, bits=4, block_cache_tokens=0, gqa_combine="sum"),
    )
    layer.method = make_method("oracle")
    q = torch.randn(1, 1, 1, 16, generator=g)
    top, valid = layer.select(q, 1.0)
    exact = keys[0, 0] @ q[0, 0, 0]
    exact[:4] = exact[494:] = float("-inf")
    assert set(top[0, 0][valid[0, 0]].tolist()) == set(exact.topk(50).indices.tolist())


def test_sparq_with_full_rank_selects_like_oracle():
    ids = torch.randint(1, 96, (1, 400), generator=torch.Generator().manual_seed(4))
    cfg = PQCacheConfig(token_budget=0.15, **SMALL)
    _, oracle = _one_step("oracle", ids, cfg)
    _, sparq = _one_step("sparq", ids, cfg, r=16)  # r = head_dim
    assert _selected(sparq) == _selected(oracle)
    _, sparq4 = _one_step("sparq", ids, cfg, r=4)
    assert _selected(sparq4) != _selected(oracle)  # fewer components: an approximation


def test_streaming_keeps_sinks_and_recent_only():
    ids = torch.randint(1, 96, (1, 400), generator=torch.Generator().manual_seed(5))
    cfg = PQCacheConfig(token_budget=0.2, **{**SMALL, "n_init": 32})
    cache, layer = _one_step("streaming", ids, cfg)
    assert layer.window.n_init == 4  # StreamingLLM's 4 sinks, whatever n_init says
    S = 400
    budget = cfg.budget_tokens(S)
    for sel in _selected(layer):  # the selection continues the window: the newest candidates
        window_start = S - layer.window.n_local[0]
        assert sel == set(range(window_start - len(sel), window_start))
        assert 4 + len(sel) + layer.window.n_local[0] == budget


def _prefilled(method, seed, n=300):
    """A tiny Llama and a cache of `method` prefilled with n random tokens."""
    model = tiny_model("llama")
    cache = PQCache(model, PQCacheConfig(token_budget=0.2, **SMALL), method=method)
    with torch.no_grad():
        model(torch.randint(1, 96, (1, n), generator=torch.Generator().manual_seed(seed)), cache=cache)
    return model, cache, cache.pq_layers[0]


def test_snapkv_keeps_what_the_window_attends_to_and_freezes():
    model, cache, layer = _prefilled("snapkv", seed=6)
    with torch.no_grad():
        scores = layer.method_state["scores"]  # pooled attention of the last 32 prompt queries
        cand = layer.candidates()[0]
        k = layer.topk_counts()[0]
        expected = [set(scores[0, h].masked_fill(~cand, float("-inf")).topk(k).indices.tolist()) for h in range(2)]
        steps = []
        for t in range(4):
            model(torch.tensor([[7 + t]]), cache=cache)
            steps.append(_selected(layer))
    first = steps[0]
    assert first == expected
    window_start = 300 - layer.window.n_local[0]  # the prompt's observation window stays kept as well
    for later in steps[1:]:  # frozen: the prompt part never changes; new tokens only add
        assert all(f <= s and all(p >= window_start or p in f for p in s) for f, s in zip(first, later))


def test_pyramid_budgets_shrink_with_depth_and_sum_to_total():
    b = pyramid_budgets(100, 8, 20.0, cap=10_000)
    assert b == sorted(b, reverse=True) and b[0] > b[-1]
    assert sum(b) == 800
    assert b[-1] == 5  # k / beta
    clipped = pyramid_budgets(100, 4, 20.0, cap=120)  # raw 195, 131, 68, 5: the clipped excess moves up
    assert clipped == [120, 120, 112, 48] and sum(clipped) == 400
    assert pyramid_budgets(100, 4, 20.0, cap=90) == [90] * 4  # budget covers everything
    model = tiny_model("llama")
    cache = PQCache(model, PQCacheConfig(token_budget=0.2, **SMALL), method="pyramidkv")
    with torch.no_grad():
        model(torch.randint(1, 96, (1, 400)), cache=cache)
    ks = [layer.topk_counts()[0] for layer in cache.pq_layers]
    assert ks == sorted(ks, reverse=True) and ks[0] > ks[-1]
    assert sum(ks) == 3 * PQCacheConfig(token_budget=0.2, **SMALL).split(400)[1]


def test_h2o_accumulates_scores_and_evicts_for_good():
    model, cache, layer = _prefilled("h2o", seed=7)
    with torch.no_grad():
        acc0 = layer.method_state["acc"].clone()
        assert acc0.sum().item() == pytest.approx(2 * 2 * 300, rel=1e-4)  # 2 KV heads x 2 query heads x 300 queries
        sels = []
        for t in range(5):
            model(torch.tensor([[3 + t]]), cache=cache)
            sels.append(_selected(layer))
        acc = layer.method_state["acc"]
    assert (acc[..., :300] >= acc0 - 1e-6).all() and acc.sum() > acc0.sum()  # accumulated over steps
    assert layer.window.n_init == 0
    kept = layer.method_state["kept"]
    evicted = (~kept[..., :300]).sum().item()
    assert evicted > 0
    for h in range(2):  # once evicted, never selected again
        gone = set((~kept[0, h, :300]).nonzero().squeeze(1).tolist())
        assert not (gone & sels[-1][h])


def test_infllm_picks_blocks_by_representative_keys():
    from pqcache.engine.layer.standalone import filled_layer

    g = torch.Generator().manual_seed(8)
    D, bs = 16, 16
    keys = torch.randn(1, 1, 320, D, generator=g) * 0.1
    q = torch.randn(1, 1, 1, D, generator=g)
    keys[0, 0, 5 * bs + 3] = 5 * q[0, 0, 0]  # block 5 holds one key that points at q
    layer = filled_layer(
        keys, torch.randn_like(keys), PQCacheConfig(token_budget=40, n_init=4, n_local=8, bits=4, block_cache_tokens=0)
    )
    method = make_method("infllm", block_size=bs, n_rep=2)
    layer.method = method
    queries = q.expand(1, 1, 320, D)  # the blocks' own queries
    method.on_prefill(layer.view(), queries, 1.0)
    top, valid = layer.select(q, 1.0)
    sel = set(top[0, 0][valid[0, 0]].tolist())
    assert set(range(5 * bs, 6 * bs)) <= sel  # the whole block with the matching representative
    assert len(sel) <= 2 * bs  # ceil(28 / 16) = 2 blocks


def test_selected_positions_reach_instrumentation():
    model = tiny_model("llama")
    cache = PQCache(model, PQCacheConfig(token_budget=0.2, **SMALL), method="streaming")
    obs = cache.instrument(selections=True)
    with torch.no_grad():
        model(torch.randint(1, 96, (1, 200)), cache=cache)
        model(torch.tensor([[5]]), cache=cache)
    rec = [r for r in obs.selected if r["layer"] == 0]
    (step,) = rec
    positions = step["positions"][0][0]
    assert positions[:4] == [0, 1, 2, 3] and positions[-1] == 200  # sinks ... the new token
    assert len(positions) == PQCacheConfig(token_budget=0.2, **SMALL).budget_tokens(200) + 1


def test_infllm_scores_the_block_that_straddles_the_window():
    """The last complete block reaches into the local window: its older positions are candidates,
    its newest are not. It must still be scored (and win here), not count as empty."""
    from pqcache.engine.layer.standalone import filled_layer

    g = torch.Generator().manual_seed(9)
    D, bs = 16, 16
    keys = torch.randn(1, 1, 320, D, generator=g) * 0.1
    q = torch.randn(1, 1, 1, D, generator=g)
    keys[0, 0, 19 * bs + 2] = 5 * q[0, 0, 0]  # block 19 = 304..319; the window is 312..319
    cfg = PQCacheConfig(token_budget=40, n_init=4, n_local=8, bits=4, block_cache_tokens=0)
    layer = filled_layer(keys, torch.randn_like(keys), cfg)
    method = make_method("infllm", block_size=bs, n_rep=2)
    layer.method = method
    method.on_prefill(layer.view(), q.expand(1, 1, 320, D), 1.0)
    assert not layer.candidates()[0, 319] and layer.candidates()[0, 306]
    top, valid = layer.select(q, 1.0)
    assert set(range(19 * bs, 19 * bs + 8)) <= set(top[0, 0][valid[0, 0]].tolist())


def test_fork_shares_the_document_instead_of_copying_it():
    """A fork reads the parent's host tier in place and stores only the tokens it appends; the
    parent's tokens are unchanged by what the fork decodes."""
    model = tiny_model("llama")
    base = PQCache(model, PQCacheConfig(token_budget=0.2, **SMALL), keep_queries=True)
    with torch.no_grad():
        model(torch.randint(1, 96, (1, 300), generator=torch.Generator().manual_seed(10)), cache=base)
        before = base.pq_layers[0].host.keys(0, 300).clone()
        fork = base.fork("pqcache")
        parent, child = base.pq_layers[0].host, fork.pq_layers[0].host
        assert child.shared_k.data_ptr() == parent.own_k.data_ptr() and child.own_bytes == 0
        tok = torch.tensor([[5]])
        for _ in range(3):
            tok = model(tok, cache=fork).logits[:, -1:].argmax(-1)
    assert child.S == 303 and parent.S == 300
    assert child.own_bytes == 2 * 1 * 2 * 3 * 16 * 2  # K and V of 3 tokens, 2 KV heads, head_dim 16, float16
    assert torch.equal(parent.keys(0, 300), before)
    assert torch.equal(child.keys(0, 300), before)  # read across the shared and own parts
    stats = fork.stats()
    assert stats["host_kv_bytes"] == base.stats()["host_kv_bytes"] * 303 // 300  # what the fork reads


def test_readme_example_method_runs():
    """The README's ~20-line example method, executed as written: it plugs into PQCache and picks
    exactly the top-k middle tokens by key norm."""
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme[readme.index("### Adding a method") :]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert 12 <= len(code.strip().splitlines()) <= 25
    namespace = {}
    exec(compile(code, "README.md", "exec"), namespace)
    method = namespace["KeyNorm"]()
    model = tiny_model("llama")
    cfg = PQCacheConfig(token_budget=60, n_init=4, n_local=8, bits=4, block_cache_tokens=0, gqa_combine="sum")
    cache = PQCache(model, cfg, method=method)
    with torch.no_grad():
        model(torch.randint(1, 96, (1, 300), generator=torch.Generator().manual_seed(11)), cache=cache)
        model(torch.tensor([[5]]), cache=cache)
    layer = cache.pq_layers[0]
    top, valid = layer.last_selection
    norms = layer.host.keys(0, 300).norm(dim=-1)[0].tolist()  # (H, S); RoPE keeps norms, so ties happen
    for h in range(2):  # middle tokens (after the sinks, before the window), ties to the earliest
        expected = sorted(range(4, 300 - 8), key=lambda i: (-norms[h][i], i))[:48]
        assert set(top[0, h][valid[0, h]].tolist()) == set(expected)


@pytest.mark.parametrize("k", [5, 40, 70])
def test_shared_top_k_reads_only_up_to_the_last_candidate(k):
    """select_top leaves the rows' tails after their last candidate (the local windows) out of the top-k: the same
    picks and validity as a top-k over the whole rows, ties to the earliest included; k = 70 is more than a row's
    candidates (the extra picks are invalid)."""
    from pqcache.engine.methods.base import combine_rows, select_top, topk_positions

    g = torch.Generator().manual_seed(k)
    B, H, S, R = 2, 2, 100, 3
    scores = torch.randn(B, H, S, R, generator=g).round(decimals=1)  # coarse values: ties at the k-th score
    cand = torch.zeros(B, S, dtype=torch.bool)
    cand[0, 4:80], cand[1, 10:61] = True, True  # sinks, then each row's window after its last candidate
    for mode in ("softmax_sum", "sum"):
        top, valid = select_top(scores, cand, [k, k], k, mode)
        full, full_valid = topk_positions(combine_rows(scores, cand, mode), [k, k], k)
        full_valid = full_valid & torch.gather(cand[:, None, :].expand(-1, H, -1), 2, full)
        for b in range(B):
            for h in range(H):
                got = sorted(top[b, h][valid[b, h]].tolist())
                assert got == sorted(full[b, h][full_valid[b, h]].tolist())
                assert len(got) == min(k, int(cand[b].sum()))


@pytest.mark.parametrize("seed", range(8))
def test_top_k_ties_go_to_the_earliest_positions(seed):
    """topk_positions picks every position above the k-th score, then the earliest at it: for one row and KV head (a
    decode step's few-operator pass) as for several, with coarse scores (ties at the k-th) and rows holding -inf
    (fewer candidates than k: the earliest -inf positions fill the picks, as the general pass's mask does)."""
    from pqcache.engine.methods.base import topk_positions

    g = torch.Generator().manual_seed(seed)
    for B, H in ((1, 1), (2, 3)):
        S = int(torch.randint(8, 200, (1,), generator=g))
        k = int(torch.randint(1, S, (1,), generator=g))
        scores = torch.randn(B, H, S, generator=g).round(decimals=seed % 2)
        if seed % 3 == 0:
            scores[..., S // 3 :] = float("-inf")
        top, valid = topk_positions(scores, [k] * B, k)
        assert valid.all() and top.shape == (B, H, k)
        for b in range(B):
            for h in range(H):
                row = scores[b, h].tolist()
                assert sorted(top[b, h].tolist()) == sorted(sorted(range(S), key=lambda i: (-row[i], i))[:k])
