"""The app's side of a Ray cluster: the Q&A tab's worker calls (pqcache/serving/worker.py), each sent to the
replica that holds the user's document.

Affinity: the launcher deploys one Serve deployment per replica, so a deployment's handle reaches exactly one
replica. A user's first load goes to the live replica with the fewest of this app's documents; from then on every
call of that user goes to that replica's handle (`home`), with the incarnation that loaded the document.

Replica loss: a call that fails because the replica died, or that reaches the replica Serve started in its place
(another incarnation), means the user's document is gone from that replica. With a document store the replicas
share (reopen.py), the user's next question or notice poll loads it again on a live replica, read back from the store
with no prefill, and says so once. Without one, every user whose document lived there is told, once, "your document
was unloaded ...; load it again" (the page's notice poll, the status line, a question), and their next load goes to a
live replica. Users on other replicas are not affected.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass, field

from pqcache.cluster.reopen import Reopener
from pqcache.cluster.replicas import PROBE_TIMEOUT_S, ForwardedStop, Replica, ReplicaDown, cluster_summary
from pqcache.cluster.views import RemoteDocument, ReplicaError, error_of
from pqcache.engine.errors import NoDocumentError, PQCacheError, SessionEvictedError
from pqcache.serving.service import CHAT

LOST = "your document was unloaded: the worker holding it (replica {index}) stopped; load it again"


@dataclass
class UserEntry:
    stop: ForwardedStop
    busy: int = 0  # this user's requests in flight through this app


@dataclass
class Home:
    replica: Replica
    incarnation: str
    document: RemoteDocument | None = field(default=None)


class ClusterDocuments:
    """The Q&A tab's worker on a Ray cluster (see the module's doc)."""

    def __init__(self, handles: list, shared_store: bool = False):
        """shared_store: the replicas read and write one document store (a lost replica's users are reopened)."""
        self.replicas = [Replica(i, h) for i, h in enumerate(handles)]
        self.reopener = Reopener(self, shared_store)
        self.homes: dict[str, Home] = {}  # user -> where their document lives (or is being loaded)
        self.lost: dict[str, str] = {}  # user -> why their document is gone, until they load or unload
        self.lost_on: dict[str, int] = {}  # user -> the replica their document was lost with
        self.untold: set[str] = set()  # users whose page has not shown that yet
        self.entries: dict[str, UserEntry] = {}
        self.lock = threading.RLock()

    # ---- bookkeeping ---------------------------------------------------------------------------------
    def entry(self, user: str) -> UserEntry:
        with self.lock:
            if user not in self.entries:
                self.entries[user] = UserEntry(ForwardedStop(lambda op: self._forward(user, op)))
            return self.entries[user]

    @contextmanager
    def use(self, user: str):
        entry = self.entry(user)
        with self.lock:
            entry.busy += 1
        try:
            yield entry
        finally:
            with self.lock:
                entry.busy -= 1

    def _forward(self, user: str, op: str):
        home = self.homes.get(user)
        if home is not None:
            try:
                home.replica.call(op, user)
            except ReplicaDown:
                self._lose(home)

    def _lose(self, home: Home):
        """The replica of `home` died (or restarted): every user whose document lived in that incarnation is told."""
        with self.lock:
            for user, h in list(self.homes.items()):
                if h.replica is home.replica and h.incarnation == home.incarnation:
                    del self.homes[user]
                    self.lost[user] = LOST.format(index=home.replica.index)
                    self.lost_on[user] = home.replica.index
                    self.untold.add(user)

    # ---- the user's document -----------------------------------------------------------------------------
    def session(self, user: str, slot: str = "qa"):
        """The user's document on its replica (RemoteDocument), None, or SessionEvictedError saying why it is gone."""
        home = self.homes.get(user)
        if home is not None:
            known = home.document.doc if home.document is not None else None
            try:
                reply = home.replica.call("document", user, home.incarnation, known)
            except ReplicaDown:
                reply = {"lost": True}
            if reply.get("lost"):
                self._lose(home)
            elif reply["state"] == "freed":
                raise SessionEvictedError(reply["why"])
            elif reply["state"] == "none":
                return None
            else:
                if "view" in reply:
                    home.document = RemoteDocument(reply["view"], self._asker(user, home))
                return home.document
        if user in self.lost and (document := self.reopener.reopen(user, self.lost_on.get(user))) is not None:
            return document  # read back on a live replica; the notice poll says so
        with self.lock:
            why = self.lost.get(user)
            self.untold.discard(user)
        if why is not None:
            raise SessionEvictedError(why)
        return None

    def notice(self, user: str) -> str | None:
        """What the user has not been told yet: their replica died, or it freed their document."""
        home = self.homes.get(user)
        if home is not None:
            try:
                reply = home.replica.call("notice", user, home.incarnation)
            except ReplicaDown:
                reply = {"lost": True}
            if reply.get("lost"):
                self._lose(home)
            else:
                return reply["notice"] or self.reopener.line(user)
        if user in self.lost and self.reopener.reopen(user, self.lost_on.get(user)) is not None:
            return self.reopener.line(user)
        with self.lock:
            if user in self.untold:
                self.untold.discard(user)
                return self.lost.get(user)
        return None

    def free(self, user: str, slot: str = "qa"):
        self._drop(user, "free")

    def end(self, user: str):
        self._drop(user, "end")
        with self.lock:
            self.entries.pop(user, None)

    def _drop(self, user: str, op: str):
        with self.lock:
            home = self.homes.pop(user, None)
            self.lost.pop(user, None)
            self.untold.discard(user)
        self.reopener.forget(user)
        if home is not None:
            try:
                home.replica.call(op, user)
            except ReplicaDown:
                self._lose(home)

    def summary(self) -> dict:
        return cluster_summary(self.replicas)

    # ---- loading and asking ------------------------------------------------------------------------------
    def _place(self, user: str) -> Replica:
        """The replica for the user's load: where their document is, else the live one with fewest documents."""
        home = self.homes.get(user)
        if home is not None and not home.replica.down:
            return home.replica
        with self.lock:
            load = {r.index: 0 for r in self.replicas}
            for h in self.homes.values():
                load[h.replica.index] += 1
        for replica in sorted(self.replicas, key=lambda r: (r.down, load[r.index], r.index)):
            if replica.down:  # ask again: Serve may have started its replacement
                try:
                    replica.call("hello", timeout_s=PROBE_TIMEOUT_S)
                except ReplicaDown:
                    continue
                replica.down = False
            return replica
        raise PQCacheError("no worker is running right now: try again in a moment")

    def load(self, user: str, name: str, text: str, settings, progress=None, stop: threading.Event | None = None):
        """Prefill the document on the user's replica; returns its RemoteDocument. A Stop reaches the replica
        through the user's stop event; a replica that dies meanwhile is reported as an error."""
        replica = self._place(user)
        try:
            for part in self._relayed(user, replica.stream("load", user, name, text, settings), progress, stop):
                if "incarnation" in part:
                    with self.lock:
                        old = self.homes.get(user)
                        if old is not None and (old.replica is not replica or old.incarnation != part["incarnation"]):
                            self._lose(old)  # its replica restarted: the old document is gone
                        self.homes[user] = Home(replica, part["incarnation"])
                        self.lost.pop(user, None)
                        self.untold.discard(user)
                if "view" in part:
                    home = self.homes[user]
                    home.document = RemoteDocument(part["view"], self._asker(user, home))
                    self.reopener.remember(user, name, text, settings)
                    return home.document
        except ReplicaDown:
            home = self.homes.get(user)
            if home is not None and home.replica is replica:
                self._lose(home)
            raise ReplicaError(
                f"the worker loading the document (replica {replica.index}) stopped: load it again"
            ) from None
        raise ReplicaError("the worker ended the load without a result")

    def about(self) -> dict:
        """The replicas' model (each loads the same one) and its device, from the first that answers."""
        for replica in self.replicas:
            try:
                return replica.call("about", timeout_s=PROBE_TIMEOUT_S)
            except ReplicaDown:
                continue
        raise PQCacheError("no worker is running right now: try again in a moment")

    def teach(self, user: str, case, methods: list[str], budget, progress=None, stop=None) -> dict:
        """The Teaching tab's run on the user's replica (where their document is, else the least busy one)."""
        replica = self._place(user)
        try:
            for part in self._relayed(user, replica.stream("teach", user, case, methods, budget), progress, stop):
                if "lesson" in part:
                    return part["lesson"]
        except ReplicaDown:
            lost = f"the worker running the lesson (replica {replica.index}) stopped: run it again"
            raise ReplicaError(lost) from None
        raise ReplicaError("the worker ended the lesson without a result")

    def _asker(self, user: str, home: Home):
        def ask(question, method, max_new_tokens, observe, conversation):
            return self._stream(user, home, "ask", question, method, max_new_tokens, observe, conversation)

        return ask

    def _stream(self, user: str, home: Home, op: str, *args):
        """The replica's stream of `op` for the user's document (their incarnation first); a replica lost meanwhile
        (or restarted: another incarnation) raises SessionEvictedError, which tells the user now."""
        try:
            for part in home.replica.stream(op, user, home.incarnation, *args):
                if part.get("lost"):
                    raise ReplicaDown("another incarnation")
                yield part
        except ReplicaDown:
            self._lose(home)
            with self.lock:
                self.untold.discard(user)  # the reply tells them now
            raise SessionEvictedError(LOST.format(index=home.replica.index)) from None

    def replica_of(self, user: str) -> int | None:
        """The index of the replica holding the user's document (None: none)."""
        home = self.homes.get(user)
        return None if home is None else home.replica.index

    # ---- the user's conversation, on the replica holding their document ------------------------------------
    def ask(
        self, user, question, method, max_new_tokens=64, stop=None, observer=None, on_token=None, conversation=CHAT
    ):
        """An answer within the user's conversation on their replica (as DocumentWorker.ask)."""
        document = self.session(user)
        if document is None:
            raise NoDocumentError("load a document first")
        return document.ask(question, method, max_new_tokens, stop, observer, on_token, conversation)

    def add_document(
        self, user: str, name: str, text: str, method: str, stop=None, conversation=CHAT, progress=None
    ) -> int:
        """Read `text` into the user's conversation on their replica, its progress streamed back; its tokens."""
        return self._model_work(
            user, "tokens", "add_document", name, text, method, conversation, progress=progress, stop=stop
        )

    def resume_conversation(self, user: str, method: str, conversation: str = CHAT, stop=None) -> dict | None:
        """The document's last kept conversation replayed on the user's replica (as DocumentWorker's)."""
        return self._model_work(user, "state", "resume_conversation", method, conversation)

    def _model_work(self, user: str, result: str, op: str, *args, progress=None, stop=None):
        """A streamed replica call about the user's document (their incarnation first): its `result`; its progress
        parts to progress(fraction, words); a set `stop` (the caller's own event) forwarded to the replica."""
        if self.session(user) is None:
            raise NoDocumentError("load a document first")
        for part in self._relayed(user, self._stream(user, self.homes[user], op, *args), progress, stop):
            if result in part:
                return part[result]
        raise ReplicaError(f"the worker ended its {op} without a result")

    def _relayed(self, user: str, parts, progress=None, stop=None):
        """A replica's stream as the caller reads it: an error part raised as the worker's error, progress parts to
        progress(fraction, words), and a set `stop` (the caller's own event) forwarded to the user's replica once,
        after the caller has read a part (a load's first part tells which replica that is)."""
        forwarded = False
        for part in parts:
            if "error" in part:
                raise error_of(part)
            if "progress" in part and progress is not None:
                progress(*part["progress"])
            yield part
            if stop is not None and stop.is_set() and not forwarded:
                forwarded = True
                self._forward(user, "stop")

    def fork_conversation(self, user: str, conversation: str = CHAT, into: str = "fork") -> dict:
        return self._conversation_call(user, "fork_conversation", conversation, into)

    def new_conversation(self, user: str, conversation: str | None = None):
        self._conversation_call(user, "new_conversation", conversation)

    def conversation_state(self, user: str, conversation: str = CHAT) -> dict | None:
        return self._conversation_call(user, "conversation_state", conversation)

    def _conversation_call(self, user: str, op: str, *args):
        """A quick call about the user's conversations on their replica; an error reply raised as the worker's."""
        home = self.homes.get(user)
        if home is None:
            return None
        try:
            reply = home.replica.call(op, user, *args)
        except ReplicaDown:
            self._lose(home)
            return None
        if isinstance(reply, dict) and "error" in reply:
            raise error_of(reply)
        return reply
