"""PQCache: product-quantization KV cache for long-context LLM inference (SIGMOD 2025)."""
from .cache import PQCache
from .config import PQCacheConfig, PQCacheConfigError
from .instrument import Instrumentation
from .loading import ModelNotFoundError, load_model
from .methods import METHODS, make_method

__all__ = ["PQCache", "PQCacheConfig", "PQCacheConfigError", "Instrumentation", "load_model", "ModelNotFoundError",
           "METHODS", "make_method"]
