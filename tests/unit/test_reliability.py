"""Reliability through the Python API: bad input, cancellation, clustering-worker faults, many users."""

import gc
import os
import threading
import time

import pytest
import torch

from pqcache import PQCache, PQCacheConfig
from pqcache.engine import pq
from pqcache.engine.errors import (
    Cancelled,
    CapacityError,
    DocumentTooLongError,
    InputError,
    NoDocumentError,
    PQBuildError,
    SessionEvictedError,
)
from pqcache.serving.pool import SessionPool
from pqcache.serving.session import DocumentSession
from tests.tiny import WordTokenizer, tiny_model

TEXT = " ".join(f"w{i % 37}" for i in range(300))
CONFIG = dict(n_init=4, bits=4, kmeans_iters=3)


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def session_of(model, **kw):
    return DocumentSession(model, WordTokenizer(), PQCacheConfig(**{**CONFIG, **kw.pop("config", {})}), **kw)


def new_threads(before: set, prefix="pqcache-kmeans", wait_s=30.0):
    """Clustering threads started since `before` that are still alive after up to wait_s to finish."""
    alive = [t for t in threading.enumerate() if t.name.startswith(prefix) and t not in before]
    for t in alive:
        t.join(wait_s)
    return [t for t in alive if t.is_alive()]


def live_caches() -> set[int]:
    gc.collect()
    return {id(o) for o in gc.get_objects() if type(o) is PQCache}


class Gate:
    """Replaces pq.train_centroids: blocks every K-Means until released (a hung worker)."""

    def __init__(self, real):
        self.real, self.release, self.entered = real, threading.Event(), threading.Event()

    def __call__(self, *args, **kwargs):
        self.entered.set()
        self.release.wait(120)
        return self.real(*args, **kwargs)


def finishes(fn, timeout=120.0):
    """Run fn on a thread; its result or exception, or AssertionError if it is still running (a hang)."""
    out = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), "hung"
    if "error" in out:
        raise out["error"]
    return out["value"]


# ---- bad input ------------------------------------------------------------------------------------------------
def test_document_longer_than_the_model_refused_or_cut_in_the_middle(model):
    session = session_of(model, max_tokens=100)
    with pytest.raises(DocumentTooLongError, match="the document has 300 tokens; at most 100 fit") as info:
        session.load(TEXT)
    assert (info.value.n_tokens, info.value.limit) == (300, 100) and session.cache is None
    ids = WordTokenizer()(TEXT).input_ids
    info = session.load(TEXT, truncate="middle")
    assert (info["tokens"], info["document_tokens"], session.truncated) == (100, 300, (100, 300))
    assert session.doc_ids == ids[:50] + ids[-50:]  # first and last halves kept
    assert session.ask("w3 w4", max_new_tokens=3).done
    # without max_tokens the model's own limit applies: 1024 positions less room for the answer
    assert session_of(model).max_document_tokens == 1024 - 512
    with pytest.raises(DocumentTooLongError, match="the document has 600 tokens; at most 512 fit"):
        session_of(model).load(" ".join(f"w{i}" for i in range(600)))


def test_question_and_setting_errors(model):
    session = session_of(model)
    with pytest.raises(NoDocumentError, match="load a document first"):
        session.ask("anything")
    with pytest.raises(InputError, match="the document is empty"):
        session.load("  \n")
    with pytest.raises(InputError, match="truncate must be 'refuse' or 'middle'"):
        session.load(TEXT, truncate="end")
    session.load(TEXT)
    with pytest.raises(InputError, match="the question is empty"):
        session.ask(" ")
    with pytest.raises(InputError, match="max_new_tokens must be an int >= 1"):
        session.ask("w1", max_new_tokens=0)
    assert len(session.ask("w1 w2", max_new_tokens=4).tokens) == 4  # still works after each error


