"""What a documents server starts with: one dataclass, built once from app.py's flags and handed whole to the
document worker in this process and to each Ray replica (pqcache/cluster/), so that each setting has one default and
travels as one value."""

from __future__ import annotations

from dataclasses import dataclass

from pqcache.engine.config import PQCacheConfig
from pqcache.fastpath.choices import DEFAULT_DECODE_WEIGHTS
from pqcache.serving.pool import IDLE_S
from pqcache.serving.settings import MAX_QUESTION_CHARS, EngineSettings, LoadSettings


@dataclass(frozen=True)
class ServerSettings:
    model: str = "default"  # 'default' (Gemma 3 270M), 'smollm2', or a local transformers folder
    dtype: str | None = None  # load_model's: None is float32 on a CPU, bfloat16 on CUDA
    decode_weights: str = DEFAULT_DECODE_WEIGHTS  # the CPU decode steps' copies of the decoder linears
    kv_dtype: str = PQCacheConfig.kv_dtype  # every document's host tier
    pq_timeout_s: float | None = PQCacheConfig.pq_timeout_s  # a slower K-Means build falls back to exact attention
    max_document_tokens: int | None = None  # None: what the model reads
    max_question_chars: int | None = MAX_QUESTION_CHARS  # None: any length
    max_cache_bytes: int = 2**30  # all users' document caches, in this process (with Ray: on each replica)
    idle_s: float | None = IDLE_S  # a user's caches are freed after this long idle (None: never)
    concurrency: int = 2  # requests using the model at once (with Ray: on each replica)
    store_dir: str | None = None  # the document store's folder (None: no store, every load prefills)
    store_cap_bytes: int | None = None  # the store's size cap (None: a quarter of the free disk)

    def config_for(self, form: LoadSettings | EngineSettings) -> PQCacheConfig:
        """The engine's config of a document loaded with the form's settings on this server (EngineSettings: the
        command line's config, whole)."""
        if isinstance(form, EngineSettings):
            return form.config
        return form.to_config(pq_timeout_s=self.pq_timeout_s, kv_dtype=self.kv_dtype)

    def make_pool(self):
        """The session pool these settings ask for, its reaper of idle caches started."""
        from pqcache.serving.pool import SessionPool

        pool = SessionPool(max_bytes=self.max_cache_bytes, idle_s=self.idle_s)
        if pool.idle_s is not None:
            pool.start_reaper(every_s=min(5.0, pool.idle_s / 4))
        return pool

    def open_store(self):
        """The document store these settings name, or None."""
        if self.store_dir is None:
            return None
        from pqcache.serving.store import DocumentStore

        return DocumentStore(self.store_dir, self.store_cap_bytes)
