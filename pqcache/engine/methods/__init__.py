"""Selection methods, one module each, under one interface (base.Method).

| name      | rule |
|-----------|------|
| full      | every token (exact attention through the same tiers) |
| oracle    | exact top-k of the current query, same budget as PQCache (PQCache's upper bound) |
| streaming | 4 sink tokens + the most recent tokens (StreamingLLM, Xiao et al. 2024) |
| h2o       | heavy hitters by attention received so far + recent window, evicted for good (Zhang et al. 2023) |
| snapkv    | prompt tokens the last 32 prompt queries attend to (pooled), frozen after prefill (Li et al. 2024) |
| pyramidkv | SnapKV scoring, budgets shrinking linearly with depth (Cai et al. 2024) |
| sparq     | approximate scores from the r largest |q| components, exact attention on the top-k (Ribar et al. 2024) |
| infllm    | 128-token blocks scored by representative keys, top blocks attended (Xiao et al. 2024) |
| pqcache   | product-quantized keys, approximate scores, top-k (Zhang et al., SIGMOD 2025) |
"""

from __future__ import annotations

from pqcache.engine.errors import InputError
from pqcache.engine.methods.base import Method
from pqcache.engine.methods.full import Full
from pqcache.engine.methods.h2o import H2O
from pqcache.engine.methods.infllm import InfLLM
from pqcache.engine.methods.oracle import Oracle
from pqcache.engine.methods.pqcache import PQCacheMethod
from pqcache.engine.methods.pyramidkv import PyramidKV
from pqcache.engine.methods.snapkv import SnapKV
from pqcache.engine.methods.sparq import SparQ
from pqcache.engine.methods.streaming import StreamingLLM

METHODS: dict[str, type[Method]] = {
    cls.name: cls for cls in (Full, Oracle, StreamingLLM, H2O, SnapKV, PyramidKV, SparQ, InfLLM, PQCacheMethod)
}


def make_method(method: str | Method, **options) -> Method:
    """A method by name (with its published defaults, overridable by options) or as given."""
    if isinstance(method, Method):
        return method
    if method not in METHODS:
        raise InputError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    return METHODS[method](**options)


__all__ = ["METHODS", "Method", "make_method", *[cls.__name__ for cls in METHODS.values()]]
