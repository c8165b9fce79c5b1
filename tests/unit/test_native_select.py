"""PQCache's selection in C (native/select.py, pq_select.c) picks what torch's operators pick: the PQ search
(lookups, GQA combine, top-k with ties to the earliest positions) and the re-rank's combine and top-k, for several
rows, heads, budgets and candidate masks, on any thread count, and a decode with it gives the same tokens and
picks as one without it."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from pqcache import PQCache, PQCacheConfig, native
from pqcache.engine import pq
from pqcache.engine.kernels import Kernels
from pqcache.engine.methods.base import combine_rows, select_top, topk_positions
from pqcache.native import pq_step as native_step
from pqcache.native import select
from tests.tiny import greedy_generate, tiny_model

pytestmark = pytest.mark.skipif(native.library() is None, reason=native.status())


def _picked(top: torch.Tensor, valid: torch.Tensor) -> list[list[list[int]]]:
    """(B, H, k) positions and validity -> each (row, head)'s valid picks, sorted."""
    B, H, _ = top.shape
    return [[sorted(top[b, h][valid[b, h]].tolist()) for h in range(H)] for b in range(B)]


@pytest.mark.parametrize("mode", ["softmax_sum", "sum"])
@pytest.mark.parametrize("C, R", [(4, 4), (16, 2), (64, 3), (256, 8)])
@pytest.mark.parametrize("m", [1, 2])
def test_pq_search_picks_what_torchs_operators_pick(mode, C, R, m):
    """Few centroids make many tokens' codes (and scores) equal: ties at the k-th score, which go to the earliest
    positions in both; rows with other budgets and candidates, and one with fewer candidates than its k. One
    sub-space (m = 1, at least twice as many tokens as codes) takes pq_select.c's per-code combine."""
    g = torch.Generator().manual_seed(C + R)
    B, H, d, S = 3, 2, 8, 700
    centroids = torch.randn(B, H, m, C, d, generator=g)
    codes = torch.randint(0, C, (B, H, m, S + 37), generator=g, dtype=torch.uint8)  # capacity beyond S
    q = torch.randn(B, H, R, m * d, generator=g)
    cand = torch.rand(B, S, generator=g) > 0.2
    cand[2, 40:] = False  # 32 or so candidates for a k of 50
    ks = [200, 77, 50]
    tables = pq.lookup_tables(q, centroids)
    want = select_top(pq.approx_scores(tables, codes[..., :S]), cand, ks, max(ks), mode)
    top, valid = select.pq_top(tables, codes, cand, ks, max(ks), mode)
    assert top.shape == valid.shape == (B, H, max(ks))
    assert _picked(top, valid) == _picked(*want)
    assert valid[0].sum(-1).tolist() == [200, 200] and valid[1].sum(-1).tolist() == [77, 77]
    assert valid[2].sum() == 2 * int(cand[2].sum())  # every candidate, and no non-candidate, of the short row
    for b, k in enumerate(ks):  # the picks in position order
        assert bool((top[b, :, 1:k] > top[b, :, : k - 1]).all())


@pytest.mark.parametrize("B, H, m, C, d, R", [(1, 1, 4, 256, 64, 4), (2, 3, 2, 16, 32, 3), (1, 2, 3, 8, 5, 1)])
def test_a_steps_lookup_tables_and_key_codes_are_torchs(B, H, m, C, d, R):
    """pq_codes.c: a decode step's lookup tables (the bundled model's 4 sub-spaces of 64, and sizes off the vector
    path) within float32 rounding of pq.lookup_tables, and a new key's codes pq.encode's, both metrics."""
    g = torch.Generator().manual_seed(C + d)
    cents, q = torch.randn(B, H, m, C, d, generator=g), torch.randn(B, H, R, m * d, generator=g)
    torch.testing.assert_close(select.tables(q, cents), pq.lookup_tables(q, cents), rtol=1e-5, atol=1e-5)
    half_norm = pq.centroid_half_norms(cents)
    for metric in ("l2", "ip"):
        keys = torch.randn(B, H, 50, m * d, generator=g)
        want = pq.encode(keys, cents, metric, half_norm)  # (B, H, m, 50)
        got = torch.full_like(want, 255)
        for s in range(50):
            select.encode_one(keys[:, :, s : s + 1], cents, None if metric == "ip" else half_norm, got[..., s])
        assert torch.equal(got, want)


