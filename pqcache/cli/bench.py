"""`python -m pqcache bench ...` and `calibrate`: each benchmark's runner (pqcache/bench/), a table or --json."""

from __future__ import annotations

import json
import sys

from pqcache.cli.common import stderr, table

TITLES = {
    "attention": "one decode step, one layer, 32 q heads / 8 KV heads / head_dim 128, budget 1/10",
    "decode": "decode attention per step at a fixed budget of 1024 tokens, as the context grows",
    "ttft": "time to first token (prefill, then until every layer's PQ is built), bundled model",
    "memory": "device-tier KV bytes, PQCache against full attention",
    "blockcache": "device block-cache hit rate of the retrieved tokens over a generation",
    "kernels": "the kernels of one decode step (bundled model's shapes), torch's and native, against the memory",
    "conversation": "a conversation's turns on one read of the document, PQCache and full attention, budget 1/10; "
    "reprefill: the document and the earlier turns read again (a fresh PQCache) for that turn",
    "store": "a document read from the document store against its load (prefill, K-Means), bundled model",
}


def cmd_bench(args) -> int:
    from pqcache.bench import attention as bench
    from pqcache.bench import model as bench_model

    if args.which == "e2e":
        from pqcache.bench.e2e import cli_e2e

        return cli_e2e(args)
    if args.which == "app":
        from pqcache.bench.app import cli_app

        return cli_app(args)
    kw = {}
    if args.seq_lens:
        kw["seq_lens"] = args.seq_lens
    if args.repeats:
        kw["repeats"] = args.repeats
    if args.which in ("attention", "decode"):
        import torch

        device = "cuda" if args.device == "auto" and torch.cuda.is_available() else args.device
        device = "cpu" if device == "auto" else device
        kw.update(device=device, dtype=torch.bfloat16 if device.startswith("cuda") else torch.float32)
        if args.which == "attention":
            rows = bench.bench_attention(m=args.m, bits=args.bits, rerank=args.rerank, **kw)
        else:
            rows = bench.bench_decode(shapes=args.shapes, **kw)
    elif args.which == "memory":
        kw.pop("repeats", None)
        rows = bench_model.bench_memory(**kw)
    elif args.which == "kernels":
        from pqcache.bench.kernels import bench_kernels

        rows = bench_kernels(
            bench_model._config_for("gemma3-270m")[0], repeats=args.repeats or 10, threads=args.threads
        )
    else:
        from pqcache.serving.loading import load_model

        model, tok = load_model(
            args.model, device=args.device, dtype=args.dtype, progress=stderr, decode_weights=args.decode_weights
        )
        if args.which == "ttft":
            rows = bench_model.bench_ttft(model, tok, **kw)
        elif args.which == "store":
            from pqcache.bench.store import bench_store

            kw.pop("repeats", None)
            rows = bench_store(model, tok, root=args.store_dir, **kw)
        elif args.which == "conversation":
            from pqcache.bench.conversation import bench_conversation

            kw.pop("repeats", None)
            rows, summary = bench_conversation(model, tok, turns=args.turns, max_new_tokens=args.new_tokens or 16, **kw)
            if args.json:
                print(json.dumps({"rows": rows, "summary": summary}))
            else:
                print(TITLES[args.which], table(rows), table(summary), sep="\n")
            return 0
        else:
            rows = bench_model.bench_blockcache(
                model, tok, seq_len=(args.seq_lens or [4096])[0], new_tokens=args.new_tokens or 256
            )
    if args.json:
        print(json.dumps({"rows": rows}))
    else:
        print(TITLES[args.which])
        print(table(rows))
    return 0


def cmd_calibrate(args) -> int:
    from pqcache.bench import calibrate
    from pqcache.serving.loading import load_model

    model, tok = load_model(
        args.model, device=args.device, dtype=args.dtype, progress=stderr, decode_weights=args.decode_weights
    )
    fit = calibrate.calibrate(model, tok, seq_lens=args.seq_lens, progress=lambda msg: print(msg, file=sys.stderr))
    path = calibrate.save(fit)
    if args.json:
        print(json.dumps(fit))
    else:
        p, c = fit["prefill"], fit["cluster"]
        print(f"prefill  t = {p['a2']:.4g} + {p['b2']:.4g} s + {p['c2']:.4g} s^2  (seconds)")
        print(f"cluster  t = {c['a1']:.4g} + {c['b1']:.4g} s T")
        print("T_max:", ", ".join(f"s={s}: {t}" for s, t in fit["t_max"].items()))
        print(f"saved {path}")
    return 0
