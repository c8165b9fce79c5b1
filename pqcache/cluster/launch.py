"""Start the document workers on a Ray cluster and return the app's client for them.

One Serve application, "pqcache", holds one deployment per replica ("worker-0", "worker-1", ...), each of one
replica, under a small ingress that only names them. A deployment's handle therefore reaches exactly one replica:
that is what lets the app keep each user on the replica holding their document (Serve's routing among the replicas
of one deployment balances load and is not sticky). Serve restarts a replica that dies, on whatever node has room.

The replicas import pqcache from the copy uploaded with the application (runtime_env py_modules), so a worker
machine needs only the Python packages of requirements.txt and, for --model PATH, the model folder at that path.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

from pqcache.cluster.client import ClusterDocuments
from pqcache.serving.home import DEFAULT_NAMES, SMOLLM2_NAMES
from pqcache.serving.server_settings import ServerSettings

APP = "pqcache"
PACKAGE = Path(__file__).resolve().parents[1]  # the pqcache package, uploaded to the cluster


class Roster:
    """The application's ingress: names the worker deployments (the app calls the workers' handles directly)."""

    def __init__(self, *workers):
        self.count = len(workers)

    async def workers(self) -> list[str]:
        return [worker_name(i) for i in range(self.count)]


def worker_name(index: int) -> str:
    return f"worker-{index}"


def connect(address: str | None, **init) -> float:
    """ray.init to a cluster ("auto": the one `ray start` runs here; HOST:PORT; "local": a private one on this
    machine), unless this process is connected already (the tests start their own); returns the cluster's CPUs."""
    import ray

    if ray.is_initialized():
        return ray.cluster_resources().get("CPU", 0.0)
    # the replicas' environment: no hub, and few glibc heaps (freed cache memory goes back to the OS; the same as
    # limit_malloc_arenas() in one process, but from the process's start)
    env_vars = {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "MALLOC_ARENA_MAX": "2"}
    env = {"py_modules": [str(PACKAGE)], "env_vars": env_vars}
    ray.init(address=None if address in (None, "local") else address, runtime_env=env, **init)
    return ray.cluster_resources().get("CPU", 0.0)


def start_workers(replicas: int, server: ServerSettings, replica_cpus: float = 1.0, app: str = APP) -> ClusterDocuments:
    """Deploy `replicas` document workers, each started with the server's settings whole (each loads the model as
    load_model does: this waits until all are up), and return the client. server.store_dir: a document store every
    replica reads and writes (a path every node sees); a lost replica's users are then reopened from it on a live
    one. app: the Serve application's name (another name leaves the app's own workers on the cluster alone)."""
    from ray import serve

    from pqcache.cluster.replica import DocumentReplica

    if replicas < 1:
        raise ValueError(f"replicas must be 1 or more, got {replicas}")
    if server.model not in DEFAULT_NAMES + SMOLLM2_NAMES:  # a bundled model is found by name on every machine
        server = replace(server, model=os.path.abspath(server.model))  # the same path on every machine
    if server.store_dir is not None:
        server = replace(server, store_dir=os.path.abspath(server.store_dir))
    options = dict(
        num_replicas=1,
        max_ongoing_requests=1000,  # Stop and status calls must never queue behind loads: the replica limits those
        ray_actor_options={"num_cpus": replica_cpus},
        health_check_period_s=2,
        health_check_timeout_s=30,
        # no line per call: the page polls its replica's status each second, and a line per poll hides what matters
        logging_config={"enable_access_log": False},
    )
    worker = serve.deployment(DocumentReplica)
    workers = [
        worker.options(name=worker_name(i), **options).bind(server, max(1, int(replica_cpus))) for i in range(replicas)
    ]
    roster = serve.deployment(Roster).options(name="roster", ray_actor_options={"num_cpus": 0})
    serve.start(proxy_location="Disabled")
    serve.run(roster.bind(*workers), name=app, route_prefix=None)
    handles = [serve.get_deployment_handle(worker_name(i), app_name=app) for i in range(replicas)]
    return ClusterDocuments(handles, shared_store=server.store_dir is not None)


def stop_workers(app: str = APP):
    """Delete the application (its replicas end); the Ray cluster stays."""
    from ray import serve

    try:
        serve.delete(app)
    except Exception as exc:  # noqa: BLE001 - at exit: the cluster may be gone already
        print(f"could not delete the Ray Serve application {app!r}: {exc}", flush=True)
