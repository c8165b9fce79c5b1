"""`python -m pqcache chat --ray ...`: the conversation held on a Ray Serve replica answers, turn for turn and
source for source, as the same chat in one process (a run with --store and --resume: tests/unit/test_cli.py; a
conversation resumed on a replica: the contract, tests/contract.py)."""

import io
import sys

from pqcache.cli.main import main

DOCUMENT = "Notes from the meeting.\nThe secret code for the blue door is 4721.\n" * 3
QUESTIONS = ["What is the code?", "Repeat that number."]


def chat(capsys, monkeypatch, model_dir, document, questions, *flags):
    monkeypatch.setattr(sys, "stdin", io.StringIO("".join(q + "\n" for q in questions)))
    capsys.readouterr()
    args = ["chat", "--model", str(model_dir), "--context-file", str(document), "--max-new-tokens", "6", *flags]
    code = main(args)
    out, err = capsys.readouterr()
    assert code == 0, err
    return out, err


def test_chat_on_a_replica_answers_as_in_one_process(local_ray, model_dir, capsys, monkeypatch, tmp_path):
    document = tmp_path / "notes.txt"
    document.write_text(DOCUMENT, encoding="utf-8")
    here, err = chat(capsys, monkeypatch, model_dir, document, QUESTIONS)
    assert "on a Ray replica" not in err and "[turn 2: " in err
    there, err = chat(capsys, monkeypatch, model_dir, document, QUESTIONS, "--ray", "local")
    assert "on a Ray replica" in err and "[turn 2: " in err, err
    assert there == here and here.count("source 1 (") == 2  # both answers, token for token, with their sources
