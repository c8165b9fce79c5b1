"""The Q&A tab's conversation: a user's questions about their document are one conversation (follow-ups see the
earlier turns) until *New conversation*, another document, or another method; *Add to the conversation* reads an
attached file or pasted text into it, once, to ask across both. The conversation lives with the document, in the
documents service (this process's worker, or the Ray replica holding it: pqcache/serving/worker.py); the page only
asks it and says what it holds."""

from __future__ import annotations

import gradio as gr

from pqcache.serving.documents import read_document
from studio.common import describe, user_of
from studio.status import document_name

NO_CONVERSATION = "Load a document first: a conversation is about a document."


class ConversationHandlers:
    """New conversation, Add to the conversation, and the line saying what the user's conversation holds."""

    def conversation_line(self, user: str) -> str:
        state = self.pool.conversation_state(user)
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
        self.pool.new_conversation(user)
        session, _ = self.status.active(user)
        if session is None:
            return [], NO_CONVERSATION
        name = getattr(session, "name", "the document")
        return [], f"A new conversation about **{name}** ({session.n_tokens:,} tokens, read once: not again)."

    def add_to_conversation(self, file, pasted, encoding, method, request: gr.Request):
        """Read an attached file (else the pasted text) into the user's conversation, to ask across both."""
        user = user_of(request)
        session, _ = self.status.active(user)
        if session is None:
            return NO_CONVERSATION
        name = document_name(file, pasted)
        try:
            with self.pool.use(user) as entry:
                entry.stop.clear()
                text = read_document(file, pasted, encoding=None if encoding in (None, "", "utf-8") else encoding)
                n = self.pool.add_document(user, name, text, method, stop=entry.stop)
        except Exception as exc:  # a bad file, a conversation past the context: said, the conversation kept
            return f"**Error:** {describe(exc)}"
        return f"Added **{name}** ({n:,} tokens) to the conversation: ask about it{self.conversation_line(user)}."
