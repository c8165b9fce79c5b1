"""Greedy generation, gpt-fast style: prefill / decode_one_token / decode_n_tokens, the one loop used by
the CLI's generate, the document session's answers and the evaluation (the prompts come from
pqcache.serving.prompt, the StopRule that ends answers from pqcache.serving.stopping)."""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch

from pqcache.engine.cache import PQCache, kv_bytes
from pqcache.engine.config import PQCacheConfig
from pqcache.engine.errors import InputError
from pqcache.engine.full_attention import full_attention_cache
from pqcache.engine.heap import release_host_memory
from pqcache.engine.methods import METHODS
from pqcache.engine.sources import AttentionTally
from pqcache.serving.hooks import layer_hooks
from pqcache.serving.stopping import StopRule


def make_cache(model, method: str, config: PQCacheConfig | None = None):
    """ "full" is transformers' own DynamicCache (the reference), its full-attention layers at config's KV dtype as
    PQCache's host tier keeps them (engine/full_attention.py); every other method a PQCache."""
    if method == "full":
        return full_attention_cache(model, config)
    if method not in METHODS:
        raise InputError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    return PQCache(model, config or PQCacheConfig(), method=method)


# Prompt tokens per prefill forward. One forward over S tokens makes every sliding-window layer (15 of
# Gemma 3's 18) compute a full S x S masked attention and holds S x S masks; chunks keep those layers
# banded (chunk x (window + chunk)) and the prefill's working memory bounded by the chunk, not by S.
# Bundled model, 8K tokens, bf16, 2 cores: one forward 224 tok/s; chunks of 1024: 607, 2048: 433, 4096: 387.
PREFILL_CHUNK_TOKENS = 1024


