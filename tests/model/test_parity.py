"""The app answers as the CLI and the evaluation do: the same document and question through the Q&A tab (its
worker, its load settings with a block cache on a CPU, its observer, on threads as the page runs them), through
`generate` and through `eval` (the CLI's default settings), give the same tokens and the same sources, for
PQCache and for full attention, on the bundled model."""

import json
import types
from pathlib import Path

from pqcache.serving.pool import SessionPool
from pqcache.serving.settings import LoadSettings

ROOT = Path(__file__).resolve().parents[2]
LICENCE = ROOT / "assets" / "realdocs" / "GPL-2.txt"  # a real licence, about 3,950 tokens
FIRST_CHARS = 7000  # its first sections, about 1,500 tokens (a third of the time; the question is about its head)
QUESTION = "When was version 2 of this license released?"
METHODS = ("full", "pqcache")
USER = types.SimpleNamespace(session_hash="reader")


def app_answers(model, tok, document: Path) -> dict:
    """{method: (answer text as the chat shows it, what the tab kept of it)} through the Q&A tab's handlers."""
    from studio import Studio
    from studio.qa import QATab

    tab = QATab(Studio(model, tok, SessionPool(max_bytes=2**30, idle_s=None)))
    *_, loaded = tab.loader.load_document(str(document), "", *LoadSettings().values(), request=USER)
    assert loaded[0].startswith("Loaded"), loaded[0]
    out = {}
    for method in METHODS:
        *_, last = tab.answers.ask(QUESTION, [], method, 24, "5", request=USER)
        chat = last[0]
        out[method] = (chat[-1]["content"].split("\n\n*")[0], tab.answers.kept[USER.session_hash][1])
    tab.studio.pool.close()
    return out


def test_the_app_the_cli_and_the_eval_give_the_same_tokens(real_model, cli, tmp_path):
    model, tok = real_model
    text = LICENCE.read_text(encoding="utf-8")
    document = tmp_path / "GPL-2-head.txt"
    document.write_text(text[: text.rindex("\n\n", 0, FIRST_CHARS)], encoding="utf-8")  # whole paragraphs
    app = app_answers(model, tok, document)
    generated = {}
    for method in METHODS:
        proc = cli(
            "generate",
            "--context-file",
            document,
            "--question",
            QUESTION,
            "--method",
            method,
            "--max-new-tokens",
            24,
            "--json",
        )
        assert proc.returncode == 0, proc.stderr
        generated[method] = json.loads(proc.stdout.strip().splitlines()[-1])
    cases, rows = tmp_path / "case.jsonl", tmp_path / "rows.jsonl"
    case = {"id": "gpl2", "context": document.read_text(encoding="utf-8"), "question": QUESTION}
    cases.write_text(json.dumps({**case, "answers": ["June 1991"], "query_aware": False}) + "\n")
    proc = cli("eval", "--cases", cases, "--methods", ",".join(METHODS), "--max-new-tokens", 24, "--out", rows)
    assert proc.returncode == 0, proc.stderr
    evaluated = {r["method"]: r for r in map(json.loads, rows.read_text().splitlines())}

    for method in METHODS:
        text, kept = app[method]
        tokens = generated[method]["tokens"]
        assert kept["tokens"] == tokens == evaluated[method]["tokens"], method
        assert text.strip() == generated[method]["text"].strip() == evaluated[method]["prediction"].strip()
        ours = [[s["start"], s["end"], s["share"]] for s in generated[method]["sources"]]
        assert [[s["start"], s["end"], s["share"]] for s in kept["sources"]] == ours == evaluated[method]["sources"]
    assert "June 1991" in generated["full"]["text"]  # the answer is right with full attention
