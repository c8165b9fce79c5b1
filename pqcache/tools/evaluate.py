"""`python -m pqcache eval`: methods compared on case files, one prefill per case shared by all methods.

query_aware true: context + question are prefilled together (what SnapKV/PyramidKV are designed for);
query_aware false: the context is prefilled alone (a document uploaded first) and the question runs as a
second chunk against the cached document. Each method continues a fork of that one prefill.
"""
from __future__ import annotations

import json
import time
from collections import defaultdict

import torch

from pqcache.engine.cache import PQCache
from pqcache.engine.config import PQCacheConfig

REQUIRED = ("id", "context", "question", "answers")


class CaseError(ValueError):
    """A case file line that is not a valid case."""


def load_cases(path) -> list[dict]:
    cases = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                case = json.loads(line)
            except json.JSONDecodeError as exc:
                raise CaseError(f"{path}:{n}: not JSON ({exc.msg})") from None
            if not isinstance(case, dict):
                raise CaseError(f"{path}:{n}: a case is a JSON object")
            missing = [k for k in REQUIRED if k not in case]
            if missing:
                raise CaseError(f"{path}:{n}: missing {', '.join(missing)}")
            if not isinstance(case["answers"], list) or not all(isinstance(a, str) for a in case["answers"]):
                raise CaseError(f"{path}:{n}: answers must be a list of strings")
            case.setdefault("query_aware", True)
            cases.append(case)
    if not cases:
        raise CaseError(f"{path}: no cases")
    return cases


def score(prediction: str, answers: list[str]) -> float:
    """Fraction of the reference strings contained in the prediction (case-insensitive)."""
    if not answers:
        return 0.0
    pred = prediction.lower()
    return sum(a.lower() in pred for a in answers) / len(answers)


@torch.no_grad()
def run_case(model, tokenizer, case: dict, methods: list[str], config: PQCacheConfig, max_new_tokens: int = 24):
    device = next(model.parameters()).device
    question = "\n\n" + case["question"].strip()
    q_ids = tokenizer(question, add_special_tokens=False, return_tensors="pt").input_ids.to(device)
    ctx_ids = tokenizer(case["context"], return_tensors="pt").input_ids.to(device)
    if case.get("query_aware", True):
        prefill_ids = torch.cat([ctx_ids, q_ids], 1)
    else:
        prefill_ids = ctx_ids
    base = PQCache(model, config, method="pqcache", keep_queries=True)
    t0 = time.perf_counter()
    logits = model(prefill_ids, cache=base, logits_to_keep=1).logits[:, -1]
    base.wait()
    prefill_s = time.perf_counter() - t0
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos]) | {tokenizer.eos_token_id}
    extra = {k: v for k, v in case.items() if k not in ("context", "question", "answers", "needle")}
    rows = []
    for method in methods:
        cache = base.fork(method)
        t1 = time.perf_counter()
        first = logits if case.get("query_aware", True) else model(q_ids, cache=cache, logits_to_keep=1).logits[:, -1]
        tokens, token = [], first
        for i in range(max_new_tokens):
            tid = int(token.argmax(-1))
            if tid in eos:
                break
            tokens.append(tid)
            if i + 1 < max_new_tokens:
                token = model(torch.tensor([[tid]], device=device), cache=cache).logits[:, -1]
        decode_s = time.perf_counter() - t1
        prediction = tokenizer.decode(tokens, skip_special_tokens=True)
        rows.append({**extra, "id": case["id"], "method": method, "prediction": prediction,
                     "score": score(prediction, case["answers"]), "context_tokens": int(ctx_ids.shape[1]),
                     "question_tokens": int(q_ids.shape[1]), "new_tokens": len(tokens),
                     "prefill_s": round(prefill_s, 3), "decode_s": round(decode_s, 3)})
        cache.close()
    base.close()
    return rows


def summarize(rows: list[dict], group_by: list[str] | None = None) -> list[dict]:
    """Mean score per method (and per group-by fields), with the number of cases."""
    keys = group_by or []
    acc = defaultdict(list)
    for r in rows:
        acc[tuple(r.get(k) for k in keys) + (r["method"],)].append(r["score"])
    out = []
    for key, scores in sorted(acc.items(), key=lambda kv: tuple(str(x) for x in kv[0])):
        out.append({**dict(zip(keys, key[:-1])), "method": key[-1], "cases": len(scores),
                    "score": round(100 * sum(scores) / len(scores), 1)})
    return out


@torch.no_grad()
def recall_study(model, tokenizer, context: str, ms=(1, 2, 4, 8), bits_list=(4, 6, 8),
                 budgets=(0.2, 0.1, 0.05), n_queries: int = 16, iters: int = 20) -> list[dict]:
    """PQ top-k recall and attention-mass recall against exact scores on the model's real keys: the
    full-attention layers' keys of one prefill, the last n_queries prefill queries as queries."""
    from pqcache.tools.bench import filled_layer
    from pqcache.engine.methods.base import combine_rows, topk_positions

    device = next(model.parameters()).device
    ids = tokenizer(context, return_tensors="pt").input_ids.to(device)
    base = PQCache(model, PQCacheConfig(kmeans_iters=1), method="full", keep_queries=True)
    model(ids, cache=base, logits_to_keep=1)
    rows = []
    for layer in base.pq_layers:
        S = layer.S
        keys = layer.k_host[:, :, :S].clone()
        G = layer.prefill_q.shape[1] // layer.H
        for m in ms:
            for bits in bits_list:
                for budget in budgets:
                    cfg = PQCacheConfig(m=m, bits=bits, token_budget=budget, kmeans_iters=iters, block_cache_tokens=0)
                    pql = filled_layer(keys, keys, cfg, iters=iters)
                    recalls, masses = [], []
                    for t in range(S - n_queries, S):
                        q = layer.prefill_q[:, :, t:t + 1].reshape(1, layer.H, G, -1).float() * layer.scaling
                        top, valid = pql.select(q, 1.0)
                        cand = pql.candidates()
                        exact = (keys.float() @ q.transpose(-1, -2))  # (1, H, S, G)
                        ks = pql.topk_counts()
                        etop, evalid = topk_positions(combine_rows(exact, cand, cfg.gqa_combine), ks, top.shape[2])
                        chosen = torch.zeros((1, layer.H, S), dtype=torch.bool).scatter_(2, top, valid)
                        ref = torch.zeros_like(chosen).scatter_(2, etop, evalid)
                        recalls.append(((chosen & ref).sum(-1) / ref.sum(-1).clamp(min=1)).mean().item())
                        probs = exact.transpose(2, 3).softmax(-1)  # (1, H, G, S)
                        attended = chosen | ~cand[:, None, :]
                        masses.append((probs * attended[:, :, None, :]).sum(-1).mean().item())
                    rows.append({"layer": layer.layer_idx, "m": m, "bits": bits, "m_x_bits": m * bits,
                                 "budget": budget, "topk_recall": round(sum(recalls) / len(recalls), 4),
                                 "mass_recall": round(sum(masses) / len(masses), 4)})
    base.close()
    return rows
