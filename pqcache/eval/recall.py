"""`python -m pqcache eval recall`: top-k recall of the selection as it works, on the model's real keys."""

from __future__ import annotations

import itertools

import torch

from pqcache.engine.cache import PQCache
from pqcache.engine.config import PQCacheConfig
from pqcache.serving.generate import prefill


@torch.no_grad()
def recall_study(
    model,
    tokenizer,
    context: str,
    ms=(None, 2, 4),
    bits_list=(None, 6, 8),
    reranks=(1, 2, 4, 8),
    margins=(0.5,),
    opqs=(False,),
    budgets=(0.1,),
    n_queries: int = 16,
    iters: int = 20,
) -> list[dict]:
    """Top-k recall of the selection as it works (PQ search, then the exact re-rank of rerank x k
    candidates, ranked by PQ score plus each of `margins` (search_margin) before it) against the exact top-k under the
    same rule (same candidates, same GQA combine, same
    k), per KV head and per query head (each query head's own exact top-k), and the share of the
    exact attention mass on the attended tokens (sinks + top-k + window). On the model's real keys:
    the full-attention layers' keys of one prefill, the last n_queries prefill queries as queries.
    m or bits None: the defaults (chosen from head_dim and the context length). Beside each layer's rows, Oracle's
    (method "oracle": the exact top-k under the same combine, at each budget): its KV-head recall is 1 by
    definition, its query-head recall what the combine rule itself costs a query head whose KV head it shares."""
    from dataclasses import replace

    from pqcache.engine.layer.probe import exact_topk_set, selection_recall
    from pqcache.engine.layer.standalone import filled_layer
    from pqcache.engine.methods.pqcache import first_stage_margin

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
        oracle_done = set()
        for m, bits, budget, opq in itertools.product(ms, bits_list, budgets, opqs):
            cfg = PQCacheConfig(m=m, bits=bits, token_budget=budget, kmeans_iters=iters, block_cache_tokens=0, opq=opq)
            pql = filled_layer(keys, keys, cfg, iters=iters)  # one build serves every rerank
            if budget not in oracle_done:  # the exact top-k under the rule: the same candidates and k as PQCache's
                oracle_done.add(budget)
                acc = {"recall": [], "mass_recall": [], "qhead": []}
                for q in queries:
                    top, _ = pql.select(q, 1.0)  # for the selection's width k only
                    exact = (keys.float() @ q.transpose(-1, -2)).transpose(2, 3)  # (1, H, G, S)
                    cand, ks = pql.candidates(), pql.topk_counts()
                    chosen = exact_topk_set(exact, cand, ks, top.shape[2], cfg.gqa_combine)
                    recall, mass, qhead = selection_recall(
                        exact, all_valid, cand, chosen, ks, top.shape[2], cfg.gqa_combine, G, exact_set=chosen
                    )
                    acc["recall"].append(recall.mean().item())
                    acc["mass_recall"].append(mass.mean().item())
                    acc["qhead"].append(qhead.mean().item())
                rows.append(_row(layer.layer_idx, "oracle", None, None, None, None, budget, acc))
            for rerank, margin in itertools.product(reranks, margins):
                if rerank == 1 and margin != margins[0]:  # without a re-rank the margin is not applied
                    continue
                pql.config = replace(pql.config, rerank=rerank, search_margin=margin)
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
                bits_used = pql.method_state["index"].bits
                row = _row(layer.layer_idx, "pqcache", pql.config.m, bits_used, rerank, opq, budget, acc)
                rows.append({**row, "margin": first_stage_margin(pql.config)})
    base.close()
    return rows


def _row(layer: int, method: str, m, bits, rerank, opq, budget, acc: dict) -> dict:
    return {
        "layer": layer,
        "method": method,
        "m": m,
        "bits": bits,
        "rerank": rerank,
        "opq": opq,
        "budget": budget,
        "recall": _mean(acc["recall"]),
        "mass_recall": _mean(acc["mass_recall"]),
        "qhead_recall": _mean(acc["qhead"]),
    }


def _mean(xs: list[float]) -> float:
    return round(sum(xs) / len(xs), 4)
