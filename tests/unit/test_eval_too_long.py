"""eval on a file that mixes cases the model reads with cases longer than it reads (a tiny model of 1,024 positions,
a byte tokenizer: a character a token), in every format: the run ends with exit 0 and its summary; an over-long
case is skipped with rows that say so (`--too-long skip`, the default) or cut in the middle (`--too-long cut`), is
counted in the summary, and never runs past the model's positions; a case that fails is marked and the run goes
on."""

import json

import pytest

from pqcache.cli.main import main
from tests.unit.test_longbench import _jsonl, _record, tiny_llama_dir  # noqa: F401 - tiny_llama_dir: a fixture

FITS = "Passage 1: Paris is the capital of France. " * 4  # about 170 tokens
TOO_LONG = "Filler text that goes on. " * 60  # about 1,560 tokens: past the model's 1,024 positions


def cases(fmt: str, tmp_path):
    """(the format's file: a fitting case, an over-long one, a fitting one; the over-long case's id)."""
    if fmt == "pqcache":
        rows = [
            {"id": f"c{i}", "context": c, "question": "What is the capital?", "answers": ["Paris"]}
            for i, c in enumerate((FITS, TOO_LONG, FITS))
        ]
        return _jsonl(tmp_path / "cases.jsonl", rows), "c1"
    if fmt == "ruler":
        rows = [
            {"index": i, "input": c + " What is the capital?", "outputs": ["Paris"], "max_new_tokens": 4}
            for i, c in enumerate((FITS, TOO_LONG, FITS))
        ]
        return _jsonl(tmp_path / "qa_1.jsonl", rows), None
    if fmt == "scbench":
        turns = [{"input": "What is the capital?", "answer": "Paris"}, {"input": "And again?", "answer": "Paris"}]
        rows = [{"id": f"s{i}", "context": c, "multi_turns": turns} for i, c in enumerate((FITS, TOO_LONG, FITS))]
        return _jsonl(tmp_path / "sc.jsonl", rows), "s1"
    raise AssertionError(fmt)


def run(capsys, *args) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(["eval", "--methods", "full,pqcache", "--token-budget", "0.5", "--bits", "4", *map(str, args)])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("fmt", ["pqcache", "ruler", "scbench"])
def test_an_over_long_case_is_skipped_and_counted_and_the_others_are_scored(fmt, tiny_llama_dir, tmp_path, capsys):  # noqa: F811
    path, long_id = cases(fmt, tmp_path)
    out_rows = tmp_path / "rows.jsonl"
    args = ("--cases", path, "--format", fmt, "--model", tiny_llama_dir, "--max-new-tokens", 3, "--out", out_rows)
    code, out, err = run(capsys, *args, "--json")
    assert code == 0, err[-2000:]
    summary = json.loads(out)
    assert summary["skipped"] == 1 and summary["failed"] == 0 and summary["rows"], summary
    rows = [json.loads(line) for line in out_rows.read_text().splitlines()]
    skipped = [r for r in rows if "skipped" in r]
    assert len(skipped) == 2 and {r["method"] for r in skipped} == {"full", "pqcache"}  # a row per method
    assert all(r["skipped"] == "longer than the model reads" and r["limit"] <= 1024 for r in skipped), skipped
    assert all(r["prompt_tokens"] > r["limit"] for r in skipped)
    if long_id is not None:
        assert {r["id"] for r in skipped} == {long_id}
    scored = [r for r in rows if "score" in r]
    assert scored and all("skipped" not in r for r in scored)
    assert all(r.get("context_tokens", 0) <= 1024 for r in scored)  # nothing ran past the model's positions
    code, table, err = run(capsys, *args)  # the table says it too
    assert code == 0 and "1 case(s) skipped: longer than the model reads" in table, (table, err[-1000:])


@pytest.mark.parametrize("fmt", ["pqcache", "scbench"])
def test_too_long_cut_answers_every_case_within_the_models_positions(fmt, tiny_llama_dir, tmp_path, capsys):  # noqa: F811
    path, long_id = cases(fmt, tmp_path)
    out_rows = tmp_path / "rows.jsonl"
    args = ("--cases", path, "--format", fmt, "--model", tiny_llama_dir, "--max-new-tokens", 3, "--out", out_rows)
    code, out, err = run(capsys, *args, "--too-long", "cut", "--json")
    assert code == 0, err[-2000:]
    assert json.loads(out)["skipped"] == 0
    rows = [json.loads(line) for line in out_rows.read_text().splitlines()]
    assert all("score" in r for r in rows) and {r["id"] for r in rows} >= {long_id}
    cut = [r for r in rows if r["id"] == long_id]
    assert all(r["context_tokens"] < 1024 for r in cut), cut
    if fmt == "pqcache":
        assert all(r["truncated"] > 0 for r in cut)


def test_a_case_that_fails_is_marked_and_the_run_goes_on(tiny_llama_dir, tmp_path, capsys, monkeypatch):  # noqa: F811
    from pqcache.eval import evaluate

    real = evaluate.run_case

    def flaky(model, tok, case, *args, **kw):
        if case["id"] == "c2":
            raise RuntimeError("out of memory")
        return real(model, tok, case, *args, **kw)

    monkeypatch.setattr(evaluate, "run_case", flaky)
    path, _ = cases("pqcache", tmp_path)
    code, out, err = run(capsys, "--cases", path, "--model", tiny_llama_dir, "--max-new-tokens", 3, "--json")
    summary = json.loads(out)
    assert code == 0 and summary["failed"] == 1 and summary["skipped"] == 1, (summary, err[-1000:])
    assert [r["cases"] for r in summary["rows"]] == [1, 1]  # the one case left is scored, by each method
    assert "case 'c2': failed, RuntimeError: out of memory" in err


def test_longbench_cases_are_cut_as_before(tiny_llama_dir, tmp_path, capsys):  # noqa: F811
    path = _jsonl(tmp_path / "lb.jsonl", [_record("hotpotqa"), _record("hotpotqa", context=TOO_LONG, _id="long")])
    code, out, err = run(capsys, "--cases", path, "--format", "longbench", "--model", tiny_llama_dir, "--json")
    assert code == 0 and json.loads(out)["skipped"] == 0, err[-1000:]
