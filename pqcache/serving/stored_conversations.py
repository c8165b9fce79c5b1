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
import re
import time
import uuid

from pqcache.serving.store import DocumentStore, NotInStore, StoreError

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


def stored_conversations(store: DocumentStore, key: str) -> list[dict]:
    """Entry `key`'s conversations, the most recently written first: id, method, updated, turns (each kind and
    text); unreadable records are left out."""
    found = []
    for path in (store.root / key / FOLDER).glob("*.json"):
        if path.name.startswith("."):
            continue
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        turns = [{"kind": t["kind"], "text": t["text"], "answer": t["answer"]} for t in record["turns"]]
        found.append({"id": record["id"], "method": record["method"], "updated": record["updated"], "turns": turns})
    return sorted(found, key=lambda r: r["updated"], reverse=True)


def read_conversation(store: DocumentStore, key: str, conversation_id: str) -> dict:
    """A kept record; NotInStore when there is none, StoreError when it cannot be read."""
    if not re.fullmatch(r"[0-9a-f]{16}", conversation_id or ""):
        raise StoreError(f"{conversation_id!r} is not a kept conversation's id")
    path = store.root / key / FOLDER / f"{conversation_id}.json"
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise NotInStore(f"{key}/{conversation_id}") from None
    except (OSError, ValueError) as exc:
        raise StoreError(f"the kept conversation is unreadable ({exc})") from None


def latest_conversation(store: DocumentStore, key: str, method: str) -> dict | None:
    """The record of entry `key`'s most recently written conversation with `method`, or None."""
    for kept in stored_conversations(store, key):
        if kept["method"] == method:
            try:
                return read_conversation(store, key, kept["id"])
            except StoreError:
                continue
    return None
