"""What crosses the boundary between the app and a replica, as plain data (lists, dicts, numbers, strings).

document_view(session), on the replica: what the app's status line and panels read of a loaded document.
message_of(exc), on the replica: an error as a message; error_of(reply), in the app: the exception the tab expects.
RemoteDocument, in the app: a loaded document on a replica with the attributes the tab reads of a DocumentSession,
and ask() streamed through the replica's handle.
"""

from __future__ import annotations

import traceback
from dataclasses import asdict
from types import SimpleNamespace

from pqcache.engine.config import PQCacheConfig
from pqcache.engine.errors import Cancelled, NoDocumentError, PQCacheError, SessionEvictedError
from pqcache.serving.answer import Answer
from pqcache.serving.service import CHAT


class ReplicaError(PQCacheError):
    """An error the replica reported (its message is for the page)."""


def document_view(session) -> dict:
    """A loaded DocumentSession as plain data."""
    cache = session.cache
    obs = session.prefill_obs
    return {
        "name": getattr(session, "name", "the document"),
        "n_tokens": session.n_tokens,
        "method": session.method,
        "info": getattr(session, "info", None) or {},
        "truncated": session.truncated,
        "config": asdict(session.config),
        "pq_layers": [layer.layer_idx for layer in cache.pq_layers] if cache is not None else [],
        "stats": cache.stats() if cache is not None else None,
        "last_stats": session.last_stats,
        "prefill_panels": obs.since({}) if obs is not None else None,
        "doc_text": getattr(session, "doc_text", ""),  # the answers' sources point into it
    }


def message_of(exc: BaseException) -> dict:
    """An error for the app: ours (and file errors) as written; anything unexpected logged here with its
    traceback, and named without one."""
    if isinstance(exc, Cancelled):
        return {"error": str(exc) or "stopped", "cancelled": True}
    if isinstance(exc, (PQCacheError, OSError)):
        return {"error": str(exc), "kind": type(exc).__name__}
    traceback.print_exception(exc)
    return {"error": f"unexpected {type(exc).__name__} on a worker ({exc}); the details are in its log"}


def error_of(reply: dict) -> Exception:
    """The exception the app's tab expects for an error reply."""
    if reply.get("cancelled"):
        return Cancelled(reply["error"])
    kind = {"SessionEvictedError": SessionEvictedError, "NoDocumentError": NoDocumentError}
    return kind.get(reply.get("kind"), ReplicaError)(reply["error"])


class CacheView:
    """What the tab reads of a document's cache: its PQ layers and its sizes."""

    def __init__(self, pq_layers: list[int], stats: dict | None):
        self.pq_layers = [SimpleNamespace(layer_idx=i) for i in pq_layers]
        self._stats = stats

    def stats(self) -> dict | None:
        return self._stats


class RemoteDocument:
    """A document loaded on a replica, as the tab reads a DocumentSession: name, tokens, method, load figures,
    cache, prefill recording, last answer's stats; ask() streams through the replica."""

    def __init__(self, view: dict, asker):
        from pqcache import Instrumentation

        self.doc = view["doc"]
        self.name, self.n_tokens, self.method = view["name"], view["n_tokens"], view["method"]
        self.info, self.last_stats = view["info"], view["last_stats"]
        self.truncated = tuple(view["truncated"]) if view["truncated"] else None
        self.doc_text = view.get("doc_text", "")
        self.config = PQCacheConfig(**view["config"])
        self.cache = CacheView(view["pq_layers"], view["stats"])
        self.prefill_obs = None
        if view["prefill_panels"] is not None:
            self.prefill_obs = Instrumentation()
            self.prefill_obs.merge(view["prefill_panels"])
        self._asker = asker  # asker(question, method, max_new_tokens, observe, conversation) -> the replica's stream

    def ask(self, question, method=None, max_new_tokens=64, stop=None, observer=None, on_token=None, conversation=CHAT):
        """As DocumentWorker.ask: the answer, within the user's conversation on the replica, streams from it;
        on_token(answer) as its text grows, the observer gets the replica's records. A set `stop` reaches the replica
        through the user's stop event."""
        observe = {}
        if observer is not None:
            observe = {k: getattr(observer, k) for k in ("timeline", "attention_every", "recall_every", "selections")}
        answer = Answer()
        for part in self._asker(question, method or self.method, max_new_tokens, observe, conversation):
            if "error" in part:
                raise error_of(part)
            if observer is not None and "panels" in part:
                observer.merge(part["panels"])
            if "text" in part:
                answer.text = part["text"]
                if on_token is not None:
                    on_token(answer)
            if "answer" in part:
                self.last_stats = part.get("last_stats")
                return Answer(**part["answer"], done=True)
        raise ReplicaError("the worker ended the answer without a result")
