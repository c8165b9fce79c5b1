"""`bench e2e`: the whole model end to end (prefill tok/s, decode ms/token, peak RSS) with full attention
and PQCache, against llama.cpp on the same GGUF, the same token ids and the same threads, in one run.

Each (length, runner) runs in its own process (e2e_runner.py) so that its peak memory is its own; the
runners take turns at each length (interleaved), so drifts in the machine's speed hit them alike.
llama.cpp is an optional extra (`pip install -r requirements-bench.txt`); without it its rows say so.
"""

from __future__ import annotations

import importlib.util
import json
import statistics
import subprocess
import sys
from pathlib import Path

from pqcache import native
from pqcache.bench.e2e_turns import failure, run_in_turns, runner_env, spec_file
from pqcache.engine.config import PQCacheConfig
from pqcache.engine.errors import PQCacheConfigError
from pqcache.eval.evaluate import method_spec
from pqcache.fastpath.choices import DEFAULT_DECODE_WEIGHTS
from pqcache.fastpath.dtype import available_cpus, dtype_name, resolve_dtype
from pqcache.serving.home import DEFAULT_NAMES, SMOLLM2_NAMES

RUNNERS = ("llama.cpp", "full", "pqcache")
SEQ_LENS = (1024, 4096, 8192, 16384, 32768)
LLAMA_N_BATCH = 512  # the best of 256, 512, 1024, 2048 for an 8K prefill on the reference machine (docs/benchmarks.md)


def llama_cpp_installed() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def prompt_ids(tokenizer, n: int) -> list[int]:
    """n token ids of a long English document (the passkey filler), BOS first: every runner gets these."""
    from pqcache.bench.model import _ids

    return _ids(tokenizer, n)[0].tolist()


# the runner's process: `python -m pqcache.bench.e2e_runner SPEC.json` (the tests put a runner that crashes here)
RUNNER_COMMAND = (sys.executable, "-m", "pqcache.bench.e2e_runner")


def run_in_process(spec: dict) -> dict:
    """One runner in a fresh Python process -> its row, or {"error": how it failed} when the process dies (a
    signal, an exit code) or prints no row: the other runners and lengths still run."""
    path = spec_file(spec)
    try:
        proc = subprocess.run([*RUNNER_COMMAND, str(path)], capture_output=True, text=True, env=runner_env())
    finally:
        path.unlink(missing_ok=True)
    if proc.returncode == 0:
        try:
            return json.loads(proc.stdout.strip().splitlines()[-1])
        except (IndexError, ValueError):
            pass
    return {"error": failure(proc.returncode, proc.stdout, proc.stderr)}


def run_inline(spec: dict) -> dict:
    """One runner in this process (tests: no fresh interpreter; its peak memory is the whole process's)."""
    from pqcache.bench.e2e_runner import run_spec

    return run_spec(spec)


