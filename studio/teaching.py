"""Teaching: one prefill of a preset document with three hidden facts, several methods answering side by
side under the same budget, a token spotlight, and a five-step walkthrough of one decode step."""

from __future__ import annotations

import os

import gradio as gr

from pqcache import Instrumentation, PQCacheConfig, PQCacheError
from pqcache.serving.session import DocumentSession
from pqcache.serving.settings import number
from studio.common import describe, merged_data, user_of
from studio.state import Studio
from viz import figures

ASSETS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets")
TEACHING_DOC = os.path.join(ASSETS, "teaching_doc.txt")
TEACHING_FACTS = {
    "the code to open the blue door": "What is the code to open the blue door? The code is",
    "the treasure is buried under": "Where is the treasure buried? The treasure is buried under",
    "the captain's cat is named": "What is the name of the captain's cat? The cat is named",
}
WALKTHROUGH = {
    "1. Prefill": (
        "Every layer computes exact attention over the whole document. Each full-attention layer's K/V "
        "is copied to host memory as soon as the layer is done.",
        "timeline",
    ),
    "2. PQ build": (
        "While later layers compute, a background worker clusters each layer's keys: m sub-spaces, "
        "2^bits centroids each (faiss K-Means). Orange bars overlap blue ones: the clustering hides "
        "behind compute.",
        "timeline",
    ),
    "3. Search": (
        "For a new token, q . centroids gives a small table; every document token's approximate score is "
        "a sum of table entries picked by its uint8 codes; the top-k are the candidates.",
        "recall",
    ),
    "4. Fetch": (
        "Only the top-k tokens' K/V come back from host memory, hot blocks straight from the device block cache.",
        "hit_rate",
    ),
    "5. Attention": (
        "Attention runs over sinks + top-k + the recent window. Attention scores follow a power law: "
        "a few tokens carry most of the mass, which is why this works.",
        "power_law",
    ),
}
FIGURES = {
    "timeline": figures.timeline,
    "recall": figures.recall,
    "hit_rate": figures.hit_rate,
    "power_law": figures.power_law,
}


