"""PQCache: product-quantization KV cache for long-context LLM inference (SIGMOD 2025)."""
from .cache import PQCache
from .config import PQCacheConfig
from .errors import (Cancelled, CapacityError, DocumentEncodingError, DocumentError, DocumentTooLongError,
                     InputError, NoDocumentError, PQBuildError, PQCacheConfigError, PQCacheError, SessionEvictedError)
from .instrument import Instrumentation
from .loading import ModelNotFoundError, load_model
from .methods import METHODS, make_method

__all__ = ["PQCache", "PQCacheConfig", "Instrumentation", "load_model", "ModelNotFoundError", "METHODS",
           "make_method", "PQCacheError", "InputError", "PQCacheConfigError", "DocumentError", "DocumentEncodingError",
           "DocumentTooLongError", "NoDocumentError", "SessionEvictedError", "CapacityError", "PQBuildError",
           "Cancelled"]
