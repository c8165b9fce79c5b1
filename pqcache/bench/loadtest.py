"""Load test: N concurrent gradio_client users against a local app for a bounded time.

python -m pqcache loadtest --clients 6 --duration 120 [--url URL] [--app-args "--max-cache-gib 0.1"]
                           [--ray local|auto|HOST:PORT --replicas N]

Without --url it starts `python app.py` itself (so it can read the server's memory and threads from
/proc). Each user repeats a random mix: load a document, ask (some answers stopped halfway), send
bad input, unload. Every request must end with a result or a readable message within
--request-timeout; anything else (an exception, a traceback, a timeout) is a failure. After the
users end, it waits for the server's caches to drain and compares resident memory, threads and
child processes with the baseline taken after one warm-up user. With --ray the app serves the documents from
Ray Serve replicas (docs/scaling.md); their resident memory comes from the app's /server_status.
"""

from __future__ import annotations

import json
import random
import threading
import time
from dataclasses import replace
from pathlib import Path

from pqcache.bench.app_process import ROOT, drain, external_app, proc_status, replicas_rss, running_app, watch
from pqcache.bench.loadtest_report import format_report, message_counts
from pqcache.eval.passkey import LONG_QUESTION, QUESTION
from pqcache.serving.settings import LoadSettings

PASSKEY = ROOT / "assets" / "passkey_1k.txt"
SETTINGS = LoadSettings()  # the app's load form, at its defaults
# replies that are a readable message, not a failure: the server is full, or evicted this user
MESSAGES = ("**Error:**", "Load a document first", "Your document was unloaded", "Stopped:", "Error: load a document")


class User:
    """One gradio_client session doing a random mix of requests; records each outcome."""

    def __init__(self, url: str, seed: int, request_timeout: float, bad_files: list[Path]):
        from gradio_client import Client

        self.client = Client(url, verbose=False)
        self.rng = random.Random(seed)
        self.timeout = request_timeout
        self.bad_files = bad_files
        self.records: list[dict] = []

    def _call(self, kind: str, fn):
        t0 = time.perf_counter()
        try:
            reply = fn()
            outcome = "message" if reply.startswith(MESSAGES) else "ok"
        except Exception as exc:  # noqa: BLE001 - every way a request can fail is recorded
            reply, outcome = f"{type(exc).__name__}: {exc}", "failure"
        self.records.append(
            {"kind": kind, "outcome": outcome, "seconds": time.perf_counter() - t0, "reply": reply[:160]}
        )

    def _load(self, path=None, text="", settings: LoadSettings = SETTINGS):
        from gradio_client import handle_file

        job = self.client.submit(
            handle_file(str(path)) if path else None, text, *settings.values(), api_name="/load_document"
        )
        return job.result(timeout=self.timeout)[0]

    def _ask(self, max_new: int, stop_after: int | None = None):
        question = QUESTION if stop_after is None else LONG_QUESTION  # a long answer to stop halfway
        job = self.client.submit(question, [], "pqcache", max_new, "5", api_name="/ask")
        deadline = time.time() + self.timeout
        if stop_after is not None:
            while len(job.outputs()) < stop_after and not job.done() and time.time() < deadline:
                time.sleep(0.1)
            self.client.predict(api_name="/stop")
        while not job.done():
            if time.time() > deadline:
                job.cancel()
                raise TimeoutError(f"no answer within {self.timeout:.0f} s")
            time.sleep(0.1)
        final = job.outputs()[-1] if job.outputs() else job.result()
        return final[0][-1]["content"][0]["text"]

    def step(self):
        r = self.rng.random()
        if r < 0.3:
            self._call("load", lambda: self._load(PASSKEY))
        elif r < 0.6:
            self._call("ask", lambda: self._ask(self.rng.choice([4, 8, 16])))
        elif r < 0.75:
            self._call("ask+stop", lambda: self._ask(64, stop_after=2))
        elif r < 0.9:
            bad = self.rng.choice(self.bad_files + [None])
            settings = SETTINGS if bad else replace(SETTINGS, m=3)  # m=3 does not divide head_dim
            self._call("bad input", lambda: self._load(bad, "some text" if bad is None else "", settings))
        else:
            self._call("unload", lambda: self.client.predict(api_name="/unload_document")[0])

    def run(self, until: float):
        while time.time() < until:
            self.step()
        self._call("unload", lambda: self.client.predict(api_name="/unload_document")[0])


