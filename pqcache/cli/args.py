"""The command line's arguments: `python -m pqcache` and its subcommands' flags (main.py runs them)."""

from __future__ import annotations

import argparse
from pathlib import Path

from pqcache.engine.config import described
from pqcache.fastpath.choices import DECODE_WEIGHTS, DEFAULT_DECODE_WEIGHTS, DTYPE_CHOICES


def _opt_ints(text: str) -> tuple:
    """ "auto,2,4" -> (None, 2, 4): None stands for the default choice."""
    return tuple(None if x.strip() == "auto" else int(x) for x in text.split(",") if x.strip())


def _budget(text: str):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"token budget must be a number, got {text!r}") from None
    return int(value) if value > 1 and value.is_integer() else value


def _iters(text: str):
    return text if text == "auto" else int(text)


# how a flag's text becomes the setting, where it is not the default's own type
PARSERS = {"token_budget": _budget, "kmeans_iters": _iters, "m": int, "bits": int, "n_local": int, "mass": float}


def add_engine_flags(parser, names: tuple[str, ...]):
    """--NAME for each of PQCacheConfig's fields `names`: the default, the choices and the help as the field declares
    them (engine/config.py), so every command says the same of each setting."""
    for name in names:
        spec = described()[name]
        if spec.default is False:  # a switch, off by default: the flag alone turns it on
            parser.add_argument("--" + name.replace("_", "-"), action="store_true", help=spec.metadata["help"])
            continue
        parse = PARSERS.get(name, type(spec.default))
        choices = spec.metadata["choices"]
        parser.add_argument(
            "--" + name.replace("_", "-"),
            type=None if choices else parse,
            choices=list(choices) if choices else None,
            default=spec.default,
            help=spec.metadata["help"],
        )


def add_dtype_flags(parser):
    """--dtype, --decode-weights and --kv-dtype: how the model's weights and its cache are read (shared with
    app.py)."""
    add_engine_flags(parser, ("kv_dtype",))
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


# the engine's settings that `generate` and `chat` set, and `eval`'s
ANSWER_SETTINGS = (
    "m",
    "bits",
    "rerank",
    "search_margin",
    "mass",
    "completion",
    "token_budget",
    "n_init",
    "n_local",
    "kmeans_iters",
    "block_cache_tokens",
    "cache_policy",
)
EVAL_SETTINGS = (
    "token_budget",
    "m",
    "bits",
    "n_init",
    "n_local",
    "rerank",
    "search_margin",
    "mass",
    "completion",
    "chunk_attention",
)


def add_answer_flags(g: argparse.ArgumentParser):
    """What `generate` and `chat` share: the answer's length, the device, the dtype and the engine's settings."""
    g.add_argument("--max-new-tokens", type=int, default=32)
    g.add_argument("--device", default="auto")
    add_dtype_flags(g)
    add_engine_flags(g, ANSWER_SETTINGS)


