"""A streamed answer for the Q&A tab: the model works on a thread, the page gets the growing answer and the
panels at a rate it keeps up with (studio/panels.py)."""

from __future__ import annotations

import re
import time

import gradio as gr

from pqcache.serving.answer import step_ms
from studio.common import describe, notices
from studio.panels import PANEL_EVERY_S
from studio.sources import chat_quotes
from studio.threadwork import ThreadWork

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
