"""The document worker: one model and its session pool, behind the few calls the Q&A tab makes.

The app's Q&A tab talks to a worker, never to the model: in one process it is this DocumentWorker; on a Ray
cluster (pqcache/cluster/) it is a client with the same calls whose documents live on replicas, each replica
holding a DocumentWorker of its own. The calls:

  entry(user).stop / .busy, use(user)  the user's stop event and requests in flight
  load(user, name, text, settings, progress, stop) -> session   prefill a document into the user's "qa" slot
  session(user)                        the loaded session, None, or SessionEvictedError (why it was freed)
  notice(user), free(user), end(user), summary()
"""

from __future__ import annotations

import threading

from pqcache.engine.config import PQCacheConfig
from pqcache.engine.errors import PQCacheConfigError
from pqcache.serving.pool import SessionPool
from pqcache.serving.session import DocumentSession
from pqcache.serving.settings import LoadSettings, in_form_words

SLOT = "qa"


class DocumentWorker:
    def __init__(
        self,
        model,
        tokenizer,
        pool: SessionPool,
        pq_timeout_s: float | None = 120.0,
        max_document_tokens: int | None = None,
        store=None,
        kv_dtype: str = PQCacheConfig.kv_dtype,
    ):
        """store: a DocumentStore (serving/store.py) each load reads from and saves to; None: every load prefills.
        kv_dtype: the host tier's keys and values (app.py --kv-dtype; PQCacheConfig.kv_dtype)."""
        self.model, self.tokenizer, self.pool = model, tokenizer, pool
        self.pq_timeout_s, self.max_document_tokens, self.store = pq_timeout_s, max_document_tokens, store
        self.kv_dtype = kv_dtype

    # ---- the pool's bookkeeping, as the tab uses it ---------------------------------------------------
    def entry(self, user: str):
        return self.pool.entry(user)

    def use(self, user: str):
        return self.pool.use(user)

    def session(self, user: str, slot: str = SLOT):
        return self.pool.session(user, slot)

    def notice(self, user: str) -> str | None:
        return self.pool.notice(user)

    def free(self, user: str, slot: str = SLOT):
        self.pool.free(user, slot)

    def end(self, user: str):
        self.pool.end(user)

    def summary(self) -> dict:
        return self.pool.summary()

    def count(self, user: str, nbytes: int, slot: str = SLOT):
        self.pool.count(user, slot, nbytes)

    # ---- a document ------------------------------------------------------------------------------------
    def load(
        self,
        user: str,
        name: str,
        text: str,
        settings: LoadSettings,
        progress=None,
        stop: threading.Event | None = None,
    ) -> DocumentSession:
        """Prefill `text` as the user's next document; it replaces the active one once loaded. Settings and text are
        checked first; then the pool makes room (the previous document stays while both fit) or refuses. Raises what
        is wrong, settings in the form's words (Cancelled when `stop` was set); the reservation is then given back
        and the previous document, if kept, stays active."""
        config = settings.to_config(pq_timeout_s=self.pq_timeout_s, kv_dtype=self.kv_dtype)
        session = DocumentSession(
            self.model, self.tokenizer, config, settings.method, self.max_document_tokens, store=self.store
        )
        session.name = name
        if progress is not None:
            progress(0.0, "tokenizing")
        try:
            session.info = session.load(
                text,
                progress=progress,
                stop=stop,
                truncate=settings.truncate,
                reserve=lambda n: self.pool.reserve(user, SLOT, n),
            )
        except PQCacheConfigError as exc:  # a setting the model refuses (m must divide its head size)
            self.pool.unreserve(user, SLOT)
            raise PQCacheConfigError(in_form_words(str(exc))) from None
        except BaseException:
            self.pool.unreserve(user, SLOT)
            raise
        self.pool.store(user, SLOT, session)
        return session
