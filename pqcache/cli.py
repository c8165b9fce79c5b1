"""python -m pqcache {generate,bench} ..."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .config import PQCacheConfig, PQCacheConfigError
from .loading import ModelNotFoundError


def _budget(text: str):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"token budget must be a number, got {text!r}")
    return int(value) if value > 1 and value.is_integer() else value


def _iters(text: str):
    return text if text == "auto" else int(text)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pqcache", description="PQCache: PQ-retrieved attention for long contexts")
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="answer a question about a context file")
    g.add_argument("--model", default="default", help="'default' (bundled Gemma 3 270M) or a local model folder")
    g.add_argument("--method", default="pqcache", choices=["full", "pqcache"])
    g.add_argument("--context-file", type=Path, help="text file put before the question")
    g.add_argument("--question", required=True)
    g.add_argument("--max-new-tokens", type=int, default=32)
    g.add_argument("--device", default="auto")
    g.add_argument("--m", type=int, default=PQCacheConfig.m)
    g.add_argument("--bits", type=int, default=PQCacheConfig.bits)
    g.add_argument("--token-budget", type=_budget, default=PQCacheConfig.token_budget,
                   help="fraction of the context (0.2) or a token count (1024)")
    g.add_argument("--n-init", type=int, default=PQCacheConfig.n_init)
    g.add_argument("--n-local", type=int, default=None)
    g.add_argument("--kmeans-iters", type=_iters, default="auto")
    g.add_argument("--json", action="store_true", help="print one JSON object: text, tokens, stats")

    b = sub.add_parser("bench", help="benchmarks that print side-by-side ratios")
    b.add_argument("which", choices=["attention"])
    b.add_argument("--seq-lens", type=lambda t: [int(x) for x in t.split(",")], default=None)
    b.add_argument("--repeats", type=int, default=15)
    b.add_argument("--json", action="store_true")
    return p


def cmd_generate(args) -> int:
    from .generate import build_prompt, generate
    from .loading import load_model

    context = ""
    if args.context_file is not None:
        try:
            context = args.context_file.read_text(encoding="utf-8", errors="replace")
        except OSError as exc:
            raise SystemExit(f"error: cannot read --context-file {args.context_file}: {exc.strerror}")
    config = PQCacheConfig(m=args.m, bits=args.bits, token_budget=args.token_budget, n_init=args.n_init,
                           n_local=args.n_local, kmeans_iters=args.kmeans_iters)
    model, tok = load_model(args.model, device=args.device, progress=lambda msg: print(msg, file=sys.stderr))
    prompt = build_prompt(tok, context, args.question)
    printed = [0]

    def stream(text):  # print each new piece of the answer as it is decoded
        print(text[printed[0]:], end="", flush=True)
        printed[0] = len(text)

    result = generate(model, tok, prompt, method=args.method, config=config,
                      max_new_tokens=args.max_new_tokens, on_token=None if args.json else stream)
    if args.json:
        print(json.dumps({"text": result.text, "tokens": result.tokens, "stats": result.stats}))
    else:
        print()
        s = result.stats
        print(f"[{s['method']}] prompt {s['prompt_tokens']} tokens, prefill {s['prefill_s']:.2f} s, "
              f"{s['s_per_token'] * 1e3:.1f} ms/token, device KV {s['device_kv_bytes'] / 2**20:.1f} MiB, "
              f"host KV {s['host_kv_bytes'] / 2**20:.1f} MiB, PQ {s['pq_bytes'] / 2**10:.1f} KiB", file=sys.stderr)
    return 0


def cmd_bench(args) -> int:
    from . import bench

    if args.which == "attention":
        kw = {"repeats": args.repeats}
        if args.seq_lens:
            kw["seq_lens"] = args.seq_lens
        rows = bench.bench_attention(**kw)
        if args.json:
            print(json.dumps({"rows": rows}))
        else:
            print("one decode step, one layer, 32 q heads / 8 KV heads / head_dim 128, budget 1/10, m=2 bits=6")
            print(f"{'seq_len':>8} {'dense ms':>10} {'pqcache ms':>11} {'speedup':>8} {'search share':>13}")
            for r in rows:
                print(f"{r['seq_len']:>8} {r['dense_ms']:>10.2f} {r['pqcache_ms']:>11.2f} "
                      f"{r['speedup']:>7.2f}x {r['search_share']:>13.2f}")
    return 0


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "generate":
            return cmd_generate(args)
        return cmd_bench(args)
    except (PQCacheConfigError, ModelNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
