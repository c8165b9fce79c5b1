"""python -m pqcache {generate,bench,eval,datasets,calibrate,loadtest} ..."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import fields
from pathlib import Path

from pqcache.engine.config import PQCacheConfig
from pqcache.engine.errors import PQCacheError
from pqcache.engine.methods import METHODS
from pqcache.serving.decode_weights import DECODE_WEIGHTS, DEFAULT_DECODE_WEIGHTS
from pqcache.serving.fast import DTYPE_CHOICES
from pqcache.serving.loading import ModelNotFoundError


def _opt_ints(text: str) -> tuple:
    """ "auto,2,4" -> (None, 2, 4): None stands for the default choice."""
    return tuple(None if x.strip() == "auto" else int(x) for x in text.split(",") if x.strip())


def _budget(text: str):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"token budget must be a number, got {text!r}") from None
    return int(value) if value > 1 and value.is_integer() else value


def _config(args) -> PQCacheConfig:
    """The engine settings a subcommand has flags for; the others keep PQCacheConfig's defaults."""
    names = [f.name for f in fields(PQCacheConfig)]
    return PQCacheConfig(**{name: getattr(args, name) for name in names if hasattr(args, name)})


def add_dtype_flags(parser):
    """--dtype and --decode-weights: how the model's weights are read (shared with app.py)."""
    parser.add_argument(
        "--dtype",
        default=None,
        choices=list(DTYPE_CHOICES),
        help="weights and compute (default: float32 on a CPU, bfloat16 on CUDA; auto: bfloat16 where the CPU "
        "has native bf16, faster but it changed an answer of the bundled model at a 1/5 budget)",
    )
    parser.add_argument(
        "--decode-weights",
        default=DEFAULT_DECODE_WEIGHTS,
        choices=list(DECODE_WEIGHTS),
        help="CPU decode steps read int8 (default) or int4 copies of the decoder linears, or int4 where the "
        "model's weights are 4-bit and int8 elsewhere (auto: faster, and it tipped one answer of the bundled model), "
        "or the model's own weights (model); the prefill keeps the model's weights",
    )


