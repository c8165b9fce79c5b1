"""Tiers, overlap, block cache, rebuilds and turns, instrumentation."""

import json

import pytest
import torch

from pqcache import PQCache, PQCacheConfig
from pqcache.engine import pq
from pqcache.engine.errors import PQCacheConfigError
from pqcache.engine.full_attention import full_attention_cache
from pqcache.engine.kernels import Kernels
from pqcache.engine.layer.blockcache import BlockCache
from pqcache.engine.layer.host import HostTier
from tests.tiny import greedy_generate, tiny_model

SMALL = dict(n_init=4, kmeans_iters=5, bits=4, block_size=16, block_cache_tokens=64, block_admit=2)


def test_instrumentation_leaves_outputs_unchanged():
    # the block cache copies its blocks, as on a GPU: each lane of the timeline then has spans (a CPU's copies
    # nothing, and the one-row step reads the picks in place: no "copy to device" at all, tests/unit/test_onerow.py)
    model = tiny_model("llama")
    ids = torch.randint(1, 96, (1, 300), generator=torch.Generator().manual_seed(0))
    cfg = PQCacheConfig(token_budget=0.2, kernels=Kernels(block_copies_on_cpu=True), **SMALL)
    with torch.no_grad():
        seq_off, scores_off = greedy_generate(model, ids, PQCache(model, cfg), n=8)
        cache = PQCache(model, cfg)
        obs = cache.instrument(attention_every=1, recall_every=1)
        seq_on, scores_on = greedy_generate(model, ids, cache, n=8)
    assert torch.equal(seq_on, seq_off)
    assert torch.equal(scores_on, scores_off)
    data = obs.to_dict()
    json.dumps(data)  # plain data
    assert {e["lane"] for e in data["events"]} >= {
        "device compute",
        "host clustering",
        "copy to host",
        "copy to device",
    }
    assert data["attention"] and data["recall"] and data["blocks"]
    assert data["bytes"]["to_host"] > 0 and data["bytes"]["to_device"] > 0


