"""The app as a separate process: `python app.py` started on a free port and stopped again, its resident memory,
threads and child processes read from /proc, and the server's own figures polled through its /server_status
(document caches, Ray replicas). The load test watches the app with these; the tests' app fixtures start it."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout: app.py, assets/


@contextmanager
def running_app(*flags, startup_s: float = 300.0, port: int | None = None):
    """`python app.py --port P *flags` on `port` (None: a free localhost port); yields (url, process). Its output
    goes to a temporary log file (a pipe nobody reads would fill up and block the server)."""
    import tempfile

    if port is None:
        port = free_port()
    log = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen(
        [sys.executable, "app.py", "--port", str(port), *flags],
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.time() + startup_s
    try:
        while True:  # wait until the server accepts connections
            if proc.poll() is not None:
                log.seek(0)
                raise RuntimeError(f"app.py exited: {log.read()[-4000:]}")
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.time() > deadline:
                    raise RuntimeError(f"app.py did not start within {startup_s:.0f} s") from None
                time.sleep(0.5)
        yield f"http://127.0.0.1:{port}/", proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def proc_status(pid: int) -> dict:
    """Resident memory (MiB), threads and child processes of a process, from /proc."""
    fields = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            fields[key] = value.strip()
    children = 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    children += int(f.read().rsplit(")", 1)[1].split()[1]) == pid
            except (OSError, IndexError, ValueError):
                pass
    return {"rss_mib": int(fields["VmRSS"].split()[0]) / 1024, "threads": int(fields["Threads"]), "children": children}


def replicas_rss(status: dict) -> float | None:
    """The Ray replicas' resident memory added up (MiB), from the app's /server_status; None without --ray."""
    if "workers" not in status:
        return None
    return round(sum(w.get("rss_mib") or 0 for w in status["workers"] if w.get("up")), 1)


def watch(admin, proc, peak: dict, done: threading.Event):
    """Until `done` is set, every 0.5 s: raise `peak` to the app's process figures (with `proc`), its document
    caches' MiB and (with --ray) its replicas' resident memory, from the gradio_client `admin`."""
    while not done.wait(0.5):
        if proc:
            now = proc_status(proc.pid)
            for key in now:
                peak[key] = max(peak.get(key, 0), now[key])
        status = admin.predict(api_name="/server_status")
        peak["cache_mib"] = max(peak.get("cache_mib", 0), status["cache_bytes"] / 2**20)
        if "workers" in status:
            peak["replicas_rss_mib"] = max(peak.get("replicas_rss_mib", 0), replicas_rss(status))


def drain(admin, timeout: float, floor: int = 0) -> bool:
    """Wait until the server's document caches are back to `floor` bytes (0: none)."""
    deadline = time.time() + timeout
    while admin.predict(api_name="/server_status")["cache_bytes"] > floor:
        if time.time() > deadline:
            return False
        time.sleep(0.5)
    return True


@contextmanager
def external_app(url: str):
    """An app someone else started, in place of running_app: yields (url, None), no process to read."""
    yield url, None
