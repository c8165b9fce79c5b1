"""LongBench's and RULER's formats in `pqcache eval`: each metric against hand-computed values, the records read
from files written here (nothing is downloaded), the framed prompts, the middle truncation, and the CLI end to end
on a tiny model folder."""

import json

import pytest
import torch

from pqcache import PQCacheConfig
from pqcache.eval import case_formats, evaluate, longbench, ruler_format
from pqcache.eval import metrics as M
from tests.tiny import CHAT_TEMPLATE, byte_tokenizer, tiny_model


def _jsonl(path, records):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    return path


def _record(dataset, context="Passage 1: Paris is the capital of France.", question="What is the capital?", **kw):
    """A record with LongBench's fields, as its data files have them."""
    return {
        "input": question,
        "context": context,
        "answers": ["Paris"],
        "length": len(context.split()),
        "dataset": dataset,
        "language": "en",
        "all_classes": None,
        "_id": f"{dataset}-0",
        **kw,
    }


# ---- the metrics, by hand


def test_qa_f1_normalizes_articles_punctuation_and_case():
    # "cat sat on mat" (4 words) against "cat on mat" (3): 3 shared, P = 3/4, R = 1, F1 = 2 * 3/4 / (7/4) = 6/7
    assert M.qa_f1_score("The cat sat on the mat.", "a cat on a mat") == pytest.approx(6 / 7)
    assert M.qa_f1_score("PARIS!", "Paris") == 1.0
    assert M.qa_f1_score("the a an", "Paris") == 0.0  # nothing left after the articles
    assert M.qa_f1_score("Paris Paris", "Paris") == pytest.approx(2 / 3)  # P = 1/2 (multiset), R = 1


def test_rouge_l_is_the_lcs_f_measure():
    # LCS of "the cat sat on the mat" / "the cat was on the mat" is "the cat on the mat": 5 of 6 either way
    assert M.rouge_score("the cat sat on the mat", "the cat was on the mat") == pytest.approx(5 / 6)
    # "a b c d" against "a c e": LCS "a c", P = 2/4, R = 2/3, F = 2PR / (P + R) = 4/7
    assert M.rouge_score("a b c d", "a c e") == pytest.approx(4 / 7)
    assert M.rouge_score("", "a c e") == 0.0 and M.rouge_score("...", "a") == 0.0


def test_chinese_f1_and_rouge_go_through_jieba():
    assert M.jieba_words("我来到北京清华大学") == ["我", "来到", "北京", "清华大学"]
    # 2 of the prediction's 4 words are the reference's 2: P = 1/2, R = 1 -> 2/3, for F1 and ROUGE-L alike
    assert M.qa_f1_zh_score("我来到北京清华大学", "北京清华大学") == pytest.approx(2 / 3)
    assert M.rouge_zh_score("我来到北京清华大学", "北京清华大学") == pytest.approx(2 / 3)
    assert M.qa_f1_zh_score("北京，清华大学。", "北京清华大学") == 1.0  # Chinese punctuation is dropped
    assert longbench.score("multifieldqa_zh", "北京", ["上海", "北京"]) == 1.0  # the best answer counts


def test_classification_by_the_class_names_in_the_prediction():
    classes = ["Location", "Number", "Entity"]
    assert M.classification_score("Location", "Location", all_classes=classes) == 1.0
    assert M.classification_score("Location or Number", "Location", all_classes=classes) == 0.5
    assert M.classification_score("Entity", "Location", all_classes=classes) == 0.0
    assert M.classification_score("no idea", "Location", all_classes=classes) == 0.0  # no fallback (see metrics)
    # a class that is part of the right one is not counted against it ...
    assert M.classification_score("国际体育", "国际体育", all_classes=["体育", "国际体育", "财经"]) == 1.0
    # ... but LongBench's scan skips the name after a removed one: "AB" stays, so 1/2
    assert M.classification_score("ABC", "ABC", all_classes=["A", "AB", "ABC"]) == 0.5
    assert longbench.score("trec", "Location\nNumber", ["Location"], classes) == 1.0  # the first line only


def test_passage_retrieval_and_count_score_the_numbers_named():
    assert M.retrieval_score("Paragraph 3", "Paragraph 3") == 1.0
    assert M.retrieval_score("Paragraph 3 or Paragraph 12", "Paragraph 3") == 0.5
    assert M.retrieval_score("I cannot tell", "Paragraph 3") == 0.0  # no number at all
    assert M.retrieval_zh_score("段落3", "段落3") == 1.0
    assert M.retrieval_zh_score("段落3，段落5", "段落3") == 0.5
    assert M.count_score("There are 12 unique paragraphs.", "12") == 1.0
    assert M.count_score("12 or 13", "12") == 0.5
    assert M.count_score("120", "12") == 0.0 and M.count_score("", "12") == 0.0  # whole numbers only