# ---- cancellation ---------------------------------------------------------------------------------------------
def test_stop_during_prefill_frees_the_cache_and_the_next_load_works(model):
    before_threads = set(threading.enumerate())
    before_caches = live_caches()
    session, stop = session_of(model), threading.Event()
    layers_run = []

    def progress(fraction, message):
        if message.startswith("prefill"):
            layers_run.append(message)
            stop.set()  # the user presses Stop while layer 1 of 3 has just finished

    with pytest.raises(Cancelled) as info:
        session.load(TEXT, progress=progress, stop=stop)
    del info  # its traceback holds the frames (and the partial cache)
    assert len(layers_run) == 1  # layers 2 and 3 never ran
    assert session.cache is None
    assert not new_threads(before_threads) and live_caches() <= before_caches  # worker and memory freed
    stop.clear()
    session.load(TEXT, stop=stop)
    assert len(session.ask("w5 w6", max_new_tokens=3, stop=stop).tokens) == 3


def test_stop_while_clustering_does_not_wait_for_the_worker(model, monkeypatch):
    gate = Gate(pq.train_centroids)
    monkeypatch.setattr(pq, "train_centroids", gate)
    before_threads = set(threading.enumerate())
    session, stop = session_of(model, config={"pq_timeout_s": None}), threading.Event()

    def progress(fraction, message):
        if message.startswith("clustering"):
            assert gate.entered.wait(60)
            stop.set()

    try:
        with pytest.raises(Cancelled):
            finishes(lambda: session.load(TEXT, progress=progress, stop=stop))
        assert session.cache is None
    finally:
        gate.release.set()
    assert not new_threads(before_threads)  # the worker saw the closed cache and stopped


def test_stop_during_decoding_and_the_next_question_works(model):
    session, stop = session_of(model), threading.Event()
    session.load(TEXT)

    def on_token(answer):
        if len(answer.tokens) == 3:
            stop.set()

    answer = session.ask("w1 w2", max_new_tokens=50, stop=stop, on_token=on_token)
    assert answer.stopped and len(answer.tokens) == 3
    stop.clear()
    assert len(session.ask("w1 w2", max_new_tokens=5, stop=stop).tokens) == 5


# ---- clustering-worker faults ------------------------------------------------------------------------------------
def _decode(model, cache, ids, steps=4):
    out = [model(ids, cache=cache).logits[:, -1]]
    cache.wait()
    for _ in range(steps):
        out.append(model(out[-1].argmax(-1, keepdim=True), cache=cache).logits[:, -1])
    return torch.stack(out)


@torch.no_grad()
def test_worker_that_dies_falls_back_to_exact_attention_with_a_notice(model, monkeypatch):
    ids = torch.randint(1, 96, (1, 160), generator=torch.Generator().manual_seed(3))
    config = PQCacheConfig(**CONFIG, token_budget=0.2)
    exact = _decode(model, PQCache(model, config, method="full"), ids)

    def dies(*args, **kwargs):
        raise MemoryError("faiss could not allocate")

    monkeypatch.setattr(pq, "train_centroids", dies)
    cache = PQCache(model, PQCacheConfig(**CONFIG, token_budget=0.2))
    got = _decode(model, cache, ids)
    torch.testing.assert_close(got, exact, atol=1e-5, rtol=1e-5)  # every token attended: full attention
    notices = cache.stats()["notices"]
    assert len(notices) == 3 and all("exact attention" in n for n in notices)
    assert "PQ clustering of layer 0 failed (MemoryError: faiss could not allocate)" in notices[0]
    assert all(f"layer {i} failed" in n for i, n in enumerate(notices))  # its own error, or cancelled after layer 0
    cache.close()


