"""Work the page streams from: a load or an answer runs on a worker thread while the handler, a generator, sends
the page what the work has posted so far. One helper for both, so a Stop, a page gone away mid-work and an error
are handled the same way everywhere."""

from __future__ import annotations

import queue
import threading

_DONE = object()  # posted once the work has returned or raised


class ThreadWork:
    """work(post) run on a daemon thread; post(item) hands the handler its latest progress. Use it as a context
    manager: leaving the block before the work ended (the page went away: GeneratorExit) sets `stop` and waits for
    the work to see it, so no thread is leaked. After the block, `value` is what work returned, `error` what it raised
    (an Exception; the handler shows it and the page stays usable)."""

    def __init__(self, work, stop: threading.Event, name: str):
        self.stop, self.done = stop, False
        self.value, self.error = None, None
        self._posted: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, args=(work,), daemon=True, name=name)

    def _run(self, work):
        try:
            self.value = work(self._posted.put)
        except Exception as exc:
            self.error = exc
        self._posted.put(_DONE)

    def __enter__(self) -> ThreadWork:
        self._thread.start()
        return self

    def __exit__(self, *exc_info):
        if not self.done:
            self.stop.set()
            self._thread.join(timeout=30)

    def posts(self, wait_s: float):
        """Yields, until the work ends, the latest item posted since the last yield (older ones are dropped: only
        the newest progress matters), or None when `wait_s` passed with nothing posted; the handler decides what to
        send the page and how often."""
        while True:
            try:
                item = self._posted.get(timeout=wait_s)
                while item is not _DONE and not self._posted.empty():
                    item = self._posted.get_nowait()
            except queue.Empty:
                item = None
            if item is _DONE:
                self.done = True
                return
            yield item
