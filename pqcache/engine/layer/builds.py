"""Background builds with a deadline: jobs go to the cache's executor (one K-Means worker) and their
results are collected on the decoding thread, between steps, so nothing a step reads changes under it.

A job that raised, or is not done `timeout_s` after it was submitted, is a fault: `collect` raises
BuildFault and forgets the other jobs (the caller decides what a fault means). A job that finished,
however late, is used. A set `stop` event while waiting raises Cancelled.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import CancelledError, Executor, Future
from concurrent.futures import wait as wait_futures

from pqcache.engine.errors import Cancelled
from pqcache.engine.heap import release_host_memory


class BuildFault(Exception):
    """A build raised, hung past its timeout, or was cancelled after a fault elsewhere."""


class Builds:
    def __init__(self, executor: Executor, timeout_s: float | None):
        self.executor, self.timeout_s = executor, timeout_s
        self.jobs: list[Future] = []  # in flight, each with a .submitted time
        self.fault: BaseException | None = None  # a submit that found the executor shut down
        self.wait_s = 0.0  # time the decoding thread spent waiting for results

    def submit(self, fn, *args):
        try:
            fut = self.executor.submit(_then_trimmed, fn, *args)
        except RuntimeError:  # the executor was shut down after a fault in another layer
            self.fault = CancelledError()
            return
        fut.submitted = time.perf_counter()
        self.jobs.append(fut)

    def collect(self, block: bool, stop=None) -> Iterator[tuple[object, bool]]:
        """Yield (result, was it ready without waiting) for each finished job (block: wait for all)."""
        if self.fault is not None:
            raise BuildFault(_why(self.fault)) from self.fault
        remaining = []
        for i, fut in enumerate(self.jobs):
            overdue = self.timeout_s is not None and time.perf_counter() - fut.submitted > self.timeout_s
            if not block and not fut.done() and not overdue:  # still within its time: check next step
                remaining.append(fut)
                continue
            ready = fut.done()
            t0 = time.perf_counter()
            try:
                result = self._result(fut, stop)
            except Cancelled:
                self.jobs = remaining + self.jobs[i:]
                raise
            except Exception as exc:  # the worker raised, hung, or was shut down
                self.jobs = []
                raise BuildFault(_why(exc)) from exc
            finally:
                self.wait_s += time.perf_counter() - t0
            yield result, ready
        self.jobs = remaining

    def _result(self, fut: Future, stop=None):
        deadline = None if self.timeout_s is None else fut.submitted + self.timeout_s
        while not fut.done():
            left = None if deadline is None else deadline - time.perf_counter()
            if left is not None and left <= 0:
                raise TimeoutError(f"not finished {self.timeout_s:g} s after it was submitted")
            if stop is not None and stop.is_set():
                raise Cancelled("stopped while clustering")
            wait_futures([fut], timeout=left if stop is None else 0.1 if left is None else min(0.1, left))
        return fut.result()


def _why(exc: BaseException) -> str:
    if isinstance(exc, CancelledError):
        return "its build was cancelled after a fault in another layer"
    return f"{type(exc).__name__}: {exc}"


def _then_trimmed(fn, *args):
    """fn(*args), then its temporaries (a K-Means's copies of the keys, its distances) handed back to the OS: the
    worker thread's heap would otherwise keep them resident beside the prefill's last chunk and the decode (about
    100 MiB at 32K tokens of the bundled model, docs/benchmarks.md)."""
    try:
        return fn(*args)
    finally:
        release_host_memory()
