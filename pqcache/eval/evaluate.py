"""`python -m pqcache eval`: methods compared on case files, one prefill per case shared by all methods.

query_aware true: context + question are prefilled together (what SnapKV/PyramidKV are designed for);
query_aware false: the context is prefilled alone (a document uploaded first) and the question runs as a
second chunk against the cached document. Each method continues a fork of that one prefill.

The case files and the prompts they are answered from: case_formats.py (this project's JSONL, LongBench's and
RULER's); a case is scored by its own benchmark's metric (longbench.py, ruler_format.py), or by the share of its
reference strings found in the answer.
"""

from __future__ import annotations

import time
from collections import defaultdict

import torch

from pqcache.engine.cache import PQCache
from pqcache.engine.config import PQCacheConfig
from pqcache.engine.errors import DocumentTooLongError
from pqcache.engine.sources import AttentionTally
from pqcache.eval import case_formats, case_sources, longbench, ruler_format
from pqcache.eval.case_formats import CaseError, load_cases  # noqa: F401  (evaluate's API)
from pqcache.serving.generate import decode_n_tokens, eos_token_ids, prefill
from pqcache.serving.restore import load_or_restore
from pqcache.serving.stopping import looping

# the case fields not copied into its rows (the texts, and what only the prompt or the score needs)
NOT_IN_ROWS = ("context", "question", "answers", "needle", "prompt", "all_classes", "multi_turns")
SKIPPED = "longer than the model reads"  # a skipped case's rows say so


def score(prediction: str, answers: list) -> float:
    """Fraction of the reference answers contained in the prediction (case-insensitive); an answer given as a list
    of alternatives counts when any of them is."""
    if not answers:
        return 0.0
    pred = prediction.lower()
    return sum(any(a.lower() in pred for a in ([ref] if isinstance(ref, str) else ref)) for ref in answers) / len(
        answers
    )


def case_score(case: dict, prediction: str) -> float:
    """The case's benchmark's score of `prediction` (0..1)."""
    if case.get("format") == "longbench":
        return longbench.score(case["dataset"], prediction, case["answers"], case.get("all_classes"))
    if case.get("format") == "ruler":
        return ruler_format.score(case["metric"], prediction, case["answers"])
    return score(prediction, case["answers"])


def method_spec(spec: str, config: PQCacheConfig) -> tuple[str, PQCacheConfig]:
    """ "pqcache/rerank=1/bits=6/m=2" -> ("pqcache", config with those settings): variants of a method
    compared in one run (the name alone keeps the run's settings)."""
    from dataclasses import fields, replace

    name, *settings = spec.split("/")
    types = {f.name: f for f in fields(PQCacheConfig)}
    overrides = {}
    for item in settings:
        key, _, value = item.partition("=")
        if key not in types or not value:
            raise ValueError(f"method variant {spec!r}: {item!r} is not a PQCacheConfig setting=value")
        overrides[key] = _setting(value)
    return name, replace(config, **overrides)


def _setting(value: str):
    """A setting typed in a method variant: auto -> None, true/false, a number, or the word itself."""
    words = {"auto": None, "none": None, "true": True, "false": False}
    if value.lower() in words:
        return words[value.lower()]
    try:
        return float(value) if "." in value else int(value)
    except ValueError:
        return value


