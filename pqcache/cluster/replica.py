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
from pqcache.fastpath.weights import DEFAULT_DECODE_WEIGHTS

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


class DocumentReplica:
    """The Serve deployment's class (pqcache.cluster.launch deploys it, one deployment per replica)."""

    def __init__(
        self,
        model: str = "default",
        max_bytes: int = 2**30,
        idle_s: float | None = 1800.0,
        concurrency: int = 2,
        pq_timeout_s: float | None = 120.0,
        max_document_tokens: int | None = None,
        threads: int = 1,
        dtype: str | None = None,
        decode_weights: str = DEFAULT_DECODE_WEIGHTS,
        store_dir: str | None = None,
        kv_dtype: str = "auto",  # PQCacheConfig.kv_dtype: the host tier's keys and values
    ):
        """store_dir: the document store's folder, the same for every replica (a filesystem all machines share)."""
        import torch

        from pqcache import load_model
        from pqcache.serving.pool import SessionPool, limit_malloc_arenas
        from pqcache.serving.store import DocumentStore
        from pqcache.serving.worker import DocumentWorker

        torch.set_num_threads(max(1, threads))
        limit_malloc_arenas()
        said = lambda msg: print(msg, flush=True)  # noqa: E731  (the replica's log)
        model, tokenizer = load_model(model, device="cpu", dtype=dtype, decode_weights=decode_weights, progress=said)
        pool = SessionPool(max_bytes=max_bytes, idle_s=idle_s)
        if pool.idle_s is not None:
            pool.start_reaper(every_s=min(5.0, pool.idle_s / 4))
        store = None if store_dir is None else DocumentStore(store_dir)
        self.worker = DocumentWorker(model, tokenizer, pool, pq_timeout_s, max_document_tokens, store, kv_dtype)
        self.incarnation = uuid.uuid4().hex[:12]
        self.slots = threading.Semaphore(max(1, concurrency))
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

    async def load(self, user: str, name: str, text: str, settings):
        """Stream {"incarnation"} first, then {"progress": [fraction, step]}..., then {"view": ...} or {"error"}."""
        entry = self.worker.entry(user)
        entry.stop.clear()  # an old Stop (after an unload, say) must not end this load; the app forwards a new one
        yield {"incarnation": self.incarnation}

        def work(emit):
            def progress(fraction, step):
                emit({"progress": [fraction, step]})

            with self.worker.use(user):
                slot = self._model_slot(
                    entry.stop, lambda n: progress(0.0, f"waiting for a model slot on this worker ({n} ahead)")
                )
                if not slot:
                    emit({"error": "stopped", "cancelled": True})
                    return
                try:
                    session = self.worker.load(user, name, text, settings, progress, entry.stop)
                    session.doc_number = next(self.docs)
                    emit({"view": {**document_view(session), "doc": session.doc_number}})
                except Exception as exc:  # noqa: BLE001 - every error goes back as a message
                    emit(message_of(exc))
                finally:
                    self.slots.release()

        async for item in streamed(work, entry.stop):
            yield item

    async def ask(self, user: str, incarnation: str, question: str, method: str, max_new_tokens: int, observe: dict):
        """Stream {"text", "panels"} while the answer grows, then {"answer", "last_stats", "panels"} or
        {"error"}; {"lost": True} when the document died with another incarnation."""
        if incarnation != self.incarnation:
            yield {"lost": True}
            return
        entry = self.worker.entry(user)

        def work(emit):
            from pqcache import Instrumentation

            with self.worker.use(user):
                if not self._model_slot(entry.stop, lambda n: None):
                    emit({"answer": {"text": "", "tokens": [], "stopped": True, "ended": "stopped"}})
                    return
                try:
                    session = self.worker.session(user)
                    if session is None:
                        emit({"error": "load a document first", "kind": "NoDocumentError"})
                        return
                    obs, counts, sent = Instrumentation(**observe), {}, [0.0, 0.0]

                    def on_token(answer):
                        now = time.perf_counter()
                        if now - sent[0] >= STREAM_EVERY_S:
                            sent[0], part = now, {"text": answer.text}
                            if now - sent[1] >= PANELS_EVERY_S:
                                sent[1], part["panels"] = now, obs.since(counts)
                            emit(part)

                    answer = session.ask(
                        question, method, max_new_tokens, stop=entry.stop, observer=obs, on_token=on_token
                    )
                    emit(
                        {
                            "answer": {
                                k: getattr(answer, k)
                                for k in (
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
                                )
                            },
                            "last_stats": session.last_stats,
                            "panels": obs.since(counts),
                        }
                    )
                except Exception as exc:  # noqa: BLE001 - the session stays usable
                    emit(message_of(exc))
                finally:
                    self.slots.release()

        async for item in streamed(work, entry.stop):
            yield item