@pytest.mark.parametrize("mode", ["softmax_sum", "sum"])
@pytest.mark.parametrize("C", [2, 256])
def test_a_long_context_split_between_threads_picks_what_torch_picks(mode, C):
    """20,000 tokens: the combine and the top-k's first pass split between the threads, the later passes over the
    chosen bucket's keys, the picks taken 8 keys at a time; 2 centroids of 2 sub-spaces make 4 scores for all the
    tokens, so thousands tie at the k-th, several in the block of 8 where the ties wanted run out."""
    g = torch.Generator().manual_seed(C)
    S, m, d, R = 20000, 2, 8, 4
    centroids, q = torch.randn(1, 1, m, C, d, generator=g), torch.randn(1, 1, R, m * d, generator=g)
    codes = torch.randint(0, C, (1, 1, m, S), generator=g, dtype=torch.uint8)
    cand = torch.rand(1, S, generator=g) > 0.1
    tables = pq.lookup_tables(q, centroids)
    for k in (1, 3001, 7777, 9000, 12345):
        want = select_top(pq.approx_scores(tables, codes), cand, [k], k, mode)
        assert _picked(*select.pq_top(tables, codes, cand, [k], k, mode)) == _picked(*want)


def test_ties_go_to_the_earliest_positions():
    """Every token with the same code: the k picked are the first k candidates."""
    tables = torch.randn(1, 1, 2, 4, 4)
    codes = torch.zeros(1, 1, 2, 100, dtype=torch.uint8)
    cand = torch.ones(1, 100, dtype=torch.bool)
    cand[0, :5] = False
    top, valid = select.pq_top(tables, codes, cand, [10], 10, "softmax_sum")
    assert top[0, 0].tolist() == list(range(5, 15)) and bool(valid.all())


@pytest.mark.parametrize("mode", ["softmax_sum", "sum"])
def test_rerank_top_picks_what_torchs_operators_pick(mode):
    """Integer scores: ties among the re-rank's candidates go to the earliest of them, as topk_positions does."""
    g = torch.Generator().manual_seed(5)
    scores = torch.randint(-3, 4, (2, 3, 300, 4), generator=g).float()
    valid = torch.rand(2, 3, 300, generator=g) > 0.1
    ks = [40, 25]
    pick, in_rank = select.combined_top(scores, valid, ks, 40, mode)
    want_pick, want_in_rank = topk_positions(combine_rows(scores, valid, mode), ks, 40)
    assert _picked(pick, in_rank) == _picked(want_pick, want_in_rank)


def test_the_selection_does_not_depend_on_the_thread_count():
    g = torch.Generator().manual_seed(11)
    tables = torch.randn(1, 1, 4, 256, 4, generator=g)
    codes = torch.randint(0, 256, (1, 1, 4, 20000), generator=g, dtype=torch.uint8)
    cand = torch.ones(1, 20000, dtype=torch.bool)
    threads = torch.get_num_threads()
    try:
        picks = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            picks.append(select.pq_top(tables, codes, cand, [3000], 3000, "softmax_sum")[0])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(picks[0], picks[1]) and torch.equal(picks[0], picks[2])


