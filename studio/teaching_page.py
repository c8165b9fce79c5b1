"""The Teaching tab's components and events (inside a gr.Blocks)."""

from __future__ import annotations

import gradio as gr

from studio.teaching import FACTS, SPOTLIGHT_COLORS, WALKTHROUGH, TeachingTab, missed_picture, question_line
from viz import teaching as pictures


def build_teaching_tab(tab: TeachingTab, methods: list[str]):
    model_work = tab.studio.model_work
    t_state = gr.State(None)
    gr.Markdown(
        "One prefill of a preset document (a town description, about 3,000 tokens) with three hidden facts; each "
        "method then answers the same question under the same token budget. The strip shows where each method's "
        "attention went (first full-attention layer, first generated token); the red line is the fact."
    )
    with gr.Row():
        t_methods = gr.CheckboxGroup(methods, value=["pqcache", "snapkv", "streaming", "oracle"], label="Methods")
        t_fact = gr.Dropdown(list(FACTS), value=list(FACTS)[0], label="Hidden fact")
        t_budget = gr.Slider(0.05, 0.5, value=0.1, step=0.05, label="token budget (fraction of the document)")
    t_question = gr.Markdown(question_line(list(FACTS)[0]), elem_id="teaching-question")
    t_run = gr.Button("Run side by side", variant="primary", elem_id="teaching-run")
    t_status = gr.Markdown(elem_id="teaching-status")
    t_table = gr.Dataframe(
        headers=["method", "answer", "right?", "tokens attended"], interactive=False, elem_id="teaching-table"
    )
    t_strip = gr.Plot(pictures.heat_strip({}, 1), label="token spotlight", show_label=False, elem_id="teaching-strip")
    t_pick = gr.Dropdown(methods, value="pqcache", label="Highlight the tokens this method attended to")
    t_text = gr.HighlightedText(
        label="Around the fact",
        combine_adjacent=True,
        show_legend=True,
        show_inline_category=False,
        color_map=SPOTLIGHT_COLORS,
        elem_id="teaching-spotlight",
    )
    gr.Markdown("### What the selection missed, and what the estimate put back")
    m_line = gr.Markdown(missed_picture(None)[0], elem_id="missed-line")
    m_plot = gr.Plot(label="attention output error", show_label=False, elem_id="missed-plot")
    gr.Markdown(
        "### Walkthrough of one decode step\nPQCache's first generated token, on the first full-attention layer."
    )
    w_step = gr.Radio(list(WALKTHROUGH), value=list(WALKTHROUGH)[0], label="Step", elem_id="walk-step")
    first = tab.walkthrough(list(WALKTHROUGH)[0], None)
    w_text = gr.Markdown(first[0], elem_id="walk-text")
    w_plot = gr.Plot(label="this step, from the run", show_label=False, elem_id="walk-plot")
    t_fact.change(question_line, [t_fact], [t_question], queue=False, show_progress="hidden", api_name=False)
    t_pick.change(tab.spotlight_text, [t_state, t_pick], [t_text], api_name=False, show_progress="hidden")
    w_step.change(tab.walkthrough, [w_step, t_state], [w_text, w_plot], api_name=False, show_progress="hidden")
    t_run.click(
        tab.run_teaching,
        [t_methods, t_fact, t_budget, w_step, t_state],
        [t_state, t_status, t_table, t_strip, t_text, w_text, w_plot, m_line, m_plot],
        show_progress_on=[t_status],
        api_name="run_teaching",
        **model_work,
    )
