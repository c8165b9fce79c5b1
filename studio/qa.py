"""Document Q&A: load a document once (a file, pasted text or the bundled sample), ask questions about it;
answers stream with the live panels; Stop, Unload, notices. The page's components and events are in
studio/qa_page.py.

One status line per user says what is loaded or loading (studio/status.py); a question asked while a
document loads waits for it in the chat; the panels (studio/panels.py) are redrawn only when their data changed."""

from __future__ import annotations

import os
import queue
import threading

import gradio as gr

from pqcache import Cancelled, Instrumentation
from pqcache.serving.documents import read_document
from pqcache.serving.settings import LoadSettings
from studio.answering import stream_answer
from studio.common import ASSETS, describe, user_of
from studio.panels import PanelFeed
from studio.state import Studio
from studio.status import StatusBook, document_name

SAMPLE = "passkey_1k.txt"  # the document *Try a sample* loads (assets/)
WAIT_S = 0.5  # how often a load's progress (and a waiting question) is looked at
NO_DOCUMENT = "Load a document first."


class QATab:
    """The Q&A tab's handlers; each user's document lives in the worker's pool, in its "qa" slot: this process's
    pool, or a Ray replica's (studio.documents)."""

    def __init__(self, studio: Studio):
        self.studio = studio
        self.pool = studio.documents
        self.status = StatusBook(self.pool)
        self.feeds: dict[str, PanelFeed] = {}
        self.notices = 0
        try:
            self.device = next(studio.model.parameters()).device.type
        except (AttributeError, StopIteration):
            self.device = "cpu"

    def feed(self, user: str) -> PanelFeed:
        if user not in self.feeds:
            self.feeds[user] = PanelFeed(self.device)
        return self.feeds[user]

    # ---- loading ------------------------------------------------------------------------------------------
    def load_document(
        self,
        file,
        pasted,
        method,
        m,
        bits,
        budget,
        n_init,
        n_local,
        policy,
        capacity,
        encoding,
        too_long,
        request: gr.Request,
    ):
        """Prefill the document once (an attached file, else the pasted text); later questions reuse it. Yields
        the status line (with the load's progress), the layer choices and the panels."""
        settings = LoadSettings(method, m, bits, budget, n_init, n_local, policy, capacity, encoding, too_long)
        name = document_name(file, pasted)
        yield from self._load(user_of(request), name, lambda enc: read_document(file, pasted, encoding=enc), settings)

    def load_sample(
        self, method, m, bits, budget, n_init, n_local, policy, capacity, encoding, too_long, request: gr.Request
    ):
        """The bundled sample document, with the load form's settings; its example questions become visible."""
        settings = LoadSettings(method, m, bits, budget, n_init, n_local, policy, capacity, "utf-8", too_long)
        path = os.path.join(ASSETS, SAMPLE)
        for out in self._load(user_of(request), f"sample {SAMPLE}", lambda enc: read_document(path), settings):
            yield *out, gr.update(visible=True)

    def _load(self, user: str, name: str, read, settings: LoadSettings):
        studio, skip = self.studio, (gr.skip(),) * 6  # the layer choices and 5 panels
        self.feed(user)
        self.pool.entry(user).stop.clear()  # before the load shows: a Stop from now on ends this load
        load = self.status.start(user, name)
        updates: queue.Queue = queue.Queue()
        result: dict = {}
        try:
            yield self.status.line(user), *skip
            with self.pool.use(user) as entry:

                def progress(fraction, step):
                    load.fraction, load.step = fraction, step
                    updates.put(1)

                def work():
                    try:
                        settings.to_config(pq_timeout_s=studio.pq_timeout_s)  # the form is checked before the file
                        text = read(settings.text_encoding)
                        result["session"] = self.pool.load(user, name, text, settings, progress, entry.stop)
                    except Exception as exc:  # shown on the status line; the page stays as it was
                        result["error"] = exc
                    updates.put(None)

                worker = threading.Thread(target=work, daemon=True, name="pqcache-load")
                worker.start()
                done, shown = False, None
                try:
                    while not done:
                        try:
                            done = updates.get(timeout=WAIT_S) is None
                            while not done and not updates.empty():
                                done = updates.get_nowait() is None
                        except queue.Empty:
                            pass
                        line = self.status.line(user)
                        if not done and line != shown:
                            shown = line
                            yield line, *skip
                finally:  # the page went away mid-load (GeneratorExit): stop the prefill, do not leak it
                    if not done:
                        entry.stop.set()
                        worker.join(timeout=30)
        finally:  # the worker stored the new document, or gave its reservation back
            error = result.get("error")
            stopped = isinstance(error, Cancelled) or "session" not in result and error is None
            self.status.finish(
                user, "Stopped: the document was not loaded." if stopped else error and f"**Error:** {describe(error)}"
            )
        yield self.status.line(user), *self._show(user, result.get("session"), error)

    def _show(self, user: str, session, error) -> tuple:
        """The layer choices and panels after a load: the new document's, or (after a failure) the active one's,
        kept as they were."""
        feed = self.feed(user)
        if session is None:
            active, _ = self.status.active(user)
            if active is not None:  # a failed load leaves the active document, and the panels, as they were
                return (gr.skip(),) * 6
            feed.show(None)
            return gr.update(choices=[], value=None), *feed.figures()
        choices = [str(layer.layer_idx) for layer in session.cache.pq_layers]
        feed.show(session, layer=choices[0] if choices else None)
        return gr.update(choices=choices, value=choices[0] if choices else None), *feed.figures()

    # ---- asking -------------------------------------------------------------------------------------------
    def ask(self, question, chat, method, max_new_tokens, layer, request: gr.Request):
        """Stream the answer (the chat names the method) and refresh the panels whose data changed; a question
        asked while the document loads waits for it. Yields the chat, the timing line, the panels and the question
        box (emptied by the first update: the question moves into the chat)."""
        box = ""
        for out in self._ask(question, chat, method, max_new_tokens, layer, user_of(request)):
            yield *out, box
            box = gr.skip()

    def _ask(self, question, chat, method, max_new_tokens, layer, user):
        chat = list(chat or [])
        feed, skip = self.feed(user), (gr.skip(),) * 5
        if not question or not question.strip():
            yield chat, "Type a question.", *skip
            return
        chat.append({"role": "user", "content": question})
        with self.pool.use(user) as entry:  # busy: the pool will not evict this document meanwhile
            load = self.status.loading.get(user)
            if load is not None:
                chat.append({"role": "assistant", "content": ""})
                shown = None
                while not load.done.is_set():
                    text = (
                        f"*Waiting for **{load.name}** to finish loading ({100 * load.fraction:.0f} %); "
                        "then this question goes to it.*"
                    )
                    if text != shown:
                        chat[-1]["content"] = shown = text
                        yield chat, "waiting for the document", *skip
                    load.done.wait(WAIT_S)
                chat.pop()
            session, freed = self.status.active(user)
            if session is None:  # evicted, freed, or never loaded: tell them, keep the page working
                failed = f" The load said: {load.error}" if load is not None and load.error else ""
                chat.append({"role": "assistant", "content": (freed or NO_DOCUMENT) + failed})
                feed.show(None)
                yield chat, "", *feed.figures()
                return
            stop = entry.stop
            stop.clear()
            obs = Instrumentation(timeline=True, attention_every=4, recall_every=4)
            feed.show(session, obs, method, layer=layer)
            yield from stream_answer(session, question, chat, method, int(max_new_tokens), stop, obs, feed)

    # ---- the rest -----------------------------------------------------------------------------------------
    def stop_generation(self, request: gr.Request):
        """Stop this user's load or answer (it needs no model slot, so it is never stuck behind them). The page
        hears it from the load or the answer itself (the status or timing line says "stopping"), so a late reply
        here never overwrites their last word; with nothing running a message says so."""
        user = user_of(request)
        entry = self.pool.entry(user)
        load = self.status.loading.get(user)
        if entry.busy == 0 and load is None:
            gr.Info("Nothing is running: Stop ends a load or an answer.")
            return "nothing to stop"
        entry.stop.set()
        if load is not None:  # the status line says so until the load ends
            load.step = "stopping at the next layer"
        return "stopped"

    def unload_document(self, request: gr.Request):
        user = user_of(request)
        self.pool.free(user, "qa")
        self.status.forget(user)
        self.feed(user).show(None)
        return self.status.line(user), gr.update(choices=[], value=None), *self.feed(user).figures()

    def pool_notice(self, request: gr.Request):
        """Polled by the page: the status line again when the server freed this user's document."""
        user = user_of(request)
        if self.pool.notice(user) is None:
            return gr.skip()
        self.feed(user).show(None)
        self.notices += 1  # the page updates its status line when this value changes: each notice is new
        return f"{self.status.line(user)}<!-- notice {self.notices} -->"

    def refresh_panels(self, layer, window, request: gr.Request):
        feed = self.feed(user_of(request))
        feed.show(layer=layer, window=window)
        return feed.figures()

    def server_status(self) -> dict:
        """Users holding a document, users being served, cache bytes against the cap (polled by the page)."""
        return self.pool.summary()

    def server_line(self) -> str:
        s = self.pool.summary()
        workers = f" on {s['up']} of {s['replicas']} workers" if "replicas" in s else ""  # a Ray cluster's
        return (
            f"Server: {s['users']} user(s) with a document{workers}, {s['busy']} being served; caches "
            f"{s['cache_bytes'] / 2**20:.0f} of {s['max_bytes'] / 2**20:.0f} MiB."
        )

    def end_user(self, request: gr.Request):
        """The tab closed: free its caches."""
        user = user_of(request)
        self.pool.end(user)
        self.status.forget(user)
        self.feeds.pop(user, None)
