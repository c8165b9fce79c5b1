"""The one-row decode step (layer/onerow.py) computes what PQLayer.attend computes: same tokens, bit-identical
scores, same picks, same tiers and codes afterwards; with the picks' values read in place (native), the same
tokens and picks, scores within float32 rounding."""

import collections
import contextlib
from dataclasses import replace

import pytest
import torch

from pqcache import PQCache, PQCacheConfig
from pqcache.engine.kernels import Kernels
from pqcache.engine.layer import onerow
from tests.tiny import fork_answer, greedy_generate, tiny_model

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
        assert torch.equal(ix.residuals[..., :S], iy.residuals[..., :S])  # the next step's margin reads them
        assert (ix.joint is None) == (iy.joint is None)
        assert ix.joint is None or torch.equal(ix.joint[..., :S], iy.joint[..., :S])
        assert ix.generated == iy.generated
        assert x.counters == y.counters
        assert x.window.n_real == y.window.n_real
        assert torch.equal(x.window.slot_pos, y.window.slot_pos)
        ring = x.window.n_init + x.window.L  # the sinks' and ring's slots: what the next step attends to
        assert torch.equal(x.window.k[:, :, :ring], y.window.k[:, :, :ring])
        assert torch.equal(x.window.v[:, :, :ring], y.window.v[:, :, :ring])
        for got, want in zip(x.last_selection, y.last_selection, strict=True):
            assert torch.equal(got, want)


@pytest.mark.parametrize("setting", list(CONFIGS))
def test_one_row_step_equals_the_general_step(arch, setting, monkeypatch):
    model = tiny_model(arch)
    ids = torch.randint(1, 96, (1, 300), generator=torch.Generator().manual_seed(7))
    cfg = replace(CONFIGS[setting], kernels=Kernels(values_in_place=False))  # the picks' values copied, as attend's
    seq, scores, cache, taken = _run(model, ids, cfg, True, monkeypatch)
    ref_seq, ref_scores, ref_cache, ref_taken = _run(model, ids, cfg, False, monkeypatch)
    n_pq = len(cache.pq_layers)
    assert taken == 11 * n_pq and ref_taken == 0  # every decode step after the first token took it (or none)
    assert torch.equal(seq, ref_seq)
    assert torch.equal(scores, ref_scores)  # bit-identical: the same arithmetic on the same tensors
    _same_layers(cache, ref_cache)
    picks = cache.pq_layers[0].last_selection[1].sum()
    assert 0 < picks < 300 // 4  # a real selection: a part of the middle tokens


@pytest.mark.parametrize("in_place", [False, True], ids=["values-copied", "values-in-place"])
def test_one_row_step_after_a_question_chunk_on_a_fork(monkeypatch, in_place):
    """The app's shape: a document prefilled once, a fork per question, the question as a chunk (general path,
    exact), then the answer's decode steps (one-row path), equal to the same steps without it; with the picks'
    values read in place (from both parts of the fork's tier), the same tokens and picks, logits within float32
    rounding."""
    model = tiny_model("gemma3")
    g = torch.Generator().manual_seed(3)
    doc, question = torch.randint(1, 96, (1, 320), generator=g), torch.randint(1, 96, (1, 9), generator=g)
    cfg = PQCacheConfig(token_budget=0.1, rerank_min_tokens=0, kernels=Kernels(values_in_place=in_place), **SMALL)

    def answer(one_row: bool):
        with _one_row(monkeypatch, one_row) as taken:
            return *fork_answer(model, cfg, doc, question, 8), len(taken)

    tokens, logits, fork, taken = answer(True)
    ref_tokens, ref_logits, ref_fork, _ = answer(False)
    assert taken == 8 * len(fork.pq_layers)
    assert fork.pq_layers[0].host.S0 == 320  # the fork reads the document from its parent's tier
    assert torch.equal(tokens, ref_tokens)
    if not in_place:
        assert torch.equal(logits, ref_logits)
        _same_layers(fork, ref_fork)
        return
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    for x, y in zip(fork.pq_layers, ref_fork.pq_layers, strict=True):
        for got, want in zip(x.last_selection, y.last_selection, strict=True):
            assert torch.equal(got, want)


def test_steps_the_one_row_path_does_not_take(monkeypatch):
    """A batch of two rows, an observer that records every step's positions: PQLayer.attend (the path stays out of
    their way)."""
    model = tiny_model("llama")
    ids = torch.randint(1, 96, (2, 200), generator=torch.Generator().manual_seed(1))
    for cfg, selections, rows in (
        (PQCacheConfig(token_budget=0.2, **SMALL), False, 2),
        (PQCacheConfig(token_budget=0.2, block_size=16, block_cache_tokens=32, **SMALL), True, 1),
    ):
        with _one_row(monkeypatch) as taken, torch.no_grad():
            cache = PQCache(model, cfg)
            obs = cache.instrument(attention_every=0, recall_every=0, selections=True) if selections else None
            greedy_generate(model, ids[:rows], cache, n=4)
        assert taken == [] and cache.pq_layers[0].counters["steps"] == 3
        assert obs is None or len(obs.selected) == 3 * len(cache.pq_layers)


