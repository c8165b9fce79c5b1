"""A streamed answer for the Q&A tab: the model works on a thread, the page gets the growing answer and the
panels at a rate it keeps up with (studio/panels.py)."""

from __future__ import annotations

import re
import time

import gradio as gr

from pqcache import InputError
from pqcache.serving.answer import step_ms
from pqcache.serving.settings import answer_observer, check_question
from studio.common import describe, notices, user_of
from studio.panels import PANEL_EVERY_S, PanelFeeds
from studio.sources import chat_quotes, document_view
from studio.sources import choices as source_choices
from studio.state import Studio
from studio.status import WAIT_S, StatusBook
from studio.threadwork import ThreadWork

NO_DOCUMENT = "Load a document first."
CHAT_EVERY_S = 0.3  # the streamed answer is sent at most this often
ENDINGS = {  # why an answer ended (Answer.ended), as the chat says it
    "eos": "the model ended it",
    "end_of_answer": "end of the answer",
    "repetition": "a repeat was cut",
    "max_new_tokens": "max new tokens reached",
    "stopped": "stopped",
}


def literal(text: str) -> str:
    """A model's text for the chat's Markdown: a line starting "68422." stays text, not an ordered list."""
    return re.sub(r"^(\s*\d+)\.(?=\s|$)", r"\1\\.", text, flags=re.M)


def stream_answer(ask, session, chat, method, max_new_tokens, stop, obs, feed, on_done=None, more=None):
    """Run ask(max_new_tokens=, stop=, observer=, on_token=) (the documents service's answer to the user's question)
    on a worker thread and yield (chat, timing line, 5 panels) while it streams: the first
    text as soon as it is there, then the chat at most every CHAT_EVERY_S seconds, one panel whose data changed
    (memory excepted) at most every PANEL_EVERY_S seconds, all changed panels at the end. The chat's last message is
    the answer, with the method, its tokens, why it ended and the passages it read most (its sources);
    on_done(answer) once it has ended; more(answer): text for the end of the timing line."""

    def work(post):
        return ask(max_new_tokens=max_new_tokens, stop=stop, observer=obs, on_token=lambda a: post(a.text))

    chat.append({"role": "assistant", "content": f"*{method} is reading the question...*"})
    t0 = last_chat = last_panels = time.perf_counter()
    text = sent = None
    with ThreadWork(work, stop, "pqcache-answer") as job:
        yield chat, f"{method}: reading the question...", *(gr.skip(),) * 5
        for posted in job.posts(CHAT_EVERY_S):
            text = posted if posted is not None else text
            now = time.perf_counter()
            first = sent is None and text is not None  # the first words go out at once, not at the next tick
            if now - last_chat < CHAT_EVERY_S and not first:
                continue
            panels = (gr.skip(),) * 5
            if now - last_panels >= PANEL_EVERY_S:  # memory waits for the end: the answer's cache statistics
                # (session.last_stats) are set as it ends, a moment before this loop hears that it did
                last_panels, panels = now, feed.figures(limit=1, hold=("memory",))
            if text is not None and text != sent:
                sent = text
                chat[-1]["content"] = f"{literal(text)}\n\n*{method}, generating...*"
            last_chat = now
            doing = "stopping at the next token" if stop.is_set() else "generating"
            yield chat, f"{method}: {doing}... {now - t0:.1f} s", *panels
    if job.error is not None:  # shown in the chat; the session stays usable
        chat[-1]["content"] = f"Error: {describe(job.error)}"
        yield chat, "", *feed.figures()
        return
    answer = job.value
    if getattr(answer, "note", ""):  # a new conversation started: said above the question that started it
        chat.insert(max(0, len(chat) - 2), {"role": "assistant", "content": answer.note})
    n, seconds = len(answer.tokens), answer.seconds
    stopped = " (stopped)" if answer.stopped else ""
    why = ENDINGS.get(getattr(answer, "ended", ""), "")
    quotes = chat_quotes(getattr(answer, "sources", None) or [])
    chat[-1]["content"] = (
        f"{literal(answer.text)}\n\n*{method}: {n} tokens in {seconds:.1f} s{', ' + why if why else ''}*"
        + (f"\n\n**Sources** (what its attention read most):\n\n{quotes}" if quotes else "")
    )
    if on_done is not None:
        on_done(answer)
    status = f"{method}: {n} tokens in {seconds:.2f} s ({n / max(seconds, 1e-9):.1f} tokens/s){stopped}"
    ms = step_ms(answer)
    if ms is not None:  # the question's prefill, then each step (dropped tokens too): what a reader waits on
        status += f"; first token after {answer.first_s:.2f} s, then {ms:.0f} ms a token"
    if getattr(answer, "reread_s", 0.0):  # the load kept no queries, which this method starts from
        status += f"; {method} read the document again for its prefill queries first ({answer.reread_s:.1f} s)"
    yield chat, status + notices(session.last_stats) + (more(answer) if more else ""), *feed.figures()


