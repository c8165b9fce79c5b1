"""The evaluation's cases and studies on the bundled model: needle and RULER-style cases hold their answers, natural
questions, the recall study on real keys."""

import pytest

from pqcache.eval import datasets, evaluate


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
        model,
        tok,
        text,
        ms=(2,),
        bits_list=(4, 8),
        reranks=(1, 4, 1000),
        margins=(0.0, 0.5),
        budgets=(0.1,),
        n_queries=4,
        iters=5,
    )
    oracle, rows = [r for r in rows if r["method"] == "oracle"], [r for r in rows if r["method"] == "pqcache"]
    first = [(r["layer"], r["bits"], r["rerank"], r["margin"]) for r in rows][:6]
    assert first == [
        (5, 4, 1, 0.0),
        (5, 4, 4, 0.0),
        (5, 4, 4, 0.5),
        (5, 4, 1000, 0.0),
        (5, 4, 1000, 0.5),
        (5, 8, 1, 0.0),
    ]
    # without a re-rank no margin applies: one row; with one, a row per margin
    assert len(rows) == 3 * 2 * 5 and [r["layer"] for r in oracle] == [5, 11, 17]  # one Oracle row a layer and budget
    assert all(0 <= r["recall"] <= 1 and 0 < r["mass_recall"] <= 1 and 0 <= r["qhead_recall"] <= 1 for r in rows)
    by = {(r["layer"], r["bits"], r["rerank"], r["margin"]): r for r in rows}
    for (layer, bits, rerank, _margin), r in by.items():
        if rerank == 1000:  # every candidate re-ranked exactly: the exact top-k itself, whatever ranked them first
            assert r["recall"] == 1.0
        if rerank == 4:
            assert r["recall"] >= by[(layer, bits, 1, 0.0)]["recall"]  # the re-rank only adds exact information
    for o in oracle:  # the exact top-k under the combine: all of itself; each query head's own top-k only in part
        exact = by[(o["layer"], 4, 1000, 0.0)]
        assert o["recall"] == 1.0 and o["qhead_recall"] == exact["qhead_recall"] and o["qhead_recall"] <= 1