def bench_e2e(
    model: str = "default",
    seq_lens=SEQ_LENS,
    runners=RUNNERS,
    dtype: str | None = None,
    decode_weights: str = DEFAULT_DECODE_WEIGHTS,
    kv_dtype: str = PQCacheConfig.kv_dtype,
    decode_tokens: int = 32,
    repeats: int = 1,
    threads: int | None = None,
    n_batch: int = LLAMA_N_BATCH,
    chunk_tokens: int | None = None,
    gguf: str | None = None,
    isolate: bool = True,
    turns: bool = True,
    progress=None,
) -> list[dict]:
    """Rows {seq_len, runner, prefill_tok_s, decode_ms, peak_rss_bytes, ...} per length and runner (the
    median over `repeats` turns), with the ratios against llama.cpp at the same length when it ran:
    prefill_vs_llama (tokens/s: higher is better) and decode_vs_llama (ms/token: lower is better). turns: the
    runners' processes decode in alternation (e2e_turns.py); False: each runs alone, one after the other."""
    from transformers import AutoTokenizer

    from pqcache.serving.generate import PREFILL_CHUNK_TOKENS
    from pqcache.serving.loading import default_gguf, prepare_default_model, prepare_smollm2, smollm2_gguf

    quiet = lambda *_: None  # noqa: E731
    bundled = {"default": (prepare_default_model, default_gguf), "smollm2": (prepare_smollm2, lambda _: smollm2_gguf())}
    name = "default" if model in DEFAULT_NAMES else "smollm2" if model in SMOLLM2_NAMES else None
    path = bundled[name][0](quiet) if name else Path(model)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    threads = threads or available_cpus()
    llama_note = None
    if "llama.cpp" in runners:
        if not llama_cpp_installed():
            llama_note = "not installed (pip install -r requirements-bench.txt)"
        elif gguf is None and name is None:
            llama_note = "no GGUF for this model (--gguf)"
        else:
            gguf = str(gguf or bundled[name][1](quiet))  # a bundled model's own GGUF
    common = {
        "model": str(path),
        "dtype": dtype_name(resolve_dtype(dtype)),
        "decode_weights": decode_weights,
        "config": {"kv_dtype": kv_dtype},  # PQCache's, and full attention's rounding (engine/full_attention.py)
        "threads": threads,
        "decode_tokens": decode_tokens,
        "chunk_tokens": chunk_tokens or PREFILL_CHUNK_TOKENS,
        "gguf": gguf,
        "n_batch": n_batch,
    }
    run = run_in_process if isolate else run_inline
    rows = []
    for s in seq_lens:
        ids = prompt_ids(tokenizer, s)
        results: dict[str, list[dict]] = {r: [] for r in runners}
        for turn in range(repeats):
            order = runners[turn % len(runners) :] + runners[: turn % len(runners)]  # who goes first rotates
            order = [r for r in order if not (r == "llama.cpp" and llama_note)]
            if isolate and turns:  # every runner's process alive, their decode steps in alternation
                specs = {runner: {**common, "runner": runner, "ids": ids} for runner in order}
                done = run_in_turns(RUNNER_COMMAND, specs, decode_tokens, progress)
            else:
                done = {}
                for runner in order:
                    if progress is not None:
                        progress(f"{runner} at {s} tokens (turn {turn + 1}/{repeats})")
                    done[runner] = run({**common, "runner": runner, "ids": ids})
            for runner in order:
                if "error" in done[runner] and progress is not None:
                    progress(f"{runner} at {s} tokens failed: {done[runner]['error']}")
                results[runner].append(done[runner])
        rows += summarize(s, results, llama_note, common)
    return rows


def summarize(seq_len: int, results: dict[str, list[dict]], llama_note: str | None, common: dict) -> list[dict]:
    """The median of each runner's turns, the ratios against llama.cpp, and how many of the greedy tokens
    agree with full attention's (the same model and dtype: a check that the fast paths kept the output)."""
    rows = {}
    for runner, turns in results.items():
        row = {"seq_len": seq_len, "runner": runner, "prefill_tok_s": None, "decode_ms": None, "peak_rss_bytes": None}
        runs = [r for r in turns if "error" not in r]
        if len(runs) < len(turns):
            row["error"] = next(r["error"] for r in turns if "error" in r)
        if runs:
            row["prefill_tok_s"] = round(statistics.median(r["prefill_tok_s"] for r in runs), 1)
            row["decode_ms"] = round(statistics.median(r["decode_ms"] for r in runs), 2)
            row["peak_rss_bytes"] = max(r["peak_rss_bytes"] for r in runs)
            row["tokens"] = runs[0]["tokens"]
            row["settings"] = describe(runner, common)
        elif runner == "llama.cpp" and llama_note:
            row["note"] = llama_note
        rows[runner] = row
    llama, full, plain = rows.get("llama.cpp"), rows.get("full"), rows.get("pqcache")
    for row in rows.values():
        if row["runner"].startswith("pqcache/") and plain and plain["decode_ms"] and row["decode_ms"]:
            row["decode_vs_pqcache"] = round(row["decode_ms"] / plain["decode_ms"], 2)  # a variant's cost
        if row["runner"] != "llama.cpp" and llama and llama["prefill_tok_s"]:
            row["prefill_vs_llama"] = round(row["prefill_tok_s"] / llama["prefill_tok_s"], 2)
            row["decode_vs_llama"] = round(row["decode_ms"] / llama["decode_ms"], 2)
        if full and full.get("tokens") and row.get("tokens"):
            row["tokens_as_full"] = agreeing_prefix(row["tokens"], full["tokens"])
    return list(rows.values())