def test_code_similarity_of_the_first_code_line():
    # the first line without "`", "#" or "//" anywhere: the fence, the comment and the commented code are skipped
    pred = "\n```python\n# the next line\ny = 2  # set\n    return x + 1\n"
    assert M.code_sim_score(pred, "    return x + 1") == 1.0
    # Indel similarity: "abcd" / "abce" differ by one deletion and one insertion: (8 - 2) / 8
    assert M.code_sim_score("abcd", "abce") == 0.75
    assert M.code_sim_score("// only a comment", "x = 1") == 0.0  # no code line: "" against the reference
    assert M.code_sim_score("abcdefg", "abcdefh") == 0.86  # 85.71 -> 86, rounded as fuzzywuzzy rounds


def test_ruler_string_match_all_and_part():
    refs = ["Apple", "banana"]
    assert M.string_match_all("an APPLE pie", refs) == 0.5 and M.string_match_part("an APPLE pie", refs) == 1.0
    assert M.string_match_all("Apple, Banana", refs) == 1.0
    assert M.string_match_all("cherry", refs) == 0.0 and M.string_match_part("cherry", refs) == 0.0
    assert M.string_match_all("anything", []) == 0.0 and M.string_match_part("anything", []) == 0.0
    assert ruler_format.score("string_match_all", "  apple\x00banana ", refs) == 1.0  # RULER's postprocess


def test_dataset_table_has_a_column_per_dataset_and_the_average():
    rows = [
        {"method": "full", "dataset": "qasper", "score": 1.0},
        {"method": "full", "dataset": "qasper", "score": 0.5},
        {"method": "full", "dataset": "hotpotqa", "score": 0.25},
        {"method": "pqcache", "dataset": "qasper", "score": 0.0},
        {"method": "pqcache", "dataset": "hotpotqa", "score": 0.4},
    ]
    assert evaluate.summarize(rows, by_dataset=True) == [  # LongBench's order: qasper before hotpotqa
        {"method": "full", "qasper": 75.0, "hotpotqa": 25.0, "avg": 50.0},
        {"method": "pqcache", "qasper": 0.0, "hotpotqa": 40.0, "avg": 20.0},
    ]


# ---- the files


def test_longbench_records_become_cases(tmp_path):
    trec = _record("trec", "Q: Where is Paris?\nType: Location", "Q: How many?", all_classes=["Location", "Number"])
    path = _jsonl(tmp_path / "mixed.jsonl", [_record("hotpotqa"), trec])
    hotpot, trec_case = evaluate.load_cases(path, "longbench")
    template = longbench.tables()[0]["hotpotqa"]
    assert hotpot["prompt"]["document"] + hotpot["prompt"]["question"] == template.format(
        context=hotpot["context"], input=hotpot["question"]
    )
    assert hotpot["prompt"]["document"].endswith(hotpot["context"])  # the document part ends with the context
    assert (hotpot["max_new_tokens"], hotpot["metric"], hotpot["id"]) == (32, "qa_f1_score", "hotpotqa-0")
    assert hotpot["query_aware"] is True and hotpot["chat_template"] is True and hotpot["stop"] is None
    assert (trec_case["max_new_tokens"], trec_case["stop"], trec_case["chat_template"]) == (64, "first_line", False)
    assert len(longbench.datasets()) == 21 and set(longbench.tables()[1]) == set(longbench.datasets())


def test_the_real_document_questions_as_longbench_records(tmp_path):
    """`datasets realdocs --format longbench`: each question a multifieldqa_en record whose answers are every
    alternative, read back by the LongBench reader with its prompt and QA F1."""
    from pqcache.eval.realdocs import as_longbench, realdocs

    cases = realdocs()
    path = _jsonl(tmp_path / "realdocs.jsonl", [as_longbench(c) for c in cases])
    loaded = evaluate.load_cases(path, "longbench")
    assert [c["id"] for c in loaded] == [c["id"] for c in cases] and len(loaded) >= 20
    control = next(c for c in loaded if c["id"] == "apache-control")
    assert control["answers"] == ["50", "fifty"] and control["metric"] == "qa_f1_score"
    assert control["context"] == next(c["context"] for c in cases if c["id"] == "apache-control")
    assert longbench.score("multifieldqa_en", "Fifty percent.", control["answers"]) > 0


