"""The app's handle on one replica: a call or a stream that turns Ray's failures into ReplicaDown (and marks the
replica down), a user's stop event that reaches the replica holding their document, and the replicas' figures added
up for the page's server line."""

from __future__ import annotations

import threading
from dataclasses import dataclass

CALL_TIMEOUT_S = 10.0  # a quick call (stop, notice, status) to a replica that does not answer in this is down
PROBE_TIMEOUT_S = 2.0  # placing a load: a replica marked down is asked again, this long


class ReplicaDown(Exception):
    """A replica died, or does not answer."""


def ray_failures() -> tuple:
    """The exceptions that mean a replica is gone or unreachable."""
    from ray.exceptions import RayActorError, RayError

    return (RayActorError, RayError, TimeoutError)


@dataclass
class Replica:
    index: int
    handle: object  # the DeploymentHandle of this replica's deployment
    down: bool = False

    def call(self, method: str, *args, timeout_s: float = CALL_TIMEOUT_S):
        try:
            return getattr(self.handle, method).remote(*args).result(timeout_s=timeout_s)
        except ray_failures() as exc:
            self.down = True
            raise ReplicaDown(f"replica {self.index}: {type(exc).__name__}") from exc

    def stream(self, method: str, *args):
        """The replica's stream; ReplicaDown if it dies meanwhile."""
        try:
            yield from getattr(self.handle.options(stream=True), method).remote(*args)
        except ray_failures() as exc:
            self.down = True
            raise ReplicaDown(f"replica {self.index}: {type(exc).__name__}") from exc


class ForwardedStop(threading.Event):
    """A user's stop event whose set and clear also reach the replica holding their document."""

    def __init__(self, forward):
        super().__init__()
        self._forward = forward

    def set(self):
        super().set()
        self._forward("stop")

    def clear(self):
        super().clear()
        self._forward("clear_stop")


def cluster_summary(replicas: list[Replica]) -> dict:
    """Users with a document, users being served, cache bytes and the cap: the replicas' added up; and each
    replica's own figures ("workers": its users, cache bytes, resident memory; up or not)."""
    total = {"users": 0, "busy": 0, "cache_bytes": 0, "max_bytes": 0, "replicas": len(replicas), "up": 0}
    workers = []
    for replica in replicas:
        try:
            s = replica.call("summary", timeout_s=PROBE_TIMEOUT_S)
        except ReplicaDown:
            workers.append({"index": replica.index, "up": False})
            continue
        replica.down = False
        total["up"] += 1
        for key in ("users", "busy", "cache_bytes", "max_bytes"):
            total[key] += s[key]
        workers.append({"index": replica.index, "up": True, **s})
    return {**total, "workers": workers}
