"""The page: three tabs, each wired to its handlers around one Studio."""

from __future__ import annotations

import gradio as gr

from studio.costmodel_tab import DEFAULT, build_cost_tab, cost
from studio.qa import QATab
from studio.qa_page import build_qa_tab
from studio.state import Studio
from studio.teaching import TeachingTab
from studio.teaching_page import build_teaching_tab


def build_ui(studio: Studio) -> gr.Blocks:
    methods = studio.about["methods"]  # the selection methods the documents' server offers
    qa, teaching = QATab(studio), TeachingTab(studio)
    with gr.Blocks(title="PQCache Studio") as demo:
        gr.Markdown(
            "# PQCache Studio\nAsk questions about a long document while attention reads only the tokens that "
            "product-quantization search picks, and see what the cache did.\n\n"
            f"Answering: **{studio.about['model']}**",
            elem_id="model-line",
        )
        with gr.Tab("Document Q&A"):
            listing, listed, loaded_on, notice = build_qa_tab(qa, methods)
        with gr.Tab("Teaching"):
            build_teaching_tab(teaching, methods)
        with gr.Tab("Cost model"):
            cost_outputs = build_cost_tab()
        # the page's opening work, one step after another; its end is marked on the page (body data-opened), so a
        # script driving the page (the browser tests) knows the fields it types into are not reset after that
        quiet = dict(api_name=False, show_progress="hidden")
        opening = demo.load(lambda: cost(*DEFAULT), None, cost_outputs, **quiet)
        opening = opening.then(qa.your_documents.shown_list, [listing], [listed], **quiet)
        opening = opening.then(qa.restarted, [loaded_on], [notice, loaded_on], **quiet)
        opening.then(None, None, None, js=OPENED_JS, **quiet)
        demo.unload(qa.end_user)  # a closed tab frees its caches
    return demo


OPENED_JS = "() => { document.body.dataset.opened = 'yes'; }"
QUEUE_POLL_S = 0.05  # how often a free queue looks for a new event


def queued(demo: gr.Blocks, concurrency: int) -> gr.Blocks:
    """The page's queue, polling every QUEUE_POLL_S instead of Gradio's millisecond: each poll wakes the event
    loop and takes the GIL from the decode thread, and on a two-core machine an idle server in the process made
    decode about 30% slower a token (docs/benchmarks.md, `bench app`). A click waits at most 50 ms more to start."""
    demo.queue(default_concurrency_limit=concurrency)
    queue = getattr(demo, "_queue", None)  # Gradio keeps its queue private; without it, its defaults stand
    if queue is not None and hasattr(queue, "sleep_when_free"):
        queue.sleep_when_free = max(queue.sleep_when_free, QUEUE_POLL_S)
        queue.progress_update_sleep_when_free = max(queue.progress_update_sleep_when_free, QUEUE_POLL_S)
    return demo