def build_parser() -> argparse.ArgumentParser:
    from pqcache.engine.methods import METHODS  # here: app.py reads this module's flags without importing torch

    p = argparse.ArgumentParser(
        prog="python -m pqcache", description="PQCache: PQ-retrieved attention for long contexts"
    )
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="answer a question about a context file")
    g.add_argument(
        "--model", default="default", help="'default' (Gemma 3 270M), 'smollm2' (SmolLM2-135M-Instruct), or a folder"
    )
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
    add_answer_flags(g)
    g.add_argument("--json", action="store_true", help="print one JSON object: text, tokens, document, stats")
    g.add_argument(
        "--store",
        type=Path,
        default=None,
        metavar="DIR",
        help="a document store: the document is read from it when it holds it for this model and settings (no "
        "prefill), and saved to it otherwise (the app's is $PQCACHE_HOME/documents); default: none",
    )

    c = sub.add_parser("chat", help="a conversation about a document: one question a line, follow-ups see the earlier")
    c.add_argument(
        "--model", default="default", help="'default' (Gemma 3 270M), 'smollm2' (SmolLM2-135M-Instruct), or a folder"
    )
    c.add_argument("--method", default="pqcache", choices=list(METHODS))
    c.add_argument("--context-file", type=Path, required=True, help="the document: .txt, .md, .pdf or any text file")
    c.add_argument("--encoding", default=None, help="text encoding of --context-file (default: UTF-8)")
    add_answer_flags(c)
    c.add_argument(
        "--store",
        type=Path,
        default=None,
        metavar="DIR",
        help="a document store: the document is read from it when it holds it (no prefill), saved to it otherwise, "
        "and the conversation kept beside it after each answer",
    )
    c.add_argument(
        "--resume",
        action="store_true",
        help="with --store: continue the document's last kept conversation (for this method): follow-ups see its turns",
    )
    c.add_argument(
        "--ray",
        default=None,
        metavar="ADDRESS",
        help="hold the document and the conversation on a Ray Serve replica: 'local' (a private cluster on this "
        "machine), 'auto' (the one `ray start` runs here) or HOST:PORT; default: in this process",
    )

    b = sub.add_parser("bench", help="benchmarks that print side-by-side ratios")
    b.add_argument(
        "which",
        choices=[
            "attention",
            "decode",
            "ttft",
            "memory",
            "blockcache",
            "e2e",
            "kernels",
            "app",
            "conversation",
            "store",
        ],
    )
    b.add_argument("--seq-lens", type=lambda t: [int(x) for x in t.split(",")], default=None)
    b.add_argument("--repeats", type=int, default=None)
    b.add_argument("--shapes", choices=["llama", "gemma"], default="llama", help="decode: head shapes")
    add_engine_flags(b, ("m", "bits", "rerank"))  # attention's
    add_engine_flags(b, ("mass", "completion"))  # e2e: a PQCache runner with them, beside the plain one
    b.add_argument("--new-tokens", type=int, default=None, help="blockcache (256), conversation (16): tokens generated")
    b.add_argument("--turns", type=int, default=6, help="conversation: turns on one read of the document")
    b.add_argument("--model", default="default", help="ttft, blockcache, conversation, store: the model")
    b.add_argument("--store-dir", default=None, help="store: where its temporary store lives (default: the temp dir)")
    b.add_argument("--device", default="auto")
    add_dtype_flags(b)
    b.add_argument(
        "--decode-tokens",
        type=int,
        default=None,
        help="e2e (default 32), app (default 96): greedy tokens decoded per run",
    )
    b.add_argument("--threads", type=int, default=None, help="e2e, kernels: threads (default: the cores)")
    b.add_argument("--n-batch", type=int, default=None, help="e2e: llama.cpp's n_batch (= n_ubatch)")
    b.add_argument("--chunk-tokens", type=int, default=None, help="e2e: prefill chunk (default: generate's)")
    b.add_argument("--gguf", default=None, help="e2e: llama.cpp's GGUF (default: the bundled model's)")
    b.add_argument("--alone", action="store_true", help="e2e: each runner alone, not decoding in turns with the others")
    b.add_argument(
        "--runners",
        default=None,
        help="e2e (llama.cpp,full,pqcache; a variant such as pqcache/completion=true/mass=0.95 too), app "
        "(app,session,generate,llama.cpp): runners",
    )
    b.add_argument("--json", action="store_true", help='print one object {"rows": [...]}')

    e = sub.add_parser("eval", help="compare methods on a case file (or: eval recall, eval fidelity)")
    e.add_argument(
        "mode",
        nargs="?",
        choices=["recall", "fidelity"],
        help="recall: PQ recall study on the model's real keys; fidelity: each method's attention output against "
        "full attention's on the model's real keys, values and queries",
    )
    e.add_argument("--cases", type=Path, help="JSONL: id, context, question, answers[, query_aware] (--format)")
    e.add_argument(
        "--format",
        choices=["pqcache", "longbench", "ruler", "scbench"],
        default="pqcache",
        help="--cases is this project's JSONL (default), LongBench's data file (its prompts, generation lengths and "
        "metrics; the summary has a column per dataset), RULER's generated JSONL (its string-match scores) or "
        "SCBench's (one context, several turns: --scbench-mode; a row per turn)",
    )
    e.add_argument(
        "--store",
        type=Path,
        default=None,
        metavar="DIR",
        help="a document store each case's context is read from or saved to (contexts cached alone: scbench, and "
        "cases with query_aware false); default: none, every context prefilled",
    )
    e.add_argument(
        "--too-long",
        choices=["skip", "cut"],
        default="skip",
        help="a case (scbench: a conversation's context) longer than the model reads: skipped with a row that says "
        "so (default), or cut in the middle as LongBench cuts; either way counted in the summary",
    )
    e.add_argument(
        "--scbench-mode",
        choices=["multi-turn", "multi-request", "both", "added-document"],
        default="multi-turn",
        help="scbench: each turn sees the earlier turns with their golden answers (multi-turn) or the context alone "
        "(multi-request); both: the two on one read of each context; added-document: each context added to a "
        "conversation over the previous case's, beside multi-request on it alone",
    )
    e.add_argument(
        "--max-length",
        type=int,
        default=None,
        help="longbench: the most prompt tokens, longer prompts cut in the middle (LongBench's model2maxlen; "
        "default: the model's positions less the answer's tokens)",
    )
    e.add_argument(
        "--methods",
        default=None,
        help="comma-separated method names (default full,pqcache); fidelity: settings among full, oracle, pqcache, "
        "pqcache+mass0.9, pqcache+mass0.95, pqcache+completion (default: all)",
    )
    e.add_argument("--out", type=Path, help="write one JSON line per case and method")
    e.add_argument("--group-by", default="", help="comma-separated case fields for the summary")
    e.add_argument("--model", default="default")
    e.add_argument("--device", default="auto")
    add_dtype_flags(e)
    e.add_argument(
        "--max-new-tokens",
        type=int,
        default=None,
        help="answer tokens at most (default 24; longbench, ruler, scbench: each case its benchmark's own length)",
    )
    add_engine_flags(e, EVAL_SETTINGS)
    e.add_argument("--context-tokens", type=int, default=4096, help="recall, fidelity: essay tokens used")
    e.add_argument(
        "--context-file",
        type=Path,
        default=None,
        help="fidelity: the text prefilled (default: the essays), cut to --context-tokens",
    )
    e.add_argument("--n-queries", type=int, default=8, help="fidelity: held-out tokens replayed as decode steps")
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
        "--margins",
        type=lambda t: tuple(float(x) for x in t.split(",")),
        default=(0.5,),
        help="recall: first-stage margins (search_margin), e.g. 0,0.5",
    )
    e.add_argument(
        "--budgets",
        type=lambda t: tuple(_budget(x) for x in t.split(",")),
        default=None,
        help="recall (default 0.1), fidelity (default 0.1,0.05,0.02,0.01,0.005): token budgets",
    )
    e.add_argument("--json", action="store_true")

    d = sub.add_parser("datasets", help="write case files offline (needle in a haystack, RULER-style)")
    d.add_argument(
        "kind",
        choices=["niah", "ruler", "realdocs", "scbench"],
        help="realdocs: 26 questions on licence texts; scbench: SCBench-style shared-context conversations",
    )
    d.add_argument("--turns", type=int, default=5, help="scbench: turns per conversation")
    d.add_argument("--out", type=Path, required=True)
    d.add_argument(
        "--format", choices=["pqcache", "longbench"], default="pqcache", help="realdocs: as LongBench records too"
    )
    d.add_argument("--lengths", type=lambda t: [int(x) for x in t.split(",")], default=[2048, 4096, 8192])
    d.add_argument("--depths", type=lambda t: [float(x) for x in t.split(",")], default=[0.1, 0.5, 0.9])
    d.add_argument(
        "--tasks",
        default=None,
        help="ruler, scbench: comma-separated tasks (default: all; scbench's "
        "realdocs: the real-document conversations)",
    )
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
