"""PQCache Studio's user interface: one tab per module around one `Studio` object (state.py).

state.py         the model, its tokenizer, the session pool, the server's settings and where the Q&A documents live
                 (this process's DocumentWorker, or Ray replicas: pqcache/cluster/), built in app.main()
common.py        what the tabs share: user ids, messages for the page, the assets folder
qa.py            QATab: the Document Q&A tab's parts, each owning its state; Stop, Unload, the server's notices
qa_load.py       DocumentLoader: a file, pasted text or the sample, prefilled on a thread, Stop between layers
conversing.py    ConversationControls: New conversation, Add to the conversation, what the conversation holds
sources.py       an answer's sources: quotes under the answer, a list to click, the document with the passage
your_documents.py YourDocuments: the documents this browser loaded, kept in the browser, reopened from the store
qa_page.py       Document Q&A page: how-to line, document, settings, status line, chat, panels
answering.py     Answers: a question answered in the conversation, streamed with the panels; its sources kept
status.py        the status line: one source of truth per user (loading, active document, last message)
panels.py        the live panels (PanelFeeds: one feed a user), redrawn only when their data changed
teaching.py      Teaching handlers: one prefill, several methods side by side, the five-step walkthrough
teaching_page.py Teaching page
costmodel_tab.py Cost model: the analytic estimate, a verdict per memory row, its curves
ui.py            build_ui(studio): the page, the three tabs wired to their handlers

UI code only: the engine is pqcache/, the figures viz/.
"""

from studio.state import Studio
from studio.ui import build_ui

__all__ = ["Studio", "build_ui"]
