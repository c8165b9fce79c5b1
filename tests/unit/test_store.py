"""The document store (pqcache/serving/store.py, engine/snapshot.py): a document read once answers token for token
as its prefill did, from the store, for every kind of layer and method; and what can go wrong with a store (a
truncated or corrupt entry, one made for another model, a store that cannot be written, two writers of one entry,
the size cap) is said in one line while the document stays loaded."""

import errno
import json
import threading

import pytest

from pqcache import PQCacheConfig
from pqcache.engine.snapshot import SnapshotError, restore, snapshot
from pqcache.serving.session import DocumentSession
from pqcache.serving.store import TENSORS, DocumentStore
from tests.tiny import WordTokenizer, tiny_model

TEXT = " ".join(f"w{(5 * i) % 43}" for i in range(300))
OTHER = " ".join(f"v{(3 * i) % 29}" for i in range(280))
CONFIG = dict(n_init=4, bits=4, kmeans_iters=3, token_budget=0.1)


def session_on(model, store, method="pqcache", **config):
    return DocumentSession(model, WordTokenizer(), PQCacheConfig(**{**CONFIG, **config}), method=method, store=store)


def answers(session, questions=("what is w3", "and w7")) -> list[list[int]]:
    return [session.ask(q, max_new_tokens=5).tokens for q in questions]


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("method", ["pqcache", "full", "snapkv"])
def test_a_document_from_the_store_answers_as_its_prefill_did(tmp_path, arch, method):
    """The second load of the same text reads the store (no prefill, no K-Means) and every answer is token for token
    the first load's; a conversation on it too."""
    from pqcache.serving.conversation import Conversation

    model, store = tiny_model(arch), DocumentStore(tmp_path)
    first = session_on(model, store, method)
    info = first.load(TEXT)
    assert info["from"] == "prefill" and info["store_note"] is None and len(store.entries()) == 1
    prefilled = answers(first)
    talk = Conversation(first, method)
    said = [talk.ask(q, max_new_tokens=4).tokens for q in ("what is w3", "and w9")]
    again = session_on(model, store, method)
    info = again.load(TEXT)
    assert info["from"] == "store" and info["prefill_s"] == 0.0 and info["read_s"] > 0
    assert again.doc_ids == first.doc_ids and again.n_tokens == first.n_tokens
    assert answers(again) == prefilled
    talk = Conversation(again, method)
    assert [talk.ask(q, max_new_tokens=4).tokens for q in ("what is w3", "and w9")] == said
    if method == "pqcache":  # the saved codebooks, not a new K-Means
        index = again.cache.pq_layers[0].method_state["index"]
        saved = first.cache.pq_layers[0].method_state["index"]
        assert (index.codes[..., : again.n_tokens] == saved.codes[..., : first.n_tokens]).all()
        assert index.segments[0][1].equal(saved.segments[0][1])


def test_a_document_read_back_keeps_completions_value_codes(tmp_path):
    """Under completion the store keeps the values' codes trained with the prefill's codebooks: read back, the
    document answers as its prefill did with those codes, none trained again."""
    model, store = tiny_model("llama"), DocumentStore(tmp_path)
    first = session_on(model, store, completion=True)
    first.load(TEXT)
    prefilled = answers(first)
    again = session_on(model, store, completion=True)
    assert again.load(TEXT)["from"] == "store"
    read_back = again.cache.pq_layers[0].method_state["index"].value_codes
    saved = first.cache.pq_layers[0].method_state["index"].value_codes
    assert read_back is not None and read_back.centroids.equal(saved.centroids)
    assert read_back.codes[..., : again.n_tokens].equal(saved.codes[..., : first.n_tokens])
    assert answers(again) == prefilled


def test_another_text_or_other_settings_are_not_the_same_entry(tmp_path):
    model, store = tiny_model("llama"), DocumentStore(tmp_path)
    session_on(model, store).load(TEXT)
    assert session_on(model, store).load(OTHER)["from"] == "prefill"
    assert session_on(model, store, bits=5).load(TEXT)["from"] == "prefill"  # another codebook size
    assert session_on(model, store, token_budget=0.3).load(TEXT)["from"] == "store"  # the budget: same cache
    assert session_on(tiny_model("llama", seed=1), store).load(TEXT)["from"] == "prefill"  # other weights
    assert len(store.entries()) == 4