def make_bad_files(folder: Path) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    files = {
        "empty.txt": b"",
        "binary.txt": bytes(range(256)) * 8,
        "broken.pdf": b"%PDF-1.4 broken",
        "latin1.txt": "caf\xe9 cr\xe8me".encode("latin-1"),
        "slides.pptx": b"PK\x03\x04",
    }
    for name, data in files.items():
        (folder / name).write_bytes(data)
    return [folder / name for name in files]


def run(
    clients: int,
    duration: float,
    url: str | None = None,
    app_args: list[str] | None = None,
    request_timeout: float = 300.0,
    drain_timeout: float = 120.0,
    seed: int = 0,
    rounds: int = 2,
) -> dict:
    """Drive `clients` users for `duration` seconds, `rounds` times; returns the figures. Server memory
    and threads are read after each round: a leak grows round after round, a pool levels off."""
    import tempfile

    from gradio_client import Client

    with (  # --no-store: every load is a prefill
        tempfile.TemporaryDirectory() as tmp,
        running_app("--no-store", *(app_args or [])) if url is None else external_app(url) as (url, proc),
    ):
        bad_files = make_bad_files(Path(tmp))
        admin = Client(url, verbose=False)
        floor = admin.predict(api_name="/server_status")["cache_bytes"]  # other users' caches (--url)
        warm = User(url, seed - 1, request_timeout, bad_files)  # warm-up: first-use allocations, then baseline
        warm._call("load", lambda: warm._load(PASSKEY))
        warm._call("ask", lambda: warm._ask(8))
        warm._call("unload", lambda: warm.client.predict(api_name="/unload_document")[0])
        drain(admin, drain_timeout, floor)
        before = proc_status(proc.pid) if proc else None
        replicas_before = replicas_rss(admin.predict(api_name="/server_status"))
        peak = dict(before or {})
        done = threading.Event()
        watcher = threading.Thread(target=watch, args=(admin, proc, peak, done), daemon=True)
        watcher.start()
        users, after, replicas_after, hung, drained, t0 = [], [], [], 0, True, time.perf_counter()
        for r in range(rounds):
            group = [User(url, seed + 100 * r + i, request_timeout, bad_files) for i in range(clients)]
            users += group
            until = time.time() + duration
            threads = [threading.Thread(target=u.run, args=(until,), daemon=True) for u in group]
            for t in threads:
                t.start()
            for t in threads:
                t.join(duration + 2 * request_timeout)
            hung += sum(t.is_alive() for t in threads)
            drained &= drain(admin, drain_timeout, floor)
            if proc:
                after.append(proc_status(proc.pid))
            replicas_after.append(replicas_rss(admin.predict(api_name="/server_status")))
        wall = time.perf_counter() - t0
        done.set()
        watcher.join()
        summary = admin.predict(api_name="/server_status")
    records = [r for u in users for r in u.records]
    by_kind: dict = {}
    for r in records:
        k = by_kind.setdefault(r["kind"], {"requests": 0, "ok": 0, "message": 0, "failure": 0, "seconds": []})
        k["requests"] += 1
        k[r["outcome"]] += 1
        k["seconds"].append(r["seconds"])
    for k in by_kind.values():
        s = sorted(k.pop("seconds"))
        k["median_s"], k["max_s"] = round(s[len(s) // 2], 2), round(s[-1], 2)
    return {
        "clients": clients,
        "duration_s": duration,
        "rounds": rounds,
        "wall_s": round(wall, 1),
        "requests": len(records),
        "failures": sum(r["outcome"] == "failure" for r in records),
        "hung_clients": hung,
        "caches_drained": drained,
        "by_kind": by_kind,
        "server_before": before,
        "server_peak": peak,
        "server_after_rounds": after,
        "server_summary_after": summary,
        "replicas_rss_mib": None
        if replicas_before is None
        else [replicas_before, peak.get("replicas_rss_mib")] + replicas_after,
        "messages": message_counts(records),
        "failure_replies": [r["reply"] for r in records if r["outcome"] == "failure"][:20],
    }


def main(args) -> int:
    app_args = args.app_args.split() if args.app_args else []
    if getattr(args, "ray", None):
        app_args += ["--ray", args.ray, "--replicas", str(args.replicas)]
    report = run(
        args.clients,
        args.duration,
        args.url,
        app_args or None,
        args.request_timeout,
        seed=args.seed,
        rounds=args.rounds,
    )
    print(format_report(report))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 0 if report["failures"] == 0 and not report["hung_clients"] and report["caches_drained"] else 1
