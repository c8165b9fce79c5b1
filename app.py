"""PQCache Studio: ask questions about a long document and watch PQ-retrieved attention at work.

python app.py [--host 127.0.0.1] [--port 7860] [--model default|PATH] [--dtype float32|bfloat16|auto] [--concurrency 2]
              [--max-cache-gib G] [--idle-minutes 30] [--max-document-tokens N] [--pq-timeout 120]

Tabs: Document Q&A (upload or paste, prefill once, streamed answers, live cache panels), Teaching
(one prefill, several methods side by side, token spotlight, step-through walkthrough), Cost model.
This file parses the flags, builds the one `Studio` (model, tokenizer, session pool, settings) in main()
and launches the page; the tabs are in studio/, the engine in pqcache/, the figures in viz/.

Many users: every browser tab (or gradio_client) is a user with its own document cache in a
SessionPool (one memory cap, least recently used idle caches evicted, idle caches freed, a closed
tab's cache freed); the model is shared and model work queues with a visible position.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
for var in ("NO_PROXY", "no_proxy"):  # the browser and the client talk to localhost directly
    os.environ[var] = ",".join(filter(None, [os.environ.get(var, ""), "localhost", "127.0.0.1"]))

from pqcache import load_model  # noqa: E402
from pqcache.serving.documents import MAX_DOCUMENT_BYTES  # noqa: E402
from pqcache.serving.fast import DTYPE_CHOICES  # noqa: E402
from pqcache.serving.pool import SessionPool, limit_malloc_arenas  # noqa: E402
from studio import Studio, build_ui  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="PQCache Studio")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=7860)
    p.add_argument("--model", default="default", help="'default' (bundled Gemma 3 270M) or a local model folder")
    p.add_argument(
        "--dtype",
        default=None,
        choices=list(DTYPE_CHOICES),
        help="weights and compute (default: float32 on a CPU, bfloat16 on CUDA; auto: bfloat16 where the CPU "
        "has native bf16, faster but it changed an answer of the bundled model at a 1/5 budget)",
    )
    p.add_argument("--concurrency", type=int, default=2, help="requests using the model at once; the rest queue")
    p.add_argument(
        "--max-cache-gib",
        type=float,
        default=None,
        help="host memory for all users' document caches (default: a quarter of RAM, at most 8)",
    )
    p.add_argument(
        "--idle-minutes", type=float, default=30, help="free a user's caches after this long idle (0: never)"
    )
    p.add_argument(
        "--max-document-tokens",
        type=int,
        default=None,
        help="longest document accepted (default: what the model reads); longer ones are refused or cut",
    )
    p.add_argument(
        "--pq-timeout",
        type=float,
        default=120,
        help="seconds a K-Means build may take before its layer falls back to exact attention",
    )
    args = p.parse_args(argv)
    if not args.idle_minutes >= 0:
        p.error(f"--idle-minutes must be 0 (never) or more, got {args.idle_minutes:g}")
    return args


def make_pool(args: argparse.Namespace) -> SessionPool:
    """The session pool the flags ask for, its reaper of idle caches started."""
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    max_bytes = int((args.max_cache_gib if args.max_cache_gib is not None else min(8.0, ram / 4 / 2**30)) * 2**30)
    pool = SessionPool(max_bytes=max_bytes, idle_s=args.idle_minutes * 60 or None)  # 0: never by idleness
    if pool.idle_s is not None:
        pool.start_reaper(every_s=min(5.0, pool.idle_s / 4))
    return pool


def main(argv: list[str] | None = None):
    args = parse_args(argv)
    limit_malloc_arenas()
    print("preparing the model (the first start converts the bundled GGUF, about a minute)...", flush=True)
    model, tokenizer = load_model(args.model, dtype=args.dtype, progress=lambda msg: print(msg, flush=True))
    pool = make_pool(args)
    studio = Studio(
        model,
        tokenizer,
        pool,
        pq_timeout_s=args.pq_timeout,
        concurrency=args.concurrency,
        max_document_tokens=args.max_document_tokens,
    )
    idle = f"idle caches freed after {args.idle_minutes:g} min" if pool.idle_s else "idle caches kept"
    print(f"model ready; caches capped at {pool.max_bytes / 2**30:.2f} GiB, {idle}", flush=True)
    build_ui(studio).queue(default_concurrency_limit=args.concurrency).launch(
        server_name=args.host, server_port=args.port, show_error=False, max_file_size=MAX_DOCUMENT_BYTES
    )


if __name__ == "__main__":
    main()
