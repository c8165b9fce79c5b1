"""`bench store`: reading a document from the document store against prefilling it, in one run.

Per length: a load without a store (DocumentSession.load: the prefill, its K-Means, the sources' spans), the save of
its cache into an empty store (timed apart), a cold read (the page cache dropped where this machine allows it, else
the entry rewritten as fresh files and evicted with posix_fadvise: the `cold` column says which), and a warm read
straight after; the bytes on disk a token against the cache's bytes a token; and whether the first answer is token
for token the same after the prefill and after each read. Loads and reads are timed whole: load() from the text to a
document ready for questions.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import torch

from pqcache.bench.model import _ids
from pqcache.bench.procfs import proc_write
from pqcache.engine.config import PQCacheConfig

QUESTION = "What is the pass key?"


def drop_page_cache() -> bool:
    """Ask the kernel to drop clean page-cache pages (root, and a kernel that allows it); False where refused."""
    return proc_write("/proc/sys/vm/drop_caches", "1\n")


def _fresh_copy(store, key: str) -> None:
    """The entry rewritten as new files (its pages not yet read from them: what a first read after a restart
    meets, short of a dropped page cache). Written through, then evicted from the page cache where posix_fadvise
    is honoured."""
    import os

    folder = store.root / key
    for name in ("tensors.safetensors", "manifest.json"):
        path, tmp = folder / name, folder / f".{name}.fresh"
        shutil.copyfile(path, tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        os.replace(tmp, path)


@torch.no_grad()
def bench_store(model, tokenizer, seq_lens=(8192, 24576), config=None, root: str | Path | None = None) -> list[dict]:
    from pqcache.serving.restore import keep_stored
    from pqcache.serving.session import DocumentSession
    from pqcache.serving.store import DocumentStore

    config = config or PQCacheConfig()
    device = next(model.parameters()).device
    model(_ids(tokenizer, 64).to(device), logits_to_keep=1)  # warm-up
    rows = []
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        for s in seq_lens:
            store = DocumentStore(Path(tmp) / f"store-{s}", cap_bytes=1 << 40)
            text = tokenizer.decode(_ids(tokenizer, s)[0], skip_special_tokens=True)
            session = DocumentSession(model, tokenizer, config, method="pqcache")
            t0 = time.perf_counter()
            info = session.load(text)  # what a load costs without a store: prefill, K-Means, the sources' spans
            load_s = time.perf_counter() - t0
            answer = session.ask(QUESTION, max_new_tokens=8).tokens
            described = store.describe(model, tokenizer, config, "pqcache", False, session.doc_ids)
            t0 = time.perf_counter()
            note = keep_stored(store, described, session.cache, session.doc_ids, text)
            save_s = time.perf_counter() - t0
            assert note is None, note
            (entry,) = store.entries()
            kv = info["host_kv_bytes"] + info["device_kv_bytes"] + info["pq_bytes"]
            session.close()
            dropped = drop_page_cache()
            if not dropped:
                _fresh_copy(store, entry["key"])
            reads = {}
            for kind in ("cold", "warm"):
                again = DocumentSession(model, tokenizer, config, method="pqcache", store=store)
                t0 = time.perf_counter()
                got = again.load(text)
                wall = time.perf_counter() - t0  # the whole load: tokenizing, the read, the sources' spans
                assert got["from"] == "store", got["store_note"]
                reads[kind] = (wall, again.ask(QUESTION, max_new_tokens=8).tokens == answer)
                again.close()
            rows.append(
                {
                    "seq_len": s,
                    "load_s": round(load_s, 2),
                    "prefill_s": round(info["prefill_s"], 2),
                    "save_s": round(save_s, 2),
                    "cold": "page cache dropped" if dropped else "fresh file",
                    "cold_read_s": round(reads["cold"][0], 3),
                    "warm_read_s": round(reads["warm"][0], 3),
                    "load_over_cold": round(load_s / reads["cold"][0], 1),
                    "load_over_warm": round(load_s / reads["warm"][0], 1),
                    "disk_bytes_tok": round(entry["bytes"] / s),
                    "cache_bytes_tok": round(kv / s),
                    "same_answer": reads["cold"][1] and reads["warm"][1],
                }
            )
    return rows
