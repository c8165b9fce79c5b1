"""SCBench's shared-context format (pqcache/eval/scbench.py) and the sets made here (scbench_data.py): the layout,
SCBench's scoring per task, both modes on a tiny model (a full budget equals full attention at every turn), the
golden answers a multi-turn conversation keeps, and the generated tasks' answers in their contexts."""

import json

import pytest

from pqcache import PQCacheConfig
from pqcache.eval import scbench, scbench_data
from pqcache.eval.case_formats import CaseError
from tests.tiny import WordTokenizer, tiny_model

CONTEXT = " ".join(f"w{(7 * i) % 31}" for i in range(260))
CASE = {
    "id": "c1",
    "task": "kv",
    "context": CONTEXT,
    "multi_turns": [{"input": "what is w3", "answer": "t5"}, {"input": "and w9", "answer": ["t7", "t8"]}],
}


def test_load_cases_reads_the_layout_and_names_what_is_wrong(tmp_path):
    path = tmp_path / "s.jsonl"
    path.write_text(
        json.dumps(CASE) + "\n\n" + json.dumps({"context": "c", "multi_turns": [{"input": "q", "answer": "a"}]})
    )
    first, second = scbench.load_cases(path)
    assert first["id"] == "c1" and first["task"] == "kv" and (second["id"], second["task"]) == ("3", "scbench")
    for line, message in [
        ("{nope", ":1: not JSON"),
        (json.dumps({"context": "c", "multi_turns": []}), "needs context and a non-empty multi_turns"),
        (json.dumps({"context": "c", "multi_turns": [{"input": "q"}]}), "turn 0 needs an input string and an answer"),
    ]:
        path.write_text(line)
        with pytest.raises(CaseError, match=message):
            scbench.load_cases(path)


def test_scores_follow_scbench_per_task():
    assert scbench.score("kv", "The value is 3f2a9c01.", "3F2A9C01") == 1.0
    assert scbench.score("passkey", "It is 12345", ["54321", "12345"]) == 1.0
    assert scbench.score("prefix_suffix", "abc", "abcdef") == 0.0
    assert scbench.score("vt", "ABCDE, FGHJK and LMNPQ", ["ABCDE", "FGHJK", "LMNPQ"]) == 1.0
    assert scbench.score("vt", "ABCDE and FGHJK", ["ABCDE", "FGHJK", "LMNPQ"]) == 0.0  # every variable named
    assert scbench.score("realdocs", "June 1991", [["June 1991"], ["1991"]]) == 1.0
    assert (
        scbench.golden(["ABCDE", "FGHJK"]) == "ABCDE, FGHJK" and scbench.golden([["June 1991", "1991"]]) == "June 1991"
    )


@pytest.mark.parametrize("mode", scbench.MODES)
def test_both_modes_at_a_full_budget_answer_as_full_attention_at_every_turn(mode):
    model = tiny_model("gemma3")
    config = PQCacheConfig(token_budget=1.0, n_init=4, bits=4, kmeans_iters=3)
    rows = scbench.run_case(model, WordTokenizer(), CASE, ["full", "pqcache", "snapkv"], config, mode, 4)
    assert [(r["method"], r["turn"]) for r in rows] == [(m, t) for m in ("full", "pqcache", "snapkv") for t in (0, 1)]
    assert all(set(r) >= {"id", "turn", "method", "score", "answer", "prediction", "mode"} for r in rows)
    by_turn = {t: {r["prediction"] for r in rows if r["turn"] == t} for t in (0, 1)}
    assert all(len(p) == 1 for p in by_turn.values()), by_turn  # the same answer from every method
    summary = scbench.summarize(rows)
    assert {(s["method"], s["turn"]) for s in summary} == {(r["method"], r["turn"]) for r in rows}