@torch.no_grad()
def prefill(
    model, input_ids: torch.Tensor, cache, chunk_tokens: int | None = PREFILL_CHUNK_TOKENS, on_chunk=None
) -> torch.Tensor:
    """input_ids (B, S) -> next-token logits (B, V). A prompt into an empty cache runs in chunks of
    `chunk_tokens` (None or 0: one forward); the result equals the one-forward prefill's (each chunk
    attends to every earlier token, exactly). on_chunk(i, n) is called before chunk i of n."""
    S = input_ids.shape[1]
    if not chunk_tokens or S <= chunk_tokens or cache.get_seq_length() > 0:
        if on_chunk is not None:
            on_chunk(0, 1)
        return model(input_ids=input_ids, cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
    if isinstance(cache, PQCache):
        cache.expect_prefill(S)  # the PQ layers split their tiers after the last chunk
    starts = range(0, S, chunk_tokens)
    for i, start in enumerate(starts):
        if on_chunk is not None:
            on_chunk(i, len(starts))
        chunk = input_ids[:, start : start + chunk_tokens]
        logits = model(input_ids=chunk, cache=cache, use_cache=True, logits_to_keep=1).logits
        # the chunk's activations go back to the OS: kept by the C heap, they added up to 200 MB of resident memory
        # over an 8K prefill of the bundled model (measured; docs/benchmarks.md's memory table)
        release_host_memory()
    return logits[:, -1]


@torch.no_grad()
def prefill_document(model, ids: torch.Tensor, cache, lock, progress=None, stop=None) -> float:
    """A document's prefill into `cache` under `lock`, then the wait for its K-Means: progress(fraction, message)
    after each layer of each chunk (0 to 0.9) and each clustered layer (0.9 to 1); a set `stop` raises Cancelled
    at the next layer or during the wait. Returns the prefill's seconds."""
    n_layers, chunk = len(cache.layers), [0, 1]  # the prefill chunk running, of how many

    def on_chunk(i, n):
        chunk[:] = [i, n]

    def on_layer(idx):
        i, n = chunk
        where = f"layer {idx + 1}/{n_layers}" + (f", chunk {i + 1}/{n}" if n > 1 else "")
        progress(0.9 * (i + (idx + 1) / n_layers) / n, f"prefill: {ids.shape[1]} tokens, {where}")

    with lock, layer_hooks(model, None if progress is None else on_layer, stop):
        t0 = time.perf_counter()
        prefill(model, ids, cache, on_chunk=on_chunk)
        seconds = time.perf_counter() - t0
    for i, layer in enumerate(cache.pq_layers):
        if progress is not None:
            progress(0.9 + 0.1 * i / max(1, len(cache.pq_layers)), f"clustering layer {layer.layer_idx}")
        layer.wait_pq(stop)
    return seconds


def decode_one_token(model, token: torch.Tensor, cache) -> torch.Tensor:
    """token (B, 1) -> next-token logits (B, V): the model's forward, or the same step without the forward's
    masks and plumbing where fastpath/step.py applies (bit-identical logits)."""
    fast = getattr(model, "fast_decode_step", None)
    if fast is not None and fast.ready(token, cache):
        return fast(token, cache)
    return model(input_ids=token, cache=cache, use_cache=True).logits[:, -1]


def eos_token_ids(model, tokenizer=None) -> set[int]:
    """The ids that end a generation: the model's generation_config eos_token_id (an id or a list) and the
    tokenizer's eos_token_id."""
    gen = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    eos = set(gen if isinstance(gen, (list, tuple)) else [gen])
    eos.add(getattr(tokenizer, "eos_token_id", None))
    eos.discard(None)
    return eos


@dataclass
class Decoded:
    tokens: list[int] = field(default_factory=list)
    stopped: bool = False  # `stop` was set before the next token
    ended: str = ""  # why: one of ENDINGS
    generated: int = 0  # tokens the model produced, the dropped ones (a stop text, a cut repeat) included
    fed: list[int] = field(default_factory=list)  # the produced tokens read into the cache (all but an unread last)


@torch.no_grad()
def decode_n_tokens(
    model,
    logits: torch.Tensor,
    cache,
    max_new_tokens: int,
    eos=frozenset(),
    on_token=None,
    stop=None,
    lock=None,
    stop_rule: StopRule | None = None,
) -> Decoded:
    """Greedy decode of one row from the prefill's next-token logits (1, V), at most max_new_tokens tokens.

    Ends (Decoded.ended) at an EOS id (not kept: "eos"), when `stop_rule` says the answer ended ("end_of_answer",
    "repetition": its stop text and repeats are dropped), after max_new_tokens ("max_new_tokens"; no forward is
    run for a token that is not kept), or when `stop` (a threading.Event) is set before the next token
    ("stopped"). on_token(tokens) is called after each token with the tokens so far (with a stop rule: those
    that can be shown, and once more with the final answer when the rule ends it); `lock` (a context manager)
    is held around each forward."""
    out = Decoded(ended="max_new_tokens")
    for _ in range(max_new_tokens):
        if stop is not None and stop.is_set():
            out.stopped, out.ended = True, "stopped"
            break
        token = logits.argmax(-1, keepdim=True)  # (1, 1)
        tid = int(token)
        if tid in eos:
            out.ended = "eos"
            break
        out.tokens.append(tid)
        out.generated += 1
        verdict = stop_rule.check(out.tokens) if stop_rule is not None else None
        if verdict is not None:
            out.ended, keep = verdict
            del out.tokens[keep:]
            if on_token is not None:
                on_token(out.tokens)
            break
        if on_token is not None:
            on_token(out.tokens if stop_rule is None else out.tokens[: stop_rule.visible(out.tokens)])
        if len(out.tokens) == max_new_tokens:
            break
        with lock if lock is not None else nullcontext():
            logits = decode_one_token(model, token, cache)
        out.fed.append(tid)
    if stop_rule is not None and out.ended in ("eos", "max_new_tokens", "stopped"):
        # an answer that ended otherwise on the start of the frame's next field ("\nQuestion", then EOS or the cap)
        # keeps what the stream showed: that start is not the answer's
        del out.tokens[stop_rule.visible(out.tokens) :]
    return out


def cache_bytes(cache) -> dict:
    if isinstance(cache, PQCache):
        return cache.stats()
    return {
        "device_kv_bytes": sum(kv_bytes(layer) for layer in cache.layers),
        "host_kv_bytes": 0,
        "pq_bytes": 0,
        "kmeans_iters": None,
    }


@dataclass
class Generation:
    text: str = ""
    tokens: list[int] = field(default_factory=list)
    ended: str = ""  # why the answer ended: one of ENDINGS
    stats: dict = field(default_factory=dict)
    # the passages of the prompt's document its attention read most (pqcache.serving.sources): {"start", "end",
    # "text", "share"}, highest share first, character ranges in the user's document (prompt.source)
    sources: list[dict] = field(default_factory=list)
    document: dict | None = None  # {"from": "prefill" | "store", "seconds", "note"?} when the prompt has a document


def generate(
    model,
    tokenizer,
    prompt,
    method: str = "pqcache",
    config: PQCacheConfig | None = None,
    max_new_tokens: int = 32,
    on_token=None,
    sources: bool = True,
    store=None,
) -> Generation:
    """Greedy answer to `prompt` (a pqcache.serving.prompt.Prompt: its stop rule ends the answer; or a plain
    string, which ends at EOS, a repetition loop or max_new_tokens); on_token(text_so_far) after each token.

    A Prompt with a document runs as the app runs it: the document part is prefilled (and its PQ built), then the
    question part as a second chunk, then the answer; every method, full attention too, is a PQCache over the
    same tiers, and the answer's sources come with it. A plain string is one prefill (full attention: transformers'
    DynamicCache). sources=False: no tally of the attention (what the sources cost: `bench app`). store: a
    DocumentStore the document part is read from when it holds it (no prefill), and saved to otherwise;
    `Generation.document` says which, and in how long."""
    if max_new_tokens < 1:
        raise InputError("max_new_tokens must be >= 1")
    device = next(model.parameters()).device
    document = not isinstance(prompt, str) and bool(prompt.document.strip())
    if isinstance(prompt, str):
        parts, rule = [tokenizer(prompt, return_tensors="pt").input_ids], StopRule(tokenizer)
    else:
        doc_ids, q_ids = prompt.encode(tokenizer)
        parts, rule = ([doc_ids, q_ids] if document else [torch.cat([doc_ids, q_ids], 1)]), prompt.stop_rule(tokenizer)
    parts = [ids.to(device) for ids in parts]
    cache = PQCache(model, config or PQCacheConfig(), method=method) if document else make_cache(model, method, config)
    t0 = time.perf_counter()
    tally, loaded = None, None
    if document:  # the document is cached (from the store, or prefilled and its PQ built) before the question
        from pqcache.serving.restore import load_or_restore

        def from_text():
            prefill(model, parts[0], cache)
            cache.wait()
            return cache

        doc_ids = parts[0][0].tolist()
        settings = config or PQCacheConfig()
        loaded = load_or_restore(store, model, tokenizer, settings, method, False, doc_ids, from_text, prompt.source)
        if loaded.cache is not cache:  # the document read back: no prefill, no K-Means
            cache.close()
            cache = loaded.cache
            cache.wait()
        prefill_s = loaded.seconds
        tally = cache.tally_sources(AttentionTally(parts[0].shape[1])) if sources else None
        t0 = time.perf_counter() - prefill_s  # the question's time starts here, after the save
        logits = prefill(model, parts[1], cache)
    else:
        logits = prefill(model, parts[0], cache)
        prefill_s = time.perf_counter() - t0
    first_s = time.perf_counter() - t0 - prefill_s
    out = Generation()
    if loaded is not None:  # how the document was read: prefilled or from the store (seconds: either, K-Means too)
        note = {"note": loaded.note} if loaded.note else {}
        out.document = {"from": loaded.read_from, "seconds": round(loaded.seconds, 4), **note}
    show = None if on_token is None else (lambda tokens: on_token(tokenizer.decode(tokens, skip_special_tokens=True)))
    t1 = time.perf_counter()
    eos = eos_token_ids(model, tokenizer)
    decoded = decode_n_tokens(model, logits, cache, max_new_tokens, eos, show, stop_rule=rule)
    decode_s = time.perf_counter() - t1
    out.tokens, out.ended = decoded.tokens, decoded.ended
    out.text = tokenizer.decode(out.tokens, skip_special_tokens=True)
    mem = cache_bytes(cache)
    out.stats = {
        "method": method,
        "prompt_tokens": sum(int(ids.shape[1]) for ids in parts),
        "new_tokens": len(out.tokens),
        "ended": out.ended,
        "prefill_s": round(prefill_s, 4),
        "question_s": round(first_s, 4),
        "s_per_token": round(decode_s / max(1, decoded.generated), 5),  # each token the model produced
        "generated": decoded.generated,
        "device_kv_bytes": mem["device_kv_bytes"],
        "host_kv_bytes": mem["host_kv_bytes"],
        "pq_bytes": mem["pq_bytes"],
        "kmeans_iters": mem.get("kmeans_iters"),
    }
    if tally is not None:
        from pqcache.serving.prompt import PromptBuilder
        from pqcache.serving.sources import passages

        spans = PromptBuilder(tokenizer).document_spans(prompt.source)
        out.sources = [p.to_dict() for p in passages(prompt.source, spans, tally.received)]
    if isinstance(cache, PQCache):
        out.stats["config"] = cache.pq_config.to_dict()
        cache.close()
    return out
