"""The unit tier runs on tiny random models built in-process: a test here that reaches for a bundled model (its
conversion, or a load of its converted folder) fails at once, and belongs in tests/model/."""

import pytest

from pqcache.serving import loading


@pytest.fixture(autouse=True)
def no_bundled_model(monkeypatch):
    def refuse(*args, **kwargs):
        pytest.fail("a unit test reads a bundled model: move it to tests/model/ (the unit tier runs on tiny models)")

    for step in ("_convert", "_convert_smollm2", "_bundled_tokenizer"):
        monkeypatch.setattr(loading, step, refuse)
