"""Your documents: the documents this browser loaded, kept in the browser (gr.BrowserState, in its localStorage),
each one click to reopen from the document store (serving/store.py: no prefill when the load form's settings shape
the cache as they did) or to delete from it.

The server keeps no list of anyone's documents: the listing lives in the browser that loaded them, and a document
is reopened by its store key, a hash of its model, settings and token ids that only a browser which loaded it holds.
The browser's copy is encrypted with a secret kept in $PQCACHE_HOME (made once), so it reads back after a restart.
"""

from __future__ import annotations

import os
import secrets

import gradio as gr

from pqcache.serving.settings import LoadSettings
from studio.answering import literal
from studio.common import describe, user_of
from studio.qa_load import DocumentLoader
from studio.state import Studio
from studio.status import StatusBook

MAX_LISTED = 20  # documents a browser lists, the most recent first
NONE_YET = "Documents you load are listed here, to reopen without reading them again."
SOME = "Open reads one back from the store (no prefill, with the settings it was loaded with)."


def browser_secret() -> str:
    """The key BrowserState encrypts the listing with: one per PQCACHE_HOME, kept across restarts (a new random
    one at each start would make every browser's listing unreadable after a restart)."""
    from pqcache.serving.home import pqcache_home

    path = pqcache_home() / "browser_secret"
    try:
        return path.read_text().strip()
    except OSError:
        path.parent.mkdir(parents=True, exist_ok=True)
        value = secrets.token_hex(32)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(value)
        try:  # of two first starts at once, the first link wins and both read its secret
            os.link(tmp, path)
        except FileExistsError:
            pass
        finally:
            os.unlink(tmp)
        return path.read_text().strip()


def _clean(listing) -> list[dict]:
    """What the browser sent back, as entries (anything else dropped: the browser's storage is the user's)."""
    ok = [e for e in (listing or []) if isinstance(e, dict) and isinstance(e.get("key"), str)]
    tokens = [e.get("tokens") if isinstance(e.get("tokens"), int) else 0 for e in ok]
    return [{"key": e["key"], "name": str(e.get("name", "a document")), "tokens": n} for e, n in zip(ok, tokens)]


def choices(listing) -> dict:
    entries = _clean(listing)
    labels = [(f"{e['name']} ({e['tokens']:,} tokens)", e["key"]) for e in entries]
    return gr.update(choices=labels, value=None, info=SOME if entries else NONE_YET)


class YourDocuments:
    """The Your documents list: the documents this browser loaded (kept in the browser), reopened from the store
    with their last conversation, or deleted from it."""

    def __init__(self, studio: Studio, status: StatusBook, loader: DocumentLoader):
        self.studio, self.documents = studio, studio.documents
        self.status, self.loader = status, loader

    def remember(self, listing, request: gr.Request):
        """After a load: the active document at the top of this browser's list, when the store holds it."""
        session = self.documents.session(user_of(request))
        key = getattr(session, "store_key", None)
        entries = [e for e in _clean(listing) if e["key"] != key]
        if key:
            entries.insert(0, {"key": key, "name": getattr(session, "name", "a document"), "tokens": session.n_tokens})
        entries = entries[:MAX_LISTED]
        return entries, choices(entries)

    def shown_list(self, listing):
        """The list's choices when the page opens (the browser's stored listing)."""
        return choices(listing)

    def reopen(
        self,
        key,
        listing,
        method,
        m,
        bits,
        budget,
        n_init,
        n_local,
        policy,
        capacity,
        encoding,
        too_long,
        mass,
        completion,
        request: gr.Request,
    ):
        """Load a listed document again, from its text kept in the store (its cache read back, no prefill, when the
        form's settings shape it as they did). Yields what a load yields."""
        from pqcache.serving.store import StoreError

        user, skip = user_of(request), (gr.skip(),) * 6
        entry = next((e for e in _clean(listing) if e["key"] == key), None)
        store = self.studio.store
        if store is None or entry is None:
            gr.Warning("Choose one of your documents first." if store is not None else "This app keeps no store.")
            yield self.status.line(user), *skip
            return
        try:
            text = store.text(key)
        except StoreError as exc:
            gr.Warning(f"{entry['name']}: {exc}; load it from its file again.")
            yield self.status.line(user), *skip
            return
        form = (method, m, bits, budget, n_init, n_local, policy, capacity, encoding, too_long, mass, completion)
        settings = LoadSettings(*form)
        yield from self.loader.load(user, entry["name"], lambda enc: text, settings)

    def resumed(self, key, method, request: gr.Request):
        """After a reopen: the conversation kept with that document (its last one for the method) back in the chat,
        its turns shown and the next question a follow-up; without one the chat starts empty. (chat, timing line)"""
        user = user_of(request)
        session, _ = self.status.active(user)
        if session is None or getattr(session, "store_key", None) != key:
            return gr.skip(), gr.skip()  # the reopen failed: the chat stays as it was
        try:
            state = self.documents.resume_conversation(user, method)
        except Exception as exc:  # an unreadable record, a Stop: the document stays, a new conversation starts
            return [], f"**Error:** the kept conversation could not be read back ({describe(exc)}); a new one starts."
        if state is None:
            return [], ""
        chat = []
        for turn in state["turns"]:
            if turn["kind"] == "question":
                chat += [
                    {"role": "user", "content": turn["text"]},
                    {"role": "assistant", "content": literal(turn["answer"])},
                ]
            else:
                chat.append({"role": "assistant", "content": f"*Added **{turn['text']}** to the conversation.*"})
        asked = len(state["asked"])
        return chat, f"Reopened the conversation kept with this document ({asked} question(s)): ask a follow-up."

    def forget(self, key, listing, request: gr.Request):
        """Delete a listed document from the store and from this browser's list (a loaded copy stays loaded)."""
        entries = _clean(listing)
        if self.studio.store is not None and any(e["key"] == key for e in entries):
            self.studio.store.delete(key)
        entries = [e for e in entries if e["key"] != key]
        return entries, choices(entries)
