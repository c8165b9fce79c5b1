"""Each setting has one declaration: PQCacheConfig's fields say their help, label and choices (engine/config.py), the
server's settings their defaults (serving/server_settings.py); the command line's flags, the app's flags and the
load form's labels and messages come from there, and no other module writes a default of its own."""

import ast
import contextlib
import io
import re
from pathlib import Path

import pytest

from pqcache.engine.config import PQCacheConfig, described
from pqcache.serving.server_settings import ServerSettings
from pqcache.serving.settings import LoadSettings

ROOT = Path(__file__).resolve().parents[2]
# where a setting's default may be written: its declaration
DECLARED_IN = {ROOT / "pqcache/engine/config.py", ROOT / "pqcache/serving/server_settings.py"}
# the settings whose defaults must not be written again (the form's m, bits and window use 0 for "chosen for you")
SETTINGS = {"pq_timeout_s", "kv_dtype", "token_budget", "n_init", "rerank", "kmeans_iters", "cache_policy"}
SETTINGS |= {"concurrency", "idle_s", "max_question_chars", "max_document_tokens", "store_cap_bytes"}


def flags_of(parse_args, args) -> dict[str, str]:
    """--flag -> its entry in `args --help` (the flag, its metavar and its help), on one line."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        parse_args([*args, "--help"])
    text = " ".join(out.getvalue().split())
    entries = re.split(r" (?=--[a-z][a-z-]* )", text)[1:]  # each option's entry: the flag, its metavar, its help
    return {entry.split()[0]: entry for entry in entries}


@pytest.fixture
def wide(monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")  # argparse wraps help at the terminal's width


@pytest.mark.parametrize("command", ["generate", "chat", "eval", "bench"])
def test_the_command_lines_engine_flags_come_from_the_config(command, wide):
    from pqcache.cli.args import build_parser

    parser = build_parser()
    flags = flags_of(parser.parse_args, [command])
    shown = [name for name in described() if "--" + name.replace("_", "-") in flags]
    assert {"m", "bits", "rerank", "kv_dtype"} <= set(shown)
    minimal = {"generate": ["--context-file", "f", "--question", "q"], "chat": ["--context-file", "f"]}
    parsed = parser.parse_args([command, *(["attention"] if command == "bench" else []), *minimal.get(command, [])])
    for name in shown:
        spec = described()[name]
        assert " ".join(spec.metadata["help"].split()) in flags["--" + name.replace("_", "-")], name
        assert getattr(parsed, name) == spec.default, name


def test_the_apps_flags_default_to_the_servers_settings(wide):
    import app

    args = app.parse_args([])
    server = app.server_settings(args)
    for name in ("model", "kv_dtype", "pq_timeout_s", "max_document_tokens", "max_question_chars", "concurrency"):
        assert getattr(server, name) == getattr(ServerSettings(), name), name
    assert server.idle_s == ServerSettings().idle_s and server.pq_timeout_s == PQCacheConfig().pq_timeout_s


@pytest.mark.parametrize(
    "form, field",
    [
        (LoadSettings(budget=-1), "token_budget"),
        (LoadSettings(n_init=-1), "n_init"),
        (LoadSettings(n_local=-1), "n_local"),
        (LoadSettings(capacity=-1), "block_cache_tokens"),
        (LoadSettings(policy="fifo"), "cache_policy"),
    ],
)
def test_the_forms_messages_name_the_field_by_its_declared_label(form, field):
    from pqcache import PQCacheConfigError

    with pytest.raises(PQCacheConfigError) as refused:
        form.to_config()
    assert str(refused.value).startswith(described()[field].metadata["label"])


def literal_defaults(path: Path):
    """(line, name, value) of every default written as a literal for one of SETTINGS in a module."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args.posonlyargs + node.args.args
            pairs = list(zip(args[len(args) - len(node.args.defaults) :], node.args.defaults))
            pairs += [(a, d) for a, d in zip(node.args.kwonlyargs, node.args.kw_defaults) if d is not None]
            for arg, default in pairs:
                if arg.arg in SETTINGS and isinstance(default, ast.Constant) and default.value is not None:
                    yield node.lineno, arg.arg, default.value
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id in SETTINGS:
            if isinstance(node.value, ast.Constant) and node.value.value is not None:
                yield node.lineno, node.target.id, node.value.value


def test_no_setting_has_a_default_written_twice():
    paths = [*ROOT.glob("pqcache/**/*.py"), *ROOT.glob("studio/*.py"), ROOT / "app.py"]
    again = [
        f"{path.relative_to(ROOT)}:{line} {name}={value!r}"
        for path in paths
        if path not in DECLARED_IN
        for line, name, value in literal_defaults(path)
    ]
    assert again == []


def test_the_check_finds_a_default_written_again(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text("def serve(pq_timeout_s: float = 120.0, name='x'):\n    pass\n", encoding="utf-8")
    assert list(literal_defaults(planted)) == [(1, "pq_timeout_s", 120.0)]


def test_the_kernels_are_one_setting_passed_whole():
    """Which decode kernels run is one value (engine/kernels.py), passed where it is used: no module of pqcache holds
    a switch of its own (a module-level True or False that a caller would patch), and the value travels whole
    through a config's plain data (a replica's view of a document rebuilds its config from it)."""
    from dataclasses import asdict

    from pqcache.engine.kernels import Kernels

    switches = []
    for path in sorted((ROOT / "pqcache").rglob("*.py")):
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
                if isinstance(node.value.value, bool):
                    switches += [f"{path.relative_to(ROOT)}: {ast.unparse(node)}"]
    assert switches == []
    kernels = Kernels(fused=False, native_select=False, block_copies_on_cpu=True)
    config = PQCacheConfig(token_budget=0.2, kernels=kernels)
    assert PQCacheConfig(**asdict(config)) == config
    assert PQCacheConfig(**asdict(config)).kernels == kernels
