"""`python -m pqcache generate`: one question about a document (a file or standard input), the answer streamed, its
sources and the run's figures after it (or one JSON object with --json)."""

from __future__ import annotations

import json
import sys

from pqcache.cli.common import config_of, stderr
from pqcache.engine.errors import InputError


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
    config = config_of(args)
    model, tok = load_model(
        args.model, device=args.device, dtype=args.dtype, progress=stderr, decode_weights=args.decode_weights
    )
    prompt = build_prompt(tok, context, args.question)
    store = None
    if args.store is not None:
        from pqcache.serving.store import DocumentStore

        store = DocumentStore(args.store)
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
        store=store,
    )
    if args.json:
        print(
            json.dumps(
                {
                    "text": result.text,
                    "tokens": result.tokens,
                    "ended": result.ended,
                    "document": result.document,
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
        if result.document and result.document.get("note"):
            print(f"note: the document was {result.document['note']}", file=sys.stderr)
        print(
            f"[{s['method']}] ended: {result.ended}; prompt {s['prompt_tokens']} tokens, "
            + ("read from the store in " if (result.document or {}).get("from") == "store" else "prefill ")
            + f"{s['prefill_s']:.2f} s, "
            f"{s['s_per_token'] * 1e3:.1f} ms/token, device KV {s['device_kv_bytes'] / 2**20:.1f} MiB, "
            f"host KV {s['host_kv_bytes'] / 2**20:.1f} MiB, PQ {s['pq_bytes'] / 2**10:.1f} KiB",
            file=sys.stderr,
        )
    return 0