def agreeing_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens two greedy continuations share."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def describe(runner: str, common: dict) -> str:
    if runner == "llama.cpp":
        gguf = Path(common["gguf"]).name
        return f"{gguf}, n_threads={common['threads']}, n_batch=n_ubatch={common['n_batch']}, flash_attn"
    kv = common.get("config", {}).get("kv_dtype", "auto")
    variant = ", ".join(runner.split("/")[1:])
    cache = (
        f"DynamicCache, KV {kv}"
        if runner == "full"
        else f"PQCache defaults{' + ' + variant if variant else ''}, KV {kv}"
    )
    weights = f"{common['dtype']}, {common['decode_weights']} decode weights"
    if common["decode_weights"] != "model":  # the runners' processes find the same build (pqcache/native)
        weights += " (native kernels)" if native.library() is not None else " (torch's kernels)"
    return f"{weights}, {cache}, threads={common['threads']}, prefill chunks of {common['chunk_tokens']}"


def print_table(rows: list[dict]) -> None:
    print("end to end: prefill tok/s, decode ms/token, peak RSS (MiB); a PQCache variant's decode against PQCache's")
    w = max([9, *(len(r["runner"]) for r in rows)])
    header = f"{'tokens':>7} {'runner':>{w}} {'prefill':>8} {'decode':>7} {'MiB':>6} {'pre/llama':>9} {'dec/llama':>9}"
    print(f"{header} {'dec/pq':>6} same")
    for r in rows:
        if r["prefill_tok_s"] is None:
            print(f"{r['seq_len']:>7} {r['runner']:>{w}}  {r.get('error') or r.get('note', '')}")
            continue
        print(
            f"{r['seq_len']:>7} {r['runner']:>{w}} {r['prefill_tok_s']:>8} {r['decode_ms']:>7} "
            f"{r['peak_rss_bytes'] / 2**20:>6.0f} {r.get('prefill_vs_llama', '-'):>9} "
            f"{r.get('decode_vs_llama', '-'):>9} {r.get('decode_vs_pqcache', '-'):>6} {r.get('tokens_as_full', '-')}"
        )
        if r.get("error"):  # some turns failed, the others gave the figures
            print(f"{'':>{w + 8}} a turn failed: {r['error']}")


def cli_e2e(args) -> int:
    """`python -m pqcache bench e2e ...` (flags in pqcache/cli/args.py)."""
    runners = [r.strip() for r in (args.runners or ",".join(RUNNERS)).split(",") if r.strip()]
    asked = [f"mass={args.mass}"] * (args.mass is not None) + ["completion=true"] * args.completion
    if asked:  # beside the plain PQCache runner: its ratio is the cost of the estimate
        runners.append("/".join(["pqcache", *asked]))
    try:
        for runner in runners:
            if runner.startswith("pqcache/"):
                method_spec(runner, PQCacheConfig())
    except (ValueError, PQCacheConfigError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    rows = bench_e2e(
        model=args.model,
        seq_lens=args.seq_lens or SEQ_LENS,
        runners=tuple(dict.fromkeys(runners)),
        dtype=args.dtype,
        decode_weights=args.decode_weights,
        kv_dtype=args.kv_dtype,
        decode_tokens=args.decode_tokens or 32,
        repeats=args.repeats or 1,
        threads=args.threads,
        n_batch=args.n_batch or LLAMA_N_BATCH,
        chunk_tokens=args.chunk_tokens,
        gguf=args.gguf,
        turns=not args.alone,
        progress=lambda msg: print(msg, file=sys.stderr),
    )
    if args.json:
        print(json.dumps({"rows": rows}))
    else:
        print(f"model: {args.model}")
        print_table(rows)
    return 0