@torch.no_grad()
def test_worker_that_hangs_times_out_instead_of_hanging(model, monkeypatch):
    gate = Gate(pq.train_centroids)
    monkeypatch.setattr(pq, "train_centroids", gate)
    before_threads = set(threading.enumerate())
    session = session_of(model, config={"pq_timeout_s": 0.5})
    try:
        info = finishes(lambda: session.load(TEXT))
        assert any("not finished 0.5 s after it was submitted" in n for n in info["notices"])
        answer = finishes(lambda: session.ask("w1 w2", max_new_tokens=4))
        assert len(answer.tokens) == 4 and session.last_stats["notices"]
    finally:
        gate.release.set()
    session.close()
    assert not new_threads(before_threads)


@torch.no_grad()
def test_a_background_rebuild_that_hangs_is_noticed_while_decoding(model, monkeypatch):
    gate = Gate(pq.train_centroids)
    gate.release.set()  # the prefill's builds pass
    monkeypatch.setattr(pq, "train_centroids", gate)
    cache = PQCache(model, PQCacheConfig(**CONFIG, rebuild_every=1, pq_timeout_s=0.3))
    token = (
        model(torch.randint(1, 96, (1, 120), generator=torch.Generator().manual_seed(1)), cache=cache)
        .logits[:, -1:]
        .argmax(-1)
    )
    cache.wait()
    gate.release.clear()  # from now on the worker hangs (re-clustering every generated token)
    try:
        deadline = time.monotonic() + 60
        while not cache.stats()["notices"]:  # decoding goes on meanwhile: a rebuild is never waited for
            assert time.monotonic() < deadline, "the hung rebuild was never noticed"
            token = model(token, cache=cache).logits[:, -1:].argmax(-1)
        assert "not finished 0.3 s after it was submitted" in cache.stats()["notices"][0]
        assert torch.isfinite(model(token, cache=cache).logits).all()  # and after the fallback
    finally:
        gate.release.set()
        cache.close()


def test_worker_fault_can_fail_the_request_instead(model, monkeypatch):
    monkeypatch.setattr(pq, "train_centroids", lambda *a, **k: 1 / 0)
    session = session_of(model, config={"on_pq_failure": "raise"})
    with pytest.raises(PQBuildError, match=r"layer 0 failed \(ZeroDivisionError"):
        session.load(TEXT)
    assert session.cache is None
    monkeypatch.undo()
    session.load(TEXT)  # the next load works
    assert session.cache.stats()["notices"] == []


# ---- many users: the session pool -------------------------------------------------------------------------------
class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_prefill_queries_are_kept_only_for_a_method_that_starts_from_them(model):
    """A document loaded for PQCache keeps no prefill queries; a SnapKV question reads it once more for them (the
    same queries and the same answer as a document loaded for SnapKV, which keeps them), and from then on they are
    counted in its bytes (the pool's cap) and in the memory panel; the next such question reads nothing again."""
    from viz import figures

    one, snap = session_of(model), session_of(model, method="snapkv")
    one.load(TEXT)
    snap.load(TEXT)
    assert one.cache.stats()["query_bytes"] == 0 and one.nbytes() < snap.nbytes()
    assert one.estimate_bytes(one.n_tokens) < snap.estimate_bytes(snap.n_tokens)
    assert snap.estimate_bytes(snap.n_tokens) >= snap.nbytes()
    first = one.ask("what is w3", method="snapkv", max_new_tokens=4)
    assert first.reread_s > 0.0
    for mine, theirs in zip(one.cache.pq_layers, snap.cache.pq_layers, strict=True):
        assert torch.equal(mine.prefill_q, theirs.prefill_q)
    assert first.tokens == snap.ask("what is w3", max_new_tokens=4).tokens
    stats, text = one.cache.stats(), model.config
    head_dim = text.hidden_size // text.num_attention_heads
    per_layer = one.n_tokens * text.num_attention_heads * head_dim * 4  # float32 (B=1, Hq, S, D)
    assert stats["query_bytes"] == len(one.cache.pq_layers) * per_layer > 0
    assert one.nbytes() == sum(stats[k] for k in ("device_kv_bytes", "host_kv_bytes", "pq_bytes", "query_bytes"))
    assert "prefill queries" in figures.memory(stats).data[0].x
    assert one.ask("what is w3", method="h2o", max_new_tokens=2).reread_s == 0.0
    one.close()
    snap.close()


