"""RULER's generated files in `pqcache eval --format ruler`: records, generation lengths and scores.

RULER (NVIDIA/RULER) writes one JSONL per task (`<save_dir>/<task>/validation.jsonl`, or `<task>.jsonl` beside its
predictions) with `index`, `input` (the whole prompt: the model's template, the context and the question),
`outputs` (the reference strings), `length` and, in newer versions, `answer_prefix`, which the prompt ends with
when present. The prompt is the input as it is, prefilled whole (there is no document part to cache apart); the
answer is decoded greedily with no stop text, at most `max_new_tokens` of the record, or else RULER's
`tokens_to_generate` for the task's kind, or else the command's --max-new-tokens. Its score is RULER's
(scripts/eval/synthetic/constants.py): string_match_part for the qa tasks, string_match_all for the others.

The task is the record's `task` field, or else the file's name (its folder's for validation.jsonl / test.jsonl).
"""

from __future__ import annotations

from pathlib import Path

from pqcache.eval import metrics

# RULER scripts/data/synthetic/constants.py and synthetic.yaml: a task's kind -> (tokens_to_generate, metric)
KINDS = {
    "niah": (128, "string_match_all"),
    "variable_tracking": (30, "string_match_all"),
    "common_words_extraction": (120, "string_match_all"),
    "freq_words_extraction": (50, "string_match_all"),
    "qa": (32, "string_match_part"),
}
# synthetic.yaml's task names -> kinds (niah_single_1, niah_multikey_2, ... and qa_1, qa_2 by their prefix)
PREFIXES = (
    ("niah", "niah"),
    ("vt", "variable_tracking"),
    ("variable_tracking", "variable_tracking"),
    ("cwe", "common_words_extraction"),
    ("common_words", "common_words_extraction"),
    ("fwe", "freq_words_extraction"),
    ("freq_words", "freq_words_extraction"),
    ("qa", "qa"),
)
METRICS = {"string_match_all": metrics.string_match_all, "string_match_part": metrics.string_match_part}
REQUIRED = ("input", "outputs")


def kind(task: str | None) -> str | None:
    """The RULER kind of a task name ("qa_2" -> "qa", "vt" -> "variable_tracking"), None when unknown."""
    name = (task or "").lower()
    return next((k for prefix, k in PREFIXES if name == prefix or name.startswith(prefix + "_")), None)


def task_from_path(path) -> str:
    path = Path(path)
    return path.parent.name if path.stem in ("validation", "test") else path.stem


def to_case(record: dict, default_task: str | None = None) -> dict:
    """One RULER record -> an eval case; ValueError names a missing or malformed field."""
    missing = [k for k in REQUIRED if k not in record]
    if missing:
        raise ValueError(f"missing {', '.join(missing)}")
    outputs = record["outputs"]
    if not isinstance(record["input"], str):
        raise ValueError("input must be a string")
    if not isinstance(outputs, list) or not all(isinstance(o, str) for o in outputs):
        raise ValueError("outputs must be a list of strings")
    task = str(record.get("task") or default_task or "")
    tokens, metric = KINDS.get(kind(task), (None, "string_match_all"))
    prompt = record["input"] + str(record.get("answer_prefix") or "")
    case = {
        "id": str(record.get("index", "")),
        "format": "ruler",
        "task": task,
        "length": record.get("length"),
        "context": record["input"],
        "question": "",
        "answers": outputs,
        "prompt": {"document": prompt, "question": ""},
        "chat_template": False,  # RULER wrote the model's template into the input
        "stop": None,
        "metric": metric,
        "query_aware": True,
    }
    n = record.get("max_new_tokens", tokens)
    if n is not None:
        case["max_new_tokens"] = int(n)
    return case


def postprocess(prediction: str) -> str:
    """RULER's postprocess_pred: control characters become newlines, the ends are stripped."""
    return "".join("\n" if ord(ch) < 32 else ch for ch in prediction.strip()).strip()


def score(metric: str, prediction: str, references: list[str]) -> float:
    return METRICS[metric](postprocess(prediction), references)
