"""A PQLayer outside a model: filled with given keys and values, its PQ built in the caller. Benchmarks, the
recall study and tests time or probe one layer's decode steps this way, without a model or the cache's thread."""

from __future__ import annotations

from concurrent.futures import Future

import torch

from pqcache.engine.config import PQCacheConfig
from pqcache.engine.layer.layer import PQLayer


class InlineExecutor:
    """Runs a PQ build in the caller (benchmarks time decode steps, not the build). A fault in a
    build shuts the executor down, as it does the cache's thread pool: later submits raise."""

    def __init__(self):
        self.is_shutdown = False

    def submit(self, fn, *args):
        if self.is_shutdown:
            raise RuntimeError("cannot schedule new futures after shutdown")
        fut = Future()
        try:
            fut.set_result(fn(*args))
        except Exception as exc:  # the build's own error reaches the layer through the future
            fut.set_exception(exc)
        return fut

    def shutdown(self, wait: bool = True, cancel_futures: bool = False):
        self.is_shutdown = True


def filled_layer(keys, values, config: PQCacheConfig, iters: int = 10, method=None) -> PQLayer:
    """A PQLayer prefilled with keys/values (B, H, S, D) (on the compute device), PQ built."""
    layer = PQLayer(config.for_head_dim(keys.shape[-1]), 0, InlineExecutor(), lambda s: iters, method)
    layer.update(keys, values)
    layer.finish_prefill(torch.ones(keys.shape[0], keys.shape[2], dtype=torch.bool, device=keys.device))
    layer.wait_pq()
    return layer
