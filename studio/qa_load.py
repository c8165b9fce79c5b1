"""Loading a document in the Q&A tab: an attached file, pasted text or the bundled sample, prefilled once on a
worker thread while the status line shows its progress; Stop ends it at the next layer."""

from __future__ import annotations

import os

import gradio as gr

from pqcache import Cancelled
from pqcache.serving.documents import read_document
from pqcache.serving.settings import LoadSettings
from studio.common import ASSETS, describe, user_of
from studio.panels import PanelFeeds
from studio.state import Studio
from studio.status import StatusBook, document_name
from studio.threadwork import ThreadWork

SAMPLE = "passkey_1k.txt"  # the document *Try a sample* loads (assets/)
SAMPLE_NAME = f"sample {SAMPLE}"  # its name on the status line and in Your documents


class DocumentLoader:
    """Loading the user's document: the form's settings checked, the text read, the prefill on a thread (the
    documents service's load), its progress on the status line, then the panels pointed at it."""

    def __init__(self, studio: Studio, status: StatusBook, panels: PanelFeeds):
        self.studio, self.documents = studio, studio.documents
        self.status, self.panels = status, panels

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
        mass,
        completion,
        request: gr.Request,
    ):
        """Prefill the document once (an attached file, else the pasted text); later questions reuse it. Yields
        the status line (with the load's progress), the layer choices and the panels."""
        settings = LoadSettings(
            method, m, bits, budget, n_init, n_local, policy, capacity, encoding, too_long, mass, completion
        )
        name = document_name(file, pasted)
        yield from self.load(user_of(request), name, lambda enc: read_document(file, pasted, encoding=enc), settings)

    def load_sample(
        self,
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
        mass,
        completion,
        request: gr.Request,
    ):
        """The bundled sample document, with the load form's settings."""
        form = (method, m, bits, budget, n_init, n_local, policy, capacity, "utf-8", too_long, mass, completion)
        settings = LoadSettings(*form)
        path = os.path.join(ASSETS, SAMPLE)
        yield from self.load(user_of(request), SAMPLE_NAME, lambda enc: read_document(path), settings)

    def examples_shown(self, request: gr.Request):
        """The sample's example questions, shown while the sample is the active document (they are about it)."""
        session, _ = self.status.active(user_of(request))
        return gr.update(visible=getattr(session, "name", None) == SAMPLE_NAME)

    def load(self, user: str, name: str, read, settings: LoadSettings):
        """Load the text read(encoding) returns as the user's document, named `name`. Yields the status line (with
        the load's progress), the layer choices and the panels."""
        studio, skip = self.studio, (gr.skip(),) * 6  # the layer choices and 5 panels
        self.documents.entry(user).stop.clear()  # before the load shows: a Stop from now on ends this load
        load = self.status.start(user, name)
        job = None
        try:
            yield self.status.line(user), *skip
            with self.documents.use(user) as entry:

                def work(post):
                    def progress(fraction, step):
                        load.fraction, load.step = fraction, step
                        post(1)

                    studio.server.config_for(settings)  # the form is checked before the file
                    text = read(settings.text_encoding)
                    return self.documents.load(user, name, text, settings, progress, entry.stop)

                with ThreadWork(work, entry.stop, "pqcache-load") as job:
                    for line in self.status.lines_while(user, job):
                        yield line, *skip
        finally:  # the worker stored the new document, or gave its reservation back
            error = None if job is None else job.error
            stopped = isinstance(error, Cancelled) or error is None and (job is None or job.value is None)
            self.status.finish(
                user, "Stopped: the document was not loaded." if stopped else error and f"**Error:** {describe(error)}"
            )
        yield self.status.line(user), *self._show(user, job.value, error)

    def _show(self, user: str, session, error) -> tuple:
        """The layer choices and panels after a load: the new document's, or (after a failure) the active one's,
        kept as they were."""
        feed = self.panels.of(user)
        if session is None:
            active, _ = self.status.active(user)
            if active is not None:  # a failed load leaves the active document, and the panels, as they were
                return (gr.skip(),) * 6
            feed.show(None)
            return gr.update(choices=[], value=None), *feed.figures()
        choices = [str(layer.layer_idx) for layer in session.cache.pq_layers]
        feed.show(session, layer=choices[0] if choices else None)
        return gr.update(choices=choices, value=choices[0] if choices else None), *feed.figures()
