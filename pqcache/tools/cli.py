"""python -m pqcache {generate,bench,eval,datasets,calibrate,loadtest} ... (the flags: cli_args.py)"""

from __future__ import annotations

import json
import sys
from dataclasses import fields

from pqcache.engine.config import PQCacheConfig
from pqcache.engine.errors import InputError, PQCacheError
from pqcache.serving.loading import ModelNotFoundError
from pqcache.tools.cli_args import build_parser


def _config(args) -> PQCacheConfig:
    """The engine settings a subcommand has flags for; the others keep PQCacheConfig's defaults."""
    names = [f.name for f in fields(PQCacheConfig)]
    return PQCacheConfig(**{name: getattr(args, name) for name in names if hasattr(args, name)})


def _stderr(msg):
    print(msg, file=sys.stderr)


def cmd_generate(args) -> int:
    from pqcache.serving.documents import MAX_DOCUMENT_BYTES, read_bytes, read_document
    from pqcache.serving.generate import generate
    from pqcache.serving.loading import load_model
    from pqcache.serving.prompt import build_prompt

    if not args.question.strip():  # before the model loads: a blank question would only continue the document
        raise InputError('the question is empty: ask about the document, e.g. --question "What is the pass key?"')
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
        print(
            json.dumps(
                {
                    "text": result.text,
                    "tokens": result.tokens,
                    "ended": result.ended,
                    "sources": result.sources,
                    "stats": result.stats,
                }
            )
        )
    else:
        print()
        for i, src in enumerate(result.sources, 1):  # where in the document the answer came from
            quote = " ".join(src["text"].split())
            print(
                f"  source {i} ({100 * src['share']:.0f}% of the attention, characters {src['start']}-{src['end']}): "
                f'"{quote}"'
            )
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
    from pqcache.tools import bench, bench_model

    if args.which == "e2e":
        from pqcache.tools.e2e import cli_e2e

        return cli_e2e(args)
    if args.which == "app":
        from pqcache.tools.bench_app import cli_app

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
        from pqcache.tools.kernels import bench_kernels

        rows = bench_kernels(
            bench_model._config_for("gemma3-270m")[0], repeats=args.repeats or 10, threads=args.threads
        )
    else:
        from pqcache.serving.loading import load_model

        model, tok = load_model(
            args.model, device=args.device, dtype=args.dtype, progress=_stderr, decode_weights=args.decode_weights
        )
        if args.which == "ttft":
            rows = bench_model.bench_ttft(model, tok, **kw)
        else:
            rows = bench_model.bench_blockcache(
                model, tok, seq_len=(args.seq_lens or [4096])[0], new_tokens=args.new_tokens
            )
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
    cases = evaluate.load_cases(args.cases, args.format) if args.mode is None else None
    config = _config(args)
    model, tok = load_model(
        args.model, device=args.device, dtype=args.dtype, progress=_stderr, decode_weights=args.decode_weights
    )
    if args.mode == "recall":
        from pqcache.tools.datasets import essays_text

        text = tok.decode(tok(essays_text()).input_ids[1 : args.context_tokens])
        from pqcache.tools.recall import recall_study

        rows = recall_study(
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
            for row in evaluate.run_case(model, tok, case, methods, config, args.max_new_tokens, args.max_length):
                rows.append(row)
                if out:
                    out.write(json.dumps(row) + "\n")
                    out.flush()
    finally:
        if out:
            out.close()
    group = [g for g in args.group_by.split(",") if g] or (["task"] if args.format == "ruler" else [])
    summary = evaluate.summarize(rows, group, by_dataset=args.format == "longbench")  # LongBench: a column per dataset
    print(json.dumps({"rows": summary}) if args.json else _table(summary))
    return 0


def cmd_datasets(args) -> int:
    from transformers import AutoTokenizer

    from pqcache.serving.loading import prepare_default_model
    from pqcache.tools import datasets

    if args.kind == "realdocs":  # fixed questions on real texts: no tokenizer needed
        from pqcache.tools.realdocs import as_longbench, realdocs

        cases = realdocs() if args.format == "pqcache" else [as_longbench(c) for c in realdocs()]
        datasets.write_jsonl(cases, args.out)
        print(f"wrote {len(cases)} cases to {args.out}")
        return 0
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
