"""A document's conversations kept beside its entry in the document store, so that a reload, a restart or a lost
replica reopens the document and its conversation, and the next follow-up sees the earlier turns.

    <key>/conversations/<id>.json   Conversation.record(): its method, turns and the log of what was read into
                                    its cache (token ids), and when it was last written

A record is a few kilobytes of token ids, not tensors: Conversation.replay reads the same chunks and feeds the same
decoded tokens through the same calls, which rebuilds the cache the turns left (the next answer is the one it would
have been) in a few decode steps a turn. It lives in the entry's folder, under the entry's key: the same model,
tokenizer, settings and document, and it goes when the entry goes. Each write is a temporary file renamed into
place: a crash midway leaves the previous record whole.
"""

from __future__ import annotations

import json
import os
import time
import uuid

from pqcache.serving.conversation import Conversation
from pqcache.serving.store import DocumentStore

FOLDER = "conversations"


def save_conversation(store: DocumentStore, key: str, record: dict) -> str | None:
    """Keep `record` (Conversation.record()) beside entry `key`; a line when it could not be kept (the entry is gone,
    the store cannot be written), None when it was."""
    if not store.has(key):
        return "the conversation was not kept: its document is no longer in the store"
    folder = store.root / key / FOLDER
    tmp = folder / f".tmp-{uuid.uuid4().hex[:8]}.json"
    try:
        folder.mkdir(exist_ok=True)
        tmp.write_text(json.dumps({**record, "updated": time.time()}), encoding="utf-8")
        os.replace(tmp, folder / f"{record['id']}.json")
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        return f"the conversation was not kept: the store cannot be written ({exc.strerror or exc})"
    return None


def latest_conversation(store: DocumentStore, key: str, method: str) -> dict | None:
    """The record of entry `key`'s most recently written conversation with `method`, or None (unreadable records
    are passed over)."""
    latest = None
    for path in (store.root / key / FOLDER).glob("*.json"):
        if path.name.startswith("."):  # a write in progress
            continue
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if record.get("method") == method and (latest is None or record["updated"] > latest["updated"]):
            latest = record
    return latest


def keep(store: DocumentStore | None, talk) -> str | None:
    """A conversation kept beside its document's entry after a turn: None when kept, or when there is no entry to
    keep it beside; else the line saying why it was not."""
    key = getattr(talk.session, "store_key", None)
    return None if store is None or key is None else save_conversation(store, key, talk.record())


def resume(store: DocumentStore | None, session, method: str, stop=None):
    """The document's last kept conversation with `method`, replayed on `session` (Conversation.replay), or None."""
    key = getattr(session, "store_key", None)
    record = None if store is None or key is None else latest_conversation(store, key, method)
    return None if record is None else Conversation.replay(session, record, stop)