@pytest.mark.parametrize("fused", [False, True])  # call by call (select.pq_top), or one C call (native/pq_step)
@pytest.mark.parametrize("m, bits", [(4, 6), (1, 4)])  # (1, 4): the per-code combine, against torch's by tuples
@pytest.mark.parametrize("margin", [0.0, 0.5])  # the first stage's margin: per token, in C and in torch
def test_a_decode_with_the_native_selection_keeps_torchs_tokens_and_picks(arch, monkeypatch, m, bits, fused, margin):
    ids = torch.randint(1, 96, (1, 300), generator=torch.Generator().manual_seed(7))
    cfg = PQCacheConfig(
        token_budget=0.1, rerank_min_tokens=0, n_init=4, kmeans_iters=5, m=m, bits=bits, search_margin=margin
    )
    owner, name = (native_step, "pq_step") if fused else (select, "pq_top")
    taken, real = [], getattr(owner, name)

    def counted(*args, **kwargs):
        taken.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, counted)
    runs, model = [], tiny_model(arch)
    for native_select in (True, False):
        kernels = Kernels(fused=fused, native_select=native_select)
        with torch.no_grad():
            cache = PQCache(model, replace(cfg, kernels=kernels))
            seq, scores = greedy_generate(model, ids, cache, n=10)
        runs.append((seq, scores, [_picked(*layer.last_selection) for layer in cache.pq_layers]))
    assert len(taken) == 9 * len(cache.pq_layers)  # the native run's steps took it, the other's did not
    (seq, scores, picks), (ref_seq, ref_scores, ref_picks) = runs
    assert torch.equal(seq, ref_seq)
    assert picks == ref_picks
    torch.testing.assert_close(scores, ref_scores, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("Hk, G", [(1, 4), (2, 2), (2, 1)])
@pytest.mark.parametrize("n_keys, k", [(40, 30), (1500, 900)])  # one thread; split between threads (>= 2048)
def test_attend_picks_is_softmax_attention_over_the_keys_and_the_picks(Hk, G, n_keys, k):
    """One softmax over the buffer's first n keys and the picks (their scores given, their values read from a
    fork's two parts), picks that are not valid left out: torch's attention over the same tokens."""
    g = torch.Generator().manual_seed(n_keys + Hk)
    D, S0, own_rows, scaling = 64, 3000, 500, 0.125
    shared, own = torch.randn(1, Hk, S0, D, generator=g), torch.randn(1, Hk, own_rows, D, generator=g)
    keys, values = torch.randn(1, Hk, n_keys + 7, D, generator=g), torch.randn(1, Hk, n_keys + 7, D, generator=g)
    q = torch.randn(Hk * G, D, generator=g)
    pos = torch.stack([torch.randperm(S0 + own_rows, generator=g)[:k].sort().values for _ in range(Hk)])  # (Hk, k)
    valid = torch.rand(Hk, k, generator=g) > 0.1
    stored_v = torch.cat([shared, own], 2)[0]  # (Hk, S0 + own_rows, D)
    pick_keys = torch.randn(Hk, k, D, generator=g)  # the picks' keys are never read: only their scores
    scores = (pick_keys @ q.view(Hk, G, D).transpose(1, 2)) * scaling  # (Hk, k, G)
    out = select.attend_picks(q, keys, values, n_keys, scaling, (pos, valid, scores), (shared, S0, own))
    for c in range(Hk):
        rows = q.view(Hk, G, D)[c]
        att = torch.cat([rows @ keys[0, c, :n_keys].T * scaling, scores[c].T.masked_fill(~valid[c], float("-inf"))], 1)
        v = torch.cat([values[0, c, :n_keys], stored_v[c, pos[c]]])
        want = att.softmax(-1) @ v  # (G, D)
        torch.testing.assert_close(out.view(Hk, G, D)[c], want, rtol=1e-5, atol=1e-5)
    with pytest.raises(IndexError):
        select.attend_picks(q, keys, values, n_keys, scaling, (pos + S0 + own_rows, valid, scores), (shared, S0, own))
    # a fork that has stored nothing of its own yet (the first step of an answer): every pick in the parent's part
    old = pos.clamp(max=S0 - 1)
    without_own = select.attend_picks(q, keys, values, n_keys, scaling, (old, valid, scores), (shared, S0, None))
    with_own = select.attend_picks(q, keys, values, n_keys, scaling, (old, valid, scores), (shared, S0, own))
    assert torch.equal(without_own, with_own)


@pytest.mark.parametrize("kind", [torch.float16, torch.bfloat16])
def test_attend_picks_reads_half_stores_as_the_float32_stores_of_the_same_numbers(kind):
    """Value rows stored in float16 or bfloat16 (PQCacheConfig.kv_dtype) are widened to float32 as they are read:
    the output is bit for bit the one over float32 stores holding the same rounded numbers, a fork's two parts
    included; stores of two kinds are refused."""
    g = torch.Generator().manual_seed(7)
    Hk, G, D, S0, own_rows, n_keys, k = 2, 3, 64, 700, 90, 50, 300
    shared = torch.randn(1, Hk, S0, D, generator=g).to(kind)
    own = torch.randn(1, Hk, own_rows, D, generator=g).to(kind)
    keys, values = torch.randn(2, 1, Hk, n_keys + 4, D, generator=g)
    q = torch.randn(Hk * G, D, generator=g)
    pos = torch.stack([torch.randperm(S0 + own_rows, generator=g)[:k].sort().values for _ in range(Hk)])
    valid, scores = torch.rand(Hk, k, generator=g) > 0.1, torch.randn(Hk, k, G, generator=g)
    picks = (pos, valid, scores)
    half = select.attend_picks(q, keys, values, n_keys, 0.125, picks, (shared, S0, own), weights=True)
    wide = select.attend_picks(q, keys, values, n_keys, 0.125, picks, (shared.float(), S0, own.float()), weights=True)
    assert torch.equal(half[0], wide[0]) and torch.equal(half[1], wide[1])
    with pytest.raises(ValueError, match="stores"):
        select.attend_picks(q, keys, values, n_keys, 0.125, picks, (shared, S0, own.float()))