def _observed(model, ids, cfg, one_row: bool, monkeypatch, n=12):
    """Greedy tokens under the app's kind of observer (timeline, power law and recall at sampled steps) ->
    (sequences, scores, cache, one-row steps taken, the observer's records)."""
    with _one_row(monkeypatch, one_row) as taken, torch.no_grad():
        cache = PQCache(model, cfg)
        obs = cache.instrument(timeline=True, attention_every=2, recall_every=3)
        seq, scores = greedy_generate(model, ids, cache, n=n)
    return seq, scores, cache, len(taken), obs.to_dict()


def _lanes(records) -> collections.Counter:
    """The timeline's spans by lane and layer (their times differ from run to run)."""
    return collections.Counter((e["lane"], e["layer"]) for e in records["events"] if e["lane"] != "host clustering")


@pytest.mark.parametrize("in_place", [False, True], ids=["values-copied", "values-in-place"])
def test_block_cache_and_observer_keep_the_general_steps_books(arch, in_place, monkeypatch):
    """The app's answer (a device block cache, its observer) takes the one-row step: the same tokens and picks as
    PQLayer.attend, the same block-cache hits, misses, admissions and bytes, the same records for the panels
    (power law and recall at the sampled steps, hits per step); values copied: bit-identical, and the same
    timeline spans; values read in place: scores within float32 rounding, and no span for a copy that does not
    happen (only the block cache's admissions are copies). The block cache holds copies here, as on a GPU (a CPU's
    keeps its books only: the next test)."""
    kernels = Kernels(values_in_place=in_place, block_copies_on_cpu=True)
    model = tiny_model(arch)
    ids = torch.randint(1, 96, (1, 400), generator=torch.Generator().manual_seed(11))
    blocks = dict(block_size=8, block_cache_tokens=48)
    cfg = PQCacheConfig(token_budget=0.1, rerank_min_tokens=0, kernels=kernels, **blocks, **SMALL)
    seq, scores, cache, taken, got = _observed(model, ids, cfg, True, monkeypatch)
    ref_seq, ref_scores, ref_cache, ref_taken, want = _observed(model, ids, cfg, False, monkeypatch)
    n_pq = len(cache.pq_layers)
    assert taken == 11 * n_pq and ref_taken == 0
    assert torch.equal(seq, ref_seq)
    hits = sum(layer.counters["hits"] for layer in cache.pq_layers)
    assert hits > 0 and sum(layer.counters["misses"] for layer in cache.pq_layers) > 0  # the books moved
    assert got["blocks"] == want["blocks"] and got["bytes"] == want["bytes"]
    assert [(r["layer"], r["step"]) for r in got["recall"]] == [(r["layer"], r["step"]) for r in want["recall"]]
    assert [(r["layer"], r["step"]) for r in got["attention"]] == [(r["layer"], r["step"]) for r in want["attention"]]
    assert got["recall"] and got["attention"]
    if not in_place:
        assert torch.equal(scores, ref_scores)
        _same_layers(cache, ref_cache)
        assert got["recall"] == want["recall"] and got["attention"] == want["attention"]
        assert _lanes(got) == _lanes(want)  # the copies of the picks and admissions, the stores: spans alike
        return
    torch.testing.assert_close(scores, ref_scores, rtol=1e-5, atol=1e-5)
    for x, y in zip(cache.pq_layers, ref_cache.pq_layers, strict=True):
        assert x.counters == y.counters
        assert torch.equal(x.window.blocks.slot_block, y.window.blocks.slot_block)  # the same blocks admitted
        for a, b in zip(x.last_selection, y.last_selection, strict=True):
            assert torch.equal(a, b)
    for a, b in zip(got["recall"], want["recall"], strict=True):
        torch.testing.assert_close(a["topk_recall"], b["topk_recall"], rtol=1e-4, atol=1e-4)
    assert _lanes(got) == _lanes(want)  # a "copy to device" span a step: the general step's copies, here admissions
    no_blocks = PQCacheConfig(token_budget=0.1, rerank_min_tokens=0, kernels=kernels, **SMALL)
    *_, taken, records = _observed(model, ids, no_blocks, True, monkeypatch)
    lanes = _lanes(records)
    assert taken == 11 * n_pq and not any(lane == "copy to device" for lane, _ in lanes)  # nothing was copied
    assert all(lanes[("copy to host", layer.layer_idx)] == 1 + 11 for layer in cache.pq_layers)


