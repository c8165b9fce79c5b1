"""SCBench's shared-context evaluation (Li et al., "SCBench: a KV cache-centric analysis of long-context methods";
data layout and scoring as in microsoft/MInference scbench/): one context, several turns, in two modes.

A case is one JSON line ``{"id", "context", "multi_turns": [{"input", "answer"}], "task"?}``, `answer` a string or a
list of accepted strings (vt: the variables, every one of which must be named).

  multi-turn     turn t sees the context, every earlier turn's input and its golden answer, then its own input
                 (a Conversation: each turn answered on a fork of it, then the golden turn kept in it)
  multi-request  every turn sees the context alone (each question on a fork of the document)
  added-document the context arrives mid-conversation: a conversation over the set's previous case's context (its
                 first turn kept with its golden answer) reads this context with `add_document` (a K-Means codebook
                 of its own), then each turn is asked on a fork of that; the multi-request rows of the same case,
                 loaded alone, are made beside them (the comparison the mode is for)

The context is read once per case (DocumentSession.load, with the prefill queries SnapKV and its kin start from);
every method answers on forks of it. The prompt is the project's (pqcache/serving/prompt.py: the document, then
each turn as a question). Scores: string match (kv, passkey, prefix_suffix, and the project's real-document
questions: any accepted answer in the prediction, case-insensitive), all-variables match (vt).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from pqcache.eval.case_formats import CaseError

MODES = ("multi-turn", "multi-request")
BOTH = "both"  # the two modes on one read of the context
ADDED = "added-document"  # the context added to a conversation over another one, beside multi-request
MAX_NEW_TOKENS = {"kv": 24, "passkey": 12, "vt": 30, "prefix_suffix": 24}  # SCBench's are longer: 150, 15, 30, 150
DEFAULT_MAX_NEW = 32


def load_cases(path: str | Path) -> list[dict]:
    """SCBench's JSONL -> cases (CaseError names the line and what is wrong)."""
    cases = []
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            case = json.loads(line)
        except json.JSONDecodeError:
            raise CaseError(f"{path}:{n}: not JSON") from None
        turns = case.get("multi_turns") if isinstance(case, dict) else None
        if not isinstance(case, dict) or "context" not in case or not isinstance(turns, list) or not turns:
            raise CaseError(f"{path}:{n}: an SCBench case needs context and a non-empty multi_turns list")
        for t, turn in enumerate(turns):
            if not isinstance(turn, dict) or not isinstance(turn.get("input"), str) or "answer" not in turn:
                raise CaseError(f"{path}:{n}: turn {t} needs an input string and an answer")
        cases.append({"id": str(case.get("id", n)), "task": case.get("task", "scbench"), **case})
    return cases


def accepted(answer) -> list[str]:
    return [answer] if isinstance(answer, str) else [str(a) for a in answer]


def score(task: str, prediction: str, answer) -> float:
    """SCBench's per-task rule: vt names every variable; the others contain an accepted answer."""
    said = prediction.lower()
    if answer and all(isinstance(a, list) for a in answer):  # groups (real documents): one of each group
        return float(all(score(task, prediction, group) for group in answer))
    if task == "vt":
        names = accepted(answer)
        return float(all(name.lower() in said for name in names)) if names else 0.0
    return float(any(a.lower() in said for a in accepted(answer) if a))


def golden(answer) -> str:
    """The golden answer a multi-turn conversation keeps: the string, the accepted answers joined (vt: the
    variables), or each group's first (real documents)."""
    if isinstance(answer, str):
        return answer
    return ", ".join(a[0] if isinstance(a, list) else str(a) for a in answer)


