"""A Ray Serve replica of the document worker: one model and its session pool, called through a handle.

Every call names the user. Loads and answers stream plain dicts (progress, the growing answer, the panels' new
records; no tensors cross the boundary); errors come back as messages, unexpected ones logged here with their
traceback. A replica has an incarnation id, new at every start: a call naming another incarnation was meant for a
document that died with that replica, and is answered {"lost": True} with nothing done.

All methods are `async`: they run on the replica's event loop, and the model works on a thread of its own, so a Stop
(or a status poll) is served at once while a long prefill runs. At most `concurrency` loads and answers use the model
at a time; the others wait for a slot and say so.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
import uuid

from pqcache.cluster.views import document_view, message_of
from pqcache.serving.server_settings import ServerSettings
from pqcache.serving.service import CHAT

STREAM_EVERY_S = 0.25  # the growing answer is sent at most this often
PANELS_EVERY_S = 1.0  # the panels' new records at most this often
SLOT_WAIT_S = 0.25  # how often a request waiting for a model slot looks at its stop event


async def streamed(work, stop: threading.Event):
    """Run work(emit) on its own thread and yield what it emits. If the caller goes away (the stream is closed or
    cancelled) before the work ends, `stop` is set: the work ends at its next layer or token."""
    loop = asyncio.get_running_loop()
    items: asyncio.Queue = asyncio.Queue()
    end = object()

    def emit(item):
        loop.call_soon_threadsafe(items.put_nowait, item)

    def run():
        try:
            work(emit)
        finally:
            emit(end)

    threading.Thread(target=run, daemon=True, name="pqcache-replica-work").start()
    finished = False
    try:
        while (item := await items.get()) is not end:
            yield item
        finished = True
    finally:
        if not finished:
            stop.set()


def resident_mib() -> float | None:
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return None


STOPPED = {"error": "stopped", "cancelled": True}  # a Stop came before a model slot was free
STOPPED_ANSWER = {"answer": {"text": "", "tokens": [], "stopped": True, "ended": "stopped"}}  # the same, for an answer
# what crosses to the app of an Answer (serving/session.py)
ANSWER_FIELDS = (
    "text",
    "tokens",
    "seconds",
    "first_s",
    "generated",
    "stopped",
    "ended",
    "sources",
    "attended",
    "missed",
    "reread_s",
    "note",
)


class DocumentReplica:
    """The Serve deployment's class (pqcache.cluster.launch deploys it, one deployment per replica)."""

    def __init__(self, server: ServerSettings, threads: int = 1):
        """server: the app's settings, whole (its store_dir a folder every replica sees: a filesystem all machines
        share); threads: torch's, the CPUs this replica reserves."""
        import torch

        from pqcache import load_model
        from pqcache.serving.pool import limit_malloc_arenas
        from pqcache.serving.worker import DocumentWorker

        torch.set_num_threads(max(1, threads))
        limit_malloc_arenas()
        said = lambda msg: print(msg, flush=True)  # noqa: E731  (the replica's log)
        model, tokenizer = load_model(
            server.model, device="cpu", dtype=server.dtype, decode_weights=server.decode_weights, progress=said
        )
        self.worker = DocumentWorker(model, tokenizer, server.make_pool(), server, server.open_store())
        self.incarnation = uuid.uuid4().hex[:12]
        self.slots = threading.Semaphore(max(1, server.concurrency))
        self.waiting = 0  # requests waiting for a model slot
        self.lock = threading.Lock()
        self.docs = iter(range(1, 2**62))  # a number per loaded document, so the app knows when it changed

    # ---- who this is -----------------------------------------------------------------------------------
    async def hello(self) -> dict:
        import ray

        context = ray.get_runtime_context()
        return {
            "incarnation": self.incarnation,
            "pid": os.getpid(),
            "node": context.get_node_id(),
            "actor": context.get_actor_name(),
            "summary": self.worker.summary(),
        }

    async def about(self) -> dict:
        return self.worker.about()

    async def summary(self) -> dict:
        """The pool's figures, requests waiting for a model slot, and this process's resident memory (MiB)."""
        return {**self.worker.summary(), "waiting": self.waiting, "rss_mib": resident_mib()}

    # ---- a user's document -----------------------------------------------------------------------------
    async def document(self, user: str, incarnation: str, known: int | None = None) -> dict:
        """The user's document: {"state": "loaded", "doc": n, "view": ... (unless `known` is n)}, "none", or
        "freed" with why (told once, as in one process)."""
        if incarnation != self.incarnation:
            return {"lost": True}
        try:
            session = self.worker.session(user)
        except Exception as exc:  # noqa: BLE001 - evicted or reaped: the page says why
            return {"state": "freed", "why": str(exc)}
        if session is None:
            return {"state": "none"}
        number = getattr(session, "doc_number", 0)  # 0: stored by a load that has not numbered it yet
        doc = {"state": "loaded", "doc": number}
        return doc if known == number else {**doc, "view": {**document_view(session), "doc": number}}

    async def notice(self, user: str, incarnation: str) -> dict:
        if incarnation != self.incarnation:
            return {"lost": True}
        return {"notice": self.worker.notice(user)}

    async def stop(self, user: str) -> bool:
        self.worker.entry(user).stop.set()
        return True

    async def clear_stop(self, user: str) -> bool:
        self.worker.entry(user).stop.clear()
        return True

    async def free(self, user: str) -> bool:
        self.worker.free(user)
        return True

    async def end(self, user: str) -> bool:
        self.worker.end(user)
        return True

    # ---- model work: loads and answers stream ----------------------------------------------------------
    def _model_slot(self, stop: threading.Event, waiting):
        """Take a model slot (waiting(n_ahead) while none is free); False if stopped meanwhile."""
        with self.lock:
            self.waiting += 1
        try:
            while not self.slots.acquire(timeout=SLOT_WAIT_S):
                if stop.is_set():
                    return False
                waiting(self.waiting - 1)
            return True
        finally:
            with self.lock:
                self.waiting -= 1

    def _model_work(self, user: str, job, stopped: dict, waiting=None):
        """Stream what job(emit, stop) emits, run on a thread of its own once a model slot is free (waiting(emit, n)
        while none is, n requests ahead; `stopped` emitted when a Stop came first); an error goes back as a message,
        and the user's session stays usable."""
        entry = self.worker.entry(user)

        def work(emit):
            with self.worker.use(user):
                if not self._model_slot(entry.stop, lambda n: waiting and waiting(emit, n)):
                    emit(stopped)
                    return
                try:
                    job(emit, entry.stop)
                except Exception as exc:  # noqa: BLE001 - every error goes back as a message
                    emit(message_of(exc))
                finally:
                    self.slots.release()

        return streamed(work, entry.stop)

    async def load(self, user: str, name: str, text: str, settings):
        """Stream {"incarnation"} first, then {"progress": [fraction, step]}..., then {"view": ...} or {"error"}."""
        self.worker.entry(user).stop.clear()  # an old Stop (after an unload, say) must not end this load
        yield {"incarnation": self.incarnation}

        def job(emit, stop):
            def progress(fraction, step):
                emit({"progress": [fraction, step]})

            session = self.worker.load(user, name, text, settings, progress, stop)
            session.doc_number = next(self.docs)
            emit({"view": {**document_view(session), "doc": session.doc_number}})

        def waiting(emit, n):
            emit({"progress": [0.0, f"waiting for a model slot on this worker ({n} ahead)"]})

        async for item in self._model_work(user, job, STOPPED, waiting):
            yield item

    async def ask(
        self, user: str, incarnation: str, question: str, method: str, max_new_tokens: int, observe: dict, talk=CHAT
    ):
        """Stream {"text", "panels"} while the answer grows, then {"answer", "last_stats", "panels"} or
        {"error"}; {"lost": True} when the document died with another incarnation."""
        if incarnation != self.incarnation:
            yield {"lost": True}
            return

        def job(emit, stop):
            from pqcache import Instrumentation

            obs, counts, sent = Instrumentation(**observe), {}, [0.0, 0.0]

            def on_token(answer):
                now = time.perf_counter()
                if now - sent[0] >= STREAM_EVERY_S:
                    sent[0], part = now, {"text": answer.text}
                    if now - sent[1] >= PANELS_EVERY_S:
                        sent[1], part["panels"] = now, obs.since(counts)
                    emit(part)

            answer = self.worker.ask(user, question, method, max_new_tokens, stop, obs, on_token, conversation=talk)
            fields = {name: getattr(answer, name) for name in ANSWER_FIELDS}
            emit({"answer": fields, "last_stats": self.worker.session(user).last_stats, "panels": obs.since(counts)})

        async for item in self._model_work(user, job, STOPPED_ANSWER):
            yield item

    async def teach(self, user: str, case, methods: list[str], budget):
        """Stream {"progress": [fraction, step]}..., then {"lesson": ...} (the Teaching tab's run), or {"error"}."""
        self.worker.entry(user).stop.clear()

        def job(emit, stop):
            def progress(fraction, step):
                emit({"progress": [fraction, step]})

            emit({"lesson": self.worker.teach(user, case, methods, budget, progress, stop)})

        def waiting(emit, n):
            emit({"progress": [0.0, f"waiting for a model slot on this worker ({n} ahead)"]})

        async for item in self._model_work(user, job, STOPPED, waiting):
            yield item

    # ---- the user's conversation, beside their document -------------------------------------------------
    async def add_document(self, user: str, incarnation: str, name: str, text: str, method: str, talk=CHAT):
        """Stream {"progress": [fraction, step]}..., then {"tokens": n} once `text` is read into the user's
        conversation, or {"error"}; {"lost": True} when the document died with another incarnation."""
        if incarnation != self.incarnation:
            yield {"lost": True}
            return

        def job(emit, stop):
            def progress(fraction, step):
                emit({"progress": [fraction, step]})

            emit({"tokens": self.worker.add_document(user, name, text, method, stop, talk, progress)})

        async for item in self._model_work(user, job, STOPPED):
            yield item

    async def resume_conversation(self, user: str, incarnation: str, method: str, talk=CHAT):
        """Stream {"state": ...} once the document's last kept conversation is replayed (None: none kept), or
        {"error"}; {"lost": True} when the document died with another incarnation."""
        if incarnation != self.incarnation:
            yield {"lost": True}
            return

        def job(emit, stop):
            emit({"state": self.worker.resume_conversation(user, method, talk, stop)})

        async for item in self._model_work(user, job, STOPPED):
            yield item

    async def fork_conversation(self, user: str, conversation: str, into: str) -> dict:
        try:
            return self.worker.fork_conversation(user, conversation, into)
        except Exception as exc:  # noqa: BLE001 - said to the app as a message
            return message_of(exc)

    async def new_conversation(self, user: str, conversation: str | None = None) -> bool:
        self.worker.new_conversation(user, conversation)
        return True

    async def conversation_state(self, user: str, conversation: str = CHAT) -> dict | None:
        return self.worker.conversation_state(user, conversation)
