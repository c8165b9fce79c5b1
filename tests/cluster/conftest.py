"""The cluster tier: the served model's folder (a tiny random chat model, built once) and one private local Ray
instance that the single-node modules share, each deploying its own Serve application and deleting it after
(starting Ray and Serve costs about ten seconds a time on two cores).

tests/cluster/test_node_loss.py needs a cluster of several nodes (ray.cluster_utils.Cluster): it ends the shared
instance before starting its own, so it runs last (pytest takes a folder's modules in name order); placed earlier,
the modules after it would start the shared instance again, slower but as correct."""

import pytest
import ray
from ray import serve

from tests.tiny import SERVED, tiny_chat_model


@pytest.fixture(scope="package")
def model_dir(tmp_path_factory):
    """A random-weight Llama and its byte tokenizer (with a chat template), saved as a model folder."""
    folder = tmp_path_factory.mktemp("tiny-chat-model")
    model, tok = tiny_chat_model(**SERVED)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def end_ray():
    """Serve and the Ray connection ended, if there is one."""
    if ray.is_initialized():
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="package", autouse=True)
def _ray_ended_after_the_tier():
    yield
    end_ray()


@pytest.fixture(scope="module")
def local_ray():
    """A private Ray instance on this machine (2 CPUs, a small object store, no dashboard), shared by the modules
    that ask for it; yields a deploy(replicas, server, replica_cpus) that starts this module's own Serve application
    of document workers (pqcache.cluster.launch.start_workers) and deletes it after the module."""
    from pqcache.cluster import launch

    launch.connect("local", num_cpus=2, object_store_memory=100 * 2**20, include_dashboard=False)
    apps = []

    def deploy(replicas, server, replica_cpus):
        apps.append(f"test-{len(apps)}-{id(apps)}")
        return launch.start_workers(replicas, server, replica_cpus=replica_cpus, app=apps[-1])

    yield deploy
    for app in apps:
        launch.stop_workers(app)
