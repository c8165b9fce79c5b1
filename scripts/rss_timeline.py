"""Resident memory of one PQCache (or full-attention) run over bench e2e's prompt, sampled every 20 ms, with the
peak of each phase: imports, load, the prefill (chunks of 1024), the PQ build, 32 greedy tokens.

    python scripts/rss_timeline.py --tokens 32768 [--method full]

Linux only (it reads /proc/self/status).
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout: the repo's pqcache


def rss_mib() -> float:
    with open("/proc/self/status", encoding="utf-8") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--method", default="pqcache")
    args = parser.parse_args()
    samples, marks, done = [], [], threading.Event()

    def sample():
        while not done.is_set():
            samples.append((time.perf_counter(), rss_mib()))
            time.sleep(0.02)  # the sampling interval

    threading.Thread(target=sample, daemon=True).start()
    import torch

    from pqcache import PQCacheConfig
    from pqcache.bench.e2e import prompt_ids
    from pqcache.serving.generate import decode_one_token, make_cache, prefill
    from pqcache.serving.loading import load_model

    torch.set_num_threads(2)
    marks.append((time.perf_counter(), "imports"))
    model, tokenizer = load_model(None, device="cpu", progress=lambda *_: None)
    ids = torch.tensor([prompt_ids(tokenizer, args.tokens)])
    marks.append((time.perf_counter(), "load"))
    cache = make_cache(model, args.method, PQCacheConfig())
    with torch.no_grad():
        token = prefill(model, ids, cache).argmax(-1, keepdim=True)
        marks.append((time.perf_counter(), "prefill"))
        if args.method != "full":
            cache.wait()
        marks.append((time.perf_counter(), "PQ build"))
        for _ in range(32):
            token = decode_one_token(model, token, cache).argmax(-1, keepdim=True)
    marks.append((time.perf_counter(), "decode"))
    done.set()
    start = 0.0
    for t, name in marks:
        during = [r for s, r in samples if start <= s <= t] or [rss_mib()]
        print(f"{name:10s} peak {max(during):7.0f} MiB, at its end {during[-1]:7.0f} MiB")
        start = t
    print(f"process peak {max(r for _, r in samples):.0f} MiB")


if __name__ == "__main__":
    main()
