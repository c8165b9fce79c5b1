"""The sources of the evaluation's answers: for a case asked with the prompt builder's frame, each method's answer
gets its top passages (pqcache.serving.sources), and where the case says where its answer is (`evidence`: a
character range of the context, or its `needle` sentence) whether one of them holds it (`source_hit`)."""

from __future__ import annotations

from pqcache.serving.prompt import PromptBuilder
from pqcache.serving.sources import N_SOURCES, passages


def spans_and_evidence(tokenizer, case: dict, n_positions: int):
    """(each document position's character range in the context, the answer's (start, end) or None); (None, None)
    when the document part was not the builder's (then positions do not map to characters)."""
    spans = PromptBuilder(tokenizer).document_spans(case["context"])
    if len(spans) != n_positions:
        return None, None
    evidence = case.get("evidence")
    if isinstance(evidence, dict):
        return spans, (int(evidence["start"]), int(evidence["end"]))
    needle = case.get("needle")
    at = case["context"].find(needle) if needle else -1
    return spans, ((at, at + len(needle)) if at >= 0 else None)


def row_fields(context: str, spans, tally, evidence) -> dict:
    """{"sources": [[start, end, share], ...], "source_hit": bool} for a row (empty without a tally)."""
    if tally is None:
        return {}
    found = passages(context, spans, tally.received, N_SOURCES)
    out = {"sources": [[s.start, s.end, s.share] for s in found]}
    if evidence is not None:
        lo, hi = evidence
        out["source_hit"] = any(s.start < hi and lo < s.end for s in found)
    return out


def hit_rate(rows: list[dict]) -> dict:
    """{"source_hit": % of the rows with an evidence whose sources hold it} (nothing when no row has one)."""
    judged = [r["source_hit"] for r in rows if "source_hit" in r]
    return {"source_hit": round(100 * sum(judged) / len(judged), 1)} if judged else {}