def test_a_question_chunk_is_probed_at_its_last_token(monkeypatch):
    """Several new tokens in one step (a question after a document): the probe reads the last one's queries, as a
    decode step's, instead of sorting every token's scores (that took 0.3 s of a first token at 8K): its power-law
    record is that token's exact attention over the stored tokens."""
    import pqcache.engine.layer.general as layer_module

    model = tiny_model("llama")
    gen = torch.Generator().manual_seed(5)
    document, question = torch.randint(1, 96, (1, 200), generator=gen), torch.randint(1, 96, (1, 6), generator=gen)
    cache = PQCache(model, PQCacheConfig(token_budget=0.2, **SMALL))
    steps = []
    observe = layer_module.observe_step
    monkeypatch.setattr(
        layer_module, "observe_step", lambda layer, q, *a: steps.append((layer, q)) or observe(layer, q, *a)
    )
    with torch.no_grad():
        model(document, cache=cache)
        cache.wait()
        obs = cache.instrument(attention_every=1, recall_every=1)
        model(question, cache=cache)
    layer, q = steps[0]
    B, H, R, D = q.shape  # (B, H, G * Q, D): rows (query head, token)
    last = q.view(B, H, R // 6, 6, D)[:, :, :, -1].float() * layer.scaling  # (B, H, G, D)
    exact = last @ layer.host.keys(0, 200, device="cpu", dtype=torch.float32).transpose(-1, -2)  # (B, H, G, 200)
    expected = exact.softmax(-1).sort(-1, descending=True).values.mean((0, 1, 2))  # (200,)
    record = next(r for r in obs.attention if r["layer"] == layer.layer_idx)
    assert record["n_tokens"] == 200
    ranks = torch.tensor(record["rank"]) - 1
    torch.testing.assert_close(torch.tensor(record["prob"]), expected[ranks], rtol=1e-5, atol=1e-7)
    assert [len(r["qhead_recall"]) for r in obs.recall] == [H * (R // 6)] * len(obs.recall)
    cache.close()


def test_instrumentation_off_by_default():
    model = tiny_model("llama")
    cache = PQCache(model, PQCacheConfig(token_budget=0.2, **SMALL))
    assert cache.observer is None and all(layer.obs is None for layer in cache.pq_layers)
    obs = cache.instrument(timeline=True)
    assert all(layer.obs is obs for layer in cache.pq_layers)
    cache.instrument(None)
    assert cache.observer is None and all(layer.obs is None for layer in cache.pq_layers)
    with torch.no_grad():
        model(torch.randint(1, 96, (1, 50)), cache=cache)
    assert obs.events == []  # detached: nothing recorded


def test_recall_and_attention_records():
    model = tiny_model("qwen2")
    ids = torch.randint(1, 96, (1, 400), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = PQCache(model, PQCacheConfig(token_budget=1.0, **SMALL))
        obs_full = full.instrument(attention_every=2, recall_every=2)
        greedy_generate(model, ids, full, n=5)
        small = PQCache(model, PQCacheConfig(token_budget=0.1, **SMALL))
        obs_small = small.instrument(recall_every=1)
        greedy_generate(model, ids, small, n=5)
    for rec in obs_full.recall:  # the whole context is attended: recall and mass are 1
        assert rec["topk_recall"] == pytest.approx([1.0] * 2)
        assert rec["mass_recall"] == pytest.approx([1.0] * 2, abs=1e-5)
        assert rec["qhead_recall"] == pytest.approx([1.0] * 4)  # each query head's own top-k is in
    for att in obs_full.attention:
        probs = att["prob"]
        assert probs == sorted(probs, reverse=True) and 0 < probs[0] <= 1
        assert att["rank"][0] == 1 and att["n_tokens"] >= 400
    steps = {r["step"] for r in obs_full.recall}
    assert steps == {0, 2}  # sampled every 2nd of the 4 decode steps
    for rec in obs_small.recall:
        assert all(0 <= r <= 1 for r in rec["topk_recall"])
        assert all(0 < m < 1 for m in rec["mass_recall"])  # a 1/10 budget misses some mass
        assert len(rec["qhead_recall"]) == 4 and all(0 <= r <= 1 for r in rec["qhead_recall"])


def test_clustering_overlaps_later_layers_compute():
    """Layer i's K-Means runs in the background while layers > i compute (recorded timeline)."""
    model = tiny_model("llama")
    cache = PQCache(model, PQCacheConfig(token_budget=0.2, n_init=4, kmeans_iters=25, bits=6))
    obs = cache.instrument(timeline=True)
    with torch.no_grad():
        model(torch.randint(1, 96, (1, 3000), generator=torch.Generator().manual_seed(2)), cache=cache)
    cache.wait()
    ev = obs.to_dict()["events"]
    clusters = [e for e in ev if e["lane"] == "host clustering"]
    computes = [e for e in ev if e["lane"] == "device compute"]
    assert len(clusters) == len(cache.pq_layers)
    overlaps = [
        (c["layer"], d["layer"])
        for c in clusters
        for d in computes
        if d["layer"] > c["layer"] and c["start"] < d["end"] and d["start"] < c["end"]
    ]
    assert overlaps, (clusters, computes)
    assert cache.pq_layers[0].stats["kmeans_iters"] == 25


def _cache(policy, n_slots=2, bs=4):
    return BlockCache(1, 1, 2, torch.float32, torch.device("cpu"), bs, n_slots * bs, admit=1, policy=policy)


def _retrieve(bc, k_host, v_host, blocks, bs=4):
    host = HostTier(1, 1, 2, torch.float32, torch.device("cpu"))
    host.append(k_host, v_host)
    top = torch.tensor([[[b * bs + i for b in blocks for i in range(bs)]]])
    valid = torch.ones_like(top, dtype=torch.bool)
    slot = bc.lookup(top)
    bc.admit(top, valid, host, n_complete_tokens=k_host.shape[2])
    return (slot >= 0).sum().item()


@pytest.mark.parametrize("policy,victim", [("lru", 0), ("lfu", 1)])
def test_block_cache_eviction_order(policy, victim):
    """Blocks 0 and 1 cached; block 0 used 3 times long ago, block 1 once recently. Admitting block 2
    evicts the least recently used (LRU: block 0) or the least frequently used (LFU: block 1)."""
    k_host = torch.arange(64, dtype=torch.float32).view(1, 1, 32, 2)
    bc = _cache(policy)
    for blocks in ([0], [0], [0], [1]):
        _retrieve(bc, k_host, k_host, blocks)
    assert set(bc.slot_block.flatten().tolist()) == {0, 1}
    _retrieve(bc, k_host, k_host, [2])
    assert set(bc.slot_block.flatten().tolist()) == {0, 1, 2} - {victim}
    assert _retrieve(bc, k_host, k_host, [2]) == 4  # block 2 now hits, all 4 tokens
    slot = bc.slot_block[0, 0].tolist().index(2)
    assert torch.equal(bc.k[0, 0, slot], k_host[0, 0, 8:12])  # with block 2's data


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_block_cache_admits_the_same_blocks_in_numpy_as_in_torch(policy):
    """On a CPU the admission runs in numpy a (row, head) at a time, on a GPU in torch for all at once: over 40
    retrievals with distinct counts per block, both keep the same blocks with the same use counts and the data."""
    gen = torch.Generator().manual_seed(7)
    B, H, bs, n_blocks = 2, 2, 4, 16
    host = HostTier(B, H, 3, torch.float32, torch.device("cpu"))
    k_host = torch.randn(B, H, n_blocks * bs, 3, generator=gen)
    host.append(k_host, -k_host)
    numpy_cache, torch_cache = (
        BlockCache(B, H, 3, torch.float32, torch.device("cpu"), bs, 4 * bs, admit=2, policy=policy) for _ in range(2)
    )
    for _ in range(40):
        rows = []
        for _ in range(B * H):  # blocks picked 1, 2, 3, ... times: no two with the same count
            blocks = torch.randperm(n_blocks, generator=gen)[:5]
            rows.append(torch.cat([b * bs + torch.randperm(bs, generator=gen)[: i + 1] for i, b in enumerate(blocks)]))
        top = torch.stack(rows).view(B, H, -1)
        valid = torch.rand(top.shape, generator=gen) > 0.05
        for bc in (numpy_cache, torch_cache):
            bc.step += 1
            bc._grow(n_blocks)
        copied = (
            numpy_cache._admit_rows(top, valid, host, n_blocks),
            torch_cache._admit_tensors(top, valid, host, n_blocks),
        )
        assert copied[0] == copied[1]
        for b in range(B):
            for h in range(H):
                kept = [
                    {(int(blk), int(u)) for blk, u in zip(bc.slot_block[b, h], bc.uses[b, h])}
                    for bc in (numpy_cache, torch_cache)
                ]
                assert kept[0] == kept[1]
                for slot, blk in enumerate(numpy_cache.slot_block[b, h].tolist()):
                    if blk >= 0:
                        assert torch.equal(numpy_cache.k[b, h, slot], k_host[b, h, blk * bs : (blk + 1) * bs])
                        assert torch.equal(numpy_cache.v[b, h, slot], -k_host[b, h, blk * bs : (blk + 1) * bs])
                        assert int(numpy_cache.block_slot[b, h, blk]) == slot
    assert (numpy_cache.slot_block >= 0).all()  # it filled up and evicted along the way


def test_block_cache_default_is_off_on_a_cpu_and_on_elsewhere():
    """The default capacity (None) is 1024 tokens where the device has memory of its own and 0 on a CPU; an explicit
    capacity holds everywhere. A CPU cache at the defaults has no block cache; with a capacity set, it has one."""
    cfg = PQCacheConfig()
    assert cfg.block_cache_tokens is None
    assert (cfg.block_cache_for("cpu"), cfg.block_cache_for(torch.device("cuda"))) == (0, 1024)
    assert PQCacheConfig(block_cache_tokens=256).block_cache_for("cpu") == 256
    with pytest.raises(PQCacheConfigError, match="block_cache_tokens"):
        PQCacheConfig(block_cache_tokens=100)  # not a multiple of block_size
    model = tiny_model("llama")
    ids = torch.randint(1, 96, (1, 1200), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        default, explicit = (
            PQCache(model, PQCacheConfig(bits=4)),
            PQCache(model, PQCacheConfig(bits=4, block_cache_tokens=256)),
        )
        greedy_generate(model, ids, default, n=2)
        greedy_generate(model, ids, explicit, n=2)
    assert default.pq_layers[0].window.blocks is None
    assert explicit.pq_layers[0].window.blocks is not None and explicit.pq_layers[0].stats["hits"] >= 0


def test_block_cache_serves_hits_with_the_right_data():
    # without a block cache the one-row step runs: with the picks' values copied, as the general step does, so
    # that the two are bit-identical (values summed in place: tests/unit/test_onerow.py); a CPU's block cache keeps
    # its books only unless asked for copies (test_onerow.py)
    kernels = Kernels(values_in_place=False, block_copies_on_cpu=True)
    model = tiny_model("mistral")
    ids = torch.randint(1, 96, (1, 600), generator=torch.Generator().manual_seed(3))
    cfg_on = PQCacheConfig(token_budget=0.2, kernels=kernels, **SMALL)
    cfg_off = PQCacheConfig(token_budget=0.2, kernels=kernels, **{**SMALL, "block_cache_tokens": 0})
    with torch.no_grad():
        seq_on, scores_on = greedy_generate(model, ids, cache_on := PQCache(model, cfg_on), n=10)
        seq_off, scores_off = greedy_generate(model, ids, PQCache(model, cfg_off), n=10)
    assert torch.equal(seq_on, seq_off)
    torch.testing.assert_close(scores_on, scores_off, rtol=0, atol=0)  # hits carry the same K/V
    layer = cache_on.pq_layers[0]
    assert layer.stats["hits"] > 0 and layer.stats["misses"] > 0
    top, valid = layer.last_selection
    assert layer.window.blocks.n_slots == 4


def test_rebuild_every_n_tokens():
    model = tiny_model("llama")
    ids = torch.randint(1, 96, (1, 200), generator=torch.Generator().manual_seed(4))
    cfg = PQCacheConfig(token_budget=1.0, n_local=8, rebuild_every=4, **SMALL)
    with torch.no_grad():
        ref_seq, ref_scores = greedy_generate(model, ids, full_attention_cache(model), n=12)
        cache = PQCache(model, cfg)
        seq, scores = greedy_generate(model, ids, cache, n=12)
    cache.wait()
    layer = cache.pq_layers[0]
    assert layer.stats["rebuilds"] >= 2
    index = layer.method_state["index"]
    assert len(index.segments) == 1
    S = layer.S
    codes = pq.encode(layer.host.keys(0, S), index.segments[0][1], "l2")
    assert torch.equal(index.codes[..., :S], codes)  # every token coded by the rebuilt centroids
    torch.testing.assert_close(scores, ref_scores, rtol=1e-5, atol=1e-5)  # still exact at full budget


def test_new_turn_gets_its_own_codebook():
    model = tiny_model("gemma3")
    g = torch.Generator().manual_seed(5)
    doc, turn = torch.randint(1, 96, (1, 300), generator=g), torch.randint(1, 96, (1, 40), generator=g)
    cache = PQCache(model, PQCacheConfig(token_budget=0.3, turn_min_tokens=32, **SMALL))
    with torch.no_grad():
        model(doc, cache=cache)
        model(turn, cache=cache)
        cache.wait()
        model(torch.tensor([[7]]), cache=cache)
    layer = cache.pq_layers[0]
    index = layer.method_state["index"]
    assert [start for start, _ in index.segments] == [0, 300]
    assert layer.stats["turn_segments"] == 1
    seg_codes = pq.encode(layer.host.keys(300, 340), index.segments[1][1], "l2")
    assert torch.equal(index.codes[..., 300:340], seg_codes)
    assert layer.S == 341


def test_pq_ready_flag_and_iterations_in_stats():
    model = tiny_model("llama")
    cache = PQCache(model, PQCacheConfig(token_budget=0.2, **SMALL))
    with torch.no_grad():
        greedy_generate(model, torch.randint(1, 96, (1, 120)), cache, n=3)
    stats = cache.stats()
    assert stats["kmeans_iters"] == 5
    for row in stats["layers"]:
        assert row["pq_ready_before_use"] in (True, False)
        assert row["pq_build_s"] > 0


def test_device_map_places_tiers_on_each_layers_device(tmp_path):
    """Placement through accelerate: each PQ layer's tiers live on its own layer's device."""
    from pqcache import load_model

    model = tiny_model("llama")
    model.save_pretrained(tmp_path)
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    ).save_pretrained(tmp_path)
    device_map = {
        "model.embed_tokens": "cpu",
        "model.layers.0": "cpu",
        "model.layers.1": "cpu",
        "model.layers.2": "cpu",
        "model.norm": "cpu",
        "model.rotary_emb": "cpu",
        "lm_head": "cpu",
    }
    loaded, _ = load_model(str(tmp_path), device_map=device_map)
    cache = PQCache(loaded, PQCacheConfig(token_budget=0.2, **SMALL))
    with torch.no_grad():
        greedy_generate(loaded, torch.randint(1, 96, (1, 100)), cache, n=2)
    for layer in cache.pq_layers:
        param_device = next(loaded.model.layers[layer.layer_idx].parameters()).device
        assert layer.device == param_device == layer.window.k.device == layer.method_state["index"].codes.device
        assert layer.host.own_k.device.type == "cpu"


def test_per_query_head_recall_counts_each_heads_own_top_k():
    """Two query heads share a KV head: a selection holding head 0's exact top-k but none of head
    1's scores 1 for head 0 and 0 for head 1."""
    from pqcache.engine.layer.probe import per_query_head_recall

    exact = torch.zeros(1, 1, 2, 10)
    exact[0, 0, 0, [1, 2]] = 5.0  # head 0 looks at 1 and 2
    exact[0, 0, 1, [6, 7]] = 5.0  # head 1 at 6 and 7
    cand = torch.ones(1, 10, dtype=torch.bool)
    chosen = torch.zeros(1, 1, 10, dtype=torch.bool)
    chosen[0, 0, [1, 2]] = True
    assert per_query_head_recall(exact, cand, chosen, k=2, G=2).tolist() == [1.0, 0.0]
