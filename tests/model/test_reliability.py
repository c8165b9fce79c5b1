"""The app's handlers on the bundled model: a failed clustering's notice, an unexpected error named without a
traceback."""

import pytest

from pqcache.engine import pq
from pqcache.serving.pool import SessionPool
from pqcache.serving.session import DocumentSession
from pqcache.serving.settings import LoadSettings


@pytest.fixture
def app_load(real_model):
    """The app's load_document handler called in-process with the bundled model, as user `name`; returns the
    status."""
    import types

    from studio import Studio
    from studio.qa import QATab

    qa = QATab(Studio(*real_model, SessionPool(max_bytes=2 * 2**30, idle_s=1800)))

    def load(name, text):
        try:  # the handler yields the status line while it loads: the last one says how it ended
            return list(
                qa.loader.load_document(
                    None, text, *LoadSettings().values(), request=types.SimpleNamespace(session_hash=name)
                )
            )[-1][0]
        finally:
            qa.documents.end(name)

    return load


def test_app_shows_the_fallback_notice(app_load, monkeypatch):
    monkeypatch.setattr(pq, "train_centroids", lambda *a, **k: 1 / 0)
    status = app_load("fault-test", "The pass key is 68422. " * 40)
    assert status.startswith("Loaded") and "**Notice:** PQ clustering of layer 5 failed (ZeroDivisionError" in status


def test_app_names_an_unexpected_error_without_a_traceback(app_load, monkeypatch):
    def broken(self, *args, **kwargs):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory")

    monkeypatch.setattr(DocumentSession, "load", broken)
    status = app_load("unexpected", "some text")
    assert status == (
        "**Error:** unexpected RuntimeError on the server (DefaultCPUAllocator: can't allocate memory); "
        "the details are in the server log\n\nNo document is loaded."
    )
