"""The document status line of the Q&A tab, from one source of truth per user: the document being loaded (its
name and progress), the active document (the pool's session, named), and what the last load said (an error,
a stop). Every handler that shows the status renders it here, so the line never contradicts itself."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field

from pqcache import PQCacheError
from studio.common import notices, sentence

BAR = 12  # characters of the progress bar
NOTHING = "No document loaded. Attach a file or paste text and press *Load document*, or press *Try a sample*."


@dataclass
class Loading:
    """A load in progress: what the status line and a waiting question show."""

    name: str
    fraction: float = 0.0
    step: str = "reading the document"
    done: threading.Event = field(default_factory=threading.Event)
    error: str | None = None  # how it ended, when it failed
    adding: bool = False  # read into the conversation (Add to the conversation), not loaded in place of the document

    def line(self) -> str:
        filled = round(BAR * self.fraction)
        bar = "\u25b0" * filled + "\u25b1" * (BAR - filled)
        what = f"Adding **{self.name}** to the conversation" if self.adding else f"Loading **{self.name}**"
        return f"{what}: {self.step}  {bar} {100 * self.fraction:.0f} %"


def document_name(file: str | None, pasted: str | None) -> str:
    """How the status line names a document: the file's name, or the pasted text and its size."""
    if file:
        return os.path.basename(file)
    return f"pasted text ({len((pasted or '').strip()):,} characters)"


def every_token(session) -> str:
    """A sentence when the settings select every token of the document: the answers are full attention's then."""
    config, n = getattr(session, "config", None), session.n_tokens
    if session.method == "full" or config is None or not n:
        return ""
    n_init, n_topk, n_local = config.split(n)
    if n_init + n_topk + n_local < n:
        return ""
    return (
        f" These settings attend to every one of its {n:,} tokens ({n_init} sinks + {n_topk} top-k + a window of "
        f"{n_local}): this is full attention; lower the budget or the window to select."
    )


def loaded_line(session) -> str:
    info = getattr(session, "info", None) or {}
    layers = ", ".join(str(layer.layer_idx) for layer in session.cache.pq_layers) if session.cache else ""
    cut = (
        f" The document had {info['document_tokens']} tokens: its middle was cut to fit the model."
        if session.truncated
        else ""
    )
    figures = ""
    if info:
        read = (
            f" Read from the document store in **{info['read_s']:.2f} s** (no prefill)"
            if info.get("from") == "store"
            else f" Prefill **{info['prefill_s']:.2f} s**"
        )
        # the tiers as they are on this machine: on a CPU both are RAM (the working set and every token's KV)
        on_gpu = str(getattr(session, "device", "cpu")).startswith("cuda")
        tiers = ("device KV", "host KV") if on_gpu else ("working KV", "all tokens' KV")
        figures = (
            f"{read}; PQ on layers {layers}; {tiers[0]} "
            f"{info['device_kv_bytes'] / 2**20:.1f} MiB, {tiers[1]} {info['host_kv_bytes'] / 2**20:.1f} MiB, "
            f"PQ {info['pq_bytes'] / 2**10:.0f} KiB"
            + (f", prefill queries {info['query_bytes'] / 2**20:.1f} MiB" if info.get("query_bytes") else "")
            + "."
        )
    return (
        f"Loaded **{session.n_tokens}** tokens of **{getattr(session, 'name', 'the document')}**, "
        f"the active document (method {session.method}).{figures}{cut}{every_token(session)}{notices(info)}"
        + (f"\n\n**Notice:** the document was {info['store_note']}" if info.get("store_note") else "")
    )


WAIT_S = 0.5  # how often a load's progress (and a waiting question) is looked at
PROGRESS_EVERY_S = 1.0  # a load's progress is sent to the page at most this often


class StatusBook:
    """Per user: the load in progress and the last load's message; the active document is the service's."""

    def __init__(self, documents, slot: str = "qa"):
        self.documents, self.slot = documents, slot  # the documents service (serving/service.py)
        self.loading: dict[str, Loading] = {}
        self.said: dict[str, str] = {}  # the last load's error or stop message, until the next load
        self.lock = threading.Lock()

    def start(self, user: str, name: str, adding: bool = False) -> Loading:
        with self.lock:
            self.said.pop(user, None)
            self.loading[user] = load = Loading(name, adding=adding)
        return load

    def finish(self, user: str, message: str | None = None):
        """The load ended: message (an error, a stop) is shown until the next load."""
        with self.lock:
            load = self.loading.pop(user, None)
            if message:
                self.said[user] = message
        if load is not None:
            load.error = message
            load.done.set()

    def forget(self, user: str):
        self.finish(user)
        with self.lock:
            self.said.pop(user, None)

    def active(self, user: str):
        """(the active session or None, why the server freed it or None)."""
        try:
            return self.documents.session(user, self.slot), None
        except PQCacheError as exc:  # evicted or reaped: say so
            return None, sentence(str(exc))

    def line(self, user: str) -> str:
        """The status line: what the last load said, the load in progress, the active document."""
        with self.lock:
            said, load = self.said.get(user), self.loading.get(user)
        session, freed = self.active(user)
        parts = [said] if said else []
        if load is not None:
            parts.append(load.line())
            if load.adding:
                parts.append("A question now waits for it; if it stops or fails, the conversation stays as it was.")
            elif session is not None and session.cache is not None:  # replaced only once its successor is ready
                name = getattr(session, "name", "the document")
                parts.append(f"A question now waits for it; if it stops or fails, **{name}** stays active.")
        if freed:
            parts.append(f"**Notice:** {freed}")
        if session is not None and session.cache is not None and load is None:
            if said:
                name = getattr(session, "name", "the document")
                parts.append(f"Still active: **{name}** ({session.n_tokens} tokens); questions go to it.")
            else:
                parts.append(loaded_line(session))
            state = self.documents.conversation_state(user)
            if state and state["added"]:  # every document the conversation holds, named where the document is
                parts.append(
                    f"The conversation holds **{getattr(session, 'name', 'the document')}** and, added: "
                    + ", ".join(f"**{n}**" for n in state["added"])
                    + "."
                )
        elif load is None and not said and not freed:
            parts.append(NOTHING)
        elif load is None and said and not said.startswith("Stopped"):
            parts.append("No document is loaded.")
        return "\n\n".join(parts)

    def lines_while(self, user: str, job):
        """The user's status line while `job` (a ThreadWork: a load, a document added) runs, each time it changed,
        at most one a second: each update costs the server's event loop (and the GIL the prefill's operators wait
        for) a few ms per output, skipped ones included."""
        shown, sent = None, 0.0
        for _ in job.posts(WAIT_S):
            line, now = self.line(user), time.monotonic()
            if line != shown and now - sent >= PROGRESS_EVERY_S:
                shown, sent = line, now
                yield line