def test_longbench_dataset_from_the_file_name_and_clear_errors(tmp_path):
    record = _record("qasper")
    del record["dataset"], record["_id"]
    (case,) = evaluate.load_cases(_jsonl(tmp_path / "qasper.jsonl", [record]), "longbench")
    assert case["dataset"] == "qasper" and case["id"] == "qasper-1"  # LongBench's eval.py names it by the file
    (case,) = evaluate.load_cases(_jsonl(tmp_path / "qasper_e.jsonl", [record]), "longbench")
    assert case["dataset"] == "qasper"  # LongBench-E
    bad = tmp_path / "bad.jsonl"
    for records, message in [
        ([record], ":1: missing dataset"),
        ([_record("hotpotqa"), {"context": "c"}], ":2: missing input, answers"),
        ([_record("nope")], "unknown LongBench dataset 'nope'; known: narrativeqa, qasper,"),
        ([_record("trec")], "all_classes must be a list of strings for trec"),
        ([_record("qasper", answers="Paris")], "answers must be a list of strings"),
    ]:
        with pytest.raises(evaluate.CaseError, match=message):
            evaluate.load_cases(_jsonl(bad, records), "longbench")
    with pytest.raises(ValueError, match="unknown case format"):
        evaluate.load_cases(bad, "longbenchh")


def test_ruler_records_become_cases(tmp_path):
    niah = {"index": 0, "input": "Some magic numbers ... What is it?", "outputs": ["123"], "length": 9}
    path = _jsonl(tmp_path / "niah_single_1" / "validation.jsonl", [{**niah, "answer_prefix": " The number is"}])
    (case,) = evaluate.load_cases(path, "ruler")
    assert (case["task"], case["metric"], case["max_new_tokens"], case["id"]) == (
        "niah_single_1",
        "string_match_all",
        128,
        "0",
    )
    assert case["prompt"] == {"document": niah["input"] + " The number is", "question": ""}
    qa = _jsonl(tmp_path / "qa_1.jsonl", [niah, {**niah, "index": 1, "task": "niah_multikey_2", "max_new_tokens": 9}])
    first, second = evaluate.load_cases(qa, "ruler")
    assert (first["task"], first["metric"], first["max_new_tokens"]) == ("qa_1", "string_match_part", 32)
    assert (second["task"], second["metric"], second["max_new_tokens"]) == ("niah_multikey_2", "string_match_all", 9)
    (other,) = evaluate.load_cases(_jsonl(tmp_path / "mine.jsonl", [niah]), "ruler")
    assert other["metric"] == "string_match_all" and "max_new_tokens" not in other  # the CLI's length then
    with pytest.raises(evaluate.CaseError, match=r"mine.jsonl:1: missing outputs"):
        evaluate.load_cases(_jsonl(tmp_path / "mine.jsonl", [{"input": "x"}]), "ruler")


# ---- prompts, truncation, stopping


def test_middle_truncation_keeps_both_ends():
    doc, q = torch.arange(10)[None], torch.arange(10, 13)[None]
    d, qq, cut = case_formats.middle_truncate(doc, q, 8)  # the first 4 and the last 4 of 13
    assert d.tolist() == [[0, 1, 2, 3, 9]] and qq.tolist() == [[10, 11, 12]] and cut == 5
    d, qq, cut = case_formats.middle_truncate(doc, q, 9)  # half = 4, as LongBench's int(max_length / 2)
    assert d.shape[1] + qq.shape[1] == 8 and cut == 5
    d, qq, cut = case_formats.middle_truncate(torch.arange(4)[None], torch.arange(4, 14)[None], 6)
    assert d.tolist() == [[0, 1, 2]] and qq.tolist() == [[11, 12, 13]]  # a long question loses its start
    assert case_formats.middle_truncate(doc, q, 13)[2] == 0 and case_formats.middle_truncate(doc, q, None)[2] == 0


def test_framed_prompts_with_and_without_a_chat_template(tmp_path):
    path = _jsonl(tmp_path / "c.jsonl", [_record("passage_count"), _record("lcc", "def f(x):\n")])
    count, lcc = evaluate.load_cases(path, "longbench")
    chat = byte_tokenizer(CHAT_TEMPLATE)
    prompt = case_formats.framed_prompt(chat, count)
    whole = count["prompt"]["document"] + count["prompt"]["question"]
    assert prompt.chat and prompt.document + prompt.question == chat.apply_chat_template(
        [{"role": "user", "content": whole}], tokenize=False, add_generation_prompt=True
    )
    assert prompt.document.endswith(count["context"]) and prompt.question.endswith("<|assistant|>\n")
    raw = case_formats.framed_prompt(chat, lcc)  # LongBench leaves code completion out of the chat template
    assert not raw.chat and raw.document + raw.question == "Please complete the code given below. \n" + (
        "def f(x):\nNext line of code:\n"
    )
    doc_ids, q_ids = raw.encode(chat)
    assert doc_ids[0, 0] == chat.bos_token_id and q_ids[0, 0] != chat.bos_token_id


