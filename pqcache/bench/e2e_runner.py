"""One runner of `bench e2e` on one prompt, alone in its process: prefill, greedy decode, peak memory.

`python -m pqcache.bench.e2e_runner SPEC.json` prints one JSON row. A process per runner makes the
peak memory its own: after loading and a warm-up the kernel's high-water mark of resident memory
(VmHWM) is reset (/proc/self/clear_refs), so `peak_rss_bytes` is the most the process held during the
timed prefill and decode, weights included (llama.cpp's mapped GGUF pages count once touched).

Runners: "full" (transformers' DynamicCache), "pqcache" (PQCache at its default settings; its prefill
time runs until every layer's PQ is built, when decoding can start at full speed), "llama.cpp"
(llama_cpp.Llama on the GGUF, fed the same token ids).
"""

from __future__ import annotations

import gc
import json
import resource
import statistics
import sys
import time

from pqcache.bench.procfs import proc_write

WARMUP_TOKENS = 128


def reset_peak_rss() -> bool:
    """Reset this process's VmHWM to its current RSS (Linux >= 4.0); False where it cannot."""
    return proc_write("/proc/self/clear_refs", "5")


def peak_rss_bytes() -> int:
    """VmHWM (the peak resident set since the last reset), else ru_maxrss (the peak since the start)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _timed_decode(step, first_token: int, n: int) -> tuple[list[int], list[float]]:
    """Greedy decode: step(token) -> next token; n tokens, each step timed (ms)."""
    tokens, times, token = [first_token], [], first_token
    for _ in range(n - 1):
        t0 = time.perf_counter()
        token = step(token)
        times.append((time.perf_counter() - t0) * 1e3)
        tokens.append(token)
    return tokens, times


def torch_runner(spec: dict):
    """The bundled model (or spec's) under spec's method -> (start(prompt) -> (prefill seconds, first token),
    step(token) -> next token, end()), warmed up."""
    import torch

    from pqcache.engine.config import PQCacheConfig
    from pqcache.eval.evaluate import method_spec
    from pqcache.fastpath.choices import DEFAULT_DECODE_WEIGHTS
    from pqcache.serving.generate import decode_one_token, make_cache, prefill
    from pqcache.serving.loading import load_model

    torch.set_num_threads(spec["threads"])
    model, _ = load_model(
        spec["model"],
        device="cpu",
        dtype=spec["dtype"],
        decode_weights=spec.get("decode_weights", DEFAULT_DECODE_WEIGHTS),
        progress=lambda *_: None,
    )
    method, config = method_spec(spec["runner"], PQCacheConfig(**spec.get("config", {})))  # a variant's settings
    chunk = spec.get("chunk_tokens")
    state = {}

    def start(prompt: list[int]) -> tuple[float, int]:
        state["cache"] = cache = make_cache(model, method, config)
        t0 = time.perf_counter()
        logits = prefill(model, torch.tensor([prompt]), cache, chunk_tokens=chunk)
        if method != "full":
            cache.wait()  # the PQ is built: the next step runs at full speed
        return time.perf_counter() - t0, int(logits.argmax(-1))

    def step(token: int) -> int:
        return int(decode_one_token(model, torch.tensor([[token]]), state["cache"]).argmax(-1))

    def end():
        if method != "full":
            state["cache"].close()

    return _warmed(start, step, end, spec)


def llama_runner(spec: dict):
    """llama.cpp on spec's GGUF -> (start, step, end) as torch_runner's, warmed up."""
    import numpy as np
    from llama_cpp import Llama

    llm = Llama(
        model_path=spec["gguf"],
        n_ctx=len(spec["ids"]) + spec["decode_tokens"] + 16,
        n_batch=spec["n_batch"],
        n_ubatch=spec["n_batch"],
        n_threads=spec["threads"],
        n_threads_batch=spec["threads"],
        flash_attn=True,
        swa_full=False,  # sliding-window layers keep their window only, as llama.cpp's own CLI and server do
        verbose=False,
    )
    n_vocab = llm.n_vocab()

    def logits_argmax() -> int:  # the last evaluated token's logits (the only ones kept)
        return int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(n_vocab,))))

    def start(prompt: list[int]) -> tuple[float, int]:
        llm.reset()  # eval() then drops the cached positions from 0 on
        t0 = time.perf_counter()
        llm.eval(prompt)
        return time.perf_counter() - t0, logits_argmax()

    def step(token: int) -> int:
        llm.eval([token])
        return logits_argmax()

    return _warmed(start, step, lambda: None, spec)


def _warmed(start, step, end, spec: dict):
    """A warm-up on the prompt's first tokens (first calls allocate and pick kernels), then the runner."""
    _, token = start(spec["ids"][:WARMUP_TOKENS])
    _timed_decode(step, token, 4)
    end()
    return start, step, end


def _prefill(start, ids: list[int]) -> tuple[float, int, bool]:
    """The timed prompt's prefill with the memory high-water mark reset just before -> (tokens/s, the first token,
    whether the mark was reset)."""
    gc.collect()
    scoped = reset_peak_rss()
    prefill_s, first = start(ids)
    return len(ids) / prefill_s, first, scoped


def measure(runner, ids: list[int], n_new: int) -> dict:
    """Prefill the timed prompt (_prefill), then n_new greedy tokens."""
    start, step, end = runner
    prefill_tok_s, first, scoped = _prefill(start, ids)
    tokens, times = _timed_decode(step, first, n_new)
    end()
    return _row(prefill_tok_s, tokens, times, scoped)


def _row(prefill_tok_s: float, tokens: list[int], times: list[float], scoped: bool) -> dict:
    return {
        "prefill_tok_s": round(prefill_tok_s, 1),
        "decode_ms": round(statistics.median(times), 2),
        "peak_rss_bytes": peak_rss_bytes(),
        "peak_scope": "run" if scoped else "process",  # process: ru_maxrss, loading included
        "tokens": tokens,
    }


def serve(runner, ids: list[int], lines, say) -> None:
    """The runner in turns with others (e2e_turns.py): prefill, say {"ready", "prefill_tok_s"}, then for each line
    "decode N" decode N more tokens and say {"times": [ms, ...]}; at "finish" say the row (the median of every
    step's time) and return. say(dict) prints one JSON line."""
    start, step, end = runner
    prefill_tok_s, token, scoped = _prefill(start, ids)
    say({"ready": True, "prefill_tok_s": round(prefill_tok_s, 1)})
    tokens, times = [token], []
    for line in lines:
        command = line.split()
        if command[:1] == ["decode"]:
            more, taken = _timed_decode(step, tokens[-1], int(command[1]) + 1)
            tokens += more[1:]
            times += taken
            say({"times": [round(t, 3) for t in taken]})
        elif command[:1] == ["finish"]:
            break
    end()
    say(_row(prefill_tok_s, tokens, times, scoped))


def make_runner(spec: dict):
    return llama_runner(spec) if spec["runner"] == "llama.cpp" else torch_runner(spec)


def run_spec(spec: dict) -> dict:
    """The row of one runner's spec (its "ids" and settings)."""
    return measure(make_runner(spec), spec["ids"], spec["decode_tokens"])


def main(argv: list[str] | None = None) -> int:
    """SPEC.json: print the runner's row; SPEC.json --turns: serve() its turns, commands on stdin."""
    argv = sys.argv[1:] if argv is None else argv
    with open(argv[0], encoding="utf-8") as f:
        spec = json.load(f)
    if "--turns" in argv[1:]:
        serve(make_runner(spec), spec["ids"], sys.stdin, lambda msg: print(json.dumps(msg), flush=True))
    else:
        print(json.dumps(run_spec(spec)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
