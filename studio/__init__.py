"""PQCache Studio's user interface: one tab per module around one `Studio` object (state.py).

state.py         the model, its tokenizer, the session pool and the server's settings, built in app.main()
common.py        what the tabs share: user ids, messages for the page, the live panels
qa.py            Document Q&A: load, ask (streamed), stop, unload, notices, server status
teaching.py      Teaching: one prefill, several methods side by side, the walkthrough
costmodel_tab.py Cost model: the analytic estimate and its curves
ui.py            build_ui(studio): the page, the three tabs wired to their handlers

UI code only: the engine is pqcache/, the figures viz/.
"""

from studio.state import Studio
from studio.ui import build_ui

__all__ = ["Studio", "build_ui"]