def test_pool_caps_memory_evicts_the_least_recently_used_idle_user_and_tells_them(model):
    one = session_of(model)
    one.load(TEXT)
    size, estimate = one.nbytes(), one.estimate_bytes(300)
    assert size <= estimate < 2 * size  # the reservation before a prefill is an upper bound, and not a loose one
    one.close()
    clock = Clock()
    pool = SessionPool(max_bytes=int(1.5 * size) + estimate, idle_s=None, clock=clock)  # room for two, not three
    for t, user in enumerate(["ann", "bob"]):
        clock.t = t
        with pool.use(user):
            s = session_of(model)
            s.load(TEXT)
            pool.store(user, "qa", s)
    assert pool.total_bytes() == 2 * size
    ann = pool.session("ann")
    clock.t = 5
    with pool.use("ann"):  # ann asked something later than bob: bob is the least recently used
        pass
    clock.t = 6
    with pool.use("cid"):
        s = session_of(model)
        s.load(TEXT, reserve=lambda n: pool.reserve("cid", "qa", n))
        pool.store("cid", "qa", s)
    assert pool.total_bytes() <= pool.max_bytes
    assert pool.session("ann") is ann and pool.session("cid") is s
    assert "to make room for another user" in pool.notice("bob")
    assert pool.notice("bob") is None  # told once
    with pytest.raises(SessionEvictedError, match="load it again"):
        pool.session("bob")
    # bob loads again: evicts ann (idle, least recent), never cid while cid is busy
    with pool.use("cid"), pool.use("bob"):
        s = session_of(model)
        s.load(TEXT, reserve=lambda n: pool.reserve("bob", "qa", n))
        pool.store("bob", "qa", s)
    assert ann.cache is None and pool.session("cid") is not None


