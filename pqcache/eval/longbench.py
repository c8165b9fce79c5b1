"""LongBench (v1) in `pqcache eval --format longbench`: its records, prompts, generation lengths and scores.

A record is one line of LongBench's data files (`input`, `context`, `answers`, `length`, `dataset`,
`all_classes`, `_id`). It is answered as LongBench's `pred.py` answers it: the dataset's prompt template
(`longbench_config.json`, LongBench's config/dataset2prompt.json) filled with the context and the input, through
the model's chat template except for trec, triviaqa, samsum, lsht, lcc and repobench-p (few-shot and code
completion, which LongBench leaves raw), greedy decoding of at most the dataset's generation length
(config/dataset2maxlen.json), and a prompt longer than the model's limit cut in the middle (the first and last
halves kept). It is scored as LongBench's `eval.py` scores it: the dataset's metric (pqcache/eval/metrics.py),
the best over the reference answers, on the first line only for trec, triviaqa, samsum and lsht; a dataset's
score is 100 x the mean, to 2 decimals, and the table's average is the mean over datasets.

The filled template is kept as two parts, as every prompt of this project is: the **document** (the template up
to and including the context) and the **question** (the rest), so that a case runs either with both prefilled
together (query-aware, as LongBench runs it: the default) or with the document cached first.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

from pqcache.eval import metrics

# THUDM/LongBench eval.py, dataset2metric
DATASET2METRIC = {
    "narrativeqa": metrics.qa_f1_score,
    "qasper": metrics.qa_f1_score,
    "multifieldqa_en": metrics.qa_f1_score,
    "multifieldqa_zh": metrics.qa_f1_zh_score,
    "hotpotqa": metrics.qa_f1_score,
    "2wikimqa": metrics.qa_f1_score,
    "musique": metrics.qa_f1_score,
    "dureader": metrics.rouge_zh_score,
    "gov_report": metrics.rouge_score,
    "qmsum": metrics.rouge_score,
    "multi_news": metrics.rouge_score,
    "vcsum": metrics.rouge_zh_score,
    "trec": metrics.classification_score,
    "triviaqa": metrics.qa_f1_score,
    "samsum": metrics.rouge_score,
    "lsht": metrics.classification_score,
    "passage_retrieval_en": metrics.retrieval_score,
    "passage_count": metrics.count_score,
    "passage_retrieval_zh": metrics.retrieval_zh_score,
    "lcc": metrics.code_sim_score,
    "repobench-p": metrics.code_sim_score,
}
# eval.py scores only the first line of these answers (the few-shot examples go on after it)
FIRST_LINE = ("trec", "triviaqa", "samsum", "lsht")
# pred.py: "chat models are better off without build prompts on these tasks"
NO_CHAT = ("trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p")
CLASSIFICATION = ("trec", "lsht")
REQUIRED = ("input", "context", "answers")


@cache
def tables() -> tuple[dict[str, str], dict[str, int]]:
    """(dataset -> prompt template, dataset -> generation length), in LongBench's order of datasets."""
    data = json.loads((Path(__file__).with_name("longbench_config.json")).read_text(encoding="utf-8"))
    return data["dataset2prompt"], data["dataset2maxlen"]


def datasets() -> list[str]:
    return list(tables()[0])


def dataset_name(name: str) -> str:
    """A LongBench dataset name (LongBench-E's "<name>_e" is the same dataset); ValueError naming the known ones."""
    known = tables()[0]
    if name.endswith("_e") and name[:-2] in known:
        name = name[:-2]
    if name not in known:
        raise ValueError(f"unknown LongBench dataset {name!r}; known: {', '.join(known)}")
    return name


def split_prompt(dataset: str, context: str, question: str) -> dict[str, str]:
    """The dataset's template filled with `context` and `question` (LongBench's `input`), cut after the context:
    {"document": ..., "question": ...}, whose concatenation is `template.format(context=..., input=...)`."""
    head, tail = tables()[0][dataset].split("{context}", 1)
    return {"document": head.format(input=question) + context, "question": tail.format(input=question)}


def _known(name: str | None) -> bool:
    try:
        return name is not None and bool(dataset_name(name))
    except ValueError:
        return False


def to_case(record: dict, default_dataset: str | None = None) -> dict:
    """One LongBench record -> an eval case. `default_dataset` (the file's name, as LongBench's eval.py names a
    dataset) stands in for a missing `dataset` field. ValueError names a missing or malformed field."""
    missing = [k for k in REQUIRED if k not in record]
    if not record.get("dataset") and not _known(default_dataset):
        missing.append("dataset")
    if missing:
        raise ValueError(f"missing {', '.join(missing)}")
    dataset = dataset_name(str(record.get("dataset") or default_dataset))
    for key in ("input", "context"):
        if not isinstance(record[key], str):
            raise ValueError(f"{key} must be a string")
    answers, classes = record["answers"], record.get("all_classes")
    if not isinstance(answers, list) or not all(isinstance(a, str) for a in answers):
        raise ValueError("answers must be a list of strings")
    if dataset in CLASSIFICATION and not (isinstance(classes, list) and all(isinstance(c, str) for c in classes)):
        raise ValueError(f"all_classes must be a list of strings for {dataset}")
    return {
        "id": str(record.get("_id", "")),
        "format": "longbench",
        "dataset": dataset,
        "length": record.get("length"),
        "context": record["context"],
        "question": record["input"],
        "answers": answers,
        "all_classes": classes,
        "prompt": split_prompt(dataset, record["context"], record["input"]),
        "chat_template": dataset not in NO_CHAT,
        "stop": "first_line" if dataset in FIRST_LINE else None,
        "max_new_tokens": tables()[1][dataset],
        "truncate": "middle",
        "metric": DATASET2METRIC[dataset].__name__,
        "query_aware": bool(record.get("query_aware", True)),
    }


def score(dataset: str, prediction: str, answers: list[str], all_classes=None) -> float:
    """LongBench's score of one prediction (0..1): the dataset's metric, the best over the answers."""
    if dataset in FIRST_LINE:
        prediction = prediction.lstrip("\n").split("\n")[0]
    metric = DATASET2METRIC[dataset]
    return max((metric(prediction, a, all_classes=all_classes) for a in answers), default=0.0)


def dataset_table(rows: list[dict]) -> list[dict]:
    """Per-case rows -> one row per method: each dataset's score (100 x mean, 2 decimals, as LongBench's eval.py
    rounds it) in LongBench's order of datasets, and "avg", the mean over those datasets (the paper's table)."""
    order = [d for d in datasets() if any(r.get("dataset") == d for r in rows)]
    methods = list(dict.fromkeys(r["method"] for r in rows))
    out = []
    for method in methods:
        row: dict = {"method": method}
        for dataset in order:
            scores = [r["score"] for r in rows if r["method"] == method and r.get("dataset") == dataset]
            row[dataset] = round(100 * sum(scores) / len(scores), 2) if scores else None
        done = [v for k, v in row.items() if k != "method" and v is not None]
        row["avg"] = round(sum(done) / len(done), 2) if done else None
        out.append(row)
    return out
