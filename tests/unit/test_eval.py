"""Evaluation harness: case parsing, scoring, one prefill per case, generators' needle placement."""

import json

import pytest
import torch

from pqcache import PQCache, PQCacheConfig
from pqcache.eval import evaluate
from pqcache.serving.prompt import build_prompt
from pqcache.serving.stopping import ENDINGS
from tests.tiny import WordTokenizer, tiny_model


def _write(tmp_path, lines):
    path = tmp_path / "cases.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_load_cases_defaults_and_errors(tmp_path):
    ok = _write(tmp_path, [json.dumps({"id": "a", "context": "c", "question": "q", "answers": ["x"], "task": "t"})])
    (case,) = evaluate.load_cases(ok)
    assert case["query_aware"] is True and case["task"] == "t"
    for line, msg in [
        ("{not json", ":1: not JSON"),
        (json.dumps({"id": "a"}), "missing context, question, answers"),
        (json.dumps({"id": "a", "context": "c", "question": "q", "answers": "x"}), "answers must be a list of strings"),
        ("[1]", "a case is a JSON object"),
    ]:
        with pytest.raises(evaluate.CaseError, match=msg):
            evaluate.load_cases(_write(tmp_path, [line]))


def test_score_is_the_fraction_of_answers_found():
    assert evaluate.score("It is Dolores PARK, with a sandwich", ["sandwich", "Dolores Park"]) == 1.0
    assert evaluate.score("a sandwich", ["sandwich", "Dolores Park"]) == 0.5
    assert evaluate.score("nothing", ["x"]) == 0.0 and evaluate.score("x", []) == 0.0


@pytest.mark.parametrize("query_aware", [True, False])
def test_one_prefill_per_case_shared_by_all_methods(query_aware):
    model = tiny_model("llama")
    lengths = []
    model.model.register_forward_pre_hook(
        lambda m, args, kw: lengths.append(kw["input_ids"].shape[1]), with_kwargs=True
    )
    context = " ".join(f"w{i}" for i in range(200))
    case = {
        "id": "c1",
        "context": context,
        "question": "what is w7 ?",
        "answers": ["t1"],
        "query_aware": query_aware,
        "task": "demo",
    }
    methods = ["full", "pqcache", "snapkv", "h2o"]
    rows = evaluate.run_case(
        model,
        WordTokenizer(),
        case,
        methods,
        PQCacheConfig(token_budget=0.2, n_init=4, bits=4, kmeans_iters=5),
        max_new_tokens=3,
    )
    n_question = build_prompt(WordTokenizer(), context, case["question"]).encode(WordTokenizer())[1].shape[1]
    long_forwards = [n for n in lengths if n >= 200]
    assert long_forwards == [200 + n_question if query_aware else 200]  # the one prefill (context + question part)
    question_chunks = [n for n in lengths if 1 < n < 200]
    assert question_chunks == ([] if query_aware else [n_question] * len(methods))
    assert [r["method"] for r in rows] == methods and all(r["task"] == "demo" for r in rows)
    assert all(
        set(r) >= {"id", "method", "prediction", "score", "context_tokens", "prefill_s", "decode_s"} for r in rows
    )
    assert all(r["ended"] in ENDINGS and isinstance(r["repeating"], bool) for r in rows)


def test_summary_per_method_and_group():
    rows = [
        {"method": "a", "score": 1.0, "task": "x", "ended": "end_of_answer", "repeating": False},
        {"method": "a", "score": 0.0, "task": "y", "ended": "max_new_tokens", "repeating": True},
        {"method": "b", "score": 0.5, "task": "x", "ended": "max_new_tokens", "repeating": False},
    ]
    assert evaluate.summarize(rows) == [
        {"method": "a", "cases": 2, "score": 50.0, "at_max": 1, "repeating": 1},
        {"method": "b", "cases": 1, "score": 50.0, "at_max": 1, "repeating": 0},
    ]
    grouped = evaluate.summarize(rows, ["task"])
    assert {"task": "y", "method": "a", "cases": 1, "score": 0.0, "at_max": 1, "repeating": 1} in grouped
    assert len(grouped) == 3