def test_first_line_stop_keeps_the_whole_first_line():
    tok = byte_tokenizer()
    rule = case_formats.FirstLineStop(tok)
    ids = tok("\nLocation.\nNumber", add_special_tokens=False).input_ids
    ends = [n for n in range(1, len(ids) + 1) if rule.check(ids[:n])]
    assert tok.decode(ids[: ends[0]]) == "\nLocation.\n" and rule.check(ids[: ends[0]]) == ("end_of_answer", ends[0])


def test_a_long_longbench_case_is_cut_in_the_middle_and_scored():
    tok = byte_tokenizer()
    model = tiny_model("llama", vocab_size=len(tok), bos_token_id=1, eos_token_id=2)
    path_case = longbench.to_case(_record("passage_count", context="Paragraph 1: " + "word " * 400))
    cfg = PQCacheConfig(token_budget=0.2, n_init=4, kmeans_iters=3, bits=4)
    rows = evaluate.run_case(model, tok, path_case, ["pqcache"], cfg, max_new_tokens=5, max_length=300)
    for row in rows:
        assert row["context_tokens"] + row["question_tokens"] == 300 and row["truncated"] > 1800
        assert row["dataset"] == "passage_count" and 0 <= row["score"] <= 1 and row["new_tokens"] <= 32
        assert row["score"] == longbench.score("passage_count", row["prediction"], ["Paris"])
    full = evaluate.run_case(model, tok, path_case, ["full"], cfg, max_new_tokens=5)  # the model's 1024 positions
    assert full[0]["context_tokens"] + full[0]["question_tokens"] == 1024 - 32


# ---- the CLI, end to end


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory):
    tok = byte_tokenizer()
    path = tmp_path_factory.mktemp("tiny_llama")
    tiny_model("llama", vocab_size=len(tok), bos_token_id=1, eos_token_id=2).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _eval(capsys, *args):
    from pqcache.cli.main import main

    capsys.readouterr()
    code = main(["eval", "--methods", "full,pqcache", "--token-budget", "0.2", "--bits", "4", *map(str, args)])
    out, err = capsys.readouterr()
    assert code == 0, err[-2000:]
    return out


def test_eval_cli_longbench_table(tiny_llama_dir, tmp_path, capsys):
    from pqcache.cli.common import table as _table

    cases = _jsonl(tmp_path / "lb.jsonl", [_record("hotpotqa"), _record("passage_count", answers=["1"])])
    out_rows = tmp_path / "rows.jsonl"
    args = ("--cases", cases, "--format", "longbench", "--model", tiny_llama_dir, "--out", out_rows, "--json")
    summary = json.loads(_eval(capsys, *args))["rows"]
    assert [list(r) for r in summary] == [["method", "hotpotqa", "passage_count", "avg"]] * 2
    assert [r["method"] for r in summary] == ["full", "pqcache"]
    for r in summary:
        assert r["avg"] == round((r["hotpotqa"] + r["passage_count"]) / 2, 2) and 0 <= r["avg"] <= 100
    rows = [json.loads(line) for line in out_rows.read_text().splitlines()]
    assert len(rows) == 4 and [r["dataset"] for r in rows] == ["hotpotqa"] * 2 + ["passage_count"] * 2
    assert all(r["new_tokens"] <= 32 and r["truncated"] == 0 and r["query_aware"] for r in rows)
    assert evaluate.summarize(rows, by_dataset=True) == summary
    assert _table(summary).splitlines()[0].split() == ["method", "hotpotqa", "passage_count", "avg"]


def test_eval_cli_ruler_by_task(tiny_llama_dir, tmp_path, capsys):
    record = {"index": 0, "input": "The magic number is 42. What is the magic number?", "outputs": ["42"]}
    cases = _jsonl(
        tmp_path / "qa_1.jsonl", [{**record, "max_new_tokens": 4}, {**record, "index": 1, "max_new_tokens": 3}]
    )
    summary = json.loads(_eval(capsys, "--cases", cases, "--format", "ruler", "--model", tiny_llama_dir, "--json"))
    assert [(r["task"], r["method"], r["cases"]) for r in summary["rows"]] == [
        ("qa_1", "full", 2),
        ("qa_1", "pqcache", 2),
    ]
    assert all(0 <= r["score"] <= 100 for r in summary["rows"])
