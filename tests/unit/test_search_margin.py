"""The first stage's margin (PQCacheConfig.search_margin): before a re-rank, a token ranks by its PQ score plus
margin x ||q|| ||k - k_hat|| / sqrt(D). Each token's residual ||k - k_hat|| is kept by every path that codes a token
(a prefill's build, a decode step in torch or in one C call, a new turn's codebook, a fork, a restore from a
snapshot); the C search ranks as torch does; and a key that PQ represents badly, the one the query is after, reaches
the re-rank with the margin where without it it does not."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from pqcache import PQCache, PQCacheConfig, native
from pqcache.engine import pq
from pqcache.engine.kernels import Kernels
from pqcache.engine.methods.base import select_top
from pqcache.engine.methods.pqcache import first_stage_margin, search, spreads
from pqcache.engine.snapshot import restore, snapshot
from pqcache.native import select
from pqcache.serving.generate import decode_one_token, prefill
from tests.tiny import greedy_generate, tiny_model

SMALL = dict(n_init=4, kmeans_iters=5, bits=4, token_budget=0.1, rerank_min_tokens=0)


def _residuals_recomputed(index) -> torch.Tensor:
    """Each stored token's ||k - k_hat|| from the host tier's keys and the codes, segment by segment -> (B, H, S)."""
    S = index.host.S
    out = torch.empty(index.residuals.shape[:2] + (S,))
    bounds = [s for s, _ in index.segments[1:]] + [S]
    for (lo, cents), hi in zip(index.segments, bounds, strict=True):
        keys = index.rotate(index.host.keys(lo, hi, dtype=torch.float32), lo)
        out[..., lo:hi] = (keys - pq.reconstruct(index.codes[..., lo:hi], cents)).norm(dim=-1)
    return out


def _same_residuals(cache):
    for layer in cache.pq_layers:
        index = layer.method_state["index"]
        assert index.residuals.shape[-1] >= index.host.S
        # a decoded token's residual is its key's as coded (float32), the host tier's key is rounded to float16
        got, want = index.residuals[..., : index.host.S], _residuals_recomputed(index)
        torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)
        assert bool((index.residuals[..., : index.host.S] > 0).any())  # coded tokens, not the buffer's zeros


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("opq", [False, True])
def test_every_coded_token_keeps_its_residual(arch, fused, opq):
    """A prefill, decode steps (call by call, or filed in the fused C call), a question long enough for a codebook
    of its own (a second segment), then a fork of it and a restore of its snapshot."""
    model = tiny_model(arch)
    cfg = PQCacheConfig(turn_min_tokens=32, opq=opq, kernels=Kernels(fused=fused), **SMALL)
    ids = torch.randint(1, 96, (1, 300), generator=torch.Generator().manual_seed(3))
    turn = torch.randint(1, 96, (1, 40), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        cache = PQCache(model, cfg)
        for part in (ids, turn):
            logits = prefill(model, part, cache)
            cache.wait()
            for _ in range(4):
                logits = decode_one_token(model, logits.reshape(-1, logits.shape[-1])[-1:].argmax(-1, True), cache)
    assert len(cache.pq_layers[0].method_state["index"].segments) == 2
    _same_residuals(cache)
    fork = cache.fork("pqcache")
    _same_residuals(fork)
    tensors, meta = snapshot(cache)
    restored = restore(model, cfg, tensors, meta)
    _same_residuals(restored)
    for c in (cache, fork, restored):
        c.close()


@pytest.mark.skipif(native.library() is None, reason=native.status())
@pytest.mark.parametrize("mode", ["softmax_sum", "sum"])
@pytest.mark.parametrize("m, C", [(1, 16), (2, 16), (4, 64)])  # (1, 16): where the margin-less search works by code
def test_the_c_search_ranks_with_the_margin_as_torch_does(mode, m, C):
    g = torch.Generator().manual_seed(m + C)
    B, H, d, S, R = 2, 2, 8, 600, 4
    centroids = torch.randn(B, H, m, C, d, generator=g)
    codes = torch.randint(0, C, (B, H, m, S + 20), generator=g, dtype=torch.uint8)
    residuals = torch.rand(B, H, S + 20, generator=g) * 3
    q = torch.randn(B, H, R, m * d, generator=g)
    cand = torch.rand(B, S, generator=g) > 0.2
    ks = [120, 40]
    row_scale = q.norm(dim=-1) * 0.5 / (m * d) ** 0.5
    tables = pq.lookup_tables(q, centroids)
    scores = pq.approx_scores(tables, codes[..., :S]) + residuals[..., :S, None] * row_scale[:, :, None, :]
    want_top, want_valid = select_top(scores, cand, ks, max(ks), mode)
    top, valid = select.pq_top(tables, codes, cand, ks, max(ks), mode, (row_scale, residuals))
    assert torch.equal(valid, want_valid)
    assert torch.equal(top.masked_fill(~valid, 0).sort(-1).values, want_top.masked_fill(~want_valid, 0).sort(-1).values)
    plain, _ = select.pq_top(tables, codes, cand, ks, max(ks), mode)
    assert not torch.equal(plain, top)  # the margin changed the ranking


class _Index:
    """What search() reads of a PQIndex: one segment's centroids, the codes and residuals, the host tier's sizes."""

    def __init__(self, keys: torch.Tensor, m: int, C: int):
        B, H, S, D = keys.shape
        self.host = type("Host", (), {"B": B, "H": H, "S": S})()
        self.config = PQCacheConfig(m=m, kernels=Kernels(native_select=False))
        cents = pq.train_centroids(keys[0, 0], m, C, 10, "l2", 0)[None, None]
        self.segments = [(0, cents)]
        self.codes = pq.encode(keys, cents, "l2")
        self.residuals = (keys - pq.reconstruct(self.codes, cents)).norm(dim=-1)
        self.use_tuples, self.device = False, keys.device

    def rotate(self, x, start):
        return x


def test_a_key_pq_represents_badly_reaches_the_rerank_with_the_margin():
    """2,000 keys in 16 tight clusters and one far from them, the key the query points at: its codes give it a
    cluster's centroids (a residual over twice the others'), so its PQ score ranks it below the 250 first-stage
    candidates; with the margin it is among them, and the re-rank's exact scores would take it first."""
    g = torch.Generator().manual_seed(4)
    D, S, target = 32, 2000, 1500
    centers = 2 * torch.randn(16, D, generator=g)
    keys = centers[torch.randint(0, 16, (S,), generator=g)] + 0.3 * torch.randn(S, D, generator=g)
    direction = torch.randn(D, generator=g)
    direction /= direction.norm()
    keys[target] = 8 * direction
    keys = keys.view(1, 1, S, D)
    index = _Index(keys, m=2, C=16)
    q = direction.view(1, 1, 1, D)
    assert int((q @ keys.transpose(-1, -2)).argmax()) == target
    cand = torch.ones(1, S, dtype=torch.bool)
    without, _ = search(index, q, cand, [250], "softmax_sum")
    with_margin, _ = search(index, q, cand, [250], "softmax_sum", margin=0.5)
    assert target not in without[0, 0].tolist()
    assert target in with_margin[0, 0].tolist()
    residuals = spreads(index, q, 0.5)[1][0, 0]
    assert float(residuals[target]) > 2 * float(residuals.median())  # it is the badly coded one


