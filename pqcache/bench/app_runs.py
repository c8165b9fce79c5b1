"""The runners of `bench app` (app.py beside it says what each measures): the app's objects in this process, generate,
`python app.py` through its API, and llama.cpp on the same token ids."""

from __future__ import annotations

import queue
import re
import threading
import time

from pqcache.engine.config import PQCacheConfig
from pqcache.eval.passkey import LONG_QUESTION
from pqcache.serving.answer import step_ms
from pqcache.serving.pool import SessionPool
from pqcache.serving.prompt import build_prompt
from pqcache.serving.settings import LoadSettings, answer_observer
from pqcache.serving.worker import DocumentWorker

FACT, QUESTION, ANSWER = (
    "The secret code for the blue door is 4721.",
    "What is the secret code for the blue door?",
    "4721",
)
LONG_TOKENS = 96  # the long answer's tokens (decode ms/token)
LONG_RUNS = 2  # every runner answers it this many times and keeps its best: one slow spell of the machine, not two


def document(tokenizer, n_tokens: int) -> str:
    """The passkey filler (the sample's kind of text, on which LONG_QUESTION's answer counts on for LONG_TOKENS) to
    about n_tokens tokens, with FACT in the middle."""
    from pqcache.eval.passkey import FILLER, INTRO

    per = len(tokenizer(FILLER, add_special_tokens=False).input_ids)
    n = max(2, (n_tokens - 40) // per)
    return INTRO + FILLER * (n // 2) + FACT + " " + FILLER * (n - n // 2)


def _row(runner: str, n_doc: int, load_s: float, ttft_s: float, decode_ms: float, text: str, **extra) -> dict:
    return {
        "runner": runner,
        "tokens": n_doc,
        "load_tok_s": round(n_doc / load_s, 1),
        "ttft_s": round(ttft_s, 3),
        "decode_ms": round(decode_ms, 2),
        "answer": text,
        "right": ANSWER in text,
        **extra,
    }


def _timed(ask) -> tuple[float, float, str, int]:
    """ask(on_token) -> an Answer or a Generation; -> (seconds to the first token, ms a step after the first (each
    token the model produced: the stop rule's dropped ones too), text, tokens)."""
    t0, stamps = time.perf_counter(), []
    answer = ask(lambda *_: stamps.append(time.perf_counter()))
    if hasattr(answer, "first_s"):  # a session's Answer times itself
        first, decode_ms = answer.first_s, step_ms(answer) or 0.0
    else:  # generate: its decode time over the steps after the first token, as the session counts them
        steps = max(2, answer.stats["generated"])
        first, decode_ms = (stamps[0] - t0 if stamps else 0.0), 1e3 * answer.stats["s_per_token"] * steps / (steps - 1)
    return first, decode_ms, answer.text, len(answer.tokens)


def session_row(model, tokenizer, text: str, long_tokens: int = LONG_TOKENS) -> dict:
    """The app's objects in this process: worker.load and session.ask on threads, the app's settings and observer."""
    worker = DocumentWorker(model, tokenizer, SessionPool(max_bytes=8 * 2**30, idle_s=None))
    stop, updates = threading.Event(), queue.Queue()

    def progress(fraction, step):  # what the app's progress callback does: note it for the page's next poll
        updates.put((fraction, step))

    t0 = time.perf_counter()
    session = _on_thread(lambda: worker.load("bench", "document", text, LoadSettings(), progress, stop))
    load_s = time.perf_counter() - t0
    observers = []

    def ask(question, max_new_tokens):
        def run(on_token):
            observers.append(answer_observer())
            return _on_thread(
                lambda: session.ask(question, "pqcache", max_new_tokens, stop, observers[-1], on_token=on_token)
            )

        return run

    ttft_s, _, text_fact, _ = _timed(ask(QUESTION, 24))
    t1 = time.perf_counter()
    decode_ms = min(_timed(ask(LONG_QUESTION, long_tokens))[1] for _ in range(LONG_RUNS))
    answer_s = (time.perf_counter() - t1) / LONG_RUNS
    n_doc = session.n_tokens
    worker.free("bench")
    observe = observers[-1].cost_s / answer_s if answer_s > 0 else 0.0
    return _row("session", n_doc, load_s, ttft_s, decode_ms, text_fact, observe_share=round(observe, 3))


def generate_row(model, tokenizer, text: str, long_tokens: int = LONG_TOKENS) -> dict:
    """generate() as the CLI runs it: the document prefilled (PQ built), the question, the answer; no observer. The
    long answer runs twice, with and without its sources' tally: `sources_cost` is the ratio of their ms/token."""
    from pqcache.serving.generate import generate

    def ask(question, max_new_tokens, sources=True):
        def run(on_token):
            prompt = build_prompt(tokenizer, text, question)  # on a thread too: no OpenMP team outlives a runner
            out = _on_thread(
                lambda: generate(
                    model,
                    tokenizer,
                    prompt,
                    "pqcache",
                    PQCacheConfig(),
                    max_new_tokens,
                    on_token=on_token,
                    sources=sources,
                )
            )
            run.stats = out.stats
            return out

        return run

    fact = ask(QUESTION, 24)
    _, _, text_fact, _ = _timed(fact)
    stats = fact.stats
    with_sources, bare = [], []
    for _ in range(LONG_RUNS):  # taking turns, the best of each: a drift of the machine's speed hits both alike
        with_sources.append(_timed(ask(LONG_QUESTION, long_tokens))[1])
        bare.append(_timed(ask(LONG_QUESTION, long_tokens, sources=False))[1])
    decode_ms, bare_ms = min(with_sources), min(bare)
    n_doc = stats["prompt_tokens"] - len(build_prompt(tokenizer, text, QUESTION).encode(tokenizer)[1][0])
    cost = round(decode_ms / bare_ms, 3) if bare_ms else None
    return _row("generate", n_doc, stats["prefill_s"], stats["question_s"], decode_ms, text_fact, sources_cost=cost)


def _on_thread(work):
    """work() on a thread of its own, as the app runs loads and answers; its result (or its exception)."""
    out: dict = {}

    def run():
        try:
            out["result"] = work()
        except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
            out["error"] = exc

    thread = threading.Thread(target=run, name="pqcache-bench")
    thread.start()
    thread.join()
    if "error" in out:
        raise out["error"]
    return out["result"]


def app_row(text: str, model: str = "default", long_tokens: int = LONG_TOKENS) -> dict:
    """`python app.py` through its API: the load's wall time, the first streamed answer text, the page's own line."""
    from gradio_client import Client

    from pqcache.bench.app_process import running_app

    flags = ["--no-store", "--max-cache-gib", "4"] + ([] if model == "default" else ["--model", model])
    with running_app(*flags) as (url, _):  # --no-store: the load is timed as a prefill
        client = Client(url, verbose=False)
        t0 = time.perf_counter()
        status = client.predict(None, text, *LoadSettings().values(), api_name="/load_document")[0]
        load_s = time.perf_counter() - t0
        n_doc = int(re.search(r"Loaded \*\*(\d+)\*\* tokens", status).group(1))
        ttft_s, text_fact, _ = _stream(client, QUESTION, 24)
        lines = [_stream(client, LONG_QUESTION, long_tokens)[2] for _ in range(LONG_RUNS)]
    # the page's own figures: "N tokens in T s (...); first token after F s, then M ms a token"; the best answer's
    found = [re.search(r"first token after ([\d.]+) s, then ([\d.]+) ms", line) for line in lines]
    decode_ms, page_first, line = min((float(f.group(2)), float(f.group(1)), f.string) for f in found)
    return _row("app", n_doc, load_s, ttft_s, decode_ms, text_fact, page=line, page_first_s=page_first)


def _stream(client, question: str, max_new_tokens: int) -> tuple[float, str, str]:
    """Ask through the page's /ask -> (seconds to the first streamed answer text, the answer, the timing line)."""
    t0, first, last = time.perf_counter(), None, None
    for last in client.submit(question, [], "pqcache", max_new_tokens, "5", api_name="/ask"):
        content = last[0][-1]["content"] if last[0] else ""
        content = content[0]["text"] if isinstance(content, list) else content
        if first is None and last[0] and last[0][-1]["role"] == "assistant" and not content.startswith("*"):
            first = time.perf_counter() - t0
    text = last[0][-1]["content"][0]["text"].split("\n\n*")[0]
    return first or time.perf_counter() - t0, text, last[1]


def llama_row(gguf: str, tokenizer, text: str, threads: int, long_tokens: int = LONG_TOKENS) -> dict:
    """llama.cpp on the same ids: the document evaluated (load), the question (the first token), the long answer."""
    import numpy as np
    from llama_cpp import Llama

    from pqcache.serving.prompt import PromptBuilder

    builder = PromptBuilder(tokenizer)
    doc = builder.document_ids(text)[0].tolist()
    llm = Llama(
        model_path=gguf,
        n_ctx=len(doc) + 256,
        n_batch=512,
        n_ubatch=512,
        n_threads=threads,
        n_threads_batch=threads,
        flash_attn=True,
        swa_full=False,
        verbose=False,
    )

    def argmax() -> int:
        return int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))))

    t0 = time.perf_counter()
    llm.eval(doc)
    load_s = time.perf_counter() - t0
    answers = []
    for question, n_new in ((QUESTION, 24), *[(LONG_QUESTION, long_tokens)] * LONG_RUNS):
        llm.n_tokens = len(doc)  # back to the cached document: the question continues it
        t1 = time.perf_counter()
        llm.eval(builder.question_ids(question)[0].tolist())
        tokens, stamps = [argmax()], [time.perf_counter()]
        for _ in range(n_new - 1):
            llm.eval([tokens[-1]])
            tokens.append(argmax())
            stamps.append(time.perf_counter())
        answers.append((stamps[0] - t1, 1e3 * (stamps[-1] - stamps[0]) / (n_new - 1), tokenizer.decode(tokens)))
    fact = answers[0][2].split("\n\n")[0]  # the page's stop rule ends the answer at a blank line
    return _row("llama.cpp", len(doc), load_s, answers[0][0], min(a[1] for a in answers[1:]), fact)