def test_multi_turn_keeps_the_golden_answers_and_multi_request_none(monkeypatch):
    from pqcache.serving.conversation import Conversation

    told = []
    real = Conversation.tell
    monkeypatch.setattr(Conversation, "tell", lambda self, q, a, stop=None: (told.append((q, a)), real(self, q, a))[1])
    config = PQCacheConfig(token_budget=0.2, n_init=4, bits=4, kmeans_iters=3)
    model = tiny_model("llama")
    scbench.run_case(model, WordTokenizer(), CASE, ["pqcache"], config, "multi-turn", 3)
    assert told == [("what is w3", "t5"), ("and w9", "t7, t8")]
    told.clear()
    scbench.run_case(model, WordTokenizer(), CASE, ["pqcache"], config, "multi-request", 3)
    assert told == []
    rows = scbench.run_case(model, WordTokenizer(), CASE, ["pqcache"], config, "both", 3)  # one read, two modes
    assert [(r["mode"], r["turn"]) for r in rows] == [(m, t) for m in scbench.MODES for t in (0, 1)]
    assert told == [("what is w3", "t5"), ("and w9", "t7, t8")]
    with pytest.raises(ValueError, match="must be one of multi-turn, multi-request, both or added-document"):
        scbench.run_case(model, WordTokenizer(), CASE, ["pqcache"], config, "every", 3)


@pytest.mark.parametrize("task", scbench_data.TASKS)
def test_generated_tasks_hold_each_turns_answer_in_their_context(task):
    tok = WordTokenizer()
    (case,) = scbench_data.synthetic(tok, [task], [600], 1, 5, seed=3)
    assert case["id"] == f"{task}-600-0" and len(case["multi_turns"]) == 5
    assert len(tok(case["context"]).input_ids) <= 600
    for turn in case["multi_turns"]:
        for answer in scbench.accepted(turn["answer"]):
            assert answer in case["context"], (turn, answer)
    assert len({t["input"] for t in case["multi_turns"]}) == 5  # five different questions
    again = scbench_data.synthetic(tok, [task], [600], 1, 5, seed=3)
    assert again == [case]  # the same seed, the same set


def test_real_document_conversations_are_one_per_licence():
    conversations = scbench_data.realdoc_conversations()
    assert len(conversations) == 5 and sum(len(c["multi_turns"]) for c in conversations) == 26
    for c in conversations:
        for turn in c["multi_turns"]:
            groups = turn["answer"] if isinstance(turn["answer"][0], list) else [turn["answer"]]
            assert any(a.lower() in c["context"].lower() for a in groups[0])


def test_added_document_mode_adds_the_context_to_another_conversation(monkeypatch):
    """The case's context read into a conversation over another case (its first turn kept), beside the same turns
    on the context alone; at a full budget PQCache answers as full attention there too."""
    from pqcache.serving.conversation import Conversation

    added = []
    real = Conversation.add_document
    monkeypatch.setattr(
        Conversation,
        "add_document",
        lambda self, text, name="", stop=None, progress=None: (
            added.append((self.n_tokens, name)),
            real(self, text, name),
        )[1],
    )
    other = {**CASE, "id": "c0", "context": " ".join(f"v{(3 * i) % 29}" for i in range(200))}
    config = PQCacheConfig(token_budget=1.0, n_init=4, bits=4, kmeans_iters=3)
    rows = scbench.run_case(
        model := tiny_model("llama"), WordTokenizer(), CASE, ["full", "pqcache"], config, scbench.ADDED, 4, first=other
    )
    assert [(r["mode"], r["method"], r["turn"]) for r in rows] == [
        (mode, m, t) for mode in ("multi-request", scbench.ADDED) for m in ("full", "pqcache") for t in (0, 1)
    ]
    assert [name for _, name in added] == ["c1", "c1"] and all(n > 200 for n, _ in added)  # after the first turn
    alone, joined = ([r for r in rows if r["mode"] == mode] for mode in ("multi-request", scbench.ADDED))
    assert all(j["context_tokens"] > a["context_tokens"] for a, j in zip(alone, joined))
    for t in (0, 1):
        assert len({r["prediction"] for r in joined if r["turn"] == t}) == 1
    with pytest.raises(ValueError, match="needs another case"):
        scbench.run_case(model, WordTokenizer(), CASE, ["pqcache"], config, scbench.ADDED, 4)
