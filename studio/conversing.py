"""The Q&A tab's conversation: a user's questions about their document are one conversation (follow-ups see the
earlier turns) until *New conversation*, another document, or another method; *Add to the conversation* reads an
attached file or pasted text into it, once, to ask across both. The conversation lives with the document, in the
documents service (this process's worker, or the Ray replica holding it: pqcache/serving/worker.py); the page only
asks it and says what it holds."""

from __future__ import annotations

import gradio as gr

from pqcache import Cancelled
from pqcache.serving.documents import read_document
from pqcache.serving.service import DocumentsService
from studio.common import describe, user_of
from studio.status import StatusBook, document_name
from studio.threadwork import ThreadWork

NO_CONVERSATION = "Load a document first: a conversation is about a document."


class ConversationControls:
    """New conversation, Add to the conversation, and the line saying what the user's conversation holds."""

    def __init__(self, documents: DocumentsService, status: StatusBook):
        self.documents, self.status = documents, status

    def line(self, user: str) -> str:
        """What the user's conversation holds, for the end of the timing line ("" without one)."""
        state = self.documents.conversation_state(user)
        if state is None:
            return ""
        asked = state["asked"]
        turns = f"turns 1-{asked[-1]}" if len(asked) > 1 else "turn 1" if asked else "no question yet"
        return (
            f"; conversation: {state['tokens']:,} tokens ({turns}"
            + (f"; added: {', '.join(state['added'])}" if state["added"] else "")
            + (f"; at most {state['limit']:,}" if state["limit"] else "")
            + ")"
        )

    def new_conversation(self, request: gr.Request):
        """Back to the document: the chat empties, the document's prefill is kept."""
        user = user_of(request)
        self.documents.new_conversation(user)
        session, _ = self.status.active(user)
        if session is None:
            return [], NO_CONVERSATION
        name = getattr(session, "name", "the document")
        return [], f"A new conversation about **{name}** ({session.n_tokens:,} tokens, read once: not again)."

    def add_to_conversation(self, file, pasted, encoding, method, request: gr.Request):
        """Read an attached file (else the pasted text) into the user's conversation, to ask across both: as a load,
        its progress on the status line and Stop ending it (the conversation then stays as it was). Yields the
        status line and the timing line."""
        user = user_of(request)
        session, _ = self.status.active(user)
        if session is None:
            yield gr.skip(), NO_CONVERSATION
            return
        name = document_name(file, pasted)
        entry = self.documents.entry(user)
        entry.stop.clear()
        adding = self.status.start(user, name, adding=True)
        job = None
        try:
            yield self.status.line(user), ""
            with self.documents.use(user):

                def work(post):
                    def progress(fraction, step):
                        adding.fraction, adding.step = fraction, step
                        post(1)

                    text = read_document(file, pasted, encoding=None if encoding in (None, "", "utf-8") else encoding)
                    return self.documents.add_document(user, name, text, method, entry.stop, progress=progress)

                with ThreadWork(work, entry.stop, "pqcache-add") as job:
                    for line in self.status.lines_while(user, job):
                        yield line, gr.skip()
        finally:  # a bad file, a Stop, a conversation past the context: said, the conversation kept
            error = None if job is None else job.error
            stopped = isinstance(error, Cancelled) or error is None and (job is None or job.value is None)
            said = f"Stopped: {name} was not added; the conversation is as it was." if stopped else None
            self.status.finish(user, said or error and f"**Error:** {describe(error)}")
        if job.value is None:
            yield self.status.line(user), ""
            return
        added = f"Added **{name}** ({job.value:,} tokens) to the conversation: ask about it"
        yield self.status.line(user), added + self.line(user) + "."
