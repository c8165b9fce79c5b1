"""Case files for `pqcache eval --format {pqcache,longbench,ruler}`, and the prompt a case is answered from.

- `pqcache` (this project's JSONL): id, context, question, answers[, query_aware, fields for grouping]; the prompt
  comes from the prompt builder (pqcache.serving.prompt) and the answer ends at its stop rule.
- `longbench` and `ruler` (pqcache/eval/longbench.py, ruler_format.py): the benchmark's own records, turned into
  cases that carry their framed prompt as two raw text parts (`prompt`: document, question), their generation
  length (`max_new_tokens`), how the answer ends (`stop`) and how it is scored (`metric`).

A bad line raises CaseError naming the file, the line and the problem.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from pqcache.eval import longbench, ruler_format
from pqcache.serving.prompt import Prompt, build_prompt, has_chat_template
from pqcache.serving.stopping import StopRule

FORMATS = ("pqcache", "longbench", "ruler")
REQUIRED = ("id", "context", "question", "answers")
_SPLIT = "\u2063PQSPLIT\u2063"  # where the question part starts, carried through a chat template


class CaseError(ValueError):
    """A case file line that is not a valid case."""


def _records(path):
    """-> (line number, JSON object) for each non-blank line."""
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise CaseError(f"{path}:{n}: not JSON ({exc.msg})") from None
            if not isinstance(record, dict):
                raise CaseError(f"{path}:{n}: a case is a JSON object")
            yield n, record


def _answer(a) -> bool:
    """A reference answer: a string, or a non-empty list of alternative strings (any one counts)."""
    return isinstance(a, str) or (isinstance(a, list) and bool(a) and all(isinstance(x, str) for x in a))


def _pqcache_case(case: dict) -> dict:
    missing = [k for k in REQUIRED if k not in case]
    if missing:
        raise ValueError(f"missing {', '.join(missing)}")
    if not isinstance(case["answers"], list) or not all(_answer(a) for a in case["answers"]):
        raise ValueError("answers must be a list of strings (or of lists of strings: alternatives)")
    case.setdefault("query_aware", True)
    return case


def load_cases(path, fmt: str = "pqcache") -> list[dict]:
    """The cases of a JSONL file in format `fmt` (one of FORMATS)."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown case format {fmt!r}; choose from {', '.join(FORMATS)}")
    stem = Path(path).stem
    convert = {
        "pqcache": _pqcache_case,
        "longbench": lambda r: longbench.to_case(r, stem),
        "ruler": lambda r: ruler_format.to_case(r, ruler_format.task_from_path(path)),
    }[fmt]
    cases = []
    for n, record in _records(path):
        try:
            case = convert(record)
        except ValueError as exc:
            raise CaseError(f"{path}:{n}: {exc}") from None
        if fmt != "pqcache" and not case.get("id"):  # a benchmark record without its id: file and line
            case["id"] = f"{stem}-{n}"
        cases.append(case)
    if not cases:
        raise CaseError(f"{path}: no cases")
    return cases


def framed_prompt(tokenizer, case: dict) -> Prompt:
    """The case's prompt: its own two parts when it carries them (rendered as one user turn through the
    tokenizer's chat template where the case asks for it and the tokenizer has one), else the prompt builder's."""
    if "prompt" not in case:
        return build_prompt(tokenizer, case["context"], case["question"])
    document, question = case["prompt"]["document"], case["prompt"]["question"]
    if not (case.get("chat_template") and has_chat_template(tokenizer)):
        return Prompt(document, question, chat=False)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": document + _SPLIT + question}], tokenize=False, add_generation_prompt=True
    )
    if text.count(_SPLIT) != 1:  # a template that changes the text: the whole rendering is the document part
        whole = [{"role": "user", "content": document + question}]
        return Prompt(tokenizer.apply_chat_template(whole, tokenize=False, add_generation_prompt=True), "", True)
    document, question = text.split(_SPLIT)
    return Prompt(document, question, chat=True)


def middle_truncate(doc_ids: torch.Tensor, q_ids: torch.Tensor, limit: int | None):
    """doc_ids (1, S), q_ids (1, Q) -> (doc_ids, q_ids, tokens cut): over `limit` tokens, the prompt keeps its
    first limit // 2 and its last limit // 2 tokens (LongBench's pred.py: the instructions at both ends survive),
    each part keeping its own kept tokens."""
    S, Q = doc_ids.shape[1], q_ids.shape[1]
    if limit is None or S + Q <= limit:
        return doc_ids, q_ids, 0
    half = max(1, limit // 2)
    keep = torch.cat([torch.arange(half), torch.arange(S + Q - half, S + Q)])  # (2 * half,) positions kept
    ids = torch.cat([doc_ids, q_ids], 1)  # (1, S + Q)
    return ids[:, keep[keep < S]], ids[:, keep[keep >= S]], S + Q - 2 * half


def prompt_limit(model, max_new_tokens: int, max_length: int | None = None) -> int | None:
    """The most prompt tokens: --max-length (LongBench's model2maxlen) where given, and at most the model's
    positions less the tokens to generate (None when the model does not say)."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    positions = getattr(config, "max_position_embeddings", None)
    room = positions - max_new_tokens if positions else None
    limits = [n for n in (max_length, room) if n is not None]
    return min(limits) if limits else None


class FirstLineStop(StopRule):
    """Ends an answer once its first line (after leading newlines) is complete, keeping every token: LongBench
    scores only that line for these datasets, so decoding further would not change the score."""

    def check(self, tokens: list[int]):
        return ("end_of_answer", len(tokens)) if "\n" in self._text(tokens).lstrip("\n") else None

    def visible(self, tokens: list[int]) -> int:
        return len(tokens)


def stop_rule(tokenizer, case: dict, prompt: Prompt) -> StopRule | None:
    """The builder's stop rule for its own prompts; for a benchmark's: EOS and the generation length only (as the
    benchmark decodes), or the first line's end where the benchmark scores the first line alone."""
    if "prompt" not in case:
        return prompt.stop_rule(tokenizer)
    return FirstLineStop(tokenizer) if case.get("stop") == "first_line" else None