def test_without_a_rerank_the_search_keeps_the_pq_ranking(arch):
    """rerank=1: the search's picks are attended, so no margin (first_stage_margin); a decode gives the same
    tokens and picks whatever search_margin says."""
    assert first_stage_margin(PQCacheConfig(rerank=1, search_margin=2.0)) == 0.0
    model = tiny_model(arch)
    ids = torch.randint(1, 96, (1, 300), generator=torch.Generator().manual_seed(5))
    runs = []
    for margin in (0.0, 2.0):
        cfg = PQCacheConfig(rerank=1, search_margin=margin, **SMALL)
        with torch.no_grad():
            cache = PQCache(model, cfg)
            seq, _ = greedy_generate(model, ids, cache, n=8)
        runs.append((seq.tolist(), [layer.last_selection[0].tolist() for layer in cache.pq_layers]))
        cache.close()
    assert runs[0] == runs[1]


def test_a_margin_changes_the_picks_of_a_rerank(arch):
    """The setting reaches the decode: with a re-rank of 4k candidates, margin 0 and 3 pick differently somewhere."""
    model = tiny_model(arch)
    ids = torch.randint(1, 96, (1, 300), generator=torch.Generator().manual_seed(5))
    picks = []
    for margin in (0.0, 3.0):
        with torch.no_grad():
            cache = PQCache(model, replace(PQCacheConfig(**SMALL), search_margin=margin))
            greedy_generate(model, ids, cache, n=8)
        picks.append([layer.last_selection[0].tolist() for layer in cache.pq_layers])
        cache.close()
    assert picks[0] != picks[1]


@pytest.mark.parametrize("margin", [0.0, 3.0])
def test_the_teaching_pictures_search_shows_what_the_first_stage_ranked(margin):
    """The Teaching tab's search picture (serving/walkthrough.py): the PQ stage's candidates lie right of its
    threshold and the others left of it, on the scores the first stage ranked (with the margin where it applies)."""
    from pqcache.serving.walkthrough import StepRecorder

    model = tiny_model("llama")
    recorder = StepRecorder()
    cfg = PQCacheConfig(search_margin=margin, **SMALL)
    ids = torch.randint(1, 96, (1, 300), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        cache = PQCache(model, cfg, method=recorder)
        greedy_generate(model, ids, cache, n=3)
    w = recorder.describe()
    cache.close()
    assert w["margin"] == margin
    search, threshold = w["search"], w["search"]["thresholds"]["approx"]
    kept = [a for a, kind in zip(search["approx"], search["kind"], strict=True) if kind > 0]
    left = [a for a, kind in zip(search["approx"], search["kind"], strict=True) if kind == 0]
    assert kept and left and min(kept) == threshold
    assert max(left) <= threshold  # ties at the threshold go to the earliest positions
