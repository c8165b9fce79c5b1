"""`bench app`: the app's own path against `generate` on the same document and questions, side by side in one run.

Per document length (essay sentences with a fact placed in the middle, asked about in plain words), each runner
loads the document, answers the fact's question (time to the first answer token) and a question whose answer runs
long (decode ms/token):

  app       `python app.py` itself, driven through its API as the page drives it (gradio_client): the load's wall
            time, the first streamed text of the answer, and the page's own "N tokens in T s" line
  session   the objects the app uses, in this process: DocumentWorker / DocumentSession with the app's LoadSettings,
            the load and the answer on worker threads with progress and Stop, the answer watched by the app's
            observer (settings.answer_observer); `observe_share` is the share of the answer time the observer's own
            recording took (Instrumentation.cost_s)
  generate  pqcache.serving.generate.generate on the same text (no observer, the CLI's settings)
  llama.cpp the same GGUF on the same token ids (document, then question), where llama-cpp-python is installed

Ratios against generate at the same length: load_vs_generate (tokens/s, higher is better) and decode_vs_generate
(ms/token, lower is better). Timings from one run on a shared machine move by several percent.
"""

from __future__ import annotations

import os
from pathlib import Path

from pqcache.tools.bench_app_runs import app_row, document, generate_row, llama_row, session_row

LENGTHS = (1024, 8192, 24576)
RUNNERS = ("app", "session", "generate", "llama.cpp")


def with_ratios(rows: list[dict]) -> list[dict]:
    """load_vs_generate and decode_vs_generate for the rows of each length that ran."""
    ref = {r["length"]: r for r in rows if r["runner"] == "generate" and "load_tok_s" in r}
    for r in rows:
        g = ref.get(r["length"])
        if g is not None and r is not g and "load_tok_s" in r:
            r["load_vs_generate"] = round(r["load_tok_s"] / g["load_tok_s"], 2)
            r["decode_vs_generate"] = round(r["decode_ms"] / g["decode_ms"], 2) if g["decode_ms"] else None
    return rows


def bench_app(model="default", lengths=LENGTHS, runners=RUNNERS, gguf=None, threads=None, progress=None) -> list:
    """The rows of every length and runner (a runner that fails gives a row with its error)."""
    from pqcache.fastpath.dtype import available_cpus
    from pqcache.serving.loading import default_gguf, load_model
    from pqcache.tools.e2e import llama_cpp_installed

    loaded, tokenizer = load_model(model, progress=lambda *_: None)
    rows = []
    for n in lengths:
        text = document(tokenizer, n)
        for runner in runners:
            if progress is not None:
                progress(f"{runner} at {n} tokens")
            try:
                if runner == "app":
                    row = app_row(text)
                elif runner == "session":
                    row = session_row(loaded, tokenizer, text)
                elif runner == "generate":
                    row = generate_row(loaded, tokenizer, text)
                elif not llama_cpp_installed():
                    row = {"runner": runner, "note": "not installed (pip install -r requirements-bench.txt)"}
                else:
                    row = llama_row(
                        gguf or str(default_gguf(lambda *_: None)), tokenizer, text, threads or available_cpus()
                    )
            except Exception as exc:  # noqa: BLE001 - the other runners still run
                row = {"runner": runner, "error": f"{type(exc).__name__}: {exc}"}
            rows.append({"length": n, **row})
    return with_ratios(rows)


def figures_path() -> Path:
    """Where `bench app` leaves its last figures for this machine (the app's how-to line quotes them)."""
    return Path(os.environ.get("PQCACHE_HOME", Path.home() / ".cache" / "pqcache")) / "bench_app.json"


def save_figures(rows: list[dict]) -> None:
    """The session rows (the app's objects) of the last run, with the CPU they ran on."""
    import json
    import platform

    kept = [r for r in rows if r["runner"] == "session" and "load_tok_s" in r]
    if kept:
        path = figures_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"machine": platform.processor() or platform.machine(), "rows": kept}))


def print_table(rows: list[dict]) -> None:
    print("the app's path against generate, bundled model: load tok/s, first answer token (s), decode ms/token")
    head = ("tokens", 7), ("runner", 9), ("load", 7), ("ttft", 6), ("decode", 7), ("load/gen", 8), ("dec/gen", 7)
    print(" ".join(f"{name:>{width}}" for name, width in head), "watch  answer")
    for r in rows:
        if "load_tok_s" not in r:
            print(f"{r['length']:>7} {r['runner']:>9}  {r.get('error') or r.get('note', '')}")
            continue
        print(
            f"{r['tokens']:>7} {r['runner']:>9} {r['load_tok_s']:>7} {r['ttft_s']:>6} {r['decode_ms']:>7} "
            f"{r.get('load_vs_generate', '-'):>8} {r.get('decode_vs_generate', '-'):>7} "
            f"{r.get('observe_share', '-'):>5}  {r['answer'].strip()!r}"
        )


def cli_app(args) -> int:
    """`python -m pqcache bench app [--seq-lens ...] [--runners ...] [--json]`."""
    import json
    import sys

    rows = bench_app(
        model=args.model,
        lengths=args.seq_lens or LENGTHS,
        runners=tuple(r.strip() for r in (args.runners or ",".join(RUNNERS)).split(",") if r.strip()),
        gguf=args.gguf,
        threads=args.threads,
        progress=lambda msg: print(msg, file=sys.stderr),
    )
    save_figures(rows)
    print(json.dumps({"rows": rows})) if args.json else print_table(rows)
    return 0
