"""The documents service's contract (tests/contract.py) on a real local Ray cluster: the same tests the worker in
one process passes (tests/unit/test_documents_contract.py), here through the app's cluster client to a Ray Serve
replica holding the documents and their conversations."""

import pytest

from pqcache import load_model
from pqcache.serving.server_settings import ServerSettings
from tests.contract import *  # noqa: F403 - the contract's tests, collected here


@pytest.fixture(scope="module")
def reference(model_dir):
    """The replica's model as the replica loads it (the same weights, decode copies and fast path)."""
    return load_model(str(model_dir), device="cpu")


@pytest.fixture(scope="module")
def service(local_ray, model_dir, tmp_path_factory):
    """One replica on the tier's private Ray instance (tests/cluster/conftest.py), with a document store."""
    server = ServerSettings(
        model=str(model_dir),
        max_cache_bytes=2**28,
        idle_s=None,
        concurrency=1,
        pq_timeout_s=60,
        store_dir=str(tmp_path_factory.mktemp("store")),
    )
    return local_ray(1, server, replica_cpus=1)
