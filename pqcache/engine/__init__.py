"""The engine: the PQCache transformers Cache, its per-layer parts (layer/), the selection methods
(methods/), product quantization (pq.py), settings (config.py), errors and instrumentation."""
