"""The documents service's contract (tests/contract.py) against the worker in this process, on a tiny chat model
of the served shape (the cluster tier runs the same tests on Ray Serve replicas)."""

import pytest

from pqcache.serving.pool import SessionPool
from pqcache.serving.server_settings import ServerSettings
from pqcache.serving.store import DocumentStore
from pqcache.serving.worker import DocumentWorker
from tests.contract import *  # noqa: F403 - the contract's tests, collected here
from tests.tiny import SERVED, tiny_chat_model


@pytest.fixture(scope="module")
def reference():
    return tiny_chat_model(**SERVED)


@pytest.fixture(scope="module")
def service(reference, tmp_path_factory):
    model, tok = reference
    pool = SessionPool(max_bytes=2**30, idle_s=None)
    store = DocumentStore(tmp_path_factory.mktemp("store"))
    yield DocumentWorker(model, tok, pool, ServerSettings(pq_timeout_s=60), store)
    pool.close()