@pytest.mark.parametrize("one_row", [True, False], ids=["one-row step", "general step"])
def test_a_cpus_block_cache_keeps_the_books_of_one_that_copies(one_row, monkeypatch):
    """On a CPU the block cache copies nothing (both tiers are host memory): the same tokens and scores as a cache
    that copies its blocks, the same hits, misses, admitted blocks and bytes, the same panel records; no block
    data held (its device bytes are gone from the stats) and, in the one-row step, no "copy to device" span."""
    model = tiny_model("llama")
    ids = torch.randint(1, 96, (1, 400), generator=torch.Generator().manual_seed(11))
    cfg = PQCacheConfig(token_budget=0.1, rerank_min_tokens=0, block_size=8, block_cache_tokens=48, **SMALL)
    seq, scores, books, _, got = _observed(model, ids, cfg, one_row, monkeypatch)
    cfg_copies = replace(cfg, kernels=Kernels(block_copies_on_cpu=True))
    ref_seq, ref_scores, copies, _, want = _observed(model, ids, cfg_copies, one_row, monkeypatch)
    assert torch.equal(seq, ref_seq) and torch.equal(scores, ref_scores)
    assert sum(layer.counters["hits"] for layer in books.pq_layers) > 0
    for x, y in zip(books.pq_layers, copies.pq_layers, strict=True):
        assert x.counters == y.counters
        assert torch.equal(x.window.blocks.slot_block, y.window.blocks.slot_block)
        assert torch.equal(x.window.blocks.uses, y.window.blocks.uses)
        assert x.window.blocks.k is None and y.window.blocks.k is not None
    assert got["blocks"] == want["blocks"] and got["bytes"] == want["bytes"]
    assert got["recall"] == want["recall"] and got["attention"] == want["attention"]
    n_pq = len(books.pq_layers)
    held = sum(layer.window.blocks.nbytes for layer in copies.pq_layers)
    assert held > 0 and books.stats()["device_kv_bytes"] == copies.stats()["device_kv_bytes"] - held
    copied = [lane for lane, _ in _lanes(got)].count("copy to device")
    assert copied == (0 if one_row else n_pq)  # the general step still copies the picks into its buffer
    assert [lane for lane, _ in _lanes(want)].count("copy to device") == n_pq


@pytest.mark.parametrize("setting", ["re-rank of every candidate", "re-rank of 4k", "raw sum over the GQA group"])
@pytest.mark.parametrize("attention", ["torch", "native"])
def test_values_read_in_place_keep_the_general_steps_tokens_and_picks(arch, setting, attention, monkeypatch):
    """With a re-rank the picks' values are summed where they lie in the host tier (HostTier.value_sums, native;
    or the whole attention in one C call, native_select.attend_picks): the same softmax in another summation order,
    so the same tokens and picks as the general step, its scores within float32 rounding (the last bits carry into
    the next steps' keys: those are close, not equal)."""
    from pqcache import native

    assert native.library() is not None, native.status()
    from pqcache.engine.layer.host import HostTier
    from pqcache.native import select as native_select

    sums = []
    owner, name = (native_select, "attend_picks") if attention == "native" else (HostTier, "value_sums")
    real_sums = getattr(owner, name)

    def counted(*args):
        sums.append(args[5][0].shape[1] if attention == "native" else args[1].shape[2])  # picks per KV head
        return real_sums(*args)

    monkeypatch.setattr(owner, name, counted)
    model = tiny_model(arch)
    ids = torch.randint(1, 96, (1, 300), generator=torch.Generator().manual_seed(7))
    # the attention's own call (the fused one: tests/unit/test_pq_step.py)
    cfg = replace(CONFIGS[setting], kernels=Kernels(native_attention=attention == "native", fused=False))
    seq, scores, cache, taken = _run(model, ids, cfg, True, monkeypatch)
    ref_seq, ref_scores, ref_cache, _ = _run(model, ids, cfg, False, monkeypatch)
    assert taken == 11 * len(cache.pq_layers) == len(sums) and min(sums) > 0  # every step summed its picks in place
    assert torch.equal(seq, ref_seq)
    torch.testing.assert_close(scores, ref_scores, rtol=1e-5, atol=1e-5)
    for x, y in zip(cache.pq_layers, ref_cache.pq_layers, strict=True):
        assert x.counters == y.counters
        for got, want in zip(x.last_selection, y.last_selection, strict=True):
            assert torch.equal(got, want)
        # float32 rounding apart, then rounded to the host tier's float16: at most one float16 step apart
        torch.testing.assert_close(x.host.values(0, x.host.S), y.host.values(0, y.host.S), rtol=2**-10, atol=1e-5)
