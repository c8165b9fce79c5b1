"""The Teaching tab's run, where the model is (the documents service: serving/worker.py in one process, a Ray
replica with --ray): one prefill of a document holding a fact, several methods answering the same question about
it on copies of that cache, PQCache's first answer step recorded for the walkthrough (serving/walkthrough.py).

`lesson(session, case, methods, progress)` returns plain data (lists, numbers, strings) for the page to show and
keep: the page needs no model and no tokenizer (the spotlight's token texts come with it).
"""

from __future__ import annotations

from pqcache import Instrumentation
from pqcache.serving.fidelity import cache_fidelity
from pqcache.serving.prompt import PromptBuilder, has_chat_template
from pqcache.serving.service import TeachingCase
from pqcache.serving.walkthrough import StepRecorder

SPOTLIGHT_BEFORE, SPOTLIGHT_AFTER = 50, 40  # tokens shown around the fact
PICTURE_METHODS = ("oracle", "pqcache", "pqcache+completion")  # what_was_missed's settings (serving/fidelity.py)
PICTURE_BUDGETS = (0.02, 0.005)  # ...and its budgets below the run's


def lesson(session, case: TeachingCase, methods: list[str], progress) -> dict:
    """Each method answers `case.question` on the loaded `session` (the document); the table's rows, each method's
    attended positions at the first answer step, the walkthrough's data and the spotlight's token texts.
    progress(fraction, words) from 0 to 1."""
    tok = session.tokenizer
    fact_pos, answer_pos, end_pos = positions(tok, case)
    answer_pos = first_answer_token(tok, session.doc_ids, answer_pos, case.answer)
    rows, selections, recorder = [], {}, StepRecorder()
    # a base model fills the answer slot ("4721."); an instruct model says a sentence ("The code to open the
    # blue door is 4721."), and ends it with its end-of-turn token
    tokens = 16 if has_chat_template(tok) else 8
    for i, method in enumerate(methods):
        progress(i / len(methods), f"{method} answering")
        obs = Instrumentation(timeline=False, selections=True)
        # PQCache's answer is also the walkthrough's run: the recorder is PQCache, it only reads
        answer = session.ask(
            case.question, method=recorder if method == "pqcache" else method, max_new_tokens=tokens, observer=obs
        )
        first = first_answer_step(obs.selected)
        positions_seen = sorted({p for head in first["positions"][0] for p in head}) if first else []
        selections[method] = [p for p in positions_seen if p < session.n_tokens]  # the spotlight: every KV head's
        correct = "yes" if case.answer.lower() in answer.text.lower() else "no"
        shown = answer.text.strip().split("\n")[0]  # the answer's line (a cut-off next frame is not shown)
        # the one count of attended tokens the tab gives: KV head 0 at that step, as the walkthrough's step 5
        rows.append([method, shown, correct, len(first["positions"][0][0]) if first else 0])
    if recorder.snap is None:  # PQCache was not among the methods: a short answer of its own for the walkthrough
        progress(0.95, "recording a PQCache step for the walkthrough")
        session.ask(case.question, method=recorder, max_new_tokens=2)
    # the answer's tokens first (the lookup table boxes the first), then the words before it in the fact
    focus = []
    if answer_pos is not None:
        ahead = range(answer_pos, min(end_pos or answer_pos + 4, answer_pos + 4))
        focus = [*ahead, *range(max(fact_pos, answer_pos - 4), answer_pos)]
    doc_ids = session.doc_ids
    around = fact_pos or 0
    lo, hi = max(0, around - SPOTLIGHT_BEFORE), min(len(doc_ids), (end_pos or around) + SPOTLIGHT_AFTER)
    progress(0.97, "measuring what the selection missed")
    return {
        "fidelity": what_was_missed(session),
        "n_tokens": session.n_tokens,
        "selections": selections,
        "fact_pos": fact_pos,
        "fact_span": [fact_pos, end_pos] if fact_pos is not None else None,
        "answer_pos": answer_pos,
        "rows": rows,
        "walk": recorder.describe(focus),
        "labels": {p: repr(tok.decode([doc_ids[p]])) for p in focus if p < len(doc_ids)},
        "spotlight": [lo, [tok.decode([doc_ids[p]]) for p in range(lo, hi)]],  # the first position, each text
    }


def what_was_missed(session) -> list[dict]:
    """The picture of what the selection missed and what the estimate put back: on the document's own keys, values
    and last queries (serving/fidelity.py), per layer, the attention output's error against full attention's for
    Oracle, PQCache and PQCache with completion, at the run's budget and two smaller ones."""
    budget = session.config.token_budget
    budgets = [budget, *(b for b in PICTURE_BUDGETS if b < budget)]
    return cache_fidelity(session.cache, budgets, PICTURE_METHODS, n_queries=4, iters=20, config=session.config)


def first_answer_step(selected: list[dict]) -> dict | None:
    """The first layer's record of the step that reads the first generated token: the question before it may read
    the whole document (PQCacheConfig.chunk_attention="exact"); every step from there on is the method's own."""
    layer0 = min((r["layer"] for r in selected), default=None)
    steps = [r for r in selected if r["layer"] == layer0]
    return steps[1] if len(steps) > 1 else steps[0] if steps else None


def positions(tok, case: TeachingCase) -> tuple[int | None, int | None, int | None]:
    """Token positions of the fact's start, of its answer, and of the end of its sentence."""
    text, low = case.text, case.text.lower()
    char = low.find(case.fact)
    if char < 0:
        return None, None, None
    answer_char = low.find(case.answer.lower(), char)
    end_char = low.find(".", answer_char if answer_char >= 0 else char)

    def at(c):
        return PromptBuilder(tok).document_ids(text[:c]).shape[1] if c >= 0 else None  # as the session caches

    return at(char), at(answer_char), at(end_char + 1 if end_char >= 0 else -1)


def first_answer_token(tok, ids: list[int], pos: int | None, answer: str) -> int | None:
    """The position of the answer's first token: the token before may hold its start (" 4"), a blank token before
    it is skipped."""
    if pos is None:
        return None
    before = tok.decode([ids[pos - 1]]).strip().lower() if 0 < pos <= len(ids) else ""
    if before and answer.lower().startswith(before):
        pos -= 1
    while pos < len(ids) - 1 and not tok.decode([ids[pos]]).strip():
        pos += 1
    return pos
