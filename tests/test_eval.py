"""Evaluation harness: case parsing, scoring, one prefill per case, generators' needle placement."""

import json

import pytest
import torch

from pqcache import PQCache, PQCacheConfig
from pqcache.eval import datasets, evaluate
from pqcache.serving.prompt import build_prompt
from pqcache.serving.stopping import ENDINGS

from .conftest import WordTokenizer, tiny_model


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


@pytest.fixture(scope="module")
def tok(real_model):
    return real_model[1]


def test_niah_needle_at_a_sentence_boundary_at_depth(tok):
    cases = datasets.niah(tok, lengths=(1024,), depths=(0.0, 0.5, 1.0), query_aware="both")
    assert len(cases) == 6 and {c["query_aware"] for c in cases} == {True, False}
    sents = datasets.haystack(tok, 1024 - 40)
    for case in cases[::2]:
        ctx = case["context"]
        assert ctx.count(datasets.NEEDLE) == 1
        i = round(case["depth"] * len(sents))
        assert ctx == " ".join(sents[:i] + [datasets.NEEDLE] + sents[i:])  # between whole sentences
        assert len(tok(ctx).input_ids) <= 1024


def test_natural_needle_cases_ask_in_plain_words(tok):
    cases = datasets.niah(tok, lengths=(1024, 2048), depths=(0.1, 0.5, 0.9), query_aware="both", natural=True)
    assert len(cases) == 12 and len({c["id"] for c in cases}) == 12
    assert {c["task"] for c in cases} == {"niah_natural"}
    sents = datasets.haystack(tok, 1024 - 40)
    for case, twin in zip(cases[::2], cases[1::2]):
        assert (case["query_aware"], twin["query_aware"]) == (True, False)
        assert {k: v for k, v in case.items() if k not in ("id", "query_aware")} == {
            k: v for k, v in twin.items() if k not in ("id", "query_aware")
        }
        (answer,) = case["answers"]
        question, needle, ctx = case["question"], case["needle"], case["context"]
        assert question.endswith("?") and answer.lower() not in question.lower()  # no answer cue, no answer
        assert answer in needle and ctx.count(needle) == 1 and ctx.count(answer) == 1
        if case["length"] == 1024:
            i = round(case["depth"] * len(sents))
            assert ctx == " ".join(sents[:i] + [needle] + sents[i:])  # between whole sentences, at the depth
        assert len(tok(ctx).input_ids) <= case["length"]
    assert len({c["fact"] for c in cases}) == 6  # every kind of fact: codes, words, numbers, names, places
    again = datasets.niah(tok, lengths=(1024, 2048), depths=(0.1, 0.5, 0.9), query_aware="both", natural=True)
    assert again == cases  # seeded


def test_datasets_cli_writes_natural_cases(tmp_path, real_model):
    from pqcache.cli.main import main

    out = tmp_path / "natural.jsonl"
    args = ["datasets", "niah", "--natural", "--lengths", "1024", "--depths", "0.5", "--query-aware", "false"]
    assert main([*args, "--out", str(out)]) == 0
    (case,) = evaluate.load_cases(out)
    assert case["task"] == "niah_natural" and case["query_aware"] is False and case["question"].endswith("?")


def test_ruler_cases_hold_their_answers(tok):
    cases = datasets.ruler(tok, length=1024, n=1, query_aware="true")
    assert [c["task"] for c in cases] == list(datasets.RULER_TASKS)
    for c in cases:
        assert all(a in c["context"] for a in c["answers"]), c["id"]
        assert len(tok(c["context"]).input_ids) <= 1100
    mv = next(c for c in cases if c["task"] == "niah_multivalue")
    assert len(mv["answers"]) == 3
    with pytest.raises(ValueError, match="unknown RULER task"):
        datasets.ruler(tok, tasks=("nope",))


def test_recall_study_on_real_keys(real_model):
    model, tok = real_model
    text = tok.decode(tok(datasets.essays_text()).input_ids[1:700])
    from pqcache.eval.recall import recall_study

    rows = recall_study(
        model, tok, text, ms=(2,), bits_list=(4, 8), reranks=(1, 4, 1000), budgets=(0.1,), n_queries=4, iters=5
    )
    oracle, rows = [r for r in rows if r["method"] == "oracle"], [r for r in rows if r["method"] == "pqcache"]
    assert [(r["layer"], r["bits"], r["rerank"]) for r in rows][:4] == [(5, 4, 1), (5, 4, 4), (5, 4, 1000), (5, 8, 1)]
    assert len(rows) == 3 * 2 * 3 and [r["layer"] for r in oracle] == [5, 11, 17]  # one Oracle row a layer and budget
    assert all(0 <= r["recall"] <= 1 and 0 < r["mass_recall"] <= 1 and 0 <= r["qhead_recall"] <= 1 for r in rows)
    by = {(r["layer"], r["bits"], r["rerank"]): r for r in rows}
    for (layer, bits, rerank), r in by.items():
        if rerank == 1000:  # every candidate re-ranked exactly: the exact top-k itself
            assert r["recall"] == 1.0
        if rerank == 4:
            assert r["recall"] >= by[(layer, bits, 1)]["recall"]  # the re-rank only adds exact information
    for o in oracle:  # the exact top-k under the combine: all of itself; each query head's own top-k only in part
        exact = by[(o["layer"], 4, 1000)]
        assert o["recall"] == 1.0 and o["qhead_recall"] == exact["qhead_recall"] and o["qhead_recall"] <= 1


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
