"""Background and loading threads leave the decoding thread's OpenMP helpers alone (pqcache/engine/threads.py)."""

import threading

import pytest
import torch

from pqcache import PQCache, PQCacheConfig
from pqcache.engine.threads import omp_max_threads, on_a_passing_thread, torch_on_this_thread_only
from tests.tiny import tiny_model

needs_libgomp = pytest.mark.skipif(omp_max_threads() is None, reason="this torch has no libgomp")


@needs_libgomp
def test_a_confined_thread_runs_torch_alone_and_other_threads_keep_their_count():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        seen = {}

        def confined():
            seen["took"] = torch_on_this_thread_only()
            seen["omp"], seen["torch"] = omp_max_threads(), torch.get_num_threads()
            seen["sum"] = float((torch.ones(512, 512) @ torch.ones(512, 512)).sum())  # still computes

        def plain():
            seen["plain"] = torch.get_num_threads()

        for target in (confined, plain):
            worker = threading.Thread(target=target)
            worker.start()
            worker.join()
        assert seen["took"] and seen["omp"] == 1 and seen["torch"] == 1 and seen["sum"] == 512.0**3
        assert seen["plain"] == 2  # a thread started later gets the process's setting, not the confined one's
        assert torch.get_num_threads() == 2 and omp_max_threads() == 2  # nor did this thread change
    finally:
        torch.set_num_threads(before)


@needs_libgomp
def test_the_kmeans_builder_thread_is_confined():
    """The cache's background builder runs torch without OpenMP helpers; the decoding thread keeps its own."""
    model = tiny_model("llama")
    ids = torch.randint(1, 96, (1, 120), generator=torch.Generator().manual_seed(0))
    cache = PQCache(model, PQCacheConfig(token_budget=0.2, n_init=4, kmeans_iters=3, bits=4))
    try:
        with torch.no_grad():
            model(ids, cache=cache, use_cache=True)
        cache.wait()
        assert cache.pq_layers[0].method_state["index"].segments, "the build ran on the builder thread"
        assert cache.executor.submit(omp_max_threads).result() == 1
        assert cache.executor.submit(threading.current_thread).result() is not threading.current_thread()
        assert omp_max_threads() == torch.get_num_threads()
    finally:
        cache.close()


def test_on_a_passing_thread_returns_raises_and_leaves():
    here = threading.get_ident()
    assert on_a_passing_thread(lambda a, b=0: (a + b, threading.get_ident()), 2, b=3)[0] == 5
    assert on_a_passing_thread(threading.get_ident) != here
    with pytest.raises(KeyError, match="missing"):
        on_a_passing_thread(lambda: {}["missing"])
    names = {t.name for t in threading.enumerate()}
    assert "pqcache-passing" not in names  # the thread ended with the call
