"""Product quantization of keys: faiss K-Means per sub-space, uint8 codes, lookup-table search.

Shapes: B batch, H KV heads, S tokens, D head_dim, m sub-spaces of d = D/m dims, C = 2**bits centroids,
R query rows scored against one KV head (GQA group size x query tokens).
"""

from __future__ import annotations

import faiss
import numpy as np
import torch
import torch.nn.functional as F


def train_subspace(x: np.ndarray, n_centroids: int, iters: int, metric: str, seed: int) -> np.ndarray:
    """K-Means of one sub-space. x (n, d) float32 -> centroids (C, d) float32."""
    n, d = x.shape
    if n <= n_centroids:
        # Fewer points than centroids: every point is its own centroid (exact), the rest repeat point 0.
        cents = np.zeros((n_centroids, d), dtype=np.float32)
        if n:
            cents[:n] = x
            cents[n:] = x[0]
        return cents
    km = faiss.Kmeans(
        d,
        n_centroids,
        niter=iters,
        seed=seed,
        verbose=False,
        spherical=(metric == "ip"),
        min_points_per_centroid=1,
        max_points_per_centroid=256,
    )
    km.train(np.ascontiguousarray(x, dtype=np.float32))
    return km.centroids.reshape(n_centroids, d).astype(np.float32, copy=False)


def train_centroids(keys: torch.Tensor, m: int, n_centroids: int, iters: int, metric: str, seed: int) -> torch.Tensor:
    """keys (n, D) of one (row, KV head) -> centroids (m, C, D/m) float32 on the host."""
    n, D = keys.shape
    sub = keys.detach().to("cpu").reshape(n, m, D // m)  # as stored (float16 on a CPU): widened a sub-space at a time
    cents = [
        train_subspace(sub[:, j].to(torch.float32).contiguous().numpy(), n_centroids, iters, metric, seed + j)
        for j in range(m)
    ]
    return torch.from_numpy(np.stack(cents))


def train_rotation(keys: torch.Tensor, m: int, bits: int, iters: int, seed: int) -> torch.Tensor:
    """OPQ (Ge et al., 2013) with faiss's OPQMatrix: an orthogonal rotation R (D, D) of one (row, KV
    head)'s keys (n, D) that spreads their variance so that m sub-space codebooks quantize R k
    better. Too few keys to train the inner PQ: the identity."""
    n, D = keys.shape
    if n < 4 * (1 << bits):
        return torch.eye(D)
    opq = faiss.OPQMatrix(D, m)
    opq.niter = max(1, min(iters, 25))
    opq.niter_pq = 4
    opq.pq = faiss.ProductQuantizer(D, m, bits)
    opq.pq.cp.seed, opq.pq.cp.min_points_per_centroid, opq.pq.verbose = seed, 1, False
    opq.train(np.ascontiguousarray(keys.detach().to("cpu", torch.float32).numpy()))
    return torch.from_numpy(faiss.vector_to_array(opq.A).reshape(D, D).copy())


# Tokens coded at a time: a block's inner products (m, block, C) in float32 are 16 MiB for a 256-dim head at 8 bits
# (m=4, C=256); the whole prefill's at once were 128 MiB at 32K tokens, twice over with the distances, on the
# background thread while the prefill's last chunk attends (docs/benchmarks.md, where a process's memory goes).
ENCODE_BLOCK = 4096


def encode(
    keys: torch.Tensor, centroids: torch.Tensor, metric: str, half_norm: torch.Tensor | None = None
) -> torch.Tensor:
    """keys (..., H, S, D), centroids (..., H, m, C, d) -> codes (..., H, m, S) uint8. half_norm: centroid_half_norms
    of these centroids, when the caller keeps them (a decode step codes one key)."""
    *lead, S, D = keys.shape
    m, C, d = centroids.shape[-3:]
    if metric != "ip" and half_norm is None:
        half_norm = centroid_half_norms(centroids)  # (..., H, m, C)
    codes = torch.empty((*lead, m, S), dtype=torch.uint8, device=keys.device)
    for start in range(0, S, ENCODE_BLOCK):
        block = keys[..., start : start + ENCODE_BLOCK, :]
        n = block.shape[-2]
        sub = block.to(centroids.dtype).reshape(*lead, n, m, d).transpose(-2, -3)  # (..., H, m, n, d)
        ip = sub @ centroids.transpose(-1, -2)  # (..., H, m, n, C)
        # argmin ||x - c||^2 = argmax (x.c - |c|^2 / 2)
        scores = ip if metric == "ip" else ip.sub_(half_norm.unsqueeze(-2))
        codes[..., start : start + n] = scores.argmax(-1)
    return codes


def centroid_half_norms(centroids: torch.Tensor) -> torch.Tensor:
    """centroids (..., C, d) -> |c|^2 / 2 (..., C)."""
    return 0.5 * (centroids * centroids).sum(-1)


def reconstruct(codes: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """codes (B, H, m, S) uint8, centroids (B, H, m, C, d) -> keys (B, H, S, m*d) as PQ sees them."""
    B, H, m, S = codes.shape
    d = centroids.shape[-1]
    idx = codes.long().unsqueeze(-1).expand(B, H, m, S, d)
    parts = torch.gather(centroids, 3, idx)  # (B, H, m, S, d)
    return parts.permute(0, 1, 3, 2, 4).reshape(B, H, S, m * d)


def residual_norms(keys: torch.Tensor, codes: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """keys (B, H, S, m*d) as the codebook sees them, their codes (B, H, m, S) -> ||k - k_hat|| (B, H, S) float32:
    how far each key is from the key its codes give (the first stage's margin, methods/pqcache.spreads)."""
    return (keys.float() - reconstruct(codes, centroids)).norm(dim=-1)


def lookup_tables(q: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """q (B, H, R, D), centroids (B, H, m, C, d) -> tables (B, H, m, C, R): q_sub . centroid."""
    B, H, R, D = q.shape
    m, C, d = centroids.shape[-3:]
    qs = q.to(centroids.dtype).reshape(B, H, R, m, d).permute(0, 1, 3, 2, 4)  # (B, H, m, R, d)
    return centroids @ qs.transpose(-1, -2)  # (B, H, m, C, R)


def approx_scores(tables: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """tables (B, H, m, C, R), codes (B, H, m, S) uint8 -> scores (B, H, S, R) = sum_j table[j, code_j].

    Embedding lookups over a flattened table: each code fetches its R contiguous table entries and
    the codes are widened only to int32 (never int64). For a few query rows (a decode step) one
    lookup serves all m sub-spaces; for many (a chunk) the m lookups accumulate in place, so the
    (m, S, R) intermediate never exists.
    """
    B, H, m, C, R = tables.shape
    flat = tables.reshape(B * H * m * C, R)
    if R <= 16:
        offset = torch.arange(B * H * m, device=codes.device, dtype=torch.int32).view(B, H, m, 1) * C
        return F.embedding(codes.to(torch.int32) + offset, flat).sum(2)  # (B, H, m, S, R) -> (B, H, S, R)
    base = (torch.arange(B * H, device=codes.device, dtype=torch.int32) * (m * C)).view(B, H, 1)
    out = None
    for j in range(m):
        idx = codes[:, :, j, :].to(torch.int32)  # (B, H, S)
        idx += base + j * C
        part = F.embedding(idx, flat)  # (B, H, S, R)
        out = part if out is None else out.add_(part)
    return out
