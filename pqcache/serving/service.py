"""The documents service: the one interface the page, the CLI's chat and the load test use to hold documents and the
conversations on them. Two implementations keep it: DocumentWorker (serving/worker.py: one model and its session
pool, in this process) and ClusterDocuments (cluster/client.py: the documents on Ray Serve replicas, each holding a
DocumentWorker of its own). tests/contract.py runs the same tests against both.

A user is a string (the page's session hash, or the CLI's own name); a conversation is named within a user
(CHAT where none is given). Errors are the engine's own (pqcache.engine.errors): NoDocumentError before a load,
SessionEvictedError once a document is gone (its message says why), Cancelled after a Stop, InputError and
PQCacheConfigError for what the user gave.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

CHAT = "chat"  # the name of a user's conversation where none is given (the page's one)


@dataclass(frozen=True)
class TeachingCase:
    """A document, a fact written in it (its words as the text has them), the question about it and its answer."""

    text: str
    fact: str
    question: str
    answer: str


@runtime_checkable
class DocumentsService(Protocol):
    # ---- the user's requests in flight, and their Stop -------------------------------------------------------
    def entry(self, user: str):
        """The user's book: `.stop` (a threading.Event-like Stop that reaches wherever the work runs), `.busy`."""

    def use(self, user: str) -> AbstractContextManager:
        """Counts one request of the user's in flight while the block runs (an idle sweep skips a busy user)."""

    # ---- a document ----------------------------------------------------------------------------------------
    def load(
        self,
        user: str,
        name: str,
        text: str,
        settings,
        progress: Callable[[float, str], None] | None = None,
        stop: threading.Event | None = None,
    ):
        """Read `text` as the user's document (from the store where kept, else a prefill), streaming
        progress(fraction, words); it replaces the active one once loaded. Returns the loaded document."""

    def session(self, user: str):
        """The user's loaded document, None, or SessionEvictedError saying why it is gone."""

    def notice(self, user: str) -> str | None:
        """What the user has not been told yet (their document freed, their replica lost), once."""

    def free(self, user: str):
        """Unload the user's document and end its conversations."""

    def end(self, user: str):
        """The user left: everything of theirs is dropped."""

    def summary(self) -> dict:
        """The service's memory and users, as plain data for the status panel."""

    def about(self) -> dict:
        """{"model": one line naming the model that answers, "device": "cpu" or "cuda", "methods": the selection
        methods' names} (where the model is)."""

    def teach(self, user: str, case, methods: list[str], budget, progress=None, stop=None) -> dict:
        """The Teaching tab's run where the model is: one prefill of `case.text` (a TeachingCase) beside the user's
        document, each method answering `case.question` on a copy of it; the run as plain data
        (serving/teaching.py), streaming progress(fraction, words)."""

    # ---- conversations on the user's document ------------------------------------------------------------------
    def ask(
        self, user, question, method, max_new_tokens=64, stop=None, observer=None, on_token=None, conversation=CHAT
    ):
        """An answer within the conversation (a follow-up sees the earlier turns), streaming on_token(text);
        the Answer's `note` says what the user should know (a new conversation began, the turn was kept)."""

    def add_document(
        self, user: str, name: str, text: str, method: str, stop=None, conversation=CHAT, progress=None
    ) -> int:
        """Read another document into the conversation, to ask across both, streaming progress(fraction, words)
        as a load does; its tokens. Stopped or failed, the conversation stays as it was."""

    def new_conversation(self, user: str, conversation: str | None = None):
        """End the conversation (None: every one of the user's); the document stays loaded."""

    def fork_conversation(self, user: str, conversation: str = CHAT, into: str = "fork") -> dict:
        """A copy of the conversation under another name, to go its own way; its state."""

    def resume_conversation(self, user: str, method: str, conversation: str = CHAT, stop=None) -> dict | None:
        """The document's last kept conversation (store) replayed as `conversation`; its state, None if none."""

    def conversation_state(self, user: str, conversation: str = CHAT) -> dict | None:
        """tokens, asked (turn numbers), added (documents' names), limit, turns; None without a conversation."""
