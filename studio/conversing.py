"""The Q&A tab's conversation: a user's questions about their document are one conversation (follow-ups see the
earlier turns, pqcache/serving/conversation.py) until *New conversation*, another document, or another method;
*Add to the conversation* reads an attached file or pasted text into it, once, to ask across both. The chat's timing
line says how long the conversation is and which turns it holds. On a Ray cluster (documents on replicas) every
question still reads the document alone: the page says so."""

from __future__ import annotations

import gradio as gr

from pqcache.serving.conversation import Conversation
from pqcache.serving.documents import read_document
from pqcache.serving.session import DocumentSession
from studio.common import describe, user_of
from studio.status import document_name

NO_CONVERSATION = "Load a document first: a conversation is about a document."
ON_A_CLUSTER = "; on this cluster each question reads the document alone"


class ConversationHandlers:
    """Each user's conversation on their active document (self.conversations[user])."""

    def conversation_for(self, user: str, session, method: str) -> tuple[Conversation | None, str]:
        """The user's conversation on `session` with `method`, started anew when the document or the method changed
        (and a note saying so when it held turns); None where sessions live on replicas."""
        if not isinstance(session, DocumentSession):
            return None, ""
        talk = self.conversations.get(user)
        note = ""
        if talk is not None and (talk.session is not session or talk.method != method or talk.cache is None):
            if talk.session is session and talk.turns:
                note = f"*The method is now {method}: a new conversation starts (the document stays loaded).*"
            self.drop_conversation(user)
            talk = None
        if talk is None:
            talk = self.conversations[user] = Conversation(session, method)
        return talk, note

    def drop_conversation(self, user: str):
        talk = self.conversations.pop(user, None)
        if talk is not None:
            talk.close()

    def conversation_line(self, user: str) -> str:
        talk = self.conversations.get(user)
        if talk is None:
            return ""
        asked = [i + 1 for i, t in enumerate(talk.turns) if t.kind == "question"]
        added = [t.text for t in talk.turns if t.kind == "document"]
        turns = f"turns 1-{asked[-1]}" if len(asked) > 1 else "turn 1" if asked else "no question yet"
        return (
            f"; conversation: {talk.n_tokens:,} tokens ({turns}"
            + (f"; added: {', '.join(added)}" if added else "")
            + (f"; at most {talk.limit:,}" if talk.limit else "")
            + ")"
        )

    def count_conversation(self, user: str):
        """The user's document and its conversation counted under the memory cap (the conversation's bytes from the
        document's bytes a token: an estimate)."""
        talk, count = self.conversations.get(user), getattr(self.pool, "count", None)
        if talk is not None and count is not None and talk.session.n_tokens:
            per_token = talk.session.nbytes() / talk.session.n_tokens
            count(user, talk.session.nbytes() + int(per_token * len(talk.ids)))

    def new_conversation(self, request: gr.Request):
        """Back to the document: the chat empties, the document's prefill is kept."""
        user = user_of(request)
        self.drop_conversation(user)
        session, _ = self.status.active(user)
        self.count_conversation(user)
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
                talk, _ = self.conversation_for(user, session, method)
                if talk is None:
                    return "Adding a document to a conversation needs the documents in this process (not --ray)."
                entry.stop.clear()
                text = read_document(file, pasted, encoding=None if encoding in (None, "", "utf-8") else encoding)
                n = talk.add_document(text, name, stop=entry.stop)
        except Exception as exc:  # a bad file, a conversation past the context: said, the conversation kept
            return f"**Error:** {describe(exc)}"
        self.count_conversation(user)
        return f"Added **{name}** ({n:,} tokens) to the conversation: ask about it{self.conversation_line(user)}."
