"""The Document Q&A tab's components and events (inside a gr.Blocks): a how-to line, the document (file,
pasted text or *Try a sample*), settings, one status line, the chat, the live panels."""

from __future__ import annotations

import json
import os

import gradio as gr

from pqcache.serving.settings import ENCODINGS, LABELS, POLICIES, TOO_LONG, LoadSettings
from studio.common import ASSETS
from studio.panels import WINDOWS, placeholders
from studio.qa import QATab
from studio.qa_load import SAMPLE
from studio.sources import SCROLL_JS, VIEW_ID, document_view
from studio.status import NOTHING
from studio.your_documents import NONE_YET, browser_secret

HOW_TO = (
    "**How to use:** 1. attach a file or paste text (or press **Try a sample**); 2. press **Load document**: the "
    "document is read once{rate}; 3. ask a question. Answers stream with the passages they read (click one to see it "
    "in the document); the panels on the right show what the cache did."
)


def how_to() -> str:
    """The how-to line, with the rates `python -m pqcache bench app` measured on this machine when it has run here
    (none otherwise: a constant would be wrong on the next machine)."""
    import json

    from pqcache.serving.measured import figures_path

    try:
        rows = json.loads(figures_path().read_text())["rows"]
        row = min(rows, key=lambda r: abs(r["tokens"] - 8192))
    except (OSError, ValueError, KeyError):
        return HOW_TO.format(rate="")
    rate = (
        f" (`bench app` on this machine: {row['load_tok_s']:.0f} tokens/s at {row['tokens']:,} tokens, then answers at "
        f"{1000 / row['decode_ms']:.0f} tokens/s)"
    )
    return HOW_TO.format(rate=rate)


STARTING = "Loading: waiting for the model (requests before this one go first)..."
RULE = (
    "An attached file is loaded rather than pasted text (remove the file with its \u00d7 to load the text); "
    "the button says which."
)


def sample_examples(document: str = SAMPLE) -> list[dict]:
    """The example questions (and right answers) of a bundled document, from assets/examples.json."""
    try:
        with open(os.path.join(ASSETS, "examples.json"), encoding="utf-8") as f:
            examples = json.load(f)
    except (OSError, ValueError):
        return []
    for key, rows in examples.items():
        if os.path.basename(key) == document:
            return [r for r in rows if isinstance(r, dict) and r.get("question")]
    return []


def load_label(file, pasted):
    """The load button names what it will load."""
    if file:
        return gr.update(value=f"Load {os.path.basename(file)}")
    if pasted and pasted.strip():
        return gr.update(value="Load the pasted text")
    return gr.update(value="Load document")