@torch.no_grad()
def run_case(
    model,
    tokenizer,
    case: dict,
    methods: list[str],
    config: PQCacheConfig,
    max_new_tokens: int = 24,
    max_length: int | None = None,
    store=None,
    cut_too_long: bool = False,
):
    """Every method answers `case` on a fork of one prefill. The prompt is the document part, then the question
    part: the prompt builder's, or the case's own (a benchmark's framing, case_formats.framed_prompt), and the
    answer ends by its stop rule, after at most the case's `max_new_tokens` (else `max_new_tokens`). A case
    marked `truncate: middle` (LongBench) longer than `max_length` or the model's positions less the answer's
    tokens is cut in the middle (`truncated`: the tokens cut), as is any case with cut_too_long; another case over
    that limit raises DocumentTooLongError (nothing is run past the model's positions). Each row says why the
    answer ended (`ended`) and whether it ran on repeating itself (`repeating`: cut by the repetition rule, or at
    max_new_tokens in a verbatim loop). store: a DocumentStore a case's context is read from (no prefill) or saved
    to, for cases whose question is not prefilled with it (`query_aware: false`); each row's `read_from` says
    which."""
    device = next(model.parameters()).device
    max_new_tokens = int(case.get("max_new_tokens") or max_new_tokens)
    prompt = case_formats.framed_prompt(tokenizer, case)
    ctx_ids, q_ids = prompt.encode(tokenizer)
    cut = 0
    limit = case_formats.prompt_limit(model, max_new_tokens, max_length)
    cutting = case.get("truncate") == "middle" or cut_too_long
    if cutting:
        ctx_ids, q_ids, cut = case_formats.middle_truncate(ctx_ids, q_ids, limit)
    elif limit is not None and ctx_ids.shape[1] + q_ids.shape[1] > limit:
        n = int(ctx_ids.shape[1] + q_ids.shape[1])
        raise DocumentTooLongError(
            f"the case has {n} prompt tokens; the model reads {limit} before its answer", n, limit
        )
    ctx_ids, q_ids = ctx_ids.to(device), q_ids.to(device)
    rule = case_formats.stop_rule(tokenizer, case, prompt)
    if case.get("query_aware", True):
        prefill_ids = torch.cat([ctx_ids, q_ids], 1)
    else:
        prefill_ids = ctx_ids
    base = PQCache(model, config, method="pqcache", keep_queries=True)
    spans = evidence = None
    if case.get("format", "pqcache") == "pqcache":  # the builder's prompt: sources map to the context's characters
        spans, evidence = case_sources.spans_and_evidence(tokenizer, case, int(ctx_ids.shape[1]))
    t0 = time.perf_counter()
    first_logits = []

    def from_text():
        first_logits.append(prefill(model, prefill_ids, base))
        base.wait()
        return base

    # the context alone is cached (the question is not prefilled with it): it can be read from the store
    stored = store if not case.get("query_aware", True) else None
    loaded = load_or_restore(
        stored, model, tokenizer, config, "pqcache", True, ctx_ids[0].tolist(), from_text, case["context"]
    )
    if loaded.cache is not base:
        base.close()
        base = loaded.cache
    base.wait()
    prefill_s = time.perf_counter() - t0
    logits = first_logits[0] if first_logits else None
    read_from = loaded.read_from
    eos = eos_token_ids(model, tokenizer)
    extra = {k: v for k, v in case.items() if k not in NOT_IN_ROWS}
    rows = []
    for method in methods:
        name, settings = method_spec(method, config)
        cache = base.fork(name, settings)
        tally = cache.tally_sources(AttentionTally(int(ctx_ids.shape[1]))) if spans is not None else None
        t1 = time.perf_counter()
        first = logits if case.get("query_aware", True) else prefill(model, q_ids, cache)
        decoded = decode_n_tokens(model, first, cache, max_new_tokens, eos, stop_rule=rule)
        tokens = decoded.tokens
        decode_s = time.perf_counter() - t1
        prediction = tokenizer.decode(tokens, skip_special_tokens=True)
        rows.append(
            {
                **extra,
                "id": case["id"],
                "method": method,
                "prediction": prediction,
                "score": case_score(case, prediction),
                "context_tokens": int(ctx_ids.shape[1]),
                "question_tokens": int(q_ids.shape[1]),
                "new_tokens": len(tokens),
                **({"truncated": cut} if cutting else {}),
                "ended": decoded.ended,
                "repeating": decoded.ended == "repetition" or (decoded.ended == "max_new_tokens" and looping(tokens)),
                "prefill_s": round(prefill_s, 3),
                "read_from": read_from,
                "decode_s": round(decode_s, 3),
                "attended": _rounded(cache.attended_per_step()),  # stored tokens a step, a KV head of a PQ layer
                "tokens": tokens,
                **case_sources.row_fields(case["context"], spans, tally, evidence),
            }
        )
        cache.close()
    base.close()
    return rows


def _rounded(x: float | None) -> float | None:
    return None if x is None else round(x, 1)


def _mean_attended(group: list[dict]) -> dict:
    """{"attended": the mean stored tokens attended a step} over the rows that say it (a row of a case that did not
    run says nothing); {} when none does."""
    counts = [r["attended"] for r in group if r.get("attended") is not None]
    return {"attended": round(sum(counts) / len(counts), 1)} if counts else {}


def marked_rows(case: dict, methods: list[str], **why) -> list[dict]:
    """A row per method for a case that was not answered (why: skipped=SKIPPED and its sizes, or failed=the
    error), with the case's own fields, so that the run goes on and the summary counts it."""
    extra = {k: v for k, v in case.items() if k not in NOT_IN_ROWS}
    return [{**extra, "id": case.get("id"), "method": method, **why} for method in methods]


def marked_count(rows: list[dict], what: str) -> int:
    """How many cases have rows marked `what` ("skipped" or "failed")."""
    return len({str(r.get("id")) for r in rows if what in r})


def summarize(rows: list[dict], group_by: list[str] | None = None, by_dataset: bool = False) -> list[dict]:
    """Mean score per method (and per group-by fields), with the number of cases, how many answers ran to
    max_new_tokens (`at_max`) and how many ran on repeating themselves (`repeating`). by_dataset: LongBench's
    table instead, one row per method with a column per dataset and their average (longbench.dataset_table)."""
    if by_dataset:
        return longbench.dataset_table(rows)
    keys = group_by or []
    acc = defaultdict(list)
    for r in rows:
        acc[tuple(r.get(k) for k in keys) + (r["method"],)].append(r)
    out = []
    for key, group in sorted(acc.items(), key=lambda kv: tuple(str(x) for x in kv[0])):
        out.append(
            {
                **dict(zip(keys, key[:-1])),
                "method": key[-1],
                "cases": len(group),
                "score": round(100 * sum(r["score"] for r in group) / len(group), 1),
                "at_max": sum(r.get("ended") == "max_new_tokens" for r in group),
                "repeating": sum(bool(r.get("repeating")) for r in group),
                **_mean_attended(group),
                **case_sources.hit_rate(group),
            }
        )
    return out
