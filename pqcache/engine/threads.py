"""Background threads that do not slow the decoding thread down: their torch operators run on them alone.

Why: torch's Linux CPU wheels use GNU OpenMP (libgomp). A thread that runs a parallel torch operator (ATen's
parallel_for, or an MKL matmul) gets its own team of OpenMP helper threads, kept for the thread's life. Once libgomp
manages more threads than the machine has CPUs, every team switches to "throttled" waiting: its helpers go to sleep
almost at once after each parallel region instead of spinning, and each of the hundreds of parallel operators of a
decode step pays a wake-up. The K-Means builder thread (one per cache) was enough to tip a 2-core machine
over: after one PQ build, a decode step of the bundled model with transformers' own cache took 48-65 ms instead of
32-40 ms, its OpenMP helper at 40-44% CPU instead of 99%. `python scripts/decode_probe.py omp --seq-len 1024` shows
it: median step 38.8 ms alone, 66.8 ms beside another live thread that ran one parallel matmul, 38.4 ms once it
ended.

The same happens to a server that loads the model on its main thread and answers on request threads: the main
thread's helpers stay, and the first request thread tips the count over (a decode step on a second thread after the
main thread's torch work: 47-50 ms against 32-34 ms on the main thread). `load_model` therefore does its torch work
on a thread that ends with it (`on_a_passing_thread`), whose helpers end with it.

The builder needs no helpers: faiss's K-Means runs on its own OpenMP runtime, and what torch does there (gathers,
the encoding matmul) is small. So the builder limits its own OpenMP and MKL thread counts to 1. Both settings are
thread-local (OpenMP's nthreads ICV, MKL's `MKL_Set_Num_Threads_Local`); torch's global setting and every other
thread keep theirs.
"""

from __future__ import annotations

import ctypes
import os
import threading

import torch

_LIB = os.path.join(os.path.dirname(torch.__file__), "lib")


def _symbol(library: str, name: str):
    """A C function of one of torch's own shared libraries (already loaded), or None where it has none."""
    path = os.path.join(_LIB, library)
    if not os.path.exists(path):
        return None
    try:
        return getattr(ctypes.CDLL(path), name)
    except (OSError, AttributeError):
        return None


def torch_on_this_thread_only() -> bool:
    """Run the calling thread's torch operators without OpenMP or MKL helper threads (thread-local; use it as a
    worker thread's initializer). Returns whether the OpenMP setting took (False where torch has no libgomp)."""
    torch.get_num_threads()  # torch's per-thread lazy initialization first: it would overwrite what follows
    omp_set = _symbol("libgomp.so.1", "omp_set_num_threads")
    if omp_set is None:
        return False
    omp_set(1)
    if torch.backends.mkl.is_available():
        mkl_set = _symbol("libtorch_cpu.so", "MKL_Set_Num_Threads_Local")  # C API (by value): mkl_service.h
        if mkl_set is not None:
            mkl_set.argtypes, mkl_set.restype = [ctypes.c_int], ctypes.c_int
            mkl_set(1)
    return True


def omp_max_threads() -> int | None:
    """What OpenMP would give a parallel region started on the calling thread (None: torch has no libgomp)."""
    get = _symbol("libgomp.so.1", "omp_get_max_threads")
    return None if get is None else int(get())


def on_a_passing_thread(fn, *args, **kwargs):
    """fn(*args, **kwargs) on a thread that ends when it returns (its result or exception passed on): the OpenMP
    helpers its torch work starts end with it, so the calling thread holds none."""
    out: dict = {}

    def run():
        try:
            out["value"] = fn(*args, **kwargs)
        except BaseException as exc:  # re-raised on the calling thread
            out["error"] = exc

    worker = threading.Thread(target=run, name="pqcache-passing", daemon=True)
    worker.start()
    worker.join()
    if "error" in out:
        raise out["error"]
    return out["value"]
