"""The document worker: one model and its session pool, the documents service (serving/service.py) in one process.

The app's Q&A tab talks to the service, never to the model: in one process it is this DocumentWorker; on a Ray
cluster (pqcache/cluster/) it is a client with the same calls whose documents live on replicas, each replica
holding a DocumentWorker of its own. The calls:

  entry(user).stop / .busy, use(user)  the user's stop event and requests in flight
  load(user, name, text, settings, progress, stop) -> session   prefill a document into the user's "qa" slot
  session(user)                        the loaded session, None, or SessionEvictedError (why it was freed)
  ask(user, question, method, ...)     an answer within the user's conversation on their document
  add_document(user, name, text, stop), new_conversation(user), conversation_state(user)
  notice(user), free(user), end(user), summary(), about()
  teach(user, case, methods, budget, progress, stop)   the Teaching tab's run, in the user's "teaching" slot

A user's conversation lives here, beside their document: follow-ups see the earlier turns in this process and on
a Ray replica alike.
"""

from __future__ import annotations

import threading

from pqcache.engine.config import PQCacheConfig
from pqcache.engine.errors import NoDocumentError, PQCacheConfigError, SessionEvictedError
from pqcache.engine.methods import METHODS
from pqcache.serving.conversation import Conversation
from pqcache.serving.loading import describe_model
from pqcache.serving.pool import SessionPool
from pqcache.serving.server_settings import ServerSettings
from pqcache.serving.service import CHAT, TeachingCase
from pqcache.serving.session import DocumentSession
from pqcache.serving.settings import DEVICE_BLOCK_CACHE_TOKENS, LABELS, LoadSettings, in_form_words, number
from pqcache.serving.stored_conversations import keep, resume
from pqcache.serving.teaching import lesson

SLOT = "qa"
TEACHING = "teaching"  # the Teaching tab's document, a slot of its own beside the user's


