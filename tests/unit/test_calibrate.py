"""Adaptive K-Means iterations: the fits, T_max, and kmeans_iters="auto" reading the stored fit."""

import json

import pytest
import torch

from pqcache import PQCache, PQCacheConfig
from pqcache.bench.calibrate import calibrate, fit_cluster, fit_prefill, save
from pqcache.engine import iters
from pqcache.engine.iters import DEFAULT_ITERS, ITERS_RANGE, kmeans_iters_for, load_fit, t_max
from tests.tiny import tiny_model


def test_fits_recover_known_coefficients():
    pre = fit_prefill([(s, 0.5 + 1e-3 * s + 2e-7 * s * s) for s in (512, 1024, 2048, 4096)])
    assert pre["a2"] == pytest.approx(0.5, abs=1e-6)
    assert pre["b2"] == pytest.approx(1e-3, rel=1e-4)
    assert pre["c2"] == pytest.approx(2e-7, rel=1e-4)
    clu = fit_cluster([(s, T, 0.01 + 3e-7 * s * T) for s in (512, 2048) for T in (5, 20)])
    assert clu["a1"] == pytest.approx(0.01, abs=1e-9)
    assert clu["b1"] == pytest.approx(3e-7, rel=1e-6)


def test_t_max_formula_and_clip():
    fit = {"prefill": {"a2": 0.5, "b2": 1e-3, "c2": 2e-7}, "cluster": {"a1": 0.01, "b1": 1e-5}}
    s = 4096
    expected = (2e-7 * s * s + 1e-3 * s + 0.5 - 0.01) / (1e-5 * s)
    assert ITERS_RANGE[0] < expected < ITERS_RANGE[1]
    assert t_max(s, fit) == int(expected)
    assert t_max(16, fit) == ITERS_RANGE[1]  # tiny s: clipped at the top
    slow = {"prefill": {"a2": 0.0, "b2": 1e-9, "c2": 0.0}, "cluster": {"a1": 0.0, "b1": 1.0}}
    assert t_max(4096, slow) == ITERS_RANGE[0]  # clustering far slower than compute: clipped at the bottom


def test_auto_uses_stored_fit(tmp_path, monkeypatch):
    monkeypatch.setenv("PQCACHE_HOME", str(tmp_path))
    assert kmeans_iters_for("auto", 1000) == DEFAULT_ITERS  # no calibration yet
    assert kmeans_iters_for(7, 1000) == 7
    fit = {"prefill": {"a2": 0.0, "b2": 0.0, "c2": 1e-6}, "cluster": {"a1": 0.0, "b1": 1e-6}}
    save(fit)
    assert json.loads((tmp_path / "calibration.json").read_text())["cluster"]["b1"] == 1e-6
    assert kmeans_iters_for("auto", 50, fit=load_fit()) == 50  # T_max = c2 s^2 / (b1 s) = s
    model = tiny_model("llama")
    cache = PQCache(model, PQCacheConfig(token_budget=0.2, n_init=4, bits=4, kmeans_iters="auto"))
    with torch.no_grad():
        model(torch.randint(1, 96, (1, 120)), cache=cache)
    cache.wait()
    assert cache.stats()["kmeans_iters"] == 120


def test_calibrate_runs_on_a_model(tmp_path, monkeypatch):
    monkeypatch.setenv("PQCACHE_HOME", str(tmp_path))

    class Tok:
        def __call__(self, text, return_tensors=None):
            return type("Enc", (), {"input_ids": torch.randint(1, 96, (1, 17))})()

    fit = calibrate(
        tiny_model("llama"),
        Tok(),
        seq_lens=(64, 128, 256),
        iters=(2, 6),
        config=PQCacheConfig(bits=4, n_init=4),
        repeats=1,
        progress=lambda *_: None,
    )
    assert len(fit["points"]["prefill"]) == 3 and len(fit["points"]["cluster"]) == 6
    assert fit["cluster"]["b1"] > 0
    assert all(ITERS_RANGE[0] <= t <= ITERS_RANGE[1] for t in fit["t_max"].values())


def test_calibration_file_read_once_per_cache(tmp_path, monkeypatch):
    """Every full-attention layer submits its own K-Means (and turns/rebuilds submit more): the
    calibration file is read when the cache is made, not on each submission."""
    monkeypatch.setenv("PQCACHE_HOME", str(tmp_path))
    save({"prefill": {"a2": 0.0, "b2": 0.0, "c2": 1e-6}, "cluster": {"a1": 0.0, "b1": 1e-6}})
    reads = []
    real = iters.load_fit
    monkeypatch.setattr(iters, "load_fit", lambda: reads.append(1) or real())
    import pqcache.engine.cache as cache_module

    monkeypatch.setattr(cache_module, "load_fit", iters.load_fit)
    model = tiny_model("llama")  # 3 full-attention layers
    cfg = PQCacheConfig(token_budget=0.2, n_init=4, bits=4, kmeans_iters="auto", rebuild_every=2)
    cache = PQCache(model, cfg)
    with torch.no_grad():
        out = model(torch.randint(1, 96, (1, 120)), cache=cache)
        token = out.logits[:, -1:].argmax(-1)
        for _ in range(4):  # two rebuilds per layer
            token = model(token, cache=cache).logits[:, -1:].argmax(-1)
    cache.wait()
    assert sum(layer.stats["rebuilds"] for layer in cache.pq_layers) >= 3
    assert len(reads) == 1