def run_spec(spec: dict) -> dict:
    """One runner at one length (app.py's spec): its row."""
    from transformers import AutoTokenizer

    from pqcache.serving.loading import DEFAULT_NAMES, default_gguf, load_model, prepare_default_model

    runner = spec["runner"]
    long_tokens = spec.get("long_tokens") or LONG_TOKENS  # --decode-tokens
    if runner == "app":  # the app loads its own model
        quiet = prepare_default_model(lambda *_: None) if spec["model"] in DEFAULT_NAMES else spec["model"]
        return app_row(document(AutoTokenizer.from_pretrained(str(quiet)), spec["length"]), spec["model"], long_tokens)
    model, tokenizer = load_model(spec["model"], progress=lambda *_: None)
    text = document(tokenizer, spec["length"])
    if runner == "session":
        return session_row(model, tokenizer, text, long_tokens)
    if runner == "generate":
        return generate_row(model, tokenizer, text, long_tokens)
    if runner == "llama.cpp":
        gguf = spec["gguf"] or str(default_gguf(lambda *_: None))
        return llama_row(gguf, tokenizer, text, spec["threads"], long_tokens)
    raise ValueError(f"unknown runner {runner!r}")


if __name__ == "__main__":
    import json
    import sys

    with open(sys.argv[1], encoding="utf-8") as f:
        print(json.dumps(run_spec(json.load(f))))
