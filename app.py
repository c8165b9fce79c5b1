"""PQCache Studio: ask questions about a long document and watch PQ-retrieved attention at work.

python app.py [--host 127.0.0.1] [--port 7860] [--model default|PATH] [--dtype float32|bfloat16|auto]
              [--decode-weights int8|auto|int4|model] [--concurrency 2] [--max-cache-gib G] [--idle-minutes 30]
              [--max-document-tokens N] [--pq-timeout 300] [--store DIR | --no-store] [--store-gib G]
              [--ray auto|local|HOST:PORT --replicas N --replica-cpus 1]

Tabs: Document Q&A (upload or paste, prefill once, streamed answers, live cache panels), Teaching
(one prefill, several methods side by side, token spotlight, step-through walkthrough), Cost model.
This file parses the flags, builds the one `Studio` (model, tokenizer, session pool, settings) in main()
and launches the page; the tabs are in studio/, the engine in pqcache/, the figures in viz/.

Many users: every browser tab (or gradio_client) is a user with its own document cache in a
SessionPool (one memory cap, least recently used idle caches evicted, idle caches freed, a closed
tab's cache freed); the model is shared and model work queues with a visible position. A loaded document's cache is
saved in the document store (pqcache/serving/store.py) and read back, with no prefill, when the same text is loaded
again with the same model and settings, after a reload or a restart too.

Several machines (--ray): the Q&A documents live on N Ray Serve replicas of the document worker (each its own
model and session pool, --max-cache-gib and --concurrency each), this process serves the page and keeps every user
on the replica holding their document (pqcache/cluster/, docs/scaling.md); the Teaching tab runs there too, and
this process holds no model.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
for var in ("NO_PROXY", "no_proxy"):  # the browser and the client talk to localhost directly
    os.environ[var] = ",".join(filter(None, [os.environ.get(var, ""), "localhost", "127.0.0.1"]))

from pqcache.cli.args import add_dtype_flags  # noqa: E402
from pqcache.serving.documents import MAX_DOCUMENT_BYTES  # noqa: E402
from pqcache.serving.home import store_root  # noqa: E402
from pqcache.serving.pool import limit_malloc_arenas  # noqa: E402
from pqcache.serving.server_settings import ServerSettings  # noqa: E402
from studio import Studio, build_ui  # noqa: E402
from studio.ui import queued  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="PQCache Studio")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=7860)
    p.add_argument(
        "--model",
        default=ServerSettings.model,
        help="'default' (Gemma 3 270M), 'smollm2' (SmolLM2-135M-Instruct), or a folder",
    )
    add_dtype_flags(p)
    p.add_argument(
        "--concurrency",
        type=int,
        default=ServerSettings.concurrency,
        help="requests using the model at once; the rest queue",
    )
    p.add_argument(
        "--max-cache-gib",
        type=float,
        default=None,
        help="host memory for all users' document caches (default: a quarter of RAM, at most 8)",
    )
    p.add_argument(
        "--store",
        default=None,
        metavar="DIR",
        help="the document store: each loaded document's cache kept on disk, read back when the same text is loaded "
        "again with the same model and settings (default: $PQCACHE_HOME/documents)",
    )
    p.add_argument("--no-store", action="store_true", help="read every document from its text; keep none on disk")
    p.add_argument(
        "--store-gib", type=float, default=None, help="the store's size cap (default: a quarter of the free disk)"
    )
    p.add_argument(
        "--idle-minutes",
        type=float,
        default=ServerSettings.idle_s / 60,
        help="free a user's caches after this long idle (0: never)",
    )
    p.add_argument(
        "--max-document-tokens",
        type=int,
        default=ServerSettings.max_document_tokens,
        help="longest document accepted (default: what the model reads); longer ones are refused or cut",
    )
    p.add_argument(
        "--max-question-chars",
        type=int,
        default=ServerSettings.max_question_chars,
        help="longest question accepted, in characters (0: any length); a long passage belongs in the document",
    )
    p.add_argument(
        "--pq-timeout",
        type=float,
        default=ServerSettings.pq_timeout_s,
        help="seconds a K-Means build may take before its layer falls back to exact attention",
    )
    p.add_argument(
        "--ray",
        default=None,
        metavar="auto|local|HOST:PORT",
        help="serve Q&A documents from Ray Serve replicas: 'auto' (the cluster `ray start` runs here), HOST:PORT "
        "(a cluster's head), 'local' (a private one on this machine); default: this process, no Ray",
    )
    p.add_argument("--replicas", type=int, default=2, help="with --ray: document workers, each its own model")
    p.add_argument("--replica-cpus", type=float, default=1.0, help="with --ray: CPUs each replica reserves")
    args = p.parse_args(argv)
    if not args.idle_minutes >= 0:
        p.error(f"--idle-minutes must be 0 (never) or more, got {args.idle_minutes:g}")
    if args.store_gib is not None and not args.store_gib > 0:
        p.error(f"--store-gib must be more than 0 (--no-store keeps no documents), got {args.store_gib:g}")
    if args.no_store and args.store:
        p.error("--store and --no-store: choose one")
    if args.replicas < 1 or not args.replica_cpus > 0:
        p.error(
            f"--replicas must be 1 or more and --replica-cpus more than 0, got {args.replicas}, {args.replica_cpus:g}"
        )
    return args


def cache_bytes(args: argparse.Namespace) -> int:
    """--max-cache-gib in bytes (default: a quarter of this machine's RAM, at most 8 GiB)."""
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int((args.max_cache_gib if args.max_cache_gib is not None else min(8.0, ram / 4 / 2**30)) * 2**30)


def server_settings(args: argparse.Namespace) -> ServerSettings:
    """The server's settings from its flags: handed whole to the worker here, or to each Ray replica."""
    return ServerSettings(
        model=args.model,
        dtype=args.dtype,
        decode_weights=args.decode_weights,
        kv_dtype=args.kv_dtype,
        pq_timeout_s=args.pq_timeout,
        max_document_tokens=args.max_document_tokens,
        max_question_chars=args.max_question_chars or None,
        max_cache_bytes=cache_bytes(args),
        idle_s=args.idle_minutes * 60 or None,  # 0: never by idleness
        concurrency=args.concurrency,
        store_dir=None if args.no_store else str(args.store or store_root()),
        store_cap_bytes=None if args.store_gib is None else int(args.store_gib * 2**30),
    )


def main(argv: list[str] | None = None):
    args = parse_args(argv)
    limit_malloc_arenas()
    if args.ray:  # before the model: a wrong address or too small a cluster is said at once
        connect_ray(args)
    server = server_settings(args)
    if args.ray:  # the replicas hold the model, the documents and their store: this process holds no model
        documents, concurrency = start_ray_workers(args, server), server.concurrency * args.replicas
        studio = Studio(None, None, None, server, documents=documents, concurrency=concurrency)
        print(f"model ready on {args.replicas} Ray replicas; caches capped on each as in one process", flush=True)
    else:
        from pqcache import load_model  # here: with --ray this process imports no torch

        print("preparing the model (the first start converts the bundled GGUF, about a minute)...", flush=True)
        model, tokenizer = load_model(
            server.model,
            dtype=server.dtype,
            decode_weights=server.decode_weights,
            progress=lambda msg: print(msg, flush=True),
        )
        pool = server.make_pool()
        studio = Studio(model, tokenizer, pool, server, store=server.open_store())
        idle = f"idle caches freed after {args.idle_minutes:g} min" if pool.idle_s else "idle caches kept"
        print(f"model ready; caches capped at {pool.max_bytes / 2**30:.2f} GiB in this process, {idle}", flush=True)
    concurrency = studio.concurrency
    queued(build_ui(studio), concurrency).launch(
        server_name=args.host, server_port=args.port, show_error=False, max_file_size=MAX_DOCUMENT_BYTES
    )


def connect_ray(args: argparse.Namespace):
    """Connect to the Ray cluster and check it has the CPUs the replicas ask for; one line and exit if not. When
    this process ends (a SIGTERM too) its replicas are deleted, and a private cluster (--ray local) goes with it; a
    cluster started with `ray start` stays."""
    import atexit
    import signal
    import sys

    from pqcache.cluster import launch

    try:
        cpus = launch.connect(args.ray)
    except (ConnectionError, ValueError, RuntimeError) as exc:
        hint = (
            ""
            if args.ray in ("auto", "local")
            else " (a cluster with token authentication, as `ray start` makes one when ~/.ray/auth_token exists, "
            "needs RAY_AUTH_MODE=token and that token here too: docs/scaling.md)"
        )
        sys.exit(f"error: could not connect to Ray at {args.ray!r}: {exc}{hint}")
    if cpus < args.replicas * args.replica_cpus:
        sys.exit(
            f"error: the Ray cluster has {cpus:g} CPUs; {args.replicas} replicas x {args.replica_cpus:g} CPUs do not "
            "fit: add machines (ray start --address=HEAD:6379), or lower --replicas or --replica-cpus"
        )
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # so that the exit handlers run
    atexit.register(launch.stop_workers)  # registered after ray.init: runs before Ray's own shutdown


def start_ray_workers(args: argparse.Namespace, server: ServerSettings):
    """Deploy the replicas (each loads the model: this waits for them) and return the app's client."""
    from pqcache.cluster import launch

    print(f"starting {args.replicas} document worker(s) on Ray ({args.ray})...", flush=True)
    return launch.start_workers(args.replicas, server, replica_cpus=args.replica_cpus)


if __name__ == "__main__":
    main()