class TeachingTab:
    """The teaching tab's handlers; the preset document lives in the pool's "teaching" slot."""

    def __init__(self, studio: Studio, document: str = TEACHING_DOC):
        self.studio = studio
        self.pool = studio.pool
        self.document = document

    def run_teaching(self, methods, fact, budget, state, request: gr.Request, progress=gr.Progress()):
        """One prefill of the preset document, then each method answers the same question."""
        if not methods:
            return state, "Pick at least one method.", [], figures.heat_strip({}, 1), []
        with open(self.document, encoding="utf-8") as f:
            text = f.read()
        user, studio = user_of(request), self.studio
        with self.pool.use(user):
            try:
                config = PQCacheConfig(token_budget=number(budget, "token budget"), pq_timeout_s=studio.pq_timeout_s)
                session = DocumentSession(studio.model, studio.tokenizer, config, method="pqcache")
                session.load(
                    text,
                    progress=lambda f, msg: progress(0.5 * f, desc=msg),
                    reserve=lambda n: self.pool.reserve(user, "teaching", n),
                )
            except Exception as exc:
                self.pool.unreserve(user, "teaching")
                return state, f"**Error:** {describe(exc)}", [], figures.heat_strip({}, 1), []
            self.pool.store(user, "teaching", session)
            try:
                return self.teaching_answers(session, text, methods, fact, progress)
            except Exception as exc:  # the document stays loaded; the page stays as it was
                return state, f"**Error:** {describe(exc)}", [], figures.heat_strip({}, 1), []

    def teaching_answers(self, session, text, methods, fact, progress):
        tok = self.studio.tokenizer
        char = text.lower().find(fact)
        fact_pos = len(tok(text[:char]).input_ids) if char >= 0 else None
        rows, selections = [], {}
        for i, method in enumerate(methods):
            progress(0.5 + 0.5 * i / len(methods), desc=f"{method} answering")
            obs = Instrumentation(timeline=False, selections=True)
            answer = session.ask(TEACHING_FACTS[fact], method=method, max_new_tokens=8, observer=obs)
            layer0 = min((r["layer"] for r in obs.selected), default=None)
            steps = [r for r in obs.selected if r["layer"] == layer0]
            # the step that reads the first generated token: the question before it may read the whole document
            # (PQCacheConfig.chunk_attention="exact"), every step from here on is the method's own selection
            first = steps[1] if len(steps) > 1 else steps[0] if steps else None
            positions = sorted({p for head in first["positions"][0] for p in head}) if first else []
            selections[method] = [p for p in positions if p < session.n_tokens]
            rows.append([method, answer.text.strip(), len(selections[method])])
        # the page keeps what it shows, not the session: the pool alone holds (and may free) the cache
        state = {"doc_ids": list(session.doc_ids), "selections": selections, "fact_pos": fact_pos}
        marks = [fact_pos] if fact_pos is not None else []
        return (
            state,
            f"Prefilled {session.n_tokens} tokens once; the fact starts at token {fact_pos}.",
            rows,
            figures.heat_strip(selections, session.n_tokens, marks),
            self.spotlight_text(state, methods[0]),
        )

    def spotlight_text(self, state, method):
        """The document tokens around the fact, marked where `method` attended at its first step."""
        if not state or method not in state.get("selections", {}):
            return []
        doc_ids, chosen = state["doc_ids"], set(state["selections"][method])
        fact = state["fact_pos"] or 0
        lo, hi = max(0, fact - 60), min(len(doc_ids), fact + 60)
        tok = self.studio.tokenizer
        return [(tok.decode([doc_ids[p]]), "attended" if p in chosen else None) for p in range(lo, hi)]

    def walkthrough(self, step, state, request: gr.Request):
        """One step of the walkthrough, its picture from this user's teaching run (a short answer of PQCache on
        the preset document for the search, fetch and attention steps)."""
        text, fig = WALKTHROUGH[step]
        user = user_of(request)
        with self.pool.use(user):  # busy: the pool will not evict the document while the model works
            try:
                session = self.pool.session(user, "teaching")
            except PQCacheError:  # the server freed it (memory cap or idle time)
                session = None
            if session is None and state:
                return f"**{step}.** {text}\n\nRun the methods again: the server unloaded this document.", None
            data = merged_data(session, None) if session else {}
            if session is not None and fig != "timeline":
                obs = Instrumentation(timeline=True, attention_every=1, recall_every=1)
                try:
                    session.ask(next(iter(TEACHING_FACTS.values())), method="pqcache", max_new_tokens=3, observer=obs)
                except Exception as exc:  # the page says what happened; the document stays loaded
                    return f"**{step}.** **Error:** {describe(exc)}", None
                data = merged_data(session, obs)
        return f"**{step}.** {text}", FIGURES[fig](data)


def build_teaching_tab(tab: TeachingTab, methods: list[str]):
    """The Teaching tab's components and events (inside a gr.Blocks)."""
    model_work = tab.studio.model_work
    t_state = gr.State(None)
    gr.Markdown(
        "One prefill of a preset document with three hidden facts; each method answers the same "
        "question under the same budget. The strip shows where each method's attention went "
        "(first full-attention layer, first generated token); the red line is the fact."
    )
    with gr.Row():
        t_methods = gr.CheckboxGroup(methods, value=["pqcache", "snapkv", "streaming", "oracle"], label="Methods")
        t_fact = gr.Dropdown(list(TEACHING_FACTS), value=list(TEACHING_FACTS)[0], label="Hidden fact")
        t_budget = gr.Slider(0.05, 0.5, value=0.1, step=0.05, label="token budget")
    t_run = gr.Button("Run side by side", variant="primary")
    t_status = gr.Markdown()
    t_table = gr.Dataframe(headers=["method", "answer", "tokens attended"], interactive=False, elem_id="teaching-table")
    t_strip = gr.Plot(elem_id="teaching-strip")
    t_pick = gr.Dropdown(methods, value="pqcache", label="Highlight the tokens this method attended to")
    t_text = gr.HighlightedText(label="Around the fact", combine_adjacent=True)
    t_pick.change(tab.spotlight_text, [t_state, t_pick], [t_text])
    gr.Markdown("### Walkthrough of one decode step")
    w_step = gr.Radio(list(WALKTHROUGH), value="1. Prefill", label="Step")
    w_text = gr.Markdown()
    w_plot = gr.Plot()
    w_step.change(tab.walkthrough, [w_step, t_state], [w_text, w_plot], **model_work)
    t_run.click(
        tab.run_teaching,
        [t_methods, t_fact, t_budget, t_state],
        [t_state, t_status, t_table, t_strip, t_text],
        **model_work,
    ).then(tab.walkthrough, [w_step, t_state], [w_text, w_plot], **model_work)