def _entry(store):
    (entry,) = store.entries()
    return store.root / entry["key"]


@pytest.mark.parametrize(
    "damage, said",
    [
        (lambda folder: (folder / TENSORS).write_bytes((folder / TENSORS).read_bytes()[:-100]), "bytes"),
        (lambda folder: (folder / TENSORS).write_bytes(b"\0" * (folder / TENSORS).stat().st_size), "unreadable"),
        (lambda folder: (folder / "manifest.json").write_text("{"), "unreadable manifest"),
        (lambda folder: _rewrite(folder, lambda m: m["for"].update(model="another")), "made for another model"),
        (lambda folder: _rewrite(folder, lambda m: m["cache"].update(format=99)), "format 99"),
    ],
    ids=["truncated", "corrupt", "manifest", "another-model", "another-format"],
)
def test_a_bad_entry_is_said_in_one_line_and_the_document_read_from_its_text(tmp_path, damage, said):
    model, store = tiny_model("llama"), DocumentStore(tmp_path)
    first = session_on(model, store)
    first.load(TEXT)
    expected = answers(first)
    damage(_entry(store))
    again = session_on(model, store)
    info = again.load(TEXT)
    assert info["from"] == "prefill" and said in info["store_note"] and "\n" not in info["store_note"]
    assert info["store_note"].startswith("not read from the store")
    assert answers(again) == expected
    assert session_on(model, store).load(TEXT)["from"] == "store"  # the bad entry was replaced by a good one


def _rewrite(folder, change):
    manifest = json.loads((folder / "manifest.json").read_text())
    change(manifest)
    (folder / "manifest.json").write_text(json.dumps(manifest))


def test_a_store_that_cannot_be_written_leaves_the_document_loaded(tmp_path, monkeypatch):
    model = tiny_model("llama")
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    session = session_on(model, DocumentStore(blocker / "documents"))  # its parent is a file: no folder there
    info = session.load(TEXT)
    assert info["from"] == "prefill" and "cannot be written" in info["store_note"]
    assert len(answers(session)) == 2

    import safetensors.torch

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    store = DocumentStore(tmp_path / "full")
    info = session_on(model, store).load(TEXT)
    assert "No space left on device" in info["store_note"] and store.entries() == []
    assert list(store.root.iterdir()) == []  # the temporary folder is gone


def test_two_writers_of_one_document_leave_one_good_entry(tmp_path):
    model, store = tiny_model("llama"), DocumentStore(tmp_path)
    sessions = [session_on(model, store) for _ in range(2)]
    for s in sessions:
        s.load(TEXT)  # the first saves; keep a copy of its entry's payload to save again at once
    (entry,) = store.entries()
    store.delete(entry["key"])
    barrier, notes = threading.Barrier(2), []

    def save(session):
        from pqcache.serving.restore import keep_stored

        barrier.wait()
        described = store.describe(model, session.tokenizer, session.config, "pqcache", False, session.doc_ids)
        notes.append(keep_stored(store, described, session.cache, session.doc_ids, TEXT))

    threads = [threading.Thread(target=save, args=(s,)) for s in sessions]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert notes == [None, None] and [e["key"] for e in store.entries()] == [entry["key"]]
    assert [p.name for p in store.root.iterdir()] == [entry["key"]]  # no temporary folder left
    assert session_on(model, store).load(TEXT)["from"] == "store"


def test_the_cap_evicts_the_least_recently_used_entries(tmp_path):
    model = tiny_model("llama")
    store = DocumentStore(tmp_path, cap_bytes=10**9)
    texts = [" ".join(f"w{(k * i) % 41}" for i in range(260)) for k in (3, 7, 11)]
    for text in texts:
        session_on(model, store).load(text)
    assert session_on(model, store).load(texts[0])["from"] == "store"  # texts[0] used last: texts[1] is the oldest
    sizes = [e["bytes"] for e in store.entries()]
    store.cap_bytes = sum(sizes) - 1
    assert len(store.evict()) == 1
    assert session_on(model, store).load(texts[1])["from"] == "prefill"
    assert session_on(model, store).load(texts[0])["from"] == "store"


