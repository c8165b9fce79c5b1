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
from pathlib import Path

from pqcache.cluster.client import ClusterDocuments
from pqcache.fastpath.weights import DEFAULT_DECODE_WEIGHTS

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


def start_workers(
    replicas: int,
    model: str = "default",
    replica_cpus: float = 1.0,
    max_bytes: int = 2**30,
    idle_s: float | None = 1800.0,
    concurrency: int = 2,
    pq_timeout_s: float | None = 120.0,
    max_document_tokens: int | None = None,
    dtype: str | None = None,
    decode_weights: str = DEFAULT_DECODE_WEIGHTS,
    store_dir: str | None = None,
    kv_dtype: str = "auto",
) -> ClusterDocuments:
    """Deploy `replicas` document workers (each loads the model with `dtype` and `decode_weights`, as
    load_model: waits until all are up) and return the client. store_dir: a document store every replica reads and
    writes (a path every node sees); a lost replica's users are then reopened from it on a live one."""
    from ray import serve

    from pqcache.cluster.replica import DocumentReplica

    if replicas < 1:
        raise ValueError(f"replicas must be 1 or more, got {replicas}")
    if model not in ("default", "gemma3-270m"):
        model = os.path.abspath(model)  # the same path on every machine
    options = dict(
        num_replicas=1,
        max_ongoing_requests=1000,  # Stop and status calls must never queue behind loads: the replica limits those
        ray_actor_options={"num_cpus": replica_cpus},
        health_check_period_s=2,
        health_check_timeout_s=30,
    )
    worker = serve.deployment(DocumentReplica)
    workers = [
        worker.options(name=worker_name(i), **options).bind(
            model,
            max_bytes,
            idle_s,
            concurrency,
            pq_timeout_s,
            max_document_tokens,
            max(1, int(replica_cpus)),
            dtype,
            decode_weights,
            None if store_dir is None else os.path.abspath(store_dir),
            kv_dtype,
        )
        for i in range(replicas)
    ]
    roster = serve.deployment(Roster).options(name="roster", ray_actor_options={"num_cpus": 0})
    serve.start(proxy_location="Disabled")
    serve.run(roster.bind(*workers), name=APP, route_prefix=None)
    handles = [serve.get_deployment_handle(worker_name(i), app_name=APP) for i in range(replicas)]
    return ClusterDocuments(handles, shared_store=store_dir is not None)


def stop_workers():
    """Delete the application (its replicas end); the Ray cluster stays."""
    from ray import serve

    try:
        serve.delete(APP)
    except Exception as exc:  # noqa: BLE001 - at exit: the cluster may be gone already
        print(f"could not delete the Ray Serve application {APP!r}: {exc}", flush=True)
