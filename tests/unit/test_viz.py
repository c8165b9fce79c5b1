"""Figure builders on data recorded from a real (tiny) run, and on empty data."""

import json

import plotly.graph_objects as go
import plotly.io as pio
import pytest
import torch

from pqcache import PQCache, PQCacheConfig, costmodel
from tests.tiny import tiny_model
from viz import figures, studies


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
    assert hits.data[-1].name == figures.ALL_LAYERS and len(hits.data) == 4
    last = max(b["step"] for b in data["blocks"])  # all layers together at the last step: their hits over fetches
    total_h = sum(b["hits"] for b in data["blocks"] if b["step"] == last)
    total = total_h + sum(b["misses"] for b in data["blocks"] if b["step"] == last)
    assert hits.data[-1].y[-1] == pytest.approx(total_h / total)
    per_layer = [tr.y[-1] for tr in hits.data[:-1]]  # between its layers' own rates, as a reader expects
    assert min(per_layer) - 1e-9 <= hits.data[-1].y[-1] <= max(per_layer) + 1e-9
    assert "block cache" in figures.hit_rate({}).layout.annotations[0].text  # the empty panel says what it will draw


def test_a_model_with_many_layers_gets_their_range_and_mean_not_a_line_each():
    rows = [
        {"layer": layer, "step": step, "topk_recall": [layer / 40 + step / 100]}
        for layer in range(30)
        for step in range(5)
    ]
    fig = figures.recall({"recall": rows})
    assert [tr.name for tr in fig.data if tr.showlegend is not False] == ["range over 30 layers", "mean of 30 layers"]
    low, high, mean = fig.data
    assert list(low.y) == pytest.approx([s / 100 for s in range(5)])
    assert list(high.y) == pytest.approx([29 / 40 + s / 100 for s in range(5)])
    assert list(mean.y) == pytest.approx([14.5 / 40 + s / 100 for s in range(5)])


def test_timeline_names_what_ran_where_and_shows_a_recent_window(recorded):
    data, _ = recorded
    fig = figures.timeline(data)  # a CPU run, the whole run
    lanes = {tr.name for tr in fig.data}
    assert {"compute (CPU)", "K-Means (CPU, background thread)", "new tokens' KV to the host tier (RAM)"} <= lanes
    assert "GPU" not in fig.layout.title.text and "whole run" in fig.layout.title.text
    for tr in fig.data:  # one path per lane: spans as (start, end, gap) triples, each at least a pixel wide
        starts, ends = tr.x[0::3], tr.x[1::3]
        assert all(e > s for s, e in zip(starts, ends)) and all(x is None for x in tr.x[2::3])
    t_end = max(e["end"] for e in data["events"])
    # the last half of the run, however fast this machine ran it (a fixed 0.05 s held the whole run on a fast one)
    window_s = (t_end - min(e["start"] for e in data["events"])) / 2
    recent = figures.timeline(data, "cpu", window_s=window_s)
    assert tuple(recent.layout.xaxis.range) == pytest.approx((t_end - window_s, t_end))
    assert sum(len(tr.x) for tr in recent.data) < sum(len(tr.x) for tr in fig.data)
    assert "compute (GPU)" in {tr.name for tr in figures.timeline(data, "cuda").data}


def test_whole_run_timeline_draws_a_long_pause_short_and_says_how_long_it_was():
    burst = [{"lane": "device compute", "layer": 0, "start": t, "end": t + 0.1} for t in (0.0, 0.2, 0.4)]
    later = [{**e, "start": e["start"] + 600, "end": e["end"] + 600} for e in burst]  # ten idle minutes later
    fig = figures.timeline({"lanes": ["device compute"], "events": burst + later})
    lo, hi = fig.layout.xaxis.range
    assert hi - lo == pytest.approx(0.5 + figures.IDLE_S + 0.5)  # the work fills the axis, not the pause
    assert [a.text for a in fig.layout.annotations] == ["idle 600 s"]
    spans = [(s, e) for s, e in zip(fig.data[0].x[0::3], fig.data[0].x[1::3])]
    assert [round(e - s, 6) for s, e in spans] == [0.1] * 6  # every span keeps its length
    assert "pauses over" in fig.layout.xaxis.title.text
    recent = figures.timeline({"lanes": ["device compute"], "events": burst + later}, "cpu", window_s=1.0)
    assert not recent.layout.annotations  # a recent window shows real time


