"""A PQ layer's one-row step in one C call (native/pq_step.py, pq_step.c) against the same step call by call
(layer/onerow.py's search, rerank_exact and attend_picks): the same kernels on the same numbers, so the same tokens,
bit-identical scores, the same picks, tiers, codes and counters; on a fork (the app's shape: a document's tier
shared, the answer's own) and under the app's kind of observer too."""

from dataclasses import replace

import pytest
import torch

from pqcache import PQCache, PQCacheConfig
from pqcache.engine.kernels import Kernels
from pqcache.engine.layer import fused as fused_step
from tests.tiny import fork_answer, greedy_generate, tiny_model
from tests.unit.test_onerow import CONFIGS, SMALL, _same_layers


def _fused(cfg: PQCacheConfig, fused: bool) -> PQCacheConfig:
    """cfg with the fused step on or off."""
    return replace(cfg, kernels=Kernels(fused=fused))


def _counted(monkeypatch) -> list:
    """The list each fused step appends to."""
    taken, real = [], fused_step.step

    def counted(*args, **kwargs):
        taken.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(fused_step, "step", counted)
    return taken


def _greedy(model, ids, cfg, fused: bool, monkeypatch, observe: bool = False):
    taken = _counted(monkeypatch)
    with torch.no_grad():
        cache = PQCache(model, _fused(cfg, fused))
        obs = cache.instrument(timeline=True, attention_every=2, recall_every=3) if observe else None
        seq, scores = greedy_generate(model, ids, cache, n=12)
    return seq, scores, cache, len(taken), obs and obs.to_dict()


@pytest.mark.parametrize("setting", ["re-rank of every candidate", "re-rank of 4k", "raw sum over the GQA group"])
def test_fused_step_equals_the_step_call_by_call(arch, setting, monkeypatch):
    from pqcache import native

    assert native.library() is not None, native.status()
    model = tiny_model(arch)
    ids = torch.randint(1, 96, (1, 300), generator=torch.Generator().manual_seed(7))
    cfg = CONFIGS[setting]
    seq, scores, cache, taken, _ = _greedy(model, ids, cfg, True, monkeypatch)
    ref_seq, ref_scores, ref_cache, ref_taken, _ = _greedy(model, ids, cfg, False, monkeypatch)
    assert taken == 11 * len(cache.pq_layers) and ref_taken == 0  # every decode step after the first token
    assert torch.equal(seq, ref_seq)
    assert torch.equal(scores, ref_scores)  # bit-identical: the same kernels in the same order
    _same_layers(cache, ref_cache)
    picks = cache.pq_layers[0].last_selection[1].sum()
    assert 0 < picks < 300 // 4  # a real selection: a part of the middle tokens


@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16"])
def test_fused_step_files_the_token_at_every_kv_dtype(kv_dtype, monkeypatch):
    """The fused step files each new token in C (pq_append): its rows rounded to the host tier's and the window's
    kind as torch's copy rounds them, its codes and its code tuple's row in the joint index (m=2, 4 bits: 256
    tuples) as the call-by-call step's index.append writes them. float16, the CPU's default, is run above."""
    model = tiny_model("qwen2")
    ids = torch.randint(1, 96, (1, 300), generator=torch.Generator().manual_seed(13))
    cfg = PQCacheConfig(token_budget=0.1, rerank_min_tokens=0, m=2, kv_dtype=kv_dtype, **SMALL)
    seq, scores, cache, taken, _ = _greedy(model, ids, cfg, True, monkeypatch)
    ref_seq, ref_scores, ref_cache, _, _ = _greedy(model, ids, cfg, False, monkeypatch)
    layer = cache.pq_layers[0]
    assert layer.host.own_k.dtype == layer.window.k.dtype == getattr(torch, kv_dtype)
    assert layer.method_state["index"].joint is not None
    assert taken == 11 * len(cache.pq_layers)
    assert torch.equal(seq, ref_seq) and torch.equal(scores, ref_scores)
    _same_layers(cache, ref_cache)


