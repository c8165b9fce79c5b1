"""The codebase's shape: the rooms' layering (import-linter's contracts in pyproject.toml, run here and by .ci/run as
`lint-imports`; a wrong arrow fails), no import cycle between the project's modules (an import inside a function
counts: it is a dependency all the same), nothing imports app.py, every room says what it holds, no module over 300
lines and no class over 200 (tests excepted), and every CLI subcommand's --help."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("pqcache", "viz", "studio")
MAX_MODULE_LINES = 300  # past this a module may hold a second role
MAX_CLASS_LINES = 200  # and a class


def sources(with_scripts: bool = True) -> list[Path]:
    paths = [p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))] + [ROOT / "app.py"]
    return paths + (sorted((ROOT / "scripts").rglob("*.py")) if with_scripts else [])


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The project modules `path` imports anywhere in it (`from a.b import c` names a.b.c when that is a module)."""

    def known(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    here = module_name(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    deps = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            deps.update(known(a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = package
                for _ in range(node.level - 1):
                    pkg = pkg.rpartition(".")[0]
                base = f"{pkg}.{base}" if base else pkg
            deps.update(known(f"{base}.{a.name}") if f"{base}.{a.name}" in modules else known(base) for a in node.names)
    deps.discard(None)
    deps.discard(here)
    return deps


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle():
    paths = sources(with_scripts=False)
    modules = {module_name(p) for p in paths}
    graph = {module_name(p): imports_of(p, modules) for p in paths}
    assert graph["pqcache.fastpath.install"] >= {"pqcache.fastpath.layer", "pqcache.fastpath.step"}
    assert cycles(graph) == []


def oversized() -> list[str]:
    """Modules past MAX_MODULE_LINES and classes past MAX_CLASS_LINES: where a second role may hide, a place to look
    (the suite's closing summary lists them, tests/conftest.py), not a limit a change must squeeze under."""
    found = []
    for path in sources():
        text = path.read_text(encoding="utf-8")
        name = path.relative_to(ROOT)
        if len(text.splitlines()) > MAX_MODULE_LINES:
            found.append(f"{name}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES:
                found.append(f"{name}: class {node.name}, {node.end_lineno - node.lineno + 1} lines")
    return found


def test_the_size_report_names_a_long_module_and_a_long_class(tmp_path, monkeypatch):
    long_module = tmp_path / "long.py"
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_CLASS_LINES + 1))
    long_module.write_text("class Big:\n" + body + "\n" + "\n" * MAX_MODULE_LINES, encoding="utf-8")
    monkeypatch.setattr(sys.modules[__name__], "sources", lambda: [long_module])
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert oversized() == [
        f"long.py: {MAX_MODULE_LINES + MAX_CLASS_LINES + 2} lines",
        f"long.py: class Big, {MAX_CLASS_LINES + 2} lines",
    ]


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    """import-linter over the packages under `root`, with pyproject.toml's contracts."""
    exe = shutil.which("lint-imports") or pytest.fail("lint-imports is missing: pip install -r requirements-test.txt")
    return subprocess.run([exe, "--no-cache"], cwd=root, capture_output=True, text=True, timeout=300)


def test_the_import_contracts_hold():
    proc = lint_imports(ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "0 broken" in proc.stdout and "kept" in proc.stdout.lower()


@pytest.mark.parametrize(
    "module, wrong_import, contract",
    [
        ("pqcache/engine/config.py", "from pqcache.serving import loading", "The engine imports nothing above it"),
        ("pqcache/serving/prompt.py", "from pqcache.eval import metrics", "Serving imports none of"),
        ("viz/base.py", "import torch", "Figures are free of the engine"),
        ("studio/common.py", "from pqcache.bench import app", "The page reads serving, not the tools"),
        ("pqcache/eval/metrics.py", "from pqcache.cli import args", "Layers:"),
    ],
)
def test_a_wrong_import_breaks_a_contract(tmp_path, module, wrong_import, contract):
    """A copy of the packages with one import against the layering: lint-imports fails and names the contract."""
    for name in PACKAGES:
        shutil.copytree(ROOT / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    target = tmp_path / module
    target.write_text(target.read_text(encoding="utf-8") + f"\n{wrong_import}  # a wrong arrow\n", encoding="utf-8")
    proc = lint_imports(tmp_path)
    assert proc.returncode != 0, proc.stdout[-3000:]
    broken = proc.stdout.split("Broken contracts")[-1]
    assert contract in broken.replace("\n", " "), proc.stdout[-3000:]


def test_no_package_imports_the_app():
    """app.py is the top: import-linter reads packages only, so this says it for the module."""
    paths = sources(with_scripts=False)
    modules = {module_name(p) for p in paths}
    importers = [module_name(p) for p in paths if p.name != "app.py" and "app" in imports_of(p, modules)]
    assert importers == []


def test_each_room_says_what_it_holds():
    """Every package's __init__ opens with a docstring: what lives there and who may import it."""
    missing = []
    for init in sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8")))
        if not doc:
            missing.append(str(init.relative_to(ROOT)))
    assert missing == []


SUBCOMMANDS = {
    "generate": [],
    "chat": ["--context-file"],
    "bench": ["attention", "decode", "ttft", "memory", "blockcache", "e2e", "kernels", "app"],
    "eval": ["recall"],
    "datasets": ["niah", "ruler", "realdocs"],
    "loadtest": [],
    "calibrate": [],
}


def test_the_entry_point_answers_help_in_a_real_process():
    """`python -m pqcache --help`, as a user types it: exits 0 and lists every subcommand."""
    proc = subprocess.run(
        [sys.executable, "-m", "pqcache", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert all(command in proc.stdout for command in SUBCOMMANDS), proc.stdout


@pytest.mark.parametrize("command", sorted(SUBCOMMANDS))
def test_each_subcommand_has_its_help(command, capsys):
    """`python -m pqcache <subcommand> --help` exits 0 and lists its choices (the entry point's main, in this
    process: the real process is the test above)."""
    from pqcache.cli.main import main

    with pytest.raises(SystemExit) as done:
        main([command, "--help"])
    out = capsys.readouterr().out
    assert done.value.code == 0
    assert out.startswith("usage: python -m pqcache " + command)
    assert all(choice in out for choice in SUBCOMMANDS[command]), out
