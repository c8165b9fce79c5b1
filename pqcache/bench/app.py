"""`bench app`: the app's own path against `generate` on the same document and questions, side by side in one run.

Per document length (the passkey filler with a fact placed in the middle, asked about in plain words), each runner
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

import subprocess
from pathlib import Path

from pqcache.serving.measured import save_figures

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


def bench_app(
    model="default", lengths=LENGTHS, runners=RUNNERS, gguf=None, threads=None, progress=None, long_tokens=None
) -> list:
    """The rows of every length and runner, each runner in a process of its own (nothing one leaves behind, such as
    llama.cpp's threads or another runner's OpenMP team, slows the next); a runner that fails gives a row that says
    how, and the others still run."""
    import json
    import sys
    import tempfile

    from pqcache.bench.e2e import failure, llama_cpp_installed
    from pqcache.fastpath.dtype import available_cpus

    rows = []
    for n in lengths:
        for runner in runners:
            if progress is not None:
                progress(f"{runner} at {n} tokens")
            if runner == "llama.cpp" and not llama_cpp_installed():
                rows.append(
                    {"length": n, "runner": runner, "note": "not installed (pip install -r requirements-bench.txt)"}
                )
                continue
            spec = {
                "model": model,
                "length": n,
                "runner": runner,
                "gguf": gguf,
                "threads": threads or available_cpus(),
                "long_tokens": long_tokens,
            }
            with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
                json.dump(spec, f)
            try:
                proc = subprocess.run(
                    [sys.executable, "-m", "pqcache.bench.app_runs", f.name], capture_output=True, text=True
                )
            finally:
                Path(f.name).unlink(missing_ok=True)
            try:
                row = json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 else None
            except (IndexError, ValueError):
                row = None
            rows.append(
                {
                    "length": n,
                    **(row or {"runner": runner, "error": failure(proc.returncode, proc.stdout, proc.stderr)}),
                }
            )
    return with_ratios(rows)


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
        long_tokens=args.decode_tokens,
    )
    save_figures(rows)
    print(json.dumps({"rows": rows})) if args.json else print_table(rows)
    return 0
