"""A load's side of the document store: a document's cache read back from the store when it holds one for this model,
tokenizer, settings and token ids, or prefilled and then kept there. The session, `generate`, `chat` and `eval` all
load through load_or_restore; store.py is the storage itself."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass

from pqcache.serving.store import DocumentStore, NotInStore, StoreError


@dataclass
class LoadedCache:
    """A document's cache as load_or_restore got it."""

    cache: object  # the PQCache: read back from the store, or prefilled (its PQ built)
    read_from: str  # "store" or "prefill"
    seconds: float  # the read, or the prefill with its K-Means
    note: str | None = None  # one line when an entry was refused or could not be saved (the document loads anyway)
    key: str | None = None  # the store's entry that holds this cache (None: no store, or it could not be saved)


def load_or_restore(
    store: DocumentStore | None,
    model,
    tokenizer,
    config,
    method: str,
    keep_queries: bool,
    ids: list[int],
    prefill: Callable[[], object],
    text: str,
    truncated=None,
) -> LoadedCache:
    """The document's cache read back from `store` where it holds one for this model, tokenizer, settings and token
    ids (no prefill, no K-Means); else `prefill()` (which returns the cache with its PQ built) and the result kept in
    the store for the next load. An entry that cannot be used is removed and said in `note`; a failed save is said
    there too. store None: `prefill()` alone. The session, `generate`, `chat` and `eval` all load through here."""
    from pqcache.engine.snapshot import SnapshotError, restore

    t0 = time.perf_counter()
    if store is None:
        return LoadedCache(prefill(), "prefill", time.perf_counter() - t0)
    described = store.describe(model, tokenizer, config, method, keep_queries, ids)
    key, note = store.key(described), None
    try:
        tensors, manifest = store.open(key, described)
        cache = restore(model, config, tensors, manifest["cache"], keep_queries)
        return LoadedCache(cache, "store", time.perf_counter() - t0, key=key)
    except NotInStore:
        pass
    except (StoreError, SnapshotError, KeyError) as exc:
        store.delete(key)
        note = f"not read from the store: {exc}"
    t0 = time.perf_counter()
    cache = prefill()
    seconds = time.perf_counter() - t0
    failed = keep_stored(store, described, cache, ids, text, truncated)
    return LoadedCache(cache, "prefill", seconds, failed or note, None if failed else key)


def keep_stored(store: DocumentStore, described: dict, cache, ids: list[int], text: str, truncated=None) -> str | None:
    """Save a loaded document's cache under `described` (store.describe's); returns a line when it could not be
    saved (the document stays loaded either way)."""
    from pqcache.engine.snapshot import SnapshotError, snapshot

    try:
        tensors, meta = snapshot(cache)
        manifest = {
            "for": described,
            "cache": meta,
            "ids": ids,
            "tokens": len(ids),
            "text_sha256": hashlib.sha256(text.encode()).hexdigest(),
            "truncated": truncated,
        }
        store.save(store.key(described), tensors, manifest, text)
    except (StoreError, SnapshotError) as exc:
        return f"not saved to the store: {exc}"
    return None
