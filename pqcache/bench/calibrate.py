"""`python -m pqcache calibrate`: fit the adaptive K-Means iteration rule on this machine.

Measures, with the real model and the real PQ build:
  prefill compute time  t_p(s)   = a2 + b2 s + c2 s^2      (full-attention prefill, DynamicCache)
  clustering time       t_c(s,T) = a1 + b1 s T             (all PQ layers' K-Means + coding)
and stores the fit in $PQCACHE_HOME/calibration.json, which kmeans_iters="auto" then uses through
T_max = (c2 s^2 + b2 s + a2 - a1) / (b1 s) (iters.py).
"""

from __future__ import annotations

import json
import time

import numpy as np
import torch
from transformers import DynamicCache

from pqcache.engine.cache import PQCache
from pqcache.engine.config import PQCacheConfig
from pqcache.engine.iters import calibration_path, t_max
from pqcache.serving.generate import prefill


def fit_prefill(points: list[tuple[int, float]]) -> dict:
    """[(s, seconds)] -> a2, b2, c2 (least squares, c2 and b2 kept >= 0)."""
    s = np.array([p[0] for p in points], dtype=float)
    t = np.array([p[1] for p in points], dtype=float)
    coef, *_ = np.linalg.lstsq(np.stack([np.ones_like(s), s, s * s], 1), t, rcond=None)
    a2, b2, c2 = coef
    if c2 < 0 or b2 < 0:  # noisy points: fall back to a straight line through them
        (a2, b2), *_ = np.linalg.lstsq(np.stack([np.ones_like(s), s], 1), t, rcond=None)
        c2 = 0.0
    return {"a2": float(a2), "b2": float(max(b2, 0.0)), "c2": float(c2)}


def fit_cluster(points: list[tuple[int, int, float]]) -> dict:
    """[(s, T, seconds)] -> a1, b1."""
    x = np.array([p[0] * p[1] for p in points], dtype=float)
    t = np.array([p[2] for p in points], dtype=float)
    (a1, b1), *_ = np.linalg.lstsq(np.stack([np.ones_like(x), x], 1), t, rcond=None)
    return {"a1": float(a1), "b1": float(max(b1, 1e-12))}


def _text_ids(tokenizer, n: int) -> torch.Tensor:
    base = tokenizer(
        "The quick brown fox jumps over the lazy dog while the river runs to the sea. ", return_tensors="pt"
    ).input_ids[0]
    return base.repeat(n // base.numel() + 1)[:n].view(1, n)


@torch.no_grad()
def calibrate(
    model,
    tokenizer,
    seq_lens=(512, 1024, 2048, 4096),
    iters=(5, 20),
    config: PQCacheConfig | None = None,
    repeats: int = 2,
    progress=print,
) -> dict:
    config = config or PQCacheConfig()
    device = next(model.parameters()).device
    prefill_pts, cluster_pts = [], []
    for s in seq_lens:
        ids = _text_ids(tokenizer, s).to(device)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            prefill(model, ids, DynamicCache(config=model.config))  # the prefill the app runs (in chunks)
            times.append(time.perf_counter() - t0)
        prefill_pts.append((s, min(times)))
        cache = PQCache(model, PQCacheConfig(**{**config.to_dict(), "kmeans_iters": iters[0]}))
        prefill(model, ids, cache)
        cache.wait()
        for T in iters:  # the real build on the real keys, timed alone
            t0 = time.perf_counter()
            for layer in cache.pq_layers:
                layer.method_state["index"].build(0, layer.S, T, "calibrate")
            cluster_pts.append((s, T, time.perf_counter() - t0))
        cache.close()
        progress(
            f"s={s}: prefill {prefill_pts[-1][1]:.3f} s, clustering "
            + ", ".join(f"T={T}: {c:.3f} s" for (_, T, c) in cluster_pts[-len(iters) :])
        )
    fit = {
        "prefill": fit_prefill(prefill_pts),
        "cluster": fit_cluster(cluster_pts),
        "points": {"prefill": prefill_pts, "cluster": cluster_pts},
        "model": getattr(model.config, "_name_or_path", "") or model.config.model_type,
        "m": config.m,
        "bits": config.bits,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    fit["t_max"] = {str(s): t_max(s, fit) for s in (1024, 4096, 8192, 16384, 32768)}
    return fit


def save(fit: dict) -> str:
    path = calibration_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(fit, indent=1))
    return str(path)
