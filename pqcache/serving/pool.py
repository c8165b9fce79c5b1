"""Many users, one model: a pool of document sessions under one memory cap.

Each user (a browser tab, a gradio_client) has an id and at most one document cache per slot
("qa", "teaching"). The model is shared; the caches are not. The pool

  - frees a cache when its user leaves (`end`) or after `idle_s` without a request (`reap`; idle_s None
    or 0: never by idleness, and `start_reaper` starts no thread),
  - keeps the total bytes of resident caches under `max_bytes`: before a prefill it evicts the least
    recently used idle caches to make room (`reserve`), and refuses the prefill with CapacityError
    when busy caches alone leave no room,
  - remembers why a cache was freed, so the user is told on the next request (`notice`), and a
    request on a freed cache raises SessionEvictedError.

A question works on a fork of the document cache; that working copy lives only while the answer is
generated and is not counted here.
"""

from __future__ import annotations

import ctypes
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

from pqcache.engine.errors import CapacityError, SessionEvictedError
from pqcache.engine.heap import release_host_memory


@dataclass
class Entry:
    sessions: dict = field(default_factory=dict)  # slot -> DocumentSession with a loaded document
    nbytes: dict = field(default_factory=dict)  # slot -> bytes of the loaded document (measured)
    pending: dict = field(default_factory=dict)  # slot -> bytes reserved for a load in progress (its successor)
    stop: threading.Event = field(default_factory=threading.Event)
    busy: int = 0  # requests in flight
    last_used: float = 0.0
    notice: str | None = None  # why a cache was freed, until the user has been told
    freed: dict = field(default_factory=dict)  # slot -> why it was freed (for SessionEvictedError)


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def limit_malloc_arenas(n: int = 2):
    """Fewer glibc heaps for a server whose many threads each allocate: freed cache memory then
    returns to a few heaps that malloc_trim can shrink (the load test measured the difference)."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(-8, n)  # M_ARENA_MAX
    except (OSError, AttributeError):
        pass


IDLE_S = 1800.0  # a user's caches are freed after this long idle: the pool's default, and the app's (--idle-minutes)


class SessionPool:
    def __init__(self, max_bytes: int, idle_s: float | None = IDLE_S, clock=time.monotonic):
        # idle_s None or 0: caches are never freed for idleness (only by end, free and the memory cap)
        self.max_bytes, self.idle_s, self.clock = max_bytes, idle_s or None, clock
        self.entries: dict[str, Entry] = {}
        self.lock = threading.RLock()
        self._reaper: IdleReaper | None = None

    # ---- bookkeeping -----------------------------------------------------------------------------
    def entry(self, user: str) -> Entry:
        with self.lock:
            if user not in self.entries:
                self.entries[user] = Entry(last_used=self.clock())
            return self.entries[user]

    @contextmanager
    def use(self, user: str):
        """Mark `user` busy for one request (busy caches are never evicted)."""
        entry = self.entry(user)
        with self.lock:
            entry.busy += 1
            entry.last_used = self.clock()
        try:
            yield entry
        finally:
            with self.lock:
                entry.busy -= 1
                entry.last_used = self.clock()

    def session(self, user: str, slot: str = "qa"):
        """The user's loaded session in `slot`, or None; SessionEvictedError if the pool freed it."""
        with self.lock:
            entry = self.entry(user)
            if slot in entry.sessions:
                return entry.sessions[slot]
            if slot in entry.freed:
                entry.notice = None  # told now, by the error
                raise SessionEvictedError(entry.freed[slot])
            return None

    def summary(self) -> dict:
        """Users with a loaded document, users with a request in flight, cache bytes and the cap."""
        with self.lock:
            return {
                "users": sum(1 for e in self.entries.values() if e.sessions),
                "busy": sum(1 for e in self.entries.values() if e.busy),
                "cache_bytes": self.total_bytes(),
                "max_bytes": self.max_bytes,
            }

    def total_bytes(self) -> int:
        with self.lock:
            return sum(sum(e.nbytes.values()) + sum(e.pending.values()) for e in self.entries.values())

    # ---- memory cap --------------------------------------------------------------------------------
    def reserve(self, user: str, slot: str, nbytes: int):
        """Make room for a cache of `nbytes` for (user, slot), evicting LRU idle caches of others."""
        with self.lock:
            entry = self.entry(user)
            if nbytes > self.max_bytes:  # refused before anything is freed: the old document stays
                raise CapacityError(
                    f"this document needs about {_gib(nbytes)} of cache; the server allows "
                    f"{_gib(self.max_bytes)} in all: use a shorter document"
                )
            entry.pending.pop(slot, None)
            self._evict_until(self.max_bytes - nbytes, keep=user)
            over = self.total_bytes() + nbytes - self.max_bytes
            if 0 < over <= entry.nbytes.get(slot, 0):  # the successor fits alone, not beside the old document
                self._free(user, slot, None)
                entry.notice = replaced = (
                    f"your earlier document was unloaded to make room for this one (the server keeps at most "
                    f"{_gib(self.max_bytes)} of caches)"
                )
                entry.freed[slot] = replaced + "; load it again"
            if self.total_bytes() + nbytes > self.max_bytes:
                raise CapacityError(
                    f"the server's cache memory ({_gib(self.max_bytes)}) is held by users who are "
                    "generating right now: try again in a moment"
                )
            entry.pending[slot] = nbytes

    def store(self, user: str, slot: str, session):
        """Keep a loaded session in place of the slot's old one (freed now); account its measured size and evict
        others if that went over."""
        with self.lock:
            entry = self.entry(user)
            old = entry.sessions.get(slot)
            if old is not None and old is not session:
                old.close()
            entry.pending.pop(slot, None)
            entry.sessions[slot] = session
            entry.freed.pop(slot, None)
            entry.nbytes[slot] = session.nbytes()
            entry.last_used = self.clock()
            self._evict_until(self.max_bytes, keep=user)

    def count(self, user: str, slot: str, nbytes: int):
        """A loaded slot's bytes measured anew (its document and a conversation grown on it); evicts other users'
        idle caches if that went over the cap."""
        with self.lock:
            entry = self.entry(user)
            if slot in entry.sessions:
                entry.nbytes[slot] = nbytes
                self._evict_until(self.max_bytes, keep=user)

    def unreserve(self, user: str, slot: str):
        """A reservation whose prefill failed or was stopped: the slot's old document, if any, stays as it was."""
        with self.lock:
            self.entry(user).pending.pop(slot, None)

    def _evict_until(self, limit: int, keep: str):
        while self.total_bytes() > limit:
            idle = [(e.last_used, u) for u, e in self.entries.items() if u != keep and e.busy == 0 and e.sessions]
            if not idle:
                return
            _, victim = min(idle)
            for slot in list(self.entries[victim].sessions):
                self._free(
                    victim,
                    slot,
                    f"your document was unloaded to make room for another user (the server "
                    f"keeps at most {_gib(self.max_bytes)} of caches); load it again",
                )

    def _free(self, user: str, slot: str, why: str | None):
        entry = self.entries.get(user)
        if entry is None:
            return
        session = entry.sessions.pop(slot, None)
        entry.nbytes.pop(slot, None)
        if session is not None:
            session.close()
            if why:
                entry.freed[slot] = why
                entry.notice = why

    # ---- ends: leaving, idling --------------------------------------------------------------------
    def free(self, user: str, slot: str = "qa"):
        """The user unloads a document."""
        with self.lock:
            self._free(user, slot, None)
        release_host_memory()

    def end(self, user: str):
        """The user left (tab closed): free everything of theirs and stop their work."""
        with self.lock:
            entry = self.entries.get(user)
            if entry is None:
                return
            entry.stop.set()  # a request still running ends at its next layer or token
            for slot in list(entry.sessions):
                self._free(user, slot, None)
            del self.entries[user]
        release_host_memory()

    def reap(self) -> list[str]:
        """Free the caches of users idle for more than idle_s; returns those users (none when idle_s is None)."""
        if not self.idle_s:
            return []
        now, reaped = self.clock(), []
        with self.lock:
            for user, entry in list(self.entries.items()):
                if entry.busy == 0 and now - entry.last_used > self.idle_s:
                    if entry.sessions:
                        for slot in list(entry.sessions):
                            self._free(
                                user,
                                slot,
                                f"your document was unloaded after {self.idle_s:g} s without a request; load it again",
                            )
                        reaped.append(user)
                    elif not entry.notice and not entry.freed:
                        del self.entries[user]  # nothing left to tell them
        if reaped:
            release_host_memory()
        return reaped

    def notice(self, user: str) -> str | None:
        """What the user has not been told yet about their cache (and forget it)."""
        with self.lock:
            entry = self.entries.get(user)
            if entry is None or entry.notice is None:
                return None
            note, entry.notice = entry.notice, None
            return note

    def start_reaper(self, every_s: float = 5.0):
        """An IdleReaper calling reap() every `every_s` seconds (> 0); none when idle_s is None (or 0), as reap()
        would never free anything."""
        if self._reaper is None and self.idle_s:
            self._reaper = IdleReaper(self, every_s)
            self._reaper.start()

    def close(self):
        if self._reaper is not None:
            self._reaper.closing.set()
        for user in list(self.entries):
            self.end(user)


class IdleReaper(threading.Thread):
    """A daemon thread calling pool.reap() every `every_s` seconds until `closing` is set."""

    def __init__(self, pool: SessionPool, every_s: float):
        if not every_s > 0:  # wait(0) returns at once: the loop would spin
            raise ValueError(f"every_s must be a number of seconds > 0, got {every_s!r}")
        super().__init__(name="pqcache-reaper", daemon=True)
        self.pool, self.every_s, self.closing = pool, every_s, threading.Event()

    def run(self):
        while not self.closing.wait(self.every_s):
            self.pool.reap()
