"""Questions about real documents: five licence texts that Debian ships (assets/realdocs/*.txt, copied verbatim),
26 questions in plain words with short answers, each with the passage that holds its answer (`evidence`, a quote
of the document). `python -m pqcache datasets realdocs --out FILE` writes them as eval cases, asked as the app
asks them: the document is loaded first, the question comes after it (query_aware false)."""

from __future__ import annotations

import json
from pathlib import Path

FOLDER = Path(__file__).resolve().parents[2] / "assets" / "realdocs"


def realdocs(folder: Path = FOLDER) -> list[dict]:
    """The eval cases: id, context (the whole document), question, answers (lists of alternatives), query_aware
    false, document, evidence {start, end, text} (where the answer is in the context)."""
    cases = []
    with open(folder / "questions.jsonl", encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            q = json.loads(line)
            text = (folder / q["document"]).read_text(encoding="utf-8")
            start = text.find(q["evidence"])
            if start < 0:
                raise ValueError(f"{q['id']}: its evidence is not in {q['document']}")
            cases.append(
                {
                    "id": q["id"],
                    "task": "realdocs",
                    "document": q["document"],
                    "context": text,
                    "question": q["question"],
                    "answers": q["answers"],
                    "query_aware": False,
                    "evidence": {"start": start, "end": start + len(q["evidence"]), "text": q["evidence"]},
                }
            )
    return cases


def as_longbench(case: dict) -> dict:
    """One case as a LongBench record (`eval --format longbench`): a single-document QA question, scored with
    LongBench's QA F1 against each alternative answer (multifieldqa_en's prompt and length)."""
    answers = [a for group in case["answers"] for a in (group if isinstance(group, list) else [group])]
    return {
        "_id": case["id"],
        "dataset": "multifieldqa_en",
        "input": case["question"],
        "context": case["context"],
        "answers": answers,
        "length": len(case["context"].split()),
        "all_classes": None,
    }
