"""PQCache: product-quantization KV cache for long-context LLM inference (SIGMOD 2025)."""
from .cache import PQCache
from .config import PQCacheConfig, PQCacheConfigError
from .loading import ModelNotFoundError, load_model

__all__ = ["PQCache", "PQCacheConfig", "PQCacheConfigError", "load_model", "ModelNotFoundError"]
