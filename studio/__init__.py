"""PQCache Studio's user interface: one tab per module around one `Studio` object (state.py).

state.py         the model, its tokenizer, the session pool, the server's settings and where the Q&A documents live
                 (this process's DocumentWorker, or Ray replicas: pqcache/cluster/), built in app.main()
common.py        what the tabs share: user ids, messages for the page, the assets folder
qa.py            Document Q&A handlers: load (a file, pasted text, the sample), ask (streamed), stop, unload
qa_load.py       loading a document: a file, pasted text or the sample, prefilled on a thread, Stop between layers
conversing.py    the conversation: follow-ups, New conversation, Add to the conversation, the chat's timing line
sources.py       an answer's sources: quotes under the answer, a list to click, the document with the passage
your_documents.py Your documents: the documents this browser loaded, kept in the browser, reopened from the store
qa_page.py       Document Q&A page: how-to line, document, settings, status line, chat, panels
answering.py     a streamed answer: the chat, the timing line and the panels at a rate the page keeps up with
status.py        the status line: one source of truth per user (loading, active document, last message)
panels.py        the live panels, redrawn only when their data changed
teaching.py      Teaching handlers: one prefill, several methods side by side, the five-step walkthrough
teaching_page.py Teaching page
costmodel_tab.py Cost model: the analytic estimate, a verdict per memory row, its curves
ui.py            build_ui(studio): the page, the three tabs wired to their handlers

UI code only: the engine is pqcache/, the figures viz/.
"""

from studio.state import Studio
from studio.ui import build_ui

__all__ = ["Studio", "build_ui"]