def _iters(text: str):
    return text if text == "auto" else int(text)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m pqcache", description="PQCache: PQ-retrieved attention for long contexts"
    )
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="answer a question about a context file")
    g.add_argument("--model", default="default", help="'default' (bundled Gemma 3 270M) or a local model folder")
    g.add_argument(
        "--method",
        default="pqcache",
        choices=list(METHODS),
        help="full (transformers' DynamicCache), or a selection method under the same budget",
    )
    g.add_argument(
        "--context-file",
        type=Path,
        help="the document: .txt, .md, .pdf or any text file; '-' reads standard input",
    )
    g.add_argument("--encoding", default=None, help="text encoding of --context-file (default: UTF-8)")
    g.add_argument("--question", required=True, help="the question, in your own words")
    g.add_argument("--max-new-tokens", type=int, default=32)
    g.add_argument("--device", default="auto")
    add_dtype_flags(g)
    g.add_argument("--m", type=int, default=PQCacheConfig.m)
    g.add_argument("--bits", type=int, default=PQCacheConfig.bits)
    g.add_argument("--rerank", type=int, default=PQCacheConfig.rerank, help="exact re-rank of rerank x k candidates")
    g.add_argument(
        "--token-budget",
        type=_budget,
        default=PQCacheConfig.token_budget,
        help="fraction of the context (default 0.1) or a token count (1024)",
    )
    g.add_argument("--n-init", type=int, default=PQCacheConfig.n_init)
    g.add_argument("--n-local", type=int, default=None)
    g.add_argument("--kmeans-iters", type=_iters, default="auto")
    g.add_argument(
        "--block-cache-tokens",
        type=int,
        default=PQCacheConfig.block_cache_tokens,
        help="device block cache per layer, in tokens (0: off; default: 1024 on a GPU, off on a CPU, where the "
        "device and host tiers are the same memory)",
    )
    g.add_argument("--cache-policy", default=PQCacheConfig.cache_policy, choices=["lru", "lfu"])
    g.add_argument("--json", action="store_true", help="print one JSON object: text, tokens, stats")

    b = sub.add_parser("bench", help="benchmarks that print side-by-side ratios")
    b.add_argument("which", choices=["attention", "decode", "ttft", "memory", "blockcache", "e2e", "kernels"])
    b.add_argument("--seq-lens", type=lambda t: [int(x) for x in t.split(",")], default=None)
    b.add_argument("--repeats", type=int, default=None)
    b.add_argument("--shapes", choices=["llama", "gemma"], default="llama", help="decode: head shapes")
    b.add_argument("--m", type=int, default=None, help="attention: sub-spaces (default: from head_dim)")
    b.add_argument("--bits", type=int, default=None, help="attention: bits per code (default: from the length)")
    b.add_argument("--rerank", type=int, default=None, help="attention: re-rank factor (default: the config's)")
    b.add_argument("--new-tokens", type=int, default=256, help="blockcache: tokens generated")
    b.add_argument("--model", default="default", help="ttft, blockcache: the model")
    b.add_argument("--device", default="auto")
    add_dtype_flags(b)
    b.add_argument("--decode-tokens", type=int, default=32, help="e2e: greedy tokens decoded per run")
    b.add_argument("--threads", type=int, default=None, help="e2e, kernels: threads (default: the cores)")
    b.add_argument("--n-batch", type=int, default=None, help="e2e: llama.cpp's n_batch (= n_ubatch)")
    b.add_argument("--chunk-tokens", type=int, default=None, help="e2e: prefill chunk (default: generate's)")
    b.add_argument("--gguf", default=None, help="e2e: llama.cpp's GGUF (default: the bundled model's)")
    b.add_argument("--runners", default="llama.cpp,full,pqcache", help="e2e: comma-separated runners")
    b.add_argument("--json", action="store_true", help='print one object {"rows": [...]}')

    e = sub.add_parser("eval", help="compare methods on a case file (or: eval recall)")
    e.add_argument("mode", nargs="?", choices=["recall"], help="recall: PQ recall study on the model's real keys")
    e.add_argument("--cases", type=Path, help="JSONL: id, context, question, answers[, query_aware]")
    e.add_argument("--methods", default="full,pqcache", help="comma-separated method names")
    e.add_argument("--out", type=Path, help="write one JSON line per case and method")
    e.add_argument("--group-by", default="", help="comma-separated case fields for the summary")
    e.add_argument("--model", default="default")
    e.add_argument("--device", default="auto")
    add_dtype_flags(e)
    e.add_argument("--max-new-tokens", type=int, default=24)
    e.add_argument("--token-budget", type=_budget, default=0.1)
    e.add_argument("--m", type=int, default=PQCacheConfig.m)
    e.add_argument("--bits", type=int, default=PQCacheConfig.bits)
    e.add_argument("--n-init", type=int, default=PQCacheConfig.n_init)
    e.add_argument("--n-local", type=int, default=None)
    e.add_argument("--context-tokens", type=int, default=4096, help="recall: essay tokens used")
    e.add_argument("--rerank", type=int, default=PQCacheConfig.rerank, help="exact re-rank of rerank x k candidates")
    e.add_argument(
        "--chunk-attention",
        choices=["exact", "selected"],
        default=PQCacheConfig.chunk_attention,
        help="a question after a cached document: every cached token, or the selection",
    )
    e.add_argument("--ms", type=_opt_ints, default=(None, 2, 4), help="recall: m values ('auto' for the default)")
    e.add_argument("--bits-list", type=_opt_ints, default=(None, 6, 8), help="recall: bits values ('auto' too)")
    e.add_argument(
        "--opq-list",
        type=lambda t: tuple(x.strip() in ("1", "true", "yes") for x in t.split(",")),
        default=(False,),
        help="recall: OPQ off/on, e.g. 0,1",
    )
    e.add_argument("--reranks", type=_opt_ints, default=(1, 2, 4, 8), help="recall: re-rank factors")
    e.add_argument(
        "--budgets",
        type=lambda t: tuple(_budget(x) for x in t.split(",")),
        default=(0.1,),
        help="recall: token budgets",
    )
    e.add_argument("--json", action="store_true")

    d = sub.add_parser("datasets", help="write case files offline (needle in a haystack, RULER-style)")
    d.add_argument("kind", choices=["niah", "ruler"])
    d.add_argument("--out", type=Path, required=True)
    d.add_argument("--lengths", type=lambda t: [int(x) for x in t.split(",")], default=[2048, 4096, 8192])
    d.add_argument("--depths", type=lambda t: [float(x) for x in t.split(",")], default=[0.1, 0.5, 0.9])
    d.add_argument("--tasks", default=None, help="ruler: comma-separated tasks (default: all)")
    d.add_argument("--n", type=int, default=2, help="ruler: cases per task and length")
    d.add_argument("--query-aware", choices=["both", "true", "false"], default="both")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument(
        "--natural",
        action="store_true",
        help="niah: facts asked in plain words (no answer cue in the question), a different fact per case",
    )

    lt = sub.add_parser("loadtest", help="N concurrent gradio_client users against a local app, bounded in time")
    lt.add_argument("--clients", type=int, default=4)
    lt.add_argument("--duration", type=float, default=60, help="seconds during which users start requests")
    lt.add_argument("--url", default=None, help="an app already running (default: start app.py and watch it)")
    lt.add_argument("--app-args", default="--max-cache-gib 0.1 --idle-minutes 5", help="flags for the app.py it starts")
    lt.add_argument("--request-timeout", type=float, default=300)
    lt.add_argument("--rounds", type=int, default=2, help="repeat the users; a leak grows round after round")
    lt.add_argument("--seed", type=int, default=0)
    lt.add_argument("--out", default=None, help="write the figures as JSON here")
    lt.add_argument(
        "--ray",
        default=None,
        metavar="local|auto|HOST:PORT",
        help="start the app with its documents on Ray Serve replicas (app.py --ray); 'local': a private cluster here",
    )
    lt.add_argument("--replicas", type=int, default=2, help="with --ray: document workers")

    c = sub.add_parser("calibrate", help="fit the adaptive K-Means iteration rule on this machine")
    c.add_argument("--model", default="default")
    c.add_argument("--seq-lens", type=lambda t: [int(x) for x in t.split(",")], default=[512, 1024, 2048, 4096])
    c.add_argument("--device", default="auto")
    add_dtype_flags(c)
    c.add_argument("--json", action="store_true")
    return p


