"""Document Q&A: load a document once (a file, pasted text or the bundled sample), ask questions about it;
answers stream with the live panels; Stop, Unload, notices. The page's components and events are in
studio/qa_page.py.

One status line per user says what is loaded or loading (studio/status.py); a question asked while a
document loads waits for it in the chat; the panels (studio/panels.py) are redrawn only when their data changed."""

from __future__ import annotations

import gradio as gr

from pqcache import InputError
from pqcache.serving.settings import answer_observer, check_question
from studio.answering import stream_answer
from studio.common import describe, sentence, user_of
from studio.conversing import ConversationHandlers
from studio.panels import PanelFeed
from studio.qa_load import LoadHandlers
from studio.sources import choices as source_choices
from studio.sources import document_view
from studio.state import Studio
from studio.status import WAIT_S, StatusBook
from studio.your_documents import DocumentListHandlers

NO_DOCUMENT = "Load a document first."
RESTARTED = "The server restarted since your document was loaded: it is no longer in the server's memory; load it again"
# what the browser keeps once told (gr.BrowserState keeps no empty value: "" would leave the old start in place)
TOLD = "told"


class QATab(LoadHandlers, ConversationHandlers, DocumentListHandlers):
    """The Q&A tab's handlers (loading a document: studio/qa_load.py; its conversation: studio/conversing.py; the
    browser's list of its documents: studio/your_documents.py); each user's document lives in the worker's pool, in
    its "qa" slot: this process's pool, or a Ray replica's."""

    def __init__(self, studio: Studio):
        self.studio = studio
        self.pool = studio.documents
        self.status = StatusBook(self.pool)
        self.feeds: dict[str, PanelFeed] = {}
        self.answers: dict[str, tuple[str, dict]] = {}  # user -> (document text, the last answer's sources)
        self.notices = 0
        self.device = studio.about["device"]

    def feed(self, user: str) -> PanelFeed:
        if user not in self.feeds:
            self.feeds[user] = PanelFeed(self.device)
        return self.feeds[user]

    # ---- asking -------------------------------------------------------------------------------------------
    def ask(self, question, chat, method, max_new_tokens, layer, request: gr.Request):
        """Stream the answer (the chat names the method) and refresh the panels whose data changed; a question
        asked while the document loads waits for it. Yields the chat, the timing line, the panels, the question box
        (emptied by the first update: the question moves into the chat) and, with the answer, its sources to click."""
        box, user = "", user_of(request)
        self.answers.pop(user, None)
        sources = gr.update(choices=[], value=None, visible=False)  # the last answer's go with it, whatever follows
        try:
            check_question(question or "", self.studio.server.max_question_chars)
        except InputError as exc:  # the question stays in its box, to be shortened
            yield list(chat or []), f"**Error:** {describe(exc)}", *(gr.skip(),) * 5, gr.skip(), sources
            return
        for out in self._ask(question, chat, method, max_new_tokens, layer, user):
            kept = self.answers.pop(user, None)  # set as the answer ended, right before its last update
            if kept is None:
                yield *out, box, sources
                sources = gr.skip()
            else:
                self.answers[user] = kept
                labels = source_choices(kept[1].get("sources") or [])
                yield *out, box, gr.update(choices=labels, value=None, visible=bool(labels))
            box = gr.skip()

    def show_source(self, index, show_missed, request: gr.Request):
        """The document view for source `index` of the user's last answer: the passage outlined, the attended
        tokens shaded, and (show_missed) the exact top-k tokens the search missed underlined."""
        text, answer = self.answers.get(user_of(request), ("", {}))
        return document_view(text, answer, index, bool(show_missed))

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
            obs = answer_observer()
            feed.show(session, obs, method, layer=layer)

            def keep(answer):  # what the document view shows of this answer
                keys = ("sources", "attended", "missed", "tokens")
                kept = {k: list(getattr(answer, k, None) or []) for k in keys}
                self.answers[user] = (getattr(session, "doc_text", ""), {**kept, "method": method})

            def ask(**kw):  # within the user's conversation, where their document lives
                return self.pool.ask(user, question, method, **kw)

            def said(_answer):  # after the timing line: what the conversation now holds
                return self.conversation_line(user)

            yield from stream_answer(ask, session, chat, method, int(max_new_tokens), stop, obs, feed, keep, said)

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
        self.answers.pop(user, None)
        self.feed(user).show(None)
        return self.status.line(user), gr.update(choices=[], value=None), *self.feed(user).figures()

    def pool_notice(self, request: gr.Request):
        """Polled by the page: the status line again when the server freed this user's document (or, on a cluster,
        reopened it on a live replica: the line then says that first)."""
        user = user_of(request)
        said = self.pool.notice(user)
        if said is None:
            return gr.skip()
        line = self.status.line(user)
        if sentence(said) not in line:  # a freed document is already named on the line; a reopen is not
            line = f"**Notice:** {sentence(said)}\n\n{line}"
        else:
            self.feed(user).show(None)
        self.notices += 1  # the page updates its status line when this value changes: each notice is new
        return f"{line}<!-- notice {self.notices} -->"

    def loaded_here(self, request: gr.Request):
        """After a load: this server's start, kept in the browser while it holds the user's document."""
        session, _ = self.status.active(user_of(request))
        return self.studio.started if session is not None else gr.skip()

    def restarted(self, kept: str, request: gr.Request):
        """When the page opens: the status line says so when this browser's document was loaded before the server
        last restarted (the browser kept that server's start; a page left open reconnects as a new page)."""
        if kept in ("", TOLD, self.studio.started):
            return gr.skip(), gr.skip()
        where = " (or open it under *Your documents*)." if self.studio.store is not None else "."
        return f"**Notice:** {RESTARTED}{where}\n\n{self.status.line(user_of(request))}", TOLD

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
        self.answers.pop(user, None)
