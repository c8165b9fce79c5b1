"""The docs name what exists: every path, module, link and anchor, every `python -m pqcache` subcommand and flag and
every `python app.py` flag that README.md and docs/ show. A rename that leaves a doc behind fails here."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import io
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
HISTORY = ROOT / "docs" / "history.md"  # names what was, by design: only its links and commands are checked here
EXTERNAL = {"pred.py"}  # other projects' files the docs name (LongBench's pred.py)

# a path inside the repo, as the docs write it: a top-level folder or file of the project, then the rest
PATH = re.compile(
    r"(?<![\w./$~-])((?:pqcache|studio|viz|tests|scripts|assets|docs|\.ci)/[\w./*-]*[\w*]"
    r"|app\.py|pyproject\.toml|requirements(?:-\w+)?\.txt)"
)
BARE_PY = re.compile(r"(?<![\w./-])(\w+\.py)\b")  # a module named by its file name alone: cache.py
MODULE = re.compile(r"(?<![\w./-])((?:pqcache|studio|viz)(?:\.\w+)+)")  # pqcache.serving.session.DocumentSession
LINK = re.compile(r"\]\(([^)\s]+)\)|^\[[^\]]+\]:\s*(\S+)", re.MULTILINE)  # inline, or a reference's definition
CLI = re.compile(r"python -m pqcache((?:(?:[ \t]*\\\n[ \t]*|[ \t]+)[^\s|;&>#`\\]+)*)")
APP = re.compile(r"python app\.py((?:[ \t]+[^\s|;&>#`]+)*)")
FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = heading.strip().lower().replace("`", "")
    return re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", text))


def anchors(doc: Path) -> set[str]:
    return {slug(line.lstrip("#")) for line in doc.read_text(encoding="utf-8").splitlines() if line.startswith("#")}


def help_text(parse_args, args: list[str]) -> str | None:
    """What `--help` prints after `args` (parse_args: a command line's parser), or None when those words are not a
    command of it."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        try:
            parse_args([*args, "--help"])
        except SystemExit as done:
            return out.getvalue() if done.code == 0 else None
    return None


def cli_problems(words: list[str]) -> list[str]:
    """`python -m pqcache WORDS...`: the subcommand (and its first positional choice) answers --help, every flag
    shown is one of its flags."""
    from pqcache.cli.args import build_parser

    words = [w.strip("[]") for w in words if w != "..."]
    flags = FLAG.findall(" ".join(words))
    plain = [w for w in words if not w.startswith("-") and not w.startswith("<")]
    if not plain:
        return []  # `python -m pqcache --help` and the like
    command = plain[:1]
    text = help_text(build_parser().parse_args, command)
    if text is None:
        return [f"python -m pqcache {command[0]}: no such subcommand"]
    choice = re.search(r"positional arguments:\n\s+\{([\w,-]+)\}", text)  # bench's which, eval's mode
    if choice and len(plain) > 1 and words.index(plain[1]) == 1:
        if plain[1] not in choice.group(1).split(","):
            return [f"python -m pqcache {command[0]} {plain[1]}: not one of {{{choice.group(1)}}}"]
    known = set(FLAG.findall(text))
    return [f"python -m pqcache {command[0]}: no flag {flag}" for flag in flags if flag not in known]


def app_problems(words: list[str]) -> list[str]:
    import app

    known = set(FLAG.findall(help_text(app.parse_args, []) or ""))
    return [f"python app.py: no flag {flag}" for flag in FLAG.findall(" ".join(words)) if flag not in known]


def module_exists(dotted: str) -> bool:
    """pqcache.serving.session or pqcache.serving.session.DocumentSession (the longest module, then attributes)."""
    parts = dotted.split(".")
    for n in range(len(parts), 0, -1):
        name = ".".join(parts[:n])
        try:
            found = importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:
            found = False
        if found:
            obj = importlib.import_module(name)
            for attr in parts[n:]:
                if not hasattr(obj, attr):
                    return False
                obj = getattr(obj, attr)
            return True
    return False


def name_problems(text: str) -> list[str]:
    """Files, folders and modules the text names that do not exist."""
    found = []
    # a method spec such as pqcache/m=2/bits=6 is not a path
    paths = {m.group(1).rstrip(".") for m in PATH.finditer(text) if not text.startswith("=", m.end())}
    for path in sorted(paths):
        if "*" in path:
            if not list(ROOT.glob(path)):
                found.append(f"{path}: matches no file")
        elif not (ROOT / path).exists():
            found.append(f"{path}: no such file or folder")
    py_names = {p.name for p in ROOT.rglob("*.py") if ".git" not in p.parts} | EXTERNAL
    found += [f"{name}: no such module" for name in sorted(set(BARE_PY.findall(text))) if name not in py_names]
    dotted = {name for name in MODULE.findall(text) if not name.endswith(".py")}
    found += [f"{name}: no such module or attribute" for name in sorted(dotted) if not module_exists(name)]
    return found


def problems(text: str, where: Path) -> list[str]:
    """Every stale name in one document's text (where: the document, for its relative links)."""
    found = name_problems(text) if where != HISTORY else []
    for link in (inline or reference for inline, reference in LINK.findall(text)):
        if re.match(r"[a-z]+:", link):
            continue  # a web address: not ours to check
        target, _, anchor = link.partition("#")
        doc = (where.parent / target).resolve() if target else where
        if not doc.exists():
            found.append(f"link {link}: no such file")
        elif anchor and doc.suffix == ".md" and anchor not in anchors(doc):
            found.append(f"link {link}: no such heading in {doc.name}")
    for words in CLI.findall(text):
        unquoted = re.sub(r"\"[^\"]*\"|'[^']*'", "", words)  # --app-args "...": another program's flags
        found += cli_problems(unquoted.replace("\\\n", " ").split())
    for words in APP.findall(text):
        found += app_problems(words.split())
    return found


@pytest.mark.parametrize("doc", DOCS, ids=[d.name for d in DOCS])
def test_every_name_a_doc_shows_exists(doc):
    assert problems(doc.read_text(encoding="utf-8"), doc) == []


def test_a_planted_stale_name_fails(tmp_path):
    """The checks above find each kind of stale name: a file, a module, a link, an anchor, a subcommand, a flag."""
    doc = tmp_path / "planted.md"
    doc.write_text(
        "Run `pqcache/cli.py` or bench_app.py; see pqcache.serving.nowhere and [x](missing.md), "
        "[y](#no-such-heading), [z][ref].\n\n[ref]: other.md#x\n\n# A heading\n\n```bash\n"
        "python -m pqcache generate --context-file f "
        "--no-such-flag\npython -m pqcache nosuch\npython -m pqcache bench nosuch\npython app.py --no-such-flag\n```\n"
        "Fine: `python -m pqcache generate --json`, [a](#a-heading), `pqcache/engine/config.py`.\n",
        encoding="utf-8",
    )
    found = problems(doc.read_text(encoding="utf-8"), doc)
    assert sorted(found) == sorted(
        [
            "pqcache/cli.py: no such file or folder",
            "bench_app.py: no such module",
            "pqcache.serving.nowhere: no such module or attribute",
            "link missing.md: no such file",
            "link #no-such-heading: no such heading in planted.md",
            "link other.md#x: no such file",
            "python -m pqcache generate: no flag --no-such-flag",
            "python -m pqcache nosuch: no such subcommand",
            "python -m pqcache bench nosuch: not one of {attention,decode,ttft,memory,blockcache,e2e,kernels,app,"
            "conversation,store}",
            "python app.py: no flag --no-such-flag",
        ]
    )
