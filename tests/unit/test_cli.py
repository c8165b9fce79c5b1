"""The command line on tiny models: a document from standard input or a file of any extension, and the console
script's help."""

import importlib
import io
import json
import shutil
import subprocess
import sys
import tomllib
from importlib.metadata import entry_points
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SUBCOMMANDS = ("generate", "chat", "bench", "eval", "datasets", "loadtest", "calibrate")
DOCUMENT = "Notes from the meeting.\nThe secret code for the blue door is 4721.\n"


def test_pqcache_console_script_help_lists_the_subcommands(capsys):
    """pyproject's `pqcache` console script is the CLI of `python -m pqcache` (the installed command when present)."""
    target = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]["pqcache"]
    assert target == "pqcache.cli.main:main"
    module, func = target.split(":")
    main = getattr(importlib.import_module(module), func)
    with pytest.raises(SystemExit) as exc:  # the console-script wrapper runs sys.exit(main())
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert all(cmd in out for cmd in SUBCOMMANDS), out
    installed = list(entry_points(group="console_scripts", name="pqcache"))
    assert all(ep.value == target for ep in installed), installed
    if installed and shutil.which("pqcache"):
        proc = subprocess.run(["pqcache", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert all(cmd in proc.stdout for cmd in SUBCOMMANDS), proc.stdout


def test_context_file_dash_reads_standard_input(chat_model_dir, capsys, monkeypatch):
    import io

    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(DOCUMENT.encode())))
    code, result, err = generate_in_process(capsys, "--model", str(chat_model_dir), "--context-file", "-", "--json")
    assert code == 0, err
    assert result["stats"]["prompt_tokens"] == prompt_tokens(chat_model_dir, DOCUMENT)  # the document was read
    assert result["ended"] in ("eos", "repetition", "max_new_tokens") and len(result["tokens"]) <= 3
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(bytes(range(256)) * 4)))
    code, _, err = generate_in_process(capsys, "--model", str(chat_model_dir), "--context-file", "-")
    assert code == 2 and "error: standard input: unsupported file type" in err and "Traceback" not in err


def test_a_text_file_without_a_known_extension_is_read(chat_model_dir, capsys, tmp_path):
    notes = tmp_path / "notes"
    notes.write_text(DOCUMENT, encoding="utf-8")
    code, result, err = generate_in_process(
        capsys, "--model", str(chat_model_dir), "--context-file", str(notes), "--json"
    )
    assert code == 0, err
    assert result["stats"]["prompt_tokens"] == prompt_tokens(chat_model_dir, DOCUMENT)
    (tmp_path / "photo").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(300))
    code, _, err = generate_in_process(
        capsys, "--model", str(chat_model_dir), "--context-file", str(tmp_path / "photo")
    )
    assert code == 2 and "photo: unsupported file type" in err


# ---- documents from standard input and from files without a known extension (a tiny chat model, in-process) --
@pytest.fixture(scope="module")
def chat_model_dir(tmp_path_factory):
    """A local Hugging Face folder with a tiny model whose tokenizer has a chat template (`--model PATH`)."""
    from tests.tiny import tiny_chat_model

    path = tmp_path_factory.mktemp("chat-model")
    model, tok = tiny_chat_model()
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def generate_in_process(capsys, *args) -> tuple[int, dict | None, str]:
    from pqcache.cli.main import main

    code = main(["generate", "--method", "full", "--question", "What is the code?", "--max-new-tokens", "3", *args])
    out, err = capsys.readouterr()
    return code, (json.loads(out.strip().splitlines()[-1]) if code == 0 else None), err


def prompt_tokens(model_dir, text: str) -> int:
    from transformers import AutoTokenizer

    from pqcache.serving.prompt import build_prompt

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    return sum(ids.shape[1] for ids in build_prompt(tok, text, "What is the code?").encode(tok))


# ---- chat with a document store: the conversation kept, then resumed by another run -------------------------------
def chat_in_process(capsys, monkeypatch, model_dir, document, questions, *flags) -> tuple[int, str, str]:
    from pqcache.cli.main import main

    monkeypatch.setattr(sys, "stdin", io.StringIO("".join(q + "\n" for q in questions)))
    capsys.readouterr()
    args = ["chat", "--model", str(model_dir), "--context-file", str(document), "--max-new-tokens", "4", *flags]
    code = main(args)
    out, err = capsys.readouterr()
    return code, out, err


def test_chat_resumes_the_conversation_kept_in_the_store(chat_model_dir, capsys, monkeypatch, tmp_path):
    """A first `chat --store DIR` run asks one question; a second run with --resume reads the document back (no
    prefill), replays the kept turn, and answers the follow-up as one run asking both does, sources included."""
    document = tmp_path / "notes.txt"
    document.write_text(DOCUMENT, encoding="utf-8")
    questions = ["What is the code?", "Repeat that number."]
    code, both, err = chat_in_process(capsys, monkeypatch, chat_model_dir, document, questions)
    assert code == 0, err
    store = ["--store", str(tmp_path / "documents")]
    code, first, err = chat_in_process(capsys, monkeypatch, chat_model_dir, document, questions[:1], *store)
    assert code == 0 and "(prefilled)" in err, err
    resumed = [*store, "--resume"]
    code, second, err = chat_in_process(capsys, monkeypatch, chat_model_dir, document, questions[1:], *resumed)
    assert code == 0 and "(from the store, no prefill)" in err and "[resumed: 1 earlier turns]" in err, err
    assert first + second == both
    code, _, err = chat_in_process(capsys, monkeypatch, chat_model_dir, document, questions, "--resume")
    assert code == 2 and "give --store DIR too" in err and "Traceback" not in err
