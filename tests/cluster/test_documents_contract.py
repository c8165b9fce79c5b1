"""The documents service's contract (tests/contract.py) on a real local Ray cluster: the same tests the worker in
one process passes (tests/unit/test_documents_contract.py), here through the app's cluster client to a Ray Serve
replica holding the documents and their conversations."""

import pytest
import ray
from ray import serve

from pqcache import load_model
from pqcache.serving.server_settings import ServerSettings
from tests.cluster.test_cluster import model_dir  # noqa: F401 - the served model's folder (a fixture)
from tests.contract import *  # noqa: F403 - the contract's tests, collected here


@pytest.fixture(scope="module")
def reference(model_dir):  # noqa: F811 - the fixture imported above
    """The replica's model as the replica loads it (the same weights, decode copies and fast path)."""
    return load_model(str(model_dir), device="cpu")


@pytest.fixture(scope="module")
def service(model_dir, tmp_path_factory):  # noqa: F811
    """One replica on a private Ray cluster, with a document store; shut down after."""
    from pqcache.cluster import launch

    launch.connect("local", num_cpus=2, object_store_memory=100 * 2**20, include_dashboard=False)
    server = ServerSettings(
        model=str(model_dir),
        max_cache_bytes=2**28,
        idle_s=None,
        concurrency=1,
        pq_timeout_s=60,
        store_dir=str(tmp_path_factory.mktemp("store")),
    )
    try:
        yield launch.start_workers(1, server, replica_cpus=1)
    finally:
        serve.shutdown()
        ray.shutdown()