def test_whole_run_timeline_merges_spans_it_could_not_draw_apart():
    events = [{"lane": "device compute", "layer": 0, "start": i * 1e-3, "end": i * 1e-3 + 5e-4} for i in range(6000)]
    fig = figures.timeline({"lanes": ["device compute"], "events": events})
    assert len(fig.data[0].x) // 3 <= figures.TIMELINE_BARS


def test_recall_and_hit_rate_say_when_they_do_not_apply(recorded):
    data, _ = recorded
    for fig in (figures.recall(data, "full"), figures.hit_rate(data, "full")):
        assert not fig.data and "Does not apply to full attention" in fig.layout.annotations[0].text
    fig = figures.recall(data, "pqcache")
    assert fig.layout.xaxis.dtick >= 1 and fig.layout.xaxis.tickformat == "d"  # whole-number steps


def test_memory_bars_match_stats(recorded):
    _, stats = recorded
    fig = figures.memory(stats)
    assert list(fig.data[0].y) == pytest.approx(
        [stats["device_kv_bytes"] / 2**20, stats["host_kv_bytes"] / 2**20, stats["pq_bytes"] / 2**20]
    )
    assert "device" not in " ".join(fig.data[0].x)  # a CPU has no device: the tiers as they are there
    assert list(figures.memory(stats, "cuda").data[0].x)[:2] == ["device KV (GPU)", "host KV (CPU memory)"]


def test_heat_strip_counts_positions_and_marks_the_fact(recorded):
    data, _ = recorded
    positions = data["selected"][0]["positions"][0][0]
    fig = figures.heat_strip({"pqcache": positions, "other": [5, 6, 7]}, n_tokens=310, marks=[100], n_bins=31)
    z = fig.data[0].z
    assert sum(z[0]) == len([p for p in positions if p < 310]) and sum(z[1]) == 3
    fact = [tr for tr in fig.data if tr.name == "the hidden fact"]
    assert len(fact) == 1 and fig.layout.shapes[0].x0 == 100  # the fact's line, with its own legend entry
    assert fig.data[0].showscale is not False and fig.data[0].colorbar.title.text.startswith("tokens attended")


def test_empty_data_gives_placeholder_figures():
    for fig in (
        figures.power_law({}),
        figures.recall({}),
        figures.hit_rate({}),
        figures.timeline({}),
        figures.memory(None),
        figures.heat_strip({}, 10),
        studies.cost_curves([]),
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
    fig = studies.cost_curves(rows)
    assert fig.layout.xaxis.type == "log" and "model" in fig.layout.title.text
    lo, hi = fig.layout.yaxis.range  # log10 GiB: the data's range, the GPU's 24 GiB inside it
    values = [y for tr in fig.data for y in tr.y]
    assert 10**lo <= min(values) and max(values) <= 10**hi and hi - lo < 3
    assert [tr.name for tr in fig.data][-1] == "GPU memory (24 GiB)" and set(fig.data[-1].y) == {24}
    marked = studies.cost_curves(rows, 131072)
    assert marked.data[-1].name == "this context (131,072 tokens)" and list(marked.data[-1].x) == [131072] * 2


def test_every_figure_is_drawn_on_the_white_template(recorded):
    """viz makes plotly_white the default template (a template passed to each figure cost about 9 ms of validation
    a figure): every figure, placeholders included, carries it when the page receives it."""
    data, stats = recorded
    white = pio.templates["plotly_white"].to_plotly_json()
    drawn = [
        figures.power_law(data, layer=1),
        figures.recall(data, "pqcache"),
        figures.hit_rate(data, "pqcache", None),
        figures.timeline(data),
        figures.memory(stats),
        figures.memory(None),
    ]
    for fig in drawn:
        assert json.loads(pio.to_json(fig))["layout"]["template"] == json.loads(json.dumps(white))


def test_recall_grid_lines_per_setting():
    rows = [
        {"layer": layer, "m": m, "bits": b, "budget": 0.1, "rerank": rr, "recall": 0.01 * m * b * rr + layer / 100}
        for layer in (5, 11)
        for m in (2, 4)
        for b in (6, 8)
        for rr in (1, 4, 8)
    ]
    fig = studies.recall_grid(rows)
    assert [tr.name for tr in fig.data][:2] == ["m=2, bits=6, budget 0.1", "m=2, bits=8, budget 0.1"]
    assert len(fig.data) == 4 and list(fig.data[0].x) == [1, 4, 8]
    assert fig.data[0].y[-1] == pytest.approx(0.01 * 2 * 6 * 8 + 0.08)  # mean over the two layers
