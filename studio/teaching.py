"""Teaching: one prefill of a preset document with three hidden facts, several methods answering the same
question side by side under the same budget (with the right answer on screen), a token spotlight, and a
five-step walkthrough of one PQCache decode step, each step with its own picture from this run
(pqcache/serving/walkthrough.py records it, viz/teaching.py draws it). The run happens where the model is
(pqcache/serving/teaching.py, through the documents service); the page is in studio/teaching_page.py."""

from __future__ import annotations

import os

import gradio as gr

from pqcache.serving.service import TeachingCase
from studio.common import ASSETS, describe, user_of
from studio.state import Studio
from viz import studies
from viz import teaching as pictures

TEACHING_DOC = os.path.join(ASSETS, "teaching_doc.txt")
# hidden fact (as written in the document) -> the question asked, and the right answer
FACTS = {
    "the code to open the blue door": ("What is the code to open the blue door?", "4721"),
    "the treasure is buried under": ("Where is the treasure buried?", "the third oak tree"),
    "the captain's cat is named": ("What is the name of the captain's cat?", "Pepper"),
}
SPOTLIGHT_COLORS = {"attended": "#F5A623", "the fact": "#9ecae1", "the fact, attended": "#E45756"}


def question_line(fact: str) -> str:
    question, answer = FACTS[fact]
    return f"**Question asked:** {question} &nbsp; **Right answer:** {answer}"


class TeachingTab:
    """The teaching tab's handlers; the run happens where the model is (the documents service: this process's
    worker, or a Ray replica), its preset document in the user's "teaching" slot there."""

    def __init__(self, studio: Studio, document: str = TEACHING_DOC):
        self.studio = studio
        self.documents = studio.documents
        self.document = document

    def run_teaching(self, methods, fact, budget, step, state, request: gr.Request, progress=gr.Progress()):
        """One prefill of the preset document, then each method answers the same question; PQCache's answer is
        recorded for the walkthrough. Returns the state, status, table, strip, spotlight and the walkthrough."""
        nothing = (state, [], pictures.heat_strip({}, 1), [], *self.walkthrough(step, state), *missed_picture(None))
        if not methods:
            return nothing[0], "Pick at least one method.", *nothing[1:]
        with open(self.document, encoding="utf-8") as f:
            case = TeachingCase(f.read(), fact, *FACTS[fact])
        user = user_of(request)
        with self.documents.use(user):
            try:
                said = lambda fraction, words: progress(fraction, desc=words)  # noqa: E731
                state = self.documents.teach(user, case, list(methods), budget, said)
            except Exception as exc:  # the page stays as it was
                return nothing[0], f"**Error:** {describe(exc)}", *nothing[1:]
        marks = [state["fact_pos"]] if state["fact_pos"] is not None else []
        return (
            state,
            f"Prefilled {state['n_tokens']} tokens once; the fact starts at token {state['fact_pos']}. Each method "
            "then answered on its own copy of that cache.",
            state["rows"],
            pictures.heat_strip(state["selections"], state["n_tokens"], marks),
            self.spotlight_text(state, methods[0]),
            *self.walkthrough(step, state),
            *missed_picture(state),
        )

    def spotlight_text(self, state, method):
        """The document tokens around the fact: the fact's own tokens and those `method` attended at its first
        step, marked by colour (the legend names them; no tag on every token)."""
        if not state or method not in state.get("selections", {}):
            return []
        chosen = set(state["selections"][method])
        lo_f, hi_f = state.get("fact_span") or [state["fact_pos"] or 0] * 2
        first, texts = state["spotlight"]

        def kind(p):
            in_fact = lo_f <= p < (hi_f or lo_f)
            if p in chosen:
                return "the fact, attended" if in_fact else "attended"
            return "the fact" if in_fact else None

        return whole_words([(text, kind(first + i)) for i, text in enumerate(texts)])

    def walkthrough(self, step, state, request: gr.Request | None = None):
        """One step of the walkthrough: what it does, with numbers and a picture from this run (no model work)."""
        intro, detail, draw = WALKTHROUGH[step]
        walk = (state or {}).get("walk")
        if walk is None:
            return f"**{step}.** {intro}\n\n*Press Run side by side: the picture comes from that run.*", None
        return f"**{step}.** {intro} {detail.format(**step_numbers(walk, state))}", draw(walk, state)


def missed_picture(state) -> tuple:
    """(the line, the figure) of what the selection missed and what the estimate put back: the attention output's
    error against full attention's per method and budget (the run's "fidelity" rows), and in words at the run's
    budget."""
    rows = [r for r in (state or {}).get("fidelity", []) if r.get("error") is None]
    if not rows:
        return "*Press Run side by side: the picture comes from that run.*", studies.fidelity_curve([])
    budget = max(r["budget"] for r in rows)

    def mean(method, field):
        xs = [r[field] for r in rows if r["method"] == method and r["budget"] == budget and r.get(field) is not None]
        return sum(xs) / len(xs) if xs else float("nan")

    line = (
        f"At this run's budget ({budget:g}), PQCache's selection held **{100 * mean('pqcache', 'mass'):.0f}%** of "
        f"full attention's weight; its output was **{mean('pqcache', 'rel_error'):.3f}** away from full attention's "
        f"(Oracle, the exact top-k: {mean('oracle', 'rel_error'):.3f}). With the tokens it did not read estimated "
        f"from their PQ codes and put back, **{mean('pqcache+completion', 'rel_error'):.3f}**. The lower budgets show "
        "where the estimate matters most (the document's last tokens replayed as decode steps, every full-attention "
        "layer)."
    )
    return line, studies.fidelity_curve(rows)


