"""Where a process's memory goes: peak and resident memory (VmHWM, VmRSS; anonymous and file pages) after each
phase of one `generate` run on a CPU, the high-water mark reset between phases (/proc/self/clear_refs).

    python -m pydoc tarfile > tarfile.txt
    python scripts/memory_phases.py \
        --context-file tarfile.txt --question "What is the default bufsize of tarfile.open()?"

Linux only (it reads /proc). The phases: imports, load_model (the tokenizer, the weights, the decode path's copies),
the document's prefill, its PQ build, the question, the answer's tokens.
docs/benchmarks.md#where-a-processs-memory-goes has the table and the machine.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout: the repo's pqcache


def status() -> dict:
    fields = {}
    with open("/proc/self/status", encoding="utf-8") as f:
        for line in f:
            key, value = line.split(":", 1)
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                fields[key] = int(value.split()[0]) / 1024  # MiB
    return fields


def phase(name: str, rows: list) -> None:
    s = status()
    rows.append((name, s["VmHWM"], s["VmRSS"], s["RssAnon"], s["RssFile"]))
    with open("/proc/self/clear_refs", "w", encoding="utf-8") as f:
        f.write("5")  # the next phase's peak starts from here


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--context-file", required=True)
    p.add_argument("--question", required=True)
    p.add_argument("--kv-dtype", default="auto")
    p.add_argument("--max-new-tokens", type=int, default=12)
    args = p.parse_args()
    rows = []
    import torch  # noqa: F401

    from pqcache.engine.cache import PQCache
    from pqcache.engine.config import PQCacheConfig
    from pqcache.serving.documents import read_document
    from pqcache.serving.generate import decode_one_token, prefill
    from pqcache.serving.loading import load_model
    from pqcache.serving.prompt import build_prompt

    phase("imports (torch, transformers, pqcache)", rows)
    t0 = time.perf_counter()
    model, tok = load_model(args.model, progress=lambda *_: None)
    phase("load_model (tokenizer, weights, int8 copies)", rows)
    doc_ids, q_ids = build_prompt(tok, read_document(args.context_file), args.question).encode(tok)
    cache = PQCache(model, PQCacheConfig(kv_dtype=args.kv_dtype))
    with torch.no_grad():
        prefill(model, doc_ids, cache)
        phase(f"document prefill ({doc_ids.shape[1]} tokens)", rows)
        cache.wait()
        phase("PQ build", rows)
        logits = prefill(model, q_ids, cache)
        phase(f"question ({q_ids.shape[1]} tokens)", rows)
        token, answer = logits.argmax(-1, keepdim=True), []
        for _ in range(args.max_new_tokens):
            answer.append(int(token))
            token = decode_one_token(model, token, cache).argmax(-1, keepdim=True)
        phase(f"answer ({args.max_new_tokens} tokens)", rows)
    print(
        f"answer: {tok.decode(answer)!r}; host KV {cache.stats()['host_kv_bytes'] / 2**20:.1f} MiB; "
        f"{time.perf_counter() - t0:.1f} s"
    )
    print("| phase | peak MiB | resident after | anonymous | file pages |\n|---|---:|---:|---:|---:|")
    for name, peak, rss, anon, file in rows:
        print(f"| {name} | {peak:.0f} | {rss:.0f} | {anon:.0f} | {file:.0f} |")
    print(f"whole process: {max(r[1] for r in rows):.0f} MiB at most")


if __name__ == "__main__":
    main()
