"""A cost MODEL (not a measurement) of full KV against PQCache for a model, context, batch, GPU and
host link. Formulas (per decode step unless said):

  full KV bytes        = 2 * L_full * H_kv * d_h * s * batch * e          (+ sliding windows, both methods)
  PQCache device bytes = 2 * L_full * H_kv * d_h * (n_init + n_local + k + cache) * batch * e
  PQ bytes             = L_full * H_kv * batch * (m * s + 2^bits * d_h * 4)
  link bytes / token   = 2 * L_full * H_kv * d_h * k * (1 - hit_rate) * batch * e
  decode attention s   = full: full KV bytes / HBM;  PQCache: device bytes / HBM + link bytes / link
  prefill s            = 2 * params * s * batch / FLOPS + 4 * L * d_model * s^2 * batch / FLOPS
  T_max                = (prefill s - a1) / (b1 * s), clipped to [3, 300], with clustering cost b1 from
                         the CPU's K-Means throughput (CPU_KMEANS_FLOPS, an assumption)

e = 2 bytes (bf16). GPU figures are vendor peak numbers; real kernels reach a fraction of them.
"""

from __future__ import annotations

from dataclasses import dataclass

from pqcache.engine.config import PQCacheConfig


@dataclass(frozen=True)
class ModelShape:
    layers: int
    full_layers: int
    kv_heads: int
    head_dim: int
    d_model: int
    params: float  # parameters (for prefill FLOPs and weight memory)
    sliding_window: int = 0


MODELS = {
    "Llama-3.1-8B": ModelShape(32, 32, 8, 128, 4096, 8.0e9),
    "Llama-3.1-70B": ModelShape(80, 80, 8, 128, 8192, 70.6e9),
    "Mistral-7B-v0.2": ModelShape(32, 32, 8, 128, 4096, 7.2e9),
    "Gemma-3-270M (bundled)": ModelShape(18, 3, 1, 256, 640, 0.27e9, sliding_window=512),
}
GPUS = {  # memory GiB, HBM GB/s, dense bf16 TFLOPS (vendor peak)
    "RTX 4090": (24, 1008, 165),
    "A100 80GB": (80, 2039, 312),
    "H100 SXM": (80, 3350, 989),
    "H200": (141, 4800, 989),
}
LINKS = {"PCIe 4.0 x16": 25.0, "PCIe 5.0 x16": 50.0, "NVLink-C2C (Grace)": 450.0}  # GB/s, effective
CPU_KMEANS_FLOPS = 200e9  # assumption: a many-core server CPU running faiss K-Means
BYTES = 2  # bf16


def estimate(
    model: str,
    context: int,
    batch: int,
    gpu: str,
    link: str,
    config: PQCacheConfig | None = None,
    hit_rate: float = 0.6,
) -> dict:
    sh = MODELS[model]
    cfg = (config or PQCacheConfig()).for_head_dim(sh.head_dim)
    n_centroids = 1 << cfg.bits_for(context, sh.head_dim)
    mem_gib, hbm, tflops = GPUS[gpu]
    per_token = 2 * sh.kv_heads * sh.head_dim * BYTES  # K and V of one token in one layer
    sliding = (sh.layers - sh.full_layers) * min(context, sh.sliding_window) * per_token * batch
    full = sh.full_layers * context * per_token * batch + sliding
    n_init, k, n_local = cfg.split(context)
    cache = min(cfg.block_cache_for("cuda"), context // 4)  # a model of a GPU
    device = sh.full_layers * (n_init + n_local + k + cache) * per_token * batch + sliding
    pq = sh.full_layers * sh.kv_heads * batch * (cfg.m * context + n_centroids * sh.head_dim * 4)
    link_bytes = sh.full_layers * k * (1 - hit_rate) * per_token * batch
    full_s = full / (hbm * 1e9)
    pq_s = (device + pq) / (hbm * 1e9) + link_bytes / (LINKS[link] * 1e9)
    prefill_s = (2 * sh.params * context * batch + 4 * sh.layers * sh.d_model * context**2 * batch) / (tflops * 1e12)
    # K-Means: s points x 2^bits centroids x d_h flops x 2, per KV head and full layer, per iteration
    b1 = 2 * n_centroids * sh.head_dim * sh.kv_heads * sh.full_layers * batch / CPU_KMEANS_FLOPS
    t_max = int(min(max(prefill_s / max(b1 * context, 1e-12), 3), 300))
    weights = sh.params * BYTES
    return {
        "model": model,
        "context": context,
        "batch": batch,
        "gpu": gpu,
        "link": link,
        "full_kv_gib": full / 2**30,
        "pqcache_device_gib": device / 2**30,
        "pq_gib": pq / 2**30,
        "weights_gib": weights / 2**30,
        "gpu_gib": mem_gib,
        "full_fits": weights + full <= mem_gib * 2**30,
        "pqcache_fits": weights + device + pq <= mem_gib * 2**30,
        "link_mib_per_token": link_bytes / 2**20,
        "full_attention_ms": full_s * 1e3,
        "pqcache_attention_ms": pq_s * 1e3,
        "prefill_s": prefill_s,
        "t_max": t_max,
        "budget_split": (n_init, k, n_local),
    }


def curve(model: str, batch: int, gpu: str, link: str, config: PQCacheConfig | None = None) -> list[dict]:
    """Device KV memory against context length, both methods (the paper's memory figure, modelled)."""
    rows = []
    for exp in range(10, 18):  # 1K .. 128K
        e = estimate(model, 2**exp, batch, gpu, link, config)
        rows.append(
            {
                "context": 2**exp,
                "full_gib": e["full_kv_gib"],
                "pqcache_gib": e["pqcache_device_gib"] + e["pq_gib"],
                "gpu_gib": e["gpu_gib"],
                "weights_gib": e["weights_gib"],
            }
        )
    return rows