def test_pool_keeps_a_document_until_its_successor_is_loaded(model):
    """Room for both: a stopped load leaves the old document active and counted alone. Room for one: the old
    one is freed first, and the user told why."""
    first = session_of(model)
    first.load(TEXT)
    size, estimate = first.nbytes(), first.estimate_bytes(300)
    pool = SessionPool(max_bytes=size + estimate, idle_s=None)
    pool.store("ann", "qa", first)
    stop = threading.Event()

    def stop_at_once(fraction, message):
        assert pool.session("ann") is first and pool.total_bytes() == size + estimate  # both counted
        stop.set()

    with pytest.raises(Cancelled):
        session_of(model).load(TEXT, progress=stop_at_once, stop=stop, reserve=lambda n: pool.reserve("ann", "qa", n))
    pool.unreserve("ann", "qa")
    assert pool.session("ann") is first and first.cache is not None and pool.total_bytes() == size
    second = session_of(model)
    second.load(TEXT, reserve=lambda n: pool.reserve("ann", "qa", n))
    pool.store("ann", "qa", second)
    assert first.cache is None and pool.session("ann") is second and pool.total_bytes() == second.nbytes()

    tight = SessionPool(max_bytes=estimate + size // 2, idle_s=None)  # one document, not two
    tight.store("ann", "qa", second)
    third = session_of(model)
    third.load(TEXT, reserve=lambda n: tight.reserve("ann", "qa", n))
    assert second.cache is None  # freed before the prefill: the two would not fit
    assert "your earlier document was unloaded to make room for this one" in tight.notice("ann")
    tight.store("ann", "qa", third)
    assert tight.session("ann") is third


def test_pool_refuses_when_busy_users_hold_the_memory(model):
    s = session_of(model)
    s.load(TEXT)
    pool = SessionPool(max_bytes=int(1.2 * s.estimate_bytes(300)), idle_s=None)
    with pool.use("ann"):
        pool.store("ann", "qa", s)
        with pool.use("bob"), pytest.raises(CapacityError, match="generating right now"):
            session_of(model).load(TEXT, reserve=lambda n: pool.reserve("bob", "qa", n))
    with pytest.raises(CapacityError, match="use a shorter document"):
        pool.reserve("bob", "qa", 10 * pool.max_bytes)
    assert pool.session("ann") is s


def test_pool_frees_idle_and_ended_sessions(model):
    clock = Clock()
    pool = SessionPool(max_bytes=2**30, idle_s=60, clock=clock)
    for user in ("ann", "bob"):
        with pool.use(user):
            s = session_of(model)
            s.load(TEXT)
            pool.store(user, "qa", s)
    clock.t = 30
    with pool.use("bob"):
        clock.t = 100
        assert pool.reap() == ["ann"]  # bob is busy, ann idle for 100 s
    assert "after 60 s without a request" in pool.notice("ann")
    bob = pool.session("bob")
    pool.end("bob")  # tab closed
    assert bob.cache is None and "bob" not in pool.entries and pool.total_bytes() == 0


@torch.no_grad()
def test_observers_of_two_users_on_one_model_do_not_mix(model):
    ids = torch.randint(1, 96, (1, 40), generator=torch.Generator().manual_seed(0))
    ann, bob = (PQCache(model, PQCacheConfig(**CONFIG)) for _ in range(2))
    ann_obs, bob_obs = ann.instrument(timeline=True), bob.instrument(timeline=True)
    model(ids, cache=bob)
    assert [e for e in ann_obs.events if e["lane"] == "device compute"] == []
    assert len([e for e in bob_obs.events if e["lane"] == "device compute"]) == 3  # one per decoder layer
    ann.close(), bob.close()


def test_reaper_thread_frees_idle_sessions(model):
    pool = SessionPool(max_bytes=2**30, idle_s=0.2)
    s = session_of(model)
    with pool.use("ann"):
        s.load(TEXT)
        pool.store("ann", "qa", s)
    pool.start_reaper(every_s=0.05)
    try:
        deadline = time.monotonic() + 30
        while pool.total_bytes() > 0:  # polling the reaper thread's effect
            assert time.monotonic() < deadline, "the idle session was not freed"
            time.sleep(0.02)
        assert s.cache is None and "after 0.2 s without a request" in pool.notice("ann")
    finally:
        pool.close()


def test_a_second_start_waits_for_the_first_ones_model_conversion(tmp_path, monkeypatch):
    """Two processes preparing the bundled model at once (the app and the tests on a fresh machine): the second
    waits on $PQCACHE_HOME's lock while the first converts, then uses that conversion instead of redoing it over
    the first one's files (it once died inside transformers' GGUF reader, the GGUF removed under it)."""
    import subprocess
    import sys

    from pqcache.serving import loading

    monkeypatch.setenv("PQCACHE_HOME", str(tmp_path))
    target = loading.default_model_dir()
    holder = subprocess.Popen(  # another process, in the middle of a conversion: it holds the lock
        [
            sys.executable,
            "-c",
            "import sys, pqcache.serving.loading as l\nwith l.home_lock():\n"
            "    print('locked', flush=True); sys.stdin.readline()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PQCACHE_HOME": str(tmp_path)},
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        monkeypatch.setattr(loading, "_convert", lambda target, progress: pytest.fail("converted a second time"))
        waiter = threading.Thread(target=lambda: got.append(loading.prepare_default_model(lambda msg: None)))
        got: list = []
        waiter.start()
        waiter.join(0.5)
        assert waiter.is_alive() and not got  # waiting on the lock, not converting
        target.mkdir(parents=True)  # the first process's conversion lands
        for name in ("model.safetensors", "tokenizer.json"):
            (target / name).write_text("x")
        holder.stdin.write("\n")
        holder.stdin.flush()
        waiter.join(60)
        assert got == [target]
    finally:
        holder.kill()