def test_method_variants_run_in_one_case_with_their_own_settings():
    """ "pqcache/m=1/bits=4/rerank=1" is PQCache with those settings, forked from the same prefill:
    settings that change the codes get their own K-Means, the rest reuse the parent's index."""
    name, cfg = evaluate.method_spec("pqcache/m=1/bits=4/rerank=1", PQCacheConfig(token_budget=0.2))
    assert name == "pqcache" and (cfg.m, cfg.bits, cfg.rerank, cfg.token_budget) == (1, 4, 1, 0.2)
    assert evaluate.method_spec("oracle", PQCacheConfig())[1] == PQCacheConfig()
    _, cfg = evaluate.method_spec("pqcache/opq=true/chunk_attention=selected/bits=auto/token_budget=0.05", cfg)
    assert (cfg.opq, cfg.chunk_attention, cfg.bits, cfg.token_budget) == (True, "selected", None, 0.05)
    with pytest.raises(ValueError, match="not a PQCacheConfig setting"):
        evaluate.method_spec("pqcache/speed=fast", PQCacheConfig())
    model = tiny_model("llama")
    case = {
        "id": "v",
        "context": " ".join(f"w{i}" for i in range(300)),
        "question": "w1 w2",
        "answers": ["t1"],
        "query_aware": False,
    }
    methods = ["pqcache", "pqcache/m=1/bits=4/rerank=1", "pqcache/rerank=1"]
    rows = evaluate.run_case(
        model, WordTokenizer(), case, methods, PQCacheConfig(token_budget=0.2, n_init=4, kmeans_iters=3, bits=5), 4
    )
    assert [r["method"] for r in rows] == methods and all(r["new_tokens"] == 4 for r in rows)
    base = PQCache(model, PQCacheConfig(token_budget=0.2, n_init=4, kmeans_iters=3, bits=5))
    with torch.no_grad():
        model(torch.randint(1, 96, (1, 300)), cache=base)
    base.wait()
    same = base.fork("pqcache", evaluate.method_spec("pqcache/rerank=1", base.pq_config)[1])
    other = base.fork("pqcache", evaluate.method_spec("pqcache/m=1/bits=4", base.pq_config)[1])
    parent_index = base.pq_layers[0].method_state["index"]
    assert same.pq_layers[0].method_state["index"].segments[0][1] is parent_index.segments[0][1]
    other.wait()
    assert other.pq_layers[0].method_state["index"].bits == 4 and other.pq_config.m == 1


@pytest.mark.parametrize("query_aware", [True, False])
@pytest.mark.parametrize(
    "settings",
    [dict(n_local=5000), dict(token_budget=5000, n_local=None), dict(n_init=5000, n_local=8)],
    ids=["window", "budget", "sinks"],
)
def test_a_selection_past_the_document_answers_as_full_attention_in_eval_and_generate(query_aware, settings):
    """A window, budget or sink count past the document reads all of it: `eval` (both prompt orders) and `generate`
    (the document cached first) give full attention's tokens, on each method that keeps every token it can."""
    from pqcache.serving.generate import generate

    model, tok = tiny_model("gemma3"), WordTokenizer()
    context = " ".join(f"w{(3 * i) % 41}" for i in range(300))
    case = {"id": "c", "context": context, "question": "what is w7 ?", "answers": ["t1"], "task": "past"}
    config = PQCacheConfig(**{"token_budget": 0.1, "n_init": 4, "bits": 4, "kmeans_iters": 5, **settings})
    methods = ["full", "pqcache", "oracle", "sparq"]
    rows = evaluate.run_case(model, tok, {**case, "query_aware": query_aware}, methods, config, max_new_tokens=6)
    assert len({tuple(r["tokens"]) for r in rows}) == 1, [(r["method"], r["tokens"]) for r in rows]
    prompt = build_prompt(tok, context, case["question"])
    full = generate(model, tok, prompt, method="full", config=config, max_new_tokens=6)
    assert generate(model, tok, prompt, method="pqcache", config=config, max_new_tokens=6).tokens == full.tokens
