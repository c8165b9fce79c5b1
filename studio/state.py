"""The one object the app's handlers share: built in app.main() from the command line, passed to build_ui()."""

from __future__ import annotations

from dataclasses import dataclass

from pqcache.serving.pool import SessionPool
from pqcache.serving.settings import MAX_QUESTION_CHARS
from pqcache.serving.worker import DocumentWorker


@dataclass
class Studio:
    model: object
    tokenizer: object
    pool: SessionPool  # this process's caches: the Teaching tab's, and the Q&A tab's when documents is local
    pq_timeout_s: float | None = 120.0  # a K-Means build slower than this falls back to exact attention
    concurrency: int = 2  # requests using the model at once; the rest queue
    max_document_tokens: int | None = None  # None: what the model reads
    max_question_chars: int | None = MAX_QUESTION_CHARS  # longer questions are refused (None: any length)
    # where the Q&A tab's documents live: None builds the in-process worker around model and pool; a Ray
    # cluster's client (pqcache.cluster) has the same calls
    documents: object = None
    store: object = None  # a DocumentStore the in-process worker reads documents from and saves them to
    kv_dtype: str = "auto"  # the host tier's keys and values (app.py --kv-dtype), for every document loaded

    def __post_init__(self):
        if self.documents is None:
            self.documents = DocumentWorker(
                self.model,
                self.tokenizer,
                self.pool,
                self.pq_timeout_s,
                self.max_document_tokens,
                self.store,
                self.kv_dtype,
            )

    @property
    def model_work(self) -> dict:
        """Event options for handlers that use the model: one concurrency group, so later requests wait in
        the queue and see their place."""
        return dict(concurrency_id="model", concurrency_limit=self.concurrency)