def run_case(
    model,
    tokenizer,
    case: dict,
    methods: list[str],
    config,
    mode: str,
    max_new_tokens=None,
    first: dict | None = None,
    store=None,
    truncate: str = "refuse",
) -> list[dict]:
    """Every method on every turn of `case`, in `mode` (or both, on one read of the context; added-document: the
    case `first` is the conversation it is added to) -> rows {id, task, turn, method, mode, score, answer,
    prediction, tokens, seconds, context_tokens}. store: a DocumentStore each context is read from or saved to.
    truncate: a context longer than the model reads raises DocumentTooLongError ("refuse") or is cut ("middle")."""
    from pqcache.serving.conversation import Conversation
    from pqcache.serving.session import DocumentSession

    if mode not in (*MODES, BOTH, ADDED):
        raise ValueError(f"--scbench-mode must be one of {', '.join(MODES)}, {BOTH} or {ADDED}, got {mode!r}")
    if mode == ADDED:
        if first is None:
            raise ValueError(f"{ADDED} needs another case to add this one to")
        alone = run_case(
            model, tokenizer, case, methods, config, MODES[1], max_new_tokens, store=store, truncate=truncate
        )
        return alone + _added(model, tokenizer, case, first, methods, config, max_new_tokens, store, truncate)
    session = DocumentSession(model, tokenizer, config, method=methods[0], keep_queries=True, store=store)
    session.load(case["context"], truncate=truncate)
    n_new = max_new_tokens or MAX_NEW_TOKENS.get(case["task"], DEFAULT_MAX_NEW)
    rows = []
    try:
        for method, each_mode in [(m, x) for x in (MODES if mode == BOTH else (mode,)) for m in methods]:
            talk = Conversation(session, method) if each_mode == "multi-turn" else None
            for t, turn in enumerate(case["multi_turns"]):
                t0 = time.perf_counter()
                if talk is None:
                    answer = session.ask(turn["input"], method=method, max_new_tokens=n_new)
                else:
                    branch = talk.fork()  # answered on a branch; the golden turn is what the conversation keeps
                    try:
                        answer = branch.ask(turn["input"], max_new_tokens=n_new)
                    finally:
                        branch.close()
                    talk.tell(turn["input"], golden(turn["answer"]))
                rows.append(_row(case, t, method, each_mode, answer, t0, session.n_tokens))
            if talk is not None:
                talk.close()
    finally:
        session.close()
    return rows


def _added(model, tokenizer, case: dict, first: dict, methods: list[str], config, max_new_tokens, store, truncate):
    """The added-document rows: `first`'s context loaded, its first turn kept, `case`'s context added, each of
    `case`'s turns asked on a fork of that conversation."""
    from pqcache.serving.conversation import Conversation
    from pqcache.serving.session import DocumentSession

    session = DocumentSession(model, tokenizer, config, method=methods[0], keep_queries=True, store=store)
    session.load(first["context"], truncate=truncate)
    n_new = max_new_tokens or MAX_NEW_TOKENS.get(case["task"], DEFAULT_MAX_NEW)
    rows = []
    try:
        for method in methods:
            talk = Conversation(session, method)
            talk.tell(first["multi_turns"][0]["input"], golden(first["multi_turns"][0]["answer"]))
            talk.add_document(case["context"], case["id"])
            for t, turn in enumerate(case["multi_turns"]):
                t0, branch = time.perf_counter(), talk.fork()
                try:
                    answer = branch.ask(turn["input"], max_new_tokens=n_new)
                finally:
                    branch.close()
                rows.append(_row(case, t, method, ADDED, answer, t0, talk.n_tokens))
            talk.close()
    finally:
        session.close()
    return rows


def _row(case: dict, t: int, method: str, mode: str, answer, t0: float, context_tokens: int) -> dict:
    turn = case["multi_turns"][t]
    return {
        "id": case["id"],
        "task": case["task"],
        "turn": t,
        "method": method,
        "mode": mode,
        "score": score(case["task"], answer.text, turn["answer"]),
        "answer": turn["answer"],
        "prediction": answer.text,
        "tokens": len(answer.tokens),
        "seconds": round(time.perf_counter() - t0, 3),
        "context_tokens": context_tokens,
    }


def summarize(rows: list[dict]) -> list[dict]:
    """Mean score (in %) per method and turn index, with the count of cases."""
    cells: dict[tuple, list[float]] = {}
    for r in rows:
        cells.setdefault((r["mode"], r["method"], r["turn"]), []).append(r["score"])
    return [
        {"mode": mode, "method": method, "turn": turn, "n": len(v), "score": round(100 * sum(v) / len(v), 1)}
        for (mode, method, turn), v in sorted(cells.items())
    ]