def test_fused_step_on_a_fork_reads_both_parts_of_its_tier(monkeypatch):
    """A document prefilled once, a fork per question, the answer's steps: picks from the parent's part and from
    the fork's own (its window's tokens age into the candidates), equal to the steps call by call."""
    model = tiny_model("gemma3")
    g = torch.Generator().manual_seed(3)
    doc, question = torch.randint(1, 96, (1, 320), generator=g), torch.randint(1, 96, (1, 9), generator=g)
    # a window of 8 tokens: after a few steps the question's tokens are candidates, in the fork's own rows
    cfg = PQCacheConfig(token_budget=0.1, rerank_min_tokens=0, n_local=8, **SMALL)

    def answer(fused: bool):
        taken = _counted(monkeypatch)
        return *fork_answer(model, _fused(cfg, fused), doc, question, 16), len(taken)

    tokens, logits, fork, taken = answer(True)
    ref_tokens, ref_logits, ref_fork, ref_taken = answer(False)
    assert taken == 16 * len(fork.pq_layers) and ref_taken == 0
    layer = fork.pq_layers[0]
    assert layer.host.S0 == 320
    assert int(layer.last_selection[0].max()) >= 320  # a pick from the fork's own rows
    assert torch.equal(tokens, ref_tokens) and torch.equal(logits, ref_logits)
    _same_layers(fork, ref_fork)


def test_fused_step_keeps_the_observers_records(monkeypatch):
    """Under the app's observer (timeline, power law and recall at sampled steps, computed from the step's query and
    picks): every step takes the fused call; the same tokens, counters and records as call by call."""
    model = tiny_model("llama")
    ids = torch.randint(1, 96, (1, 400), generator=torch.Generator().manual_seed(11))
    cfg = PQCacheConfig(token_budget=0.1, rerank_min_tokens=0, **SMALL)
    seq, scores, cache, taken, got = _greedy(model, ids, cfg, True, monkeypatch, observe=True)
    ref_seq, ref_scores, ref_cache, _, want = _greedy(model, ids, cfg, False, monkeypatch, observe=True)
    assert taken == 11 * len(cache.pq_layers)
    assert torch.equal(seq, ref_seq) and torch.equal(scores, ref_scores)
    _same_layers(cache, ref_cache)
    assert got["recall"] and got["attention"]  # sampled steps recorded
    assert got["recall"] == want["recall"] and got["attention"] == want["attention"]
    assert got["blocks"] == want["blocks"] and got["bytes"] == want["bytes"]
    lanes = [(e["lane"], e["layer"]) for e in got["events"] if e["lane"] != "host clustering"]
    assert sorted(lanes) == sorted((e["lane"], e["layer"]) for e in want["events"] if e["lane"] != "host clustering")


def _second_turn(model, cfg, fused: bool, monkeypatch):
    """A document prefilled, its PQ built, then a user turn long enough for codebooks of its own (a second segment),
    then 10 greedy steps -> (tokens, last logits, cache, fused steps taken)."""
    taken = _counted(monkeypatch)
    g = torch.Generator().manual_seed(5)
    doc, turn = torch.randint(1, 96, (1, 300), generator=g), torch.randint(1, 96, (1, 40), generator=g)
    with torch.no_grad():
        cache = PQCache(model, _fused(cfg, fused))
        model(doc, cache=cache)
        cache.wait()
        logits = model(turn, cache=cache).logits[:, -1:]
        cache.wait()
        tokens = []
        for _ in range(10):
            token = logits.argmax(-1)
            tokens.append(token)
            logits = model(token, cache=cache).logits
    return torch.cat(tokens, 1), logits, cache, len(taken)


@pytest.mark.parametrize("setting", ["OPQ", "a second turn's codebooks"])
def test_an_index_the_fused_call_cannot_read_takes_the_step_call_by_call(setting, monkeypatch):
    """pq_step.c reads one segment's centroids and the query as it is: with OPQ's rotation, or with a later turn's
    codebooks beside the document's, no step takes it (the one-row path's ready() leaves such an index to
    PQLayer.attend, which rotates the query and scores each segment's codes under its own centroids): the same
    tokens and logits with FUSED on or off."""
    model = tiny_model("llama")
    if setting == "OPQ":
        cfg = PQCacheConfig(token_budget=0.1, rerank_min_tokens=0, opq=True, **SMALL)
    else:
        cfg = PQCacheConfig(token_budget=0.1, rerank_min_tokens=0, turn_min_tokens=32, **SMALL)
    tokens, logits, cache, taken = _second_turn(model, cfg, True, monkeypatch)
    ref_tokens, ref_logits, ref_cache, _ = _second_turn(model, cfg, False, monkeypatch)
    index = cache.pq_layers[0].method_state["index"]
    assert index.rotations if setting == "OPQ" else len(index.segments) == 2
    assert taken == 0
    assert torch.equal(tokens, ref_tokens) and torch.equal(logits, ref_logits)
    _same_layers(cache, ref_cache)