def step_numbers(w: dict, state: dict) -> dict:
    """This run's numbers for the steps' explanations."""
    f, a = w["fetch"], w["attention"]
    weights = sorted(a["weight"], reverse=True)
    return {
        **{k: v for k, v in w.items() if not isinstance(v, (dict, list))},
        "D": w["m"] * w["d"],
        "cells": w["m"] * w["C"],
        "hits": sum(f["hits"]),
        "misses": sum(f["misses"]),
        "held": sum(f["held"]),
        "n_window": w["window"][1] - w["window"][0],
        "n_att": len(a["pos"]),  # the new token among them, as the instrumentation counts a step's attended tokens
        "n_total": w["n_tokens"] + 1,
        "share": 100 * len(a["pos"]) / (w["n_tokens"] + 1),
        "top10": 100 * sum(weights[:10]),
        "wide_rule": wide_rule(w),
        "label": next(iter(state.get("labels", {}).values()), "the first answer token"),
        "score": (w.get("focus") or {}).get("score", float("nan")),
    }


SPOTLIGHT_ORDER = (None, "the fact", "attended", "the fact, attended")  # a word takes its strongest token's colour


def whole_words(pieces: list[tuple[str, str | None]]) -> list[tuple[str, str | None]]:
    """(token text, kind) pieces joined into whole words, each coloured as its strongest token: a word split into
    tokens of two colours would otherwise be two spans, and the page may break the line between them ("s / hallow")."""
    words: list[list] = []
    for text, kind in pieces:
        if words and text and not text[0].isspace():
            word = words[-1]
            word[0] += text
            word[1] = max(word[1], kind, key=SPOTLIGHT_ORDER.index)
        else:
            words.append([text, kind])
    return [(text, kind) for text, kind in words]


def wide_rule(w: dict) -> str:
    """How the PQ stage's count came about (pqcache.engine.methods.pqcache.first_stage_count), in its numbers."""
    times = w["rerank"] * w["k"]
    rule = f"rerank x k = {w['rerank']} x {w['k']} = {times}"
    if w["n_wide"] > times:
        rule += f", raised to the floor of {w['rerank_min']} tokens"
    if w["n_wide"] < max(times, w["rerank_min"] if w["rerank"] > 1 else 0):
        rule += f", cut to the {w['n_wide']} candidates there are"
    if w.get("margin"):
        rule += (
            f"; each PQ score raised by {w['margin']:g} x its spread, from how far its key is from its codes, so "
            "that the keys the codes describe worst get their chance"
        )
    return rule


# step -> (what it does, this run's numbers, its picture)
WALKTHROUGH = {
    "1. Prefill and PQ build": (
        "The prefill computes exact attention over the whole document and copies each full-attention layer's keys "
        "and values to host memory. Meanwhile a background thread clusters each layer's keys (faiss K-Means): a "
        "key is cut into m sub-spaces, each with 2^bits centroids, and a token is kept as m one-byte codes, the "
        "numbers of its nearest centroids.",
        "Here, layer {layer}: keys of {D} numbers, m = {m} sub-spaces of {d}, 2^{bits} = {C} centroids each, "
        "{n_tokens} tokens coded. The picture: one sub-space's centroids and the sub-keys of the fact's tokens, "
        "each joined to the centroid its code names (the number after the arrow).",
        lambda w, s: pictures.codebook(w, s.get("labels")),
    ),
    "2. Lookup table": (
        "For a new token, its query is cut the same way and multiplied with every centroid once: a small table. "
        "A document token's approximate score is the sum of the m entries its codes name; no key is read.",
        "Here the table has {m} x {C} = {cells} entries (the first of the {group} query heads sharing KV head "
        "{kv_head}). Boxed: the cells of {label}, approximate score {score:.3f}.",
        lambda w, s: pictures.lookup_table(w, next(iter(s.get("labels", {}).values()), "")),
    ),
    "3. Search": (
        "The approximate scores pick the best candidates; their exact scores, computed where the keys live (host "
        "memory: only the query goes there, only positions and their scores come back), keep the top k.",
        "Here PQ kept the {n_wide} best of the candidates ({wide_rule}; right of the orange line) and the exact "
        "re-rank kept k = {k} (above the red line).",
        lambda w, s: pictures.search(w),
    ),
    "4. Fetch": (
        "Only the top-k tokens' values travel to the device (the re-rank already scored their keys); blocks used "
        "often stay in a device block cache. The sinks and the recent window are on the device all along.",
        "Here: {hits} top-k tokens came from the device block cache, {misses} from host memory; {held} sink "
        "and window tokens were already there.",
        lambda w, s: pictures.fetch(w),
    ),
    "5. Attention": (
        "Attention runs over the attended tokens only: sinks + top-k + recent window + the new token. A few tokens "
        "carry most of the weight, which is why reading so few works.",
        "Here {n_att} of {n_total} tokens, the new one included ({share:.0f} %; the results table counts the same: "
        "KV head {kv_head} of layer {layer}, at the step that read the first answer token); the 10 heaviest carry "
        "{top10:.0f} % of the weight. Red: the answer's place in the document.",
        lambda w, s: pictures.attention(w, s.get("answer_pos")),
    ),
}