def build_qa_tab(tab: QATab, methods: list[str]) -> tuple:
    d = LoadSettings()  # the form's defaults
    # outside any accordion: a closed one mounts its components only when opened, and the page reads the list at once
    listing = gr.BrowserState([], storage_key="pqcache-documents", secret=browser_secret())
    # the start of the server that holds this browser's document: a restart since is said when the page opens
    loaded_on = gr.BrowserState("", storage_key="pqcache-server", secret=browser_secret())
    gr.Markdown(how_to(), elem_id="how-to")
    with gr.Row():
        with gr.Column(scale=2):
            sample = gr.Button(f"Try a sample ({SAMPLE}, about 1,000 tokens)", elem_id="sample")
            # any file: the app reads .txt, .md, .pdf and other files of text (pqcache/serving/documents.py) and says
            # why it refuses another at Load (a file_types filter would drop a dropped .png without a word)
            file = gr.File(label="Document (.txt, .md, .pdf or other text)", type="filepath", height=120)
            pasted = gr.Textbox(label="...or paste text", lines=3, max_lines=8, elem_id="pasted")
            gr.Markdown(RULE, elem_id="source-rule")
            with gr.Accordion("Settings", open=False, elem_id="settings"):
                method = gr.Dropdown(methods, value=d.method, label="Method")
                with gr.Row():
                    m = gr.Number(d.m, label="m (sub-spaces; 0: from the head size)", precision=0)
                    bits = gr.Number(d.bits, label="bits (0: from the length)", precision=0)
                    budget = gr.Number(
                        d.budget, label=f"{LABELS['token_budget']} (a fraction like 0.1, or a count like 1024)"
                    )
                with gr.Row():
                    n_init = gr.Number(d.n_init, label=LABELS["n_init"], precision=0)
                    n_local = gr.Number(d.n_local, label=f"{LABELS['n_local']} (0: from the budget)", precision=0)
                with gr.Row():
                    policy = gr.Radio(list(POLICIES), value=d.policy, label=LABELS["cache_policy"])
                    capacity = gr.Number(d.capacity, label=LABELS["block_cache_tokens"], precision=0)
                max_new = gr.Slider(1, 256, value=48, step=1, label="max new tokens", elem_id="max-new")
                with gr.Row():
                    encoding = gr.Dropdown(
                        ENCODINGS, value=d.encoding, label="text encoding of the file", allow_custom_value=True
                    )
                    too_long = gr.Radio(TOO_LONG, value=d.too_long, label="a document longer than the model reads")
                with gr.Row():  # the selection sized by attention mass, and the rest estimated (engine/mass.py)
                    held = f"{LABELS['mass']} (0: the budget's top-k; 0.85: the fewest picks holding 85%)"
                    mass = gr.Number(d.mass, label=held)
                    completion = gr.Checkbox(d.completion, label=f"{LABELS['completion']} (from their PQ codes)")
            with gr.Row():
                load = gr.Button("Load document", variant="secondary", elem_id="load")
                unload = gr.Button("Unload", elem_id="unload")
            stored = tab.studio.store is not None  # with a store: the documents this browser loaded, to reopen
            with gr.Accordion("Your documents", open=False, elem_id="your-documents", visible=stored):
                listed = gr.Dropdown([], label="documents this browser loaded", info=NONE_YET, elem_id="listed")
                with gr.Row():
                    reopen = gr.Button("Open", size="sm", elem_id="reopen")
                    forget = gr.Button("Delete from the store", size="sm", variant="stop", elem_id="forget")
            status = gr.Markdown(NOTHING, elem_id="doc-status")
            chat = gr.Chatbot(label="Answers", height=300, elem_id="chat")
            question = gr.Textbox(label="Question", placeholder="Ask about the document", elem_id="question")
            examples = sample_examples()
            with gr.Column(visible=False, elem_id="sample-examples") as examples_box:
                answers = ", ".join(sorted({str(e.get("answer")) for e in examples if e.get("answer")}))
                gr.Examples(
                    [[e["question"]] for e in examples] or [["What is the pass key?"]],
                    inputs=[question],
                    label=f"Questions about the sample (click one, then Ask; the right answer: {answers or '68422'})",
                )
            with gr.Row():
                ask_btn = gr.Button("Ask", variant="primary", elem_id="ask")
                stop_btn = gr.Button("Stop", variant="stop", elem_id="stop")
            with gr.Row():  # follow-ups see the earlier turns until a new conversation (studio/conversing.py)
                new_talk = gr.Button("New conversation", size="sm", elem_id="new-conversation")
                add_doc = gr.Button(
                    "Add the attached file (or pasted text) to the conversation", size="sm", elem_id="add-document"
                )
            gen_status = gr.Markdown("", elem_id="gen-status")
            sources = gr.Radio(
                [],
                type="index",
                label="Sources of the last answer: click one to see it in the document",
                visible=False,
                elem_id="sources",
            )
            show_missed = gr.Checkbox(
                False,
                label="also mark the exact top-k tokens the search missed (PQCache; sampled steps)",
                elem_id="show-missed",
            )
            doc_view = gr.HTML(document_view("", {}, None), elem_id=VIEW_ID)
        with gr.Column(scale=3):
            with gr.Row():
                layer = gr.Dropdown(
                    [],
                    label="Layer (power law)",
                    info="the full-attention layers, once a document is loaded",
                    allow_custom_value=True,
                    elem_id="layer",
                )
                window = gr.Radio(list(WINDOWS), value="last 5 s", label="Timeline", elem_id="timeline-window")
            empty = placeholders(tab.panels.device)
            with gr.Row():
                p_power = gr.Plot(empty[0], label="attention power law", show_label=False, elem_id="panel-power")
                p_recall = gr.Plot(empty[1], label="recall", show_label=False, elem_id="panel-recall")
            with gr.Row():
                p_hits = gr.Plot(empty[2], label="block-cache hit rate", show_label=False, elem_id="panel-hits")
                p_memory = gr.Plot(empty[4], label="memory per tier", show_label=False, elem_id="panel-memory")
            p_timeline = gr.Plot(empty[3], label="timeline", show_label=False, elem_id="panel-timeline")
    plots = [p_power, p_recall, p_hits, p_timeline, p_memory]
    model_work = tab.studio.model_work
    settings = [method, m, bits, budget, n_init, n_local, policy, capacity, encoding, too_long, mass, completion]
    shown = [status, layer, *plots]
    one_progress = dict(show_progress="minimal", show_progress_on=[status])  # the status line is the progress
    for button in (load, sample):  # at once, in the browser: the status line says the load has begun
        button.click(None, None, [status], js=f"() => {json.dumps(STARTING)}", queue=False, api_name=False)
    remembered = dict(fn=tab.your_documents.remember, inputs=[listing], outputs=[listing, listed], api_name=False)
    # the sample's example questions belong to the sample: shown while it is the active document
    examples_shown = dict(fn=tab.loader.examples_shown, outputs=[examples_box], api_name=False, show_progress="hidden")
    kept_where = dict(fn=tab.loaded_here, outputs=[loaded_on], api_name=False, show_progress="hidden")

    def after_load(event):
        """Every load is followed by the sample's questions shown or hidden, this server's start kept in the
        browser (a restart since is said when the page opens), and the document listed under Your documents."""
        event.then(**examples_shown).then(**kept_where).then(**remembered)

    loading = dict(outputs=shown, **one_progress, **model_work)
    after_load(load.click(tab.loader.load_document, [file, pasted, *settings], api_name="load_document", **loading))
    after_load(sample.click(tab.loader.load_sample, settings, api_name="load_sample", **loading))
    reopened = reopen.click(
        tab.your_documents.reopen, [listed, listing, *settings], api_name="reopen_document", **loading
    )
    after_load(
        reopened.then(tab.your_documents.resumed, [listed, method], [chat, gen_status], api_name=False, **model_work)
    )
    forget.click(
        tab.your_documents.forget,
        [listed, listing],
        [listing, listed],
        api_name="delete_document",
        concurrency_limit=None,
    )
    for trigger in (file.change, pasted.change):
        trigger(load_label, [file, pasted], [load], queue=False, show_progress="hidden", api_name=False)
    asking = [question, chat, method, max_new, layer]
    # the chat shows a queued question's place ("queue: 1/2") in its corner, then the elapsed time
    answer = dict(show_progress="minimal", show_progress_on=[chat], **model_work)
    for trigger, api in ((ask_btn.click, "ask"), (question.submit, False)):
        trigger(tab.answers.ask, asking, [chat, gen_status, *plots, question, sources], api_name=api, **answer)
    # a source clicked: the document view, scrolled to it in the browser once drawn (no model slot needed)
    for control, api in ((sources.input, "show_source"), (show_missed.input, False)):
        shown_in_view = control(
            tab.answers.show_source,
            [sources, show_missed],
            [doc_view],
            api_name=api,
            concurrency_limit=None,
            show_progress="hidden",
        )
        shown_in_view.then(None, None, None, js=SCROLL_JS, api_name=False)
    # Stop needs no model slot (concurrency_limit=None): it is never stuck behind a load or an answer; its reply
    # goes to a hidden box (the load or the answer says "stopping" on the page)
    stopped = gr.Markdown(visible=False, elem_id="stop-reply")
    stop_btn.click(
        tab.stop_generation, None, [stopped], api_name="stop", concurrency_limit=None, show_progress="hidden"
    )
    unload.click(tab.unload_document, None, shown, api_name="unload_document", concurrency_limit=None).then(
        **examples_shown
    )
    new_talk.click(
        tab.conversation.new_conversation, None, [chat, gen_status], api_name="new_conversation", **model_work
    )
    add_doc.click(
        tab.conversation.add_to_conversation,
        [file, pasted, encoding, method],
        [status, gen_status],
        api_name="add_document",
        **one_progress,
        **model_work,
    )
    for control in (layer, window):
        control.change(
            tab.refresh_panels, [layer, window], plots, api_name=False, concurrency_limit=None, show_progress="hidden"
        )
    server = gr.Markdown(tab.server_line(), elem_id="server-status")
    timer = gr.Timer(5.0)
    # the timer never writes the status line itself (its request would flash on it every 5 s): a notice lands in
    # a hidden box, whose change (only when the server freed this user's document, or restarted since the page's
    # load: studio/ui.py) updates the line
    notice = gr.Markdown(visible=False, elem_id="notice")
    timer.tick(tab.server_notice, None, [notice], api_name="notice", concurrency_limit=None, show_progress="hidden")
    notice.change(lambda line: line, [notice], [status], api_name=False, queue=False, show_progress="hidden")
    timer.tick(tab.server_line, None, [server], api_name=False, concurrency_limit=None, show_progress="hidden")
    gr.api(tab.server_status, api_name="server_status", concurrency_limit=None)
    return listing, listed, loaded_on, notice  # read when the page opens (studio/ui.py)
