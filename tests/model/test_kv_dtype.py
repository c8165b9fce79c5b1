"""Half-precision KV on the bundled model: a memory cap holds twice the 8K documents."""

from pqcache import PQCacheConfig
from pqcache.serving.footprint import document_bytes


def test_a_memory_cap_holds_twice_the_8k_documents_it_held_in_float32(real_model):
    """The session pool's reservation for an 8K document of the bundled model (what decides whether one more fits):
    under 1 GiB at least 28 documents, twice the 14 it held before half-precision KV (68.3 MiB each at 3e5a09c,
    docs/benchmarks.md#half-precision-kv), and at least 1.9 times the documents of float32 rows today (the PQ
    codes and centroids stay as they are)."""
    model, _ = real_model
    cap, n = 2**30, 8192
    counts = {
        kv: cap // document_bytes(model, PQCacheConfig(kv_dtype=kv), "pqcache", n, "cpu") for kv in ("auto", "model")
    }
    assert counts["auto"] >= 2 * 14
    assert counts["auto"] >= 1.9 * counts["model"]