class Answers:
    """Asking: the user's question answered within their conversation, streamed with the live panels; the last
    answer's sources kept for the document view. A question asked while the document loads waits for it."""

    def __init__(self, studio: Studio, status: StatusBook, panels: PanelFeeds, conversation):
        self.studio, self.documents = studio, studio.documents
        self.status, self.panels, self.conversation = status, panels, conversation
        self.kept: dict[str, tuple[str, dict]] = {}  # user -> (document text, the last answer's sources)

    def ask(self, question, chat, method, max_new_tokens, layer, request: gr.Request):
        """Stream the answer (the chat names the method) and refresh the panels whose data changed. Yields the
        chat, the timing line, the panels, the question box (emptied by the first update: the question moves into
        the chat) and, with the answer, its sources to click."""
        box, user = "", user_of(request)
        self.kept.pop(user, None)
        sources = gr.update(choices=[], value=None, visible=False)  # the last answer's go with it, whatever follows
        try:
            check_question(question or "", self.studio.server.max_question_chars)
        except InputError as exc:  # the question stays in its box, to be shortened
            yield list(chat or []), f"**Error:** {describe(exc)}", *(gr.skip(),) * 5, gr.skip(), sources
            return
        for out in self._ask(question, chat, method, max_new_tokens, layer, user):
            kept = self.kept.get(user)  # set as the answer ended, right before its last update
            if kept is None:
                yield *out, box, sources
                sources = gr.skip()
            else:
                labels = source_choices(kept[1].get("sources") or [])
                yield *out, box, gr.update(choices=labels, value=None, visible=bool(labels))
            box = gr.skip()

    def show_source(self, index, show_missed, request: gr.Request):
        """The document view for source `index` of the user's last answer: the passage outlined, the attended
        tokens shaded, and (show_missed) the exact top-k tokens the search missed underlined."""
        text, answer = self.kept.get(user_of(request), ("", {}))
        return document_view(text, answer, index, bool(show_missed))

    def forget(self, user: str):
        self.kept.pop(user, None)

    def _ask(self, question, chat, method, max_new_tokens, layer, user):
        chat = list(chat or [])
        feed, skip = self.panels.of(user), (gr.skip(),) * 5
        if not question or not question.strip():
            yield chat, "Type a question.", *skip
            return
        chat.append({"role": "user", "content": question})
        with self.documents.use(user) as entry:  # busy: the service will not evict this document meanwhile
            load = self.status.loading.get(user)
            if load is not None:
                yield from self._wait_for(load, chat)
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
                self.kept[user] = (getattr(session, "doc_text", ""), {**kept, "method": method})

            def ask(**kw):  # within the user's conversation, where their document lives
                return self.documents.ask(user, question, method, **kw)

            def said(_answer):  # after the timing line: what the conversation now holds
                return self.conversation.line(user)

            yield from stream_answer(ask, session, chat, method, int(max_new_tokens), stop, obs, feed, keep, said)

    @staticmethod
    def _wait_for(load, chat):
        """While the document loads: a line in the chat saying the question waits for it, with its progress."""
        chat.append({"role": "assistant", "content": ""})
        shown = None
        while not load.done.is_set():
            text = (
                f"*Waiting for **{load.name}** to finish loading ({100 * load.fraction:.0f} %); "
                "then this question goes to it.*"
            )
            if text != shown:
                chat[-1]["content"] = shown = text
                yield chat, "waiting for the document", *(gr.skip(),) * 5
            load.done.wait(WAIT_S)
        chat.pop()