class DocumentWorker:
    def __init__(self, model, tokenizer, pool: SessionPool, server: ServerSettings | None = None, store=None):
        """server: the server's settings (K-Means timeout, KV dtype, longest document); store: a DocumentStore
        (serving/store.py) each load reads from and saves to, None: every load prefills."""
        self.model, self.tokenizer, self.pool = model, tokenizer, pool
        self.server, self.store = server or ServerSettings(), store
        self.conversations: dict[tuple[str, str], Conversation] = {}  # (user, name) -> on their active document
        self.talk_lock = threading.Lock()

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
        self.new_conversation(user)
        self.pool.free(user, slot)

    def end(self, user: str):
        self.new_conversation(user)
        self.pool.end(user)

    def summary(self) -> dict:
        return self.pool.summary()

    def about(self) -> dict:
        """The model that answers, in one line, the device it runs on and the selection methods it offers."""
        return {
            "model": describe_model(self.model, self.tokenizer),
            "device": device_of(self.model),
            "methods": list(METHODS),
        }

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
        config = self.server.config_for(settings)
        limit = self.server.max_document_tokens
        session = DocumentSession(self.model, self.tokenizer, config, settings.method, limit, store=self.store)
        session.name = name
        if progress is not None:
            progress(0.0, "tokenizing")
        try:
            self._read_into(user, SLOT, session, text, progress=progress, stop=stop, truncate=settings.truncate)
        except PQCacheConfigError as exc:  # a setting the model refuses (m must divide its head size)
            raise PQCacheConfigError(in_form_words(str(exc))) from None
        return session

    def _read_into(self, user: str, slot: str, session: DocumentSession, text: str, **load):
        """session.load(text, **load) under the pool's reservation for the user's `slot`: stored there once read
        (its load info kept as session.info), the reservation given back when the read fails or stops."""
        try:
            session.info = session.load(text, reserve=lambda n: self.pool.reserve(user, slot, n), **load)
        except BaseException:
            self.pool.unreserve(user, slot)
            raise
        self.pool.store(user, slot, session)

    def teach(self, user: str, case: TeachingCase, methods: list[str], budget, progress=None, stop=None) -> dict:
        """The Teaching tab's run: one prefill of `case.text` in the user's "teaching" slot (beside their document,
        under the same memory cap), then each method answers `case.question` on a copy of that cache; the run as
        plain data (serving/teaching.py). progress(fraction, words) from 0 to 1; a Stop ends the prefill."""
        say = progress or (lambda fraction, words: None)
        config = PQCacheConfig(
            token_budget=number(budget, LABELS["token_budget"]),
            pq_timeout_s=self.server.pq_timeout_s,
            kv_dtype=self.server.kv_dtype,
            block_cache_tokens=DEVICE_BLOCK_CACHE_TOKENS,  # the walkthrough's fetch shows the GPU design
        )
        # the prefill's queries kept: the methods that start from them, and the picture of what the selection missed,
        # read them (serving/teaching.py)
        session = DocumentSession(self.model, self.tokenizer, config, method="pqcache", keep_queries=True)
        self._read_into(user, TEACHING, session, case.text, progress=lambda f, words: say(0.5 * f, words), stop=stop)
        return lesson(session, case, methods, lambda f, words: say(0.5 + 0.5 * f, words))

    # ---- the user's conversations on their document -------------------------------------------------
    def conversation(self, user: str, method: str, name: str = CHAT) -> tuple[Conversation, str]:
        """The user's conversation `name` on their active document with `method`, started anew when the document or
        the method changed (the note says so where it held turns). NoDocumentError without a document."""
        session = self.session(user)
        if session is None:
            raise NoDocumentError("load a document first")
        with self.talk_lock:
            talk, note = self.conversations.get((user, name)), ""
            if talk is not None and (talk.session is not session or talk.method != method or talk.cache is None):
                if talk.session is session and talk.turns:
                    note = f"*The method is now {method}: a new conversation starts (the document stays loaded).*"
                elif talk.turns:  # another document: its questions start a conversation of their own
                    was = getattr(talk.session, "name", "the earlier document")
                    now = getattr(session, "name", "the new document")
                    note = f"*A new document, **{now}**: a new conversation starts (the questions above: {was}).*"
                self.conversations.pop((user, name)).close()
                talk = None
            if talk is None:
                talk = self.conversations[(user, name)] = Conversation(session, method)
        return talk, note

    def ask(
        self, user, question, method, max_new_tokens=64, stop=None, observer=None, on_token=None, conversation=CHAT
    ):
        """An answer within the user's conversation (a follow-up sees the earlier turns); the Answer's `note` says
        when a new conversation started for another method. The conversation is counted under the memory cap."""
        talk, note = self.conversation(user, method, conversation)
        answer = talk.ask(question, method, max_new_tokens, stop=stop, observer=observer, on_token=on_token)
        answer.note = " ".join(filter(None, [note, keep(self.store, talk)]))
        self._count(user)
        return answer

    def add_document(
        self, user: str, name: str, text: str, method: str, stop=None, conversation=CHAT, progress=None
    ) -> int:
        """Read `text` into the user's conversation (once, its own K-Means), to ask across both; its tokens.
        progress(fraction, words) as a load's; stopped or failed, the conversation stays as it was."""
        talk, _ = self.conversation(user, method, conversation)
        n = talk.add_document(text, name, stop=stop, progress=progress)
        keep(self.store, talk)
        self._count(user)
        return n

    def fork_conversation(self, user: str, conversation: str = CHAT, into: str = "fork") -> dict:
        """A copy of the user's conversation under another name, to go its own way (the document is shared); its
        state. NoDocumentError when there is no such conversation."""
        talk = self.conversations.get((user, conversation))
        if talk is None or talk.cache is None:
            raise NoDocumentError(f"no conversation {conversation!r} to fork: ask a question first")
        return self._install(user, into, talk.fork())

    def resume_conversation(self, user: str, method: str, conversation: str = CHAT, stop=None) -> dict | None:
        """The latest conversation kept beside the user's document for `method` (a reload, a restart, a lost
        replica), replayed as the user's conversation `conversation`: its state, None when none is kept."""
        session = self.session(user)
        if session is None:
            raise NoDocumentError("load a document first")
        talk = resume(self.store, session, method, stop)
        return None if talk is None else self._install(user, conversation, talk)

    def _install(self, user: str, name: str, talk: Conversation) -> dict:
        """`talk` as the user's conversation `name` (one there before is closed), counted; its state."""
        with self.talk_lock:
            old = self.conversations.pop((user, name), None)
            self.conversations[(user, name)] = talk
        if old is not None:
            old.close()
        self._count(user)
        return self.conversation_state(user, name)

    def new_conversation(self, user: str, conversation: str | None = None):
        """Back to the document alone: the user's conversation (None: every one) ends, the document stays."""
        with self.talk_lock:
            names = [k for k in self.conversations if k[0] == user and conversation in (None, k[1])]
            ended = [self.conversations.pop(k) for k in names]
        for talk in ended:
            talk.close()
        if ended:
            self._count(user)

    def conversation_state(self, user: str, conversation: str = CHAT) -> dict | None:
        """What the user's conversation holds, as plain data: tokens, the questions' turn numbers, the added
        documents' names, the model's limit, the turns; None without one."""
        talk = self.conversations.get((user, conversation))
        if talk is None:
            return None
        asked = [i + 1 for i, t in enumerate(talk.turns) if t.kind == "question"]
        added = [t.text for t in talk.turns if t.kind == "document"]
        turns = [{"kind": t.kind, "text": t.text, "answer": t.answer} for t in talk.turns]
        return {"tokens": talk.n_tokens, "asked": asked, "added": added, "limit": talk.limit, "turns": turns}

    def _count(self, user: str):
        """The user's document and its conversations under the memory cap (a conversation's bytes from the
        document's bytes a token: an estimate)."""
        try:
            session = self.pool.session(user, SLOT)
        except SessionEvictedError:  # freed meanwhile: nothing left to count
            return
        if session is None or not session.n_tokens:
            return
        talks = [t for (u, _), t in list(self.conversations.items()) if u == user and t.session is session]
        extra = sum(len(t.ids) for t in talks)
        self.count(user, session.nbytes() + int(session.nbytes() / session.n_tokens * extra))


def device_of(model) -> str:
    """ "cpu" or "cuda": where the model's weights are."""
    try:
        return next(model.parameters()).device.type
    except (AttributeError, StopIteration):
        return "cpu"
