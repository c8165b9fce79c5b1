"""A user's document back after its replica died: the app keeps each user's last load (its name, text and
settings) and, when the replica holding it is lost, loads it again on a live replica, where the document store (a
folder every replica reads and writes: a shared filesystem across machines, a local folder on one) holds its cache,
so the reopen reads it back with no prefill, and the conversation kept beside it is replayed: the next follow-up sees
the earlier turns. The user is told once, in the notice or the question that found it out.
"""

from __future__ import annotations

import threading
import time

from pqcache.engine.errors import PQCacheError

REOPENED = (
    "The worker holding your document (replica {old}) stopped; it was reopened on replica {new} in {seconds:.1f} s "
    "({how}){talk}."
)


class Reopener:
    def __init__(self, documents, enabled: bool):
        """documents: the ClusterDocuments whose users' documents this reopens; enabled: the replicas share a store
        (without one a reopen would read the whole document again, so the user is asked to load it instead)."""
        self.documents, self.enabled = documents, enabled
        self.loads: dict[str, tuple] = {}  # user -> (name, text, settings) of their last load
        self.told: dict[str, str] = {}  # user -> the reopen's line, until a notice shows it
        self.lock = threading.Lock()

    def remember(self, user: str, name: str, text: str, settings):
        if self.enabled:
            with self.lock:
                self.loads[user] = (name, text, settings)

    def forget(self, user: str):
        with self.lock:
            self.loads.pop(user, None)
            self.told.pop(user, None)

    def reopen(self, user: str, old_index: int | None):
        """The user's document loaded again on a live replica (RemoteDocument), or None when it cannot be (no store,
        no earlier load, or the load failed: the user is then told to load it, as before)."""
        with self.lock:
            last = self.loads.get(user)
        if last is None:
            return None
        t0 = time.perf_counter()
        try:
            document = self.documents.load(user, *last)
        except PQCacheError:
            return None
        try:  # the conversation kept beside it, turn by turn, comes back with it
            state = self.documents.resume_conversation(user, last[2].method)
        except PQCacheError:
            state = None
        talk = f"; your conversation came back with it ({len(state['asked'])} question(s))" if state else ""
        info = getattr(document, "info", None) or {}
        how = "read from the document store, no prefill" if info.get("from") == "store" else "read from its text"
        new = self.documents.replica_of(user)
        seconds = time.perf_counter() - t0
        with self.lock:
            self.told[user] = REOPENED.format(old=old_index, new=new, seconds=seconds, how=how, talk=talk)
        return document

    def line(self, user: str) -> str | None:
        """The reopen's line, once."""
        with self.lock:
            return self.told.pop(user, None)
