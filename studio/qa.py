"""Document Q&A: load a document once (a file, pasted text or the bundled sample), ask questions about it;
answers stream with the live panels; Stop, Unload, notices. The page's components and events are in
studio/qa_page.py.

QATab holds the tab's parts, each owning its state: the status line (studio/status.py), the panels
(studio/panels.py), loading (studio/qa_load.py), the conversation's controls (studio/conversing.py), asking and the
last answer's sources (studio/answering.py) and Your documents (studio/your_documents.py). What spans them (Stop,
Unload, the server's notices and line, a closed tab) is here."""

from __future__ import annotations

import gradio as gr

from studio.answering import Answers
from studio.common import sentence, user_of
from studio.conversing import ConversationControls
from studio.panels import PanelFeeds
from studio.qa_load import DocumentLoader
from studio.state import Studio
from studio.status import StatusBook
from studio.your_documents import YourDocuments

RESTARTED = "The server restarted since your document was loaded: it is no longer in the server's memory; load it again"
# what the browser keeps once told (gr.BrowserState keeps no empty value: "" would leave the old start in place)
TOLD = "told"


class QATab:
    """The Q&A tab's parts around the documents service (where each user's document lives, in its "qa" slot: this
    process's worker, or a Ray replica)."""

    def __init__(self, studio: Studio):
        self.studio = studio
        self.documents = studio.documents
        self.status = StatusBook(self.documents)
        self.panels = PanelFeeds(studio.about["device"])
        self.loader = DocumentLoader(studio, self.status, self.panels)
        self.conversation = ConversationControls(self.documents, self.status)
        self.answers = Answers(studio, self.status, self.panels, self.conversation)
        self.your_documents = YourDocuments(studio, self.status, self.loader)
        self.notices = 0

    def stop_generation(self, request: gr.Request):
        """Stop this user's load or answer (it needs no model slot, so it is never stuck behind them). The page
        hears it from the load or the answer itself (the status or timing line says "stopping"), so a late reply
        here never overwrites their last word; with nothing running a message says so."""
        user = user_of(request)
        entry = self.documents.entry(user)
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
        self.documents.free(user, "qa")
        self.status.forget(user)
        self.answers.forget(user)
        self.panels.of(user).show(None)
        return self.status.line(user), gr.update(choices=[], value=None), *self.panels.of(user).figures()

    def server_notice(self, request: gr.Request):
        """Polled by the page: the status line again when the server freed this user's document (or, on a cluster,
        reopened it on a live replica: the line then says that first)."""
        user = user_of(request)
        said = self.documents.notice(user)
        if said is None:
            return gr.skip()
        line = self.status.line(user)
        if sentence(said) not in line:  # a freed document is already named on the line; a reopen is not
            line = f"**Notice:** {sentence(said)}\n\n{line}"
        else:
            self.panels.of(user).show(None)
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
        feed = self.panels.of(user_of(request))
        feed.show(layer=layer, window=window)
        return feed.figures()

    def server_status(self) -> dict:
        """Users holding a document, users being served, cache bytes against the cap (polled by the page)."""
        return self.documents.summary()

    def server_line(self) -> str:
        s = self.documents.summary()
        workers = f" on {s['up']} of {s['replicas']} workers" if "replicas" in s else ""  # a Ray cluster's
        return (
            f"Server: {s['users']} user(s) with a document{workers}, {s['busy']} being served; caches "
            f"{s['cache_bytes'] / 2**20:.0f} of {s['max_bytes'] / 2**20:.0f} MiB."
        )

    def end_user(self, request: gr.Request):
        """The tab closed: free its caches."""
        user = user_of(request)
        self.documents.end(user)
        self.status.forget(user)
        self.panels.forget(user)
        self.answers.forget(user)