def _stderr(msg):
    print(msg, file=sys.stderr)


def cmd_generate(args) -> int:
    from pqcache.serving.documents import MAX_DOCUMENT_BYTES, read_bytes, read_document
    from pqcache.serving.generate import generate
    from pqcache.serving.loading import load_model
    from pqcache.serving.prompt import build_prompt

    context = ""
    if args.context_file is not None and str(args.context_file) == "-":  # standard input
        context = read_bytes(sys.stdin.buffer.read(MAX_DOCUMENT_BYTES + 1), "standard input", args.encoding)
    elif args.context_file is not None:  # bad files raise DocumentError (printed, exit 2)
        context = read_document(str(args.context_file), encoding=args.encoding)
    config = _config(args)
    model, tok = load_model(
        args.model, device=args.device, dtype=args.dtype, progress=_stderr, decode_weights=args.decode_weights
    )
    prompt = build_prompt(tok, context, args.question)
    printed = [0]

    def stream(text):  # print each new piece of the answer as it is decoded
        print(text[printed[0] :], end="", flush=True)
        printed[0] = len(text)

    result = generate(
        model,
        tok,
        prompt,
        method=args.method,
        config=config,
        max_new_tokens=args.max_new_tokens,
        on_token=None if args.json else stream,
    )
    if args.json:
        print(json.dumps({"text": result.text, "tokens": result.tokens, "ended": result.ended, "stats": result.stats}))
    else:
        print()
        s = result.stats
        print(
            f"[{s['method']}] ended: {result.ended}; prompt {s['prompt_tokens']} tokens, "
            f"prefill {s['prefill_s']:.2f} s, "
            f"{s['s_per_token'] * 1e3:.1f} ms/token, device KV {s['device_kv_bytes'] / 2**20:.1f} MiB, "
            f"host KV {s['host_kv_bytes'] / 2**20:.1f} MiB, PQ {s['pq_bytes'] / 2**10:.1f} KiB",
            file=sys.stderr,
        )
    return 0


TITLES = {
    "attention": "one decode step, one layer, 32 q heads / 8 KV heads / head_dim 128, budget 1/10",
    "decode": "decode attention per step at a fixed budget of 1024 tokens, as the context grows",
    "ttft": "time to first token (prefill, then until every layer's PQ is built), bundled model",
    "memory": "device-tier KV bytes, PQCache against full attention",
    "blockcache": "device block-cache hit rate of the retrieved tokens over a generation",
    "kernels": "the kernels of one decode step (bundled model's shapes), torch's and native, against the memory",
}


