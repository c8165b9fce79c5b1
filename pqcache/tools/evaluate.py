"""`python -m pqcache eval`: methods compared on case files, one prefill per case shared by all methods.

query_aware true: context + question are prefilled together (what SnapKV/PyramidKV are designed for);
query_aware false: the context is prefilled alone (a document uploaded first) and the question runs as a
second chunk against the cached document. Each method continues a fork of that one prefill.

The case files and the prompts they are answered from: case_formats.py (this project's JSONL, LongBench's and
RULER's); a case is scored by its own benchmark's metric (longbench.py, ruler_format.py), or by the share of its
reference strings found in the answer.
"""

from __future__ import annotations

import itertools
import time
from collections import defaultdict

import torch

from pqcache.engine.cache import PQCache
from pqcache.engine.config import PQCacheConfig
from pqcache.serving.generate import decode_n_tokens, eos_token_ids, prefill
from pqcache.serving.stopping import looping
from pqcache.tools import case_formats, longbench, ruler_format
from pqcache.tools.case_formats import CaseError, load_cases  # noqa: F401  (evaluate's API)

# the case fields not copied into its rows (the texts, and what only the prompt or the score needs)
NOT_IN_ROWS = ("context", "question", "answers", "needle", "prompt", "all_classes")


def score(prediction: str, answers: list[str]) -> float:
    """Fraction of the reference strings contained in the prediction (case-insensitive)."""
    if not answers:
        return 0.0
    pred = prediction.lower()
    return sum(a.lower() in pred for a in answers) / len(answers)


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
):
    """Every method answers `case` on a fork of one prefill. The prompt is the document part, then the question
    part: the prompt builder's, or the case's own (a benchmark's framing, case_formats.framed_prompt), and the
    answer ends by its stop rule, after at most the case's `max_new_tokens` (else `max_new_tokens`). A case
    marked `truncate: middle` (LongBench) longer than `max_length` or the model's positions less the answer's
    tokens is cut in the middle (`truncated`: the tokens cut). Each row says why the answer ended (`ended`) and
    whether it ran on repeating itself (`repeating`: cut by the repetition rule, or at max_new_tokens in a
    verbatim loop)."""
    device = next(model.parameters()).device
    max_new_tokens = int(case.get("max_new_tokens") or max_new_tokens)
    prompt = case_formats.framed_prompt(tokenizer, case)
    ctx_ids, q_ids = prompt.encode(tokenizer)
    cut = 0
    if case.get("truncate") == "middle":
        limit = case_formats.prompt_limit(model, max_new_tokens, max_length)
        ctx_ids, q_ids, cut = case_formats.middle_truncate(ctx_ids, q_ids, limit)
    ctx_ids, q_ids = ctx_ids.to(device), q_ids.to(device)
    rule = case_formats.stop_rule(tokenizer, case, prompt)
    if case.get("query_aware", True):
        prefill_ids = torch.cat([ctx_ids, q_ids], 1)
    else:
        prefill_ids = ctx_ids
    base = PQCache(model, config, method="pqcache", keep_queries=True)
    t0 = time.perf_counter()
    logits = prefill(model, prefill_ids, base)
    base.wait()
    prefill_s = time.perf_counter() - t0
    eos = eos_token_ids(model, tokenizer)
    extra = {k: v for k, v in case.items() if k not in NOT_IN_ROWS}
    rows = []
    for method in methods:
        name, settings = method_spec(method, config)
        cache = base.fork(name, settings)
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
                **({"truncated": cut} if case.get("truncate") else {}),
                "ended": decoded.ended,
                "repeating": decoded.ended == "repetition" or (decoded.ended == "max_new_tokens" and looping(tokens)),
                "prefill_s": round(prefill_s, 3),
                "decode_s": round(decode_s, 3),
            }
        )
        cache.close()
    base.close()
    return rows


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
            }
        )
    return out


@torch.no_grad()
def recall_study(
    model,
    tokenizer,
    context: str,
    ms=(None, 2, 4),
    bits_list=(None, 6, 8),
    reranks=(1, 2, 4, 8),
    opqs=(False,),
    budgets=(0.1,),
    n_queries: int = 16,
    iters: int = 20,
) -> list[dict]:
    """Top-k recall of the selection as it works (PQ search, then the exact re-rank of rerank x k
    candidates) against the exact top-k under the same rule (same candidates, same GQA combine, same
    k), per KV head and per query head (each query head's own exact top-k), and the share of the
    exact attention mass on the attended tokens (sinks + top-k + window). On the model's real keys:
    the full-attention layers' keys of one prefill, the last n_queries prefill queries as queries.
    m or bits None: the defaults (chosen from head_dim and the context length)."""
    from dataclasses import replace

    from pqcache.engine.layer.probe import selection_recall
    from pqcache.tools.bench import filled_layer

    device = next(model.parameters()).device
    ids = tokenizer(context, return_tensors="pt").input_ids.to(device)
    base = PQCache(model, PQCacheConfig(kmeans_iters=1), method="full", keep_queries=True)
    prefill(model, ids, base)
    rows = []
    for layer in base.pq_layers:
        S, H = layer.S, layer.host.H
        keys = layer.host.keys(0, S).clone()
        G = layer.prefill_q.shape[1] // H
        all_valid = torch.ones((1, S), dtype=torch.bool)
        queries = [
            layer.prefill_q[:, :, t : t + 1].reshape(1, H, G, -1).float() * layer.scaling
            for t in range(S - n_queries, S)
        ]
        for m, bits, budget, opq in itertools.product(ms, bits_list, budgets, opqs):
            cfg = PQCacheConfig(m=m, bits=bits, token_budget=budget, kmeans_iters=iters, block_cache_tokens=0, opq=opq)
            pql = filled_layer(keys, keys, cfg, iters=iters)  # one build serves every rerank
            for rerank in reranks:
                pql.config = replace(pql.config, rerank=rerank)
                acc = {"recall": [], "mass_recall": [], "qhead": []}
                for q in queries:
                    top, valid = pql.select(q, 1.0)
                    chosen = torch.zeros((1, H, S), dtype=torch.bool).scatter_(2, top, valid)
                    exact = (keys.float() @ q.transpose(-1, -2)).transpose(2, 3)  # (1, H, G, S)
                    recall, mass, qhead = selection_recall(
                        exact,
                        all_valid,
                        pql.candidates(),
                        chosen,
                        pql.topk_counts(),
                        top.shape[2],
                        cfg.gqa_combine,
                        G,
                    )
                    acc["recall"].append(recall.mean().item())
                    acc["mass_recall"].append(mass.mean().item())
                    acc["qhead"].append(qhead.mean().item())
                rows.append(
                    {
                        "layer": layer.layer_idx,
                        "m": pql.config.m,
                        "bits": pql.method_state["index"].bits,
                        "rerank": rerank,
                        "opq": opq,
                        "budget": budget,
                        "recall": _mean(acc["recall"]),
                        "mass_recall": _mean(acc["mass_recall"]),
                        "qhead_recall": _mean(acc["qhead"]),
                    }
                )
    base.close()
    return rows


def _mean(xs: list[float]) -> float:
    return round(sum(xs) / len(xs), 4)
