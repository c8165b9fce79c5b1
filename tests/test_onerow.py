"""The one-row decode step (layer/onerow.py) computes what PQLayer.attend computes: same tokens, bit-identical
scores, same picks, same tiers and codes afterwards."""

import contextlib

import pytest
import torch

from pqcache import PQCache, PQCacheConfig
from pqcache.engine.layer import onerow

from .conftest import greedy_generate, tiny_model

SMALL = dict(n_init=4, kmeans_iters=5, bits=4)
CONFIGS = {
    "re-rank of every candidate": PQCacheConfig(token_budget=0.2, **SMALL),
    "re-rank of 4k": PQCacheConfig(token_budget=0.1, rerank_min_tokens=0, **SMALL),
    "PQ scores alone": PQCacheConfig(token_budget=0.1, rerank=1, **SMALL),
    "raw sum over the GQA group": PQCacheConfig(token_budget=0.1, rerank_min_tokens=0, gqa_combine="sum", **SMALL),
    # 64^4 code tuples: the codes are looked up token by token (the bundled model's search), not tuple by tuple
    "table lookups": PQCacheConfig(token_budget=0.1, rerank_min_tokens=0, n_init=4, kmeans_iters=5, m=4, bits=6),
}


@contextlib.contextmanager
def _one_row(monkeypatch, on: bool = True):
    """The one-row path on (counted: yields the list its steps append to) or off."""
    taken = []
    real_attend = onerow.attend

    def counted(*args, **kwargs):
        taken.append(1)
        return real_attend(*args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(onerow, "attend", counted)
        if not on:
            m.setattr(onerow, "ready", lambda layer, query: False)
        yield taken


def _run(model, ids, cfg, one_row: bool, monkeypatch, n=12):
    """Greedy tokens with or without the one-row path -> (sequences, scores, cache, one-row steps taken)."""
    with _one_row(monkeypatch, one_row) as taken, torch.no_grad():
        cache = PQCache(model, cfg)
        seq, scores = greedy_generate(model, ids, cache, n=n)
    return seq, scores, cache, len(taken)


def _same_layers(a, b):
    for x, y in zip(a.pq_layers, b.pq_layers, strict=True):
        S = x.host.S
        assert S == y.host.S
        assert torch.equal(x.host.keys(0, S), y.host.keys(0, S))
        assert torch.equal(x.host.values(0, S), y.host.values(0, S))
        assert torch.equal(x.host.valid[:, :S], y.host.valid[:, :S])
        assert torch.equal(x.host.searchable[:, :S], y.host.searchable[:, :S])
        ix, iy = x.method_state["index"], y.method_state["index"]
        assert torch.equal(ix.codes[..., :S], iy.codes[..., :S])
        assert ix.generated == iy.generated
        assert x.counters == y.counters
        assert x.window.n_real == y.window.n_real
        assert torch.equal(x.window.slot_pos, y.window.slot_pos)
        for got, want in zip(x.last_selection, y.last_selection, strict=True):
            assert torch.equal(got, want)


@pytest.mark.parametrize("setting", list(CONFIGS))
def test_one_row_step_equals_the_general_step(arch, setting, monkeypatch):
    model = tiny_model(arch)
    ids = torch.randint(1, 96, (1, 300), generator=torch.Generator().manual_seed(7))
    cfg = CONFIGS[setting]
    seq, scores, cache, taken = _run(model, ids, cfg, True, monkeypatch)
    ref_seq, ref_scores, ref_cache, ref_taken = _run(model, ids, cfg, False, monkeypatch)
    n_pq = len(cache.pq_layers)
    assert taken == 11 * n_pq and ref_taken == 0  # every decode step after the first token took it (or none)
    assert torch.equal(seq, ref_seq)
    assert torch.equal(scores, ref_scores)  # bit-identical: the same arithmetic on the same tensors
    _same_layers(cache, ref_cache)
    picks = cache.pq_layers[0].last_selection[1].sum()
    assert 0 < picks < 300 // 4  # a real selection: a part of the middle tokens


def test_one_row_step_after_a_question_chunk_on_a_fork(monkeypatch):
    """The app's shape: a document prefilled once, a fork per question, the question as a chunk (general path,
    exact), then the answer's decode steps (one-row path), equal to the same steps without it."""
    model = tiny_model("gemma3")
    g = torch.Generator().manual_seed(3)
    doc, question = torch.randint(1, 96, (1, 320), generator=g), torch.randint(1, 96, (1, 9), generator=g)
    cfg = PQCacheConfig(token_budget=0.1, rerank_min_tokens=0, **SMALL)

    def answer(one_row: bool):
        with _one_row(monkeypatch, one_row) as taken, torch.no_grad():
            parent = PQCache(model, cfg)
            model(doc, cache=parent)
            parent.wait()
            fork = parent.fork("pqcache")
            logits = model(question, cache=fork).logits[:, -1:]
            tokens = []
            for _ in range(8):
                token = logits.argmax(-1)
                tokens.append(token)
                logits = model(token, cache=fork).logits
        return torch.cat(tokens, 1), logits, fork, len(taken)

    tokens, logits, fork, taken = answer(True)
    ref_tokens, ref_logits, ref_fork, _ = answer(False)
    assert taken == 8 * len(fork.pq_layers)
    assert fork.pq_layers[0].host.S0 == 320  # the fork reads the document from its parent's tier
    assert torch.equal(tokens, ref_tokens)
    assert torch.equal(logits, ref_logits)
    _same_layers(fork, ref_fork)


def test_steps_the_one_row_path_does_not_take(monkeypatch):
    """A batch of two rows, an observer, a block cache: PQLayer.attend (the path stays out of their way)."""
    model = tiny_model("llama")
    ids = torch.randint(1, 96, (2, 200), generator=torch.Generator().manual_seed(1))
    for cfg, observe, rows in (
        (PQCacheConfig(token_budget=0.2, **SMALL), False, 2),
        (PQCacheConfig(token_budget=0.2, **SMALL), True, 1),
        (PQCacheConfig(token_budget=0.2, block_size=16, block_cache_tokens=32, **SMALL), False, 1),
    ):
        with _one_row(monkeypatch) as taken, torch.no_grad():
            cache = PQCache(model, cfg)
            if observe:
                cache.instrument(attention_every=0, recall_every=0)
            greedy_generate(model, ids[:rows], cache, n=4)
        assert taken == [] and cache.pq_layers[0].counters["steps"] == 3
