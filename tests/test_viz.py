"""Figure builders on data recorded from a real (tiny) run, and on empty data."""

import json

import plotly.graph_objects as go
import pytest
import torch

from pqcache import PQCache, PQCacheConfig
from pqcache.tools import costmodel
from viz import figures

from .conftest import tiny_model


@pytest.fixture(scope="module")
def recorded():
    model = tiny_model("llama")
    cache = PQCache(
        model, PQCacheConfig(token_budget=0.2, n_init=4, kmeans_iters=5, bits=4, block_size=16, block_cache_tokens=64)
    )
    obs = cache.instrument(timeline=True, attention_every=2, recall_every=2, selections=True)
    with torch.no_grad():
        model.generate(
            torch.randint(1, 96, (1, 300), generator=torch.Generator().manual_seed(0)),
            max_new_tokens=9,
            min_new_tokens=9,
            do_sample=False,
            cache=cache,
            pad_token_id=0,
        )
    return json.loads(json.dumps(obs.to_dict())), cache.stats()  # as plain JSON data


def test_power_law_is_log_log_per_layer(recorded):
    data, _ = recorded
    fig = figures.power_law(data, layer=1)
    assert fig.layout.xaxis.type == "log" and fig.layout.yaxis.type == "log"
    assert 1 <= len(fig.data) <= 6 and all(tr.name.startswith("step ") for tr in fig.data)
    ys = list(fig.data[0].y)
    assert ys == sorted(ys, reverse=True)
    assert fig.layout.uirevision == "keep" and fig.layout.height == figures.HEIGHT


def test_recall_and_hit_rate_lines(recorded):
    data, _ = recorded
    rec = figures.recall(data)
    assert {tr.name for tr in rec.data} == {"layer 0", "layer 1", "layer 2"}
    assert all(0 <= y <= 1 for tr in rec.data for y in tr.y)
    hits = figures.hit_rate(data)
    assert hits.data[-1].name == "cumulative" and len(hits.data) == 4
    total_h = sum(b["hits"] for b in data["blocks"])
    total = total_h + sum(b["misses"] for b in data["blocks"])
    assert hits.data[-1].y[-1] == pytest.approx(total_h / total)


def test_timeline_has_a_lane_per_kind(recorded):
    data, _ = recorded
    fig = figures.timeline(data)
    lanes = {tr.name for tr in fig.data}
    assert {"device compute", "host clustering", "copy to host"} <= lanes
    for tr in fig.data:
        assert all(w > 0 for w in tr.x) and tr.orientation == "h"


def test_memory_bars_match_stats(recorded):
    _, stats = recorded
    fig = figures.memory(stats)
    assert list(fig.data[0].y) == pytest.approx(
        [stats["device_kv_bytes"] / 2**20, stats["host_kv_bytes"] / 2**20, stats["pq_bytes"] / 2**20]
    )


def test_heat_strip_counts_positions_and_marks_the_fact(recorded):
    data, _ = recorded
    positions = data["selected"][0]["positions"][0][0]
    fig = figures.heat_strip({"pqcache": positions, "other": [5, 6, 7]}, n_tokens=310, marks=[100], n_bins=31)
    z = fig.data[0].z
    assert sum(z[0]) == len([p for p in positions if p < 310]) and sum(z[1]) == 3
    assert fig.layout.shapes[0].x0 == 100


def test_empty_data_gives_placeholder_figures():
    for fig in (
        figures.power_law({}),
        figures.recall({}),
        figures.hit_rate({}),
        figures.timeline({}),
        figures.memory(None),
        figures.heat_strip({}, 10),
        figures.cost_curves([]),
    ):
        assert isinstance(fig, go.Figure) and fig.layout.annotations


def test_cost_model_curve_and_estimate():
    rows = costmodel.curve("Llama-3.1-8B", 1, "RTX 4090", "PCIe 4.0 x16")
    assert [r["context"] for r in rows] == [2**e for e in range(10, 18)]
    assert all(r["pqcache_gib"] < r["full_gib"] for r in rows[3:])
    e = costmodel.estimate("Llama-3.1-8B", 131072, 1, "RTX 4090", "PCIe 4.0 x16")
    assert e["full_kv_gib"] == pytest.approx(16.0)  # 2 x 32 layers x 8 heads x 128 x 128K x 2 bytes
    assert not e["full_fits"] and e["pqcache_fits"]
    assert 3 <= e["t_max"] <= 300
    fig = figures.cost_curves(rows)
    assert fig.layout.xaxis.type == "log" and "model" in fig.layout.title.text


def test_recall_grid_lines_per_setting():
    rows = [
        {"layer": layer, "m": m, "bits": b, "budget": 0.1, "rerank": rr, "recall": 0.01 * m * b * rr + layer / 100}
        for layer in (5, 11)
        for m in (2, 4)
        for b in (6, 8)
        for rr in (1, 4, 8)
    ]
    fig = figures.recall_grid(rows)
    assert [tr.name for tr in fig.data][:2] == ["m=2, bits=6, budget 0.1", "m=2, bits=8, budget 0.1"]
    assert len(fig.data) == 4 and list(fig.data[0].x) == [1, 4, 8]
    assert fig.data[0].y[-1] == pytest.approx(0.01 * 2 * 6 * 8 + 0.08)  # mean over the two layers
