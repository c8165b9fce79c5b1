"""The one object the app's handlers share: built in app.main() from the command line, passed to build_ui()."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pqcache.serving.server_settings import ServerSettings
from pqcache.serving.service import DocumentsService

if TYPE_CHECKING:
    from pqcache.serving.pool import SessionPool


@dataclass
class Studio:
    model: object  # None with --ray: the replicas hold it
    tokenizer: object
    pool: SessionPool | None  # this process's caches, when the documents are here (None with --ray)
    server: ServerSettings = field(default_factory=ServerSettings)  # app.py's flags, as the worker got them
    # where the Q&A tab's documents live (the one interface the page uses): None builds the in-process worker
    # around model and pool; with --ray, the cluster's client (pqcache.cluster)
    documents: DocumentsService | None = None
    store: object = None  # a DocumentStore the in-process worker reads documents from and saves them to
    concurrency: int | None = None  # the page's requests using a model at once (None: the server's; Ray: all replicas')
    # this server's start: a page opened before a restart is told that its document is gone
    started: str = field(default_factory=lambda: uuid.uuid4().hex)

    def __post_init__(self):
        if self.concurrency is None:
            self.concurrency = self.server.concurrency
        if self.documents is None:  # imported here: with --ray the page's process imports no torch
            from pqcache.serving.worker import DocumentWorker

            self.documents = DocumentWorker(self.model, self.tokenizer, self.pool, self.server, self.store)
        # the model that answers and its device, from where it is (with --ray this process holds no model)
        self.about = self.documents.about()

    @property
    def model_work(self) -> dict:
        """Event options for handlers that use the model: one concurrency group, so later requests wait in
        the queue and see their place."""
        return dict(concurrency_id="model", concurrency_limit=self.concurrency)
