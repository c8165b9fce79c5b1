"""Greedy generation, gpt-fast style: prefill / decode_one_token / decode_n_tokens, the one loop used by
the CLI's generate, the document session's answers and the evaluation, with the StopRule that ends answers
(the prompts come from pqcache.serving.prompt)."""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from pqcache.engine.cache import PQCache, kv_bytes
from pqcache.engine.config import PQCacheConfig
from pqcache.engine.errors import InputError
from pqcache.engine.methods import METHODS


def make_cache(model, method: str, config: PQCacheConfig | None = None):
    """ "full" is transformers' own DynamicCache (the reference); every other method a PQCache."""
    if method == "full":
        return DynamicCache(config=model.config)
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
    return logits[:, -1]


@torch.no_grad()
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


ENDINGS = ("eos", "end_of_answer", "repetition", "max_new_tokens", "stopped")


@dataclass
class StopRule:
    """When an answer ends, besides EOS and max_new_tokens (which stays the hard cap).

    - **end of answer**: one of `stop_texts` appears after the answer's first non-blank character (the prompt
      builder gives base models a blank line and a new ``Question:`` / ``Answer:`` line; chat models none: their
      end of turn is EOS). The tokens from the one holding the stop text's start on are not part of the answer.
    - **repetition**: the answer's last tokens are a block of p tokens repeated verbatim, back to back, over at
      least max(2p, `repeat_tokens`) tokens (p <= `max_period`): a loop such as "The holder is X. The holder is X."
      The repeats are dropped; the answer keeps the first copy.
    """

    tokenizer: object = None
    stop_texts: tuple[str, ...] = ()
    repeat_tokens: int = 16
    max_period: int = 64

    def _text(self, tokens) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def _stop_text_at(self, text: str) -> int:
        """Where the first stop text starts in `text` (after its leading blanks), or -1."""
        start = len(text) - len(text.lstrip())
        found = [i for i in (text.find(s, start) for s in self.stop_texts) if i >= 0]
        return min(found, default=-1)

    def _tokens_before(self, tokens: list[int], chars: int) -> int:
        """The most leading tokens whose text stays within the first `chars` characters."""
        keep = len(tokens)
        while keep > 0 and len(self._text(tokens[:keep])) > chars:
            keep -= 1
        return keep

    def check(self, tokens: list[int]) -> tuple[str, int] | None:
        """-> (why the answer ends, how many tokens it keeps) when it ends with these tokens, else None."""
        if self.stop_texts and self.tokenizer is not None:
            text = self._text(tokens)
            at = self._stop_text_at(text)
            if at >= 0:
                return "end_of_answer", self._tokens_before(tokens, at)
        span, period = repeated_tail(tokens, self.max_period)
        if period and span >= max(2 * period, self.repeat_tokens):
            return "repetition", len(tokens) - span + period
        return None

    def visible(self, tokens: list[int]) -> int:
        """How many tokens can be shown while streaming: a trailing piece that may grow into a stop text
        (a newline that may become a blank line) is held back until the next token says."""
        if not self.stop_texts or self.tokenizer is None or not tokens:
            return len(tokens)
        text = self._text(tokens)
        body = text.lstrip()
        if not body:
            return len(tokens)
        held = max(
            (n for s in self.stop_texts for n in range(1, min(len(s), len(body) + 1)) if body.endswith(s[:n])),
            default=0,
        )
        return len(tokens) if held == 0 else self._tokens_before(tokens, len(text) - held)


def repeated_tail(tokens: list[int], max_period: int = 64) -> tuple[int, int]:
    """The longest run at the end of `tokens` that repeats a block verbatim -> (span, period): the last `span`
    tokens have period `period` (span >= 2 * period means at least two whole copies). (0, 0) when none."""
    n, best = len(tokens), (0, 0)
    for p in range(1, min(max_period, n // 2) + 1):
        run = 0
        while run < n - p and tokens[n - 1 - run] == tokens[n - 1 - run - p]:
            run += 1
        if run >= p and run + p > best[0]:
            best = (run + p, p)
    return best


def looping(tokens: list[int], min_tokens: int = 8) -> bool:
    """Whether an answer ends in a verbatim loop: at least two copies of a block, min_tokens tokens or more."""
    span, period = repeated_tail(tokens)
    return period > 0 and span >= max(2 * period, min_tokens)


@dataclass
class Decoded:
    tokens: list[int] = field(default_factory=list)
    stopped: bool = False  # `stop` was set before the next token
    ended: str = ""  # why: one of ENDINGS


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


def generate(
    model,
    tokenizer,
    prompt,
    method: str = "pqcache",
    config: PQCacheConfig | None = None,
    max_new_tokens: int = 32,
    on_token=None,
) -> Generation:
    """Greedy answer to `prompt` (a pqcache.serving.prompt.Prompt: its stop rule ends the answer; or a plain
    string, which ends at EOS, a repetition loop or max_new_tokens); on_token(text_so_far) after each token."""
    if max_new_tokens < 1:
        raise InputError("max_new_tokens must be >= 1")
    device = next(model.parameters()).device
    if isinstance(prompt, str):
        input_ids, rule = tokenizer(prompt, return_tensors="pt").input_ids, StopRule(tokenizer)
    else:
        input_ids, rule = torch.cat(prompt.encode(tokenizer), dim=1), prompt.stop_rule(tokenizer)
    input_ids = input_ids.to(device)
    cache = make_cache(model, method, config)
    t0 = time.perf_counter()
    logits = prefill(model, input_ids, cache)
    prefill_s = time.perf_counter() - t0
    out = Generation()
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
        "prompt_tokens": int(input_ids.shape[1]),
        "new_tokens": len(out.tokens),
        "ended": out.ended,
        "prefill_s": round(prefill_s, 4),
        "s_per_token": round(decode_s / max(1, len(out.tokens)), 5),
        "device_kv_bytes": mem["device_kv_bytes"],
        "host_kv_bytes": mem["host_kv_bytes"],
        "pq_bytes": mem["pq_bytes"],
        "kmeans_iters": mem.get("kmeans_iters"),
    }
    if isinstance(cache, PQCache):
        out.stats["config"] = cache.pq_config.to_dict()
        cache.close()
    return out
