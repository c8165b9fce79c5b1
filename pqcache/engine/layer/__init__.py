"""One full-attention layer's KV cache, as parts: host tier, device window, PQ index, attention,
composed by layer.py's PQLayer (import it from pqcache.engine.layer.layer)."""