def _table(rows: list[dict]) -> str:
    cols = [c for c in rows[0] if not isinstance(rows[0][c], dict)]
    cells = [[str(r[c]) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(cols, widths))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def cmd_bench(args) -> int:
    from pqcache.tools import bench

    if args.which == "e2e":
        from pqcache.tools.e2e import cli_e2e

        return cli_e2e(args)
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
        rows = bench.bench_memory(**kw)
    elif args.which == "kernels":
        from pqcache.tools.kernels import bench_kernels

        rows = bench_kernels(bench._config_for("gemma3-270m")[0], repeats=args.repeats or 10, threads=args.threads)
    else:
        from pqcache.serving.loading import load_model

        model, tok = load_model(
            args.model, device=args.device, dtype=args.dtype, progress=_stderr, decode_weights=args.decode_weights
        )
        if args.which == "ttft":
            rows = bench.bench_ttft(model, tok, **kw)
        else:
            rows = bench.bench_blockcache(model, tok, seq_len=(args.seq_lens or [4096])[0], new_tokens=args.new_tokens)
    if args.json:
        print(json.dumps({"rows": rows}))
    else:
        print(TITLES[args.which])
        print(_table(rows))
    return 0


def cmd_calibrate(args) -> int:
    from pqcache.serving.loading import load_model
    from pqcache.tools import calibrate

    model, tok = load_model(
        args.model, device=args.device, dtype=args.dtype, progress=_stderr, decode_weights=args.decode_weights
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


def cmd_eval(args) -> int:
    from pqcache.engine.methods import METHODS
    from pqcache.serving.loading import load_model
    from pqcache.tools import evaluate

    if args.mode is None and args.cases is None:
        raise ValueError("give --cases FILE.jsonl (or `eval recall`)")
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m.split("/")[0] not in METHODS]
    if unknown:
        raise ValueError(f"unknown method(s) {', '.join(unknown)}; choose from {', '.join(METHODS)}")
    cases = evaluate.load_cases(args.cases) if args.mode is None else None
    config = _config(args)
    model, tok = load_model(
        args.model, device=args.device, dtype=args.dtype, progress=_stderr, decode_weights=args.decode_weights
    )
    if args.mode == "recall":
        from pqcache.tools.datasets import essays_text

        text = tok.decode(tok(essays_text()).input_ids[1 : args.context_tokens])
        rows = evaluate.recall_study(
            model,
            tok,
            text,
            ms=args.ms,
            bits_list=args.bits_list,
            reranks=args.reranks,
            opqs=args.opq_list,
            budgets=args.budgets,
        )
        print(json.dumps({"rows": rows}) if args.json else _table(rows))
        return 0
    from tqdm import tqdm

    rows = []
    out = open(args.out, "w", encoding="utf-8") if args.out else None
    try:
        for case in tqdm(cases, desc="cases", file=sys.stderr):
            for row in evaluate.run_case(model, tok, case, methods, config, args.max_new_tokens):
                rows.append(row)
                if out:
                    out.write(json.dumps(row) + "\n")
                    out.flush()
    finally:
        if out:
            out.close()
    group = [g for g in args.group_by.split(",") if g]
    summary = evaluate.summarize(rows, group)
    print(json.dumps({"rows": summary}) if args.json else _table(summary))
    return 0


def cmd_datasets(args) -> int:
    from transformers import AutoTokenizer

    from pqcache.serving.loading import prepare_default_model
    from pqcache.tools import datasets

    tok = AutoTokenizer.from_pretrained(prepare_default_model(lambda msg: print(msg, file=sys.stderr)))
    if args.kind == "niah":
        cases = datasets.niah(tok, args.lengths, args.depths, args.query_aware, natural=args.natural, seed=args.seed)
    else:
        tasks = args.tasks.split(",") if args.tasks else datasets.RULER_TASKS
        cases = [c for n in args.lengths for c in datasets.ruler(tok, tasks, n, args.n, args.seed, args.query_aware)]
    datasets.write_jsonl(cases, args.out)
    print(f"wrote {len(cases)} cases to {args.out}")
    return 0


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        if args.command == "generate":
            return cmd_generate(args)
        if args.command == "calibrate":
            return cmd_calibrate(args)
        if args.command == "eval":
            return cmd_eval(args)
        if args.command == "datasets":
            return cmd_datasets(args)
        if args.command == "loadtest":
            from pqcache.tools import loadtest

            return loadtest.main(args)
        return cmd_bench(args)
    except (PQCacheError, ModelNotFoundError, ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