def test_a_snapshot_refuses_an_unfinished_or_degraded_cache_and_another_model():
    from pqcache import PQCache

    model = tiny_model("llama")
    with pytest.raises(SnapshotError, match="not prefilled"):
        snapshot(PQCache(model, PQCacheConfig(**CONFIG)))
    session = session_on(model, None)
    session.load(TEXT)
    tensors, meta = snapshot(session.cache)
    with pytest.raises(SnapshotError, match="layer 0 was a pq layer"):
        restore(tiny_model("gemma3"), PQCacheConfig(**CONFIG), tensors, meta)
    session.cache.pq_layers[0].fall_back("a test")
    with pytest.raises(SnapshotError, match="degraded"):
        snapshot(session.cache)


def test_eval_reads_each_context_once_ever_with_a_store(tmp_path):
    """eval's two runners with a store: the second run of a case reads its context back (no forward of the
    document) and every method's answer is the first run's; a case whose question is prefilled with its context
    (query-aware) is not stored."""
    from pqcache.eval import evaluate, scbench

    model, store = tiny_model("llama"), DocumentStore(tmp_path)
    forwards = []
    model.model.register_forward_pre_hook(lambda m, a, kw: forwards.append(kw["input_ids"].shape[1]), with_kwargs=True)
    config, methods = PQCacheConfig(**CONFIG), ["full", "pqcache", "snapkv"]
    case = {"id": "c", "context": TEXT, "question": "what is w3", "answers": ["t1"], "query_aware": False}
    runs = []
    for _ in range(2):
        forwards.clear()
        runs.append(evaluate.run_case(model, WordTokenizer(), case, methods, config, 3, store=store))
        runs[-1] = (runs[-1], max(forwards))
    (first, longest_first), (second, longest_second) = runs
    assert longest_first >= 300 > longest_second  # the second run read no document
    assert [r["read_from"] for r in first + second] == ["prefill"] * 3 + ["store"] * 3
    assert [r["tokens"] for r in second] == [r["tokens"] for r in first]
    rows = evaluate.run_case(model, WordTokenizer(), {**case, "query_aware": True}, methods, config, 3, store=store)
    assert {r["read_from"] for r in rows} == {"prefill"} and len(store.entries()) == 1
    conversation = {"id": "s", "task": "kv", "context": OTHER, "multi_turns": [{"input": "what is v3", "answer": "x"}]}
    said = []
    for _ in range(2):
        forwards.clear()
        rows = scbench.run_case(model, WordTokenizer(), conversation, methods, config, "both", 3, store=store)
        said.append(([r["prediction"] for r in rows], max(forwards)))
    assert said[0][0] == said[1][0] and said[0][1] >= 280 > said[1][1]  # the second read no document
    assert len(store.entries()) == 2


def test_a_writer_killed_midway_leaves_no_entry_that_opens(tmp_path):
    """A process that dies in the middle of writing an entry (os._exit inside the tensor file's write: no cleanup
    runs, as with a killed replica) leaves only a temporary folder: the next load prefills, with no notice, and
    saves a good entry; the leftover is never read and goes once stale."""
    import os
    import subprocess
    import sys
    import time
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    script = f"""
import os, safetensors.torch
from pqcache import PQCacheConfig
from pqcache.serving.session import DocumentSession
from pqcache.serving.store import DocumentStore
from tests.tiny import WordTokenizer, tiny_model
def dies(tensors, path, *a, **k):
    open(path, "wb").write(b"half a file")
    os._exit(9)
safetensors.torch.save_file = dies
store = DocumentStore({str(tmp_path)!r})
DocumentSession(tiny_model("llama"), WordTokenizer(), PQCacheConfig(**{CONFIG!r}), store=store).load({TEXT!r})
"""
    proc = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 9, proc.stderr[-2000:]
    (left,) = list(tmp_path.iterdir())
    assert left.name.startswith(".tmp-")  # no entry: the rename never happened
    store = DocumentStore(tmp_path)
    assert store.entries() == []
    info = session_on(tiny_model("llama"), store).load(TEXT)
    assert info["from"] == "prefill" and info["store_note"] is None and len(store.entries()) == 1
    assert session_on(tiny_model("llama"), store).load(TEXT)["from"] == "store"
    old = time.time() - 2 * 3600
    os.utime(left, (old, old))
    store.evict()
    assert not left.exists() and len(store.entries()) == 1
