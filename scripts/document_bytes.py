"""What one document holds and what the session pool reserves for it, at float32 and at the default KV dtype: one
prefill of n tokens (bench e2e's passkey filler), the PQ build and 8 greedy tokens, then `cache.stats()`; the
reservation is serving/footprint.py's `document_bytes`; "under 1 GiB" is one reservation beside the others' held
bytes, as the pool admits documents.

    python scripts/document_bytes.py [--model smollm2] [--tokens 8192]

docs/benchmarks.md#half-precision-kv has the table and the machine.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout: the repo's pqcache


def main() -> None:
    import torch

    from pqcache import PQCache, PQCacheConfig
    from pqcache.bench.e2e import prompt_ids
    from pqcache.serving.footprint import document_bytes
    from pqcache.serving.generate import decode_one_token, prefill
    from pqcache.serving.loading import load_model

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--tokens", type=int, default=8192)
    args = parser.parse_args()
    model, tokenizer = load_model(args.model, device="cpu", progress=lambda *_: None)
    ids = torch.tensor([prompt_ids(tokenizer, args.tokens)])
    mib = 2**20
    for kv in ("model", "auto"):
        config = PQCacheConfig(kv_dtype=kv)
        reserved = document_bytes(model, config, "pqcache", args.tokens, torch.device("cpu"))
        cache = PQCache(model, config)
        with torch.no_grad():
            token = prefill(model, ids, cache).argmax(-1, keepdim=True)
            cache.wait()
            for _ in range(8):
                token = decode_one_token(model, token, cache).argmax(-1, keepdim=True)
        s = cache.stats()
        held = s["device_kv_bytes"] + s["host_kv_bytes"] + s["pq_bytes"] + s["query_bytes"]
        print(
            f"{args.model or 'default'} kv_dtype={kv}: reserved {reserved / mib:.1f} MiB, held {held / mib:.1f} "
            f"(host {s['host_kv_bytes'] / mib:.1f}, device {s['device_kv_bytes'] / mib:.1f}, "
            f"pq {s['pq_bytes'] / mib:.2f}), under 1 GiB: {(2**30 - reserved) // held + 1}"
        )
        cache.close()


if __name__ == "__main__":
    main()
