"""PQCache: product-quantization KV cache for long-context LLM inference (SIGMOD 2025)."""

from pqcache.engine.cache import PQCache
from pqcache.engine.config import PQCacheConfig
from pqcache.engine.errors import (
    Cancelled,
    CapacityError,
    DocumentEncodingError,
    DocumentError,
    DocumentTooLongError,
    InputError,
    NoDocumentError,
    PQBuildError,
    PQCacheConfigError,
    PQCacheError,
    SessionEvictedError,
)
from pqcache.engine.instrument import Instrumentation
from pqcache.engine.methods import METHODS, make_method
from pqcache.serving.loading import ModelNotFoundError, load_model

__all__ = [
    "PQCache",
    "PQCacheConfig",
    "Instrumentation",
    "load_model",
    "ModelNotFoundError",
    "METHODS",
    "make_method",
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
]
