"""PQCache: product-quantization KV cache for long-context LLM inference (SIGMOD 2025).

The names below are imported when first used (PEP 562), so that a process that needs only the settings or the
errors (the page's process with --ray) does not import torch and transformers.
"""

from __future__ import annotations

import importlib

_WHERE = {
    "PQCache": "pqcache.engine.cache",
    "PQCacheConfig": "pqcache.engine.config",
    "Instrumentation": "pqcache.engine.instrument",
    "METHODS": "pqcache.engine.methods",
    "make_method": "pqcache.engine.methods",
    "load_model": "pqcache.serving.loading",
    "ModelNotFoundError": "pqcache.serving.loading",
    **dict.fromkeys(
        [
            "PQCacheError",
            "InputError",
            "PQCacheConfigError",
            "DocumentError",
            "DocumentEncodingError",
            "DocumentTooLongError",
            "NoDocumentError",
            "SessionEvictedError",
            "CapacityError",
            "PQBuildError",
            "Cancelled",
        ],
        "pqcache.engine.errors",
    ),
}

__all__ = list(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'pqcache' has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value  # imported once
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
