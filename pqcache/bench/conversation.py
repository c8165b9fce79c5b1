"""`bench conversation`: a conversation's turns on one read of a document, against reading everything again.

Per turn, time to first token (the turn's question read after the cache, then its first answer token) and ms a token
after it, for PQCache and for full attention, each a Conversation on the same loaded document (serving/
conversation.py). Beside them, the paper's first strategy for a new turn: prefill the document and every earlier
turn again, with a fresh PQCache (its K-Means re-run), measured at the last turn, where it costs most. Turn 1's
re-prefill is the document's load itself (its prefill, then the first question's time), so that row's figure is the
load's, not a second run. All in one run, one after another; absolute times on a shared machine are noisy, the
ratios less so.
"""

from __future__ import annotations

import time

import torch

from pqcache.bench.model import _ids
from pqcache.engine.config import PQCacheConfig

# follow-ups in plain words about the passkey document, each leaning on the turns before it
QUESTIONS = (
    "What is the pass key?",
    "Repeat that number.",
    "What is its first digit?",
    "Is it an even number?",
    "Say the pass key once more.",
    "What was my first question?",
    "And its last digit?",
    "Write the number backwards.",
)
METHODS = ("pqcache", "full")


def _reprefill(model, config, ids: torch.Tensor) -> tuple[float, float]:
    """A fresh PQCache's prefill of ids (1, S) -> (seconds to the first token, seconds until its PQ is built)."""
    from pqcache.engine.cache import PQCache
    from pqcache.serving.generate import prefill

    cache = PQCache(model, config)
    try:
        t0 = time.perf_counter()
        prefill(model, ids, cache).argmax(-1)
        first = time.perf_counter() - t0
        cache.wait()
        return first, time.perf_counter() - t0
    finally:
        cache.close()


@torch.no_grad()
def bench_conversation(
    model, tokenizer, seq_lens=(8192, 24576), turns: int = 6, max_new_tokens: int = 16, config=None
) -> tuple[list[dict], list[dict]]:
    """-> (a row per length and turn, a summary row per length)."""
    from pqcache.serving.answer import step_ms
    from pqcache.serving.conversation import Conversation
    from pqcache.serving.session import DocumentSession

    config = config or PQCacheConfig()
    device = next(model.parameters()).device
    model(_ids(tokenizer, 64).to(device), logits_to_keep=1)  # warm-up
    rows, summary = [], []
    for s in seq_lens:
        text = tokenizer.decode(_ids(tokenizer, s)[0], skip_special_tokens=True)
        session = DocumentSession(model, tokenizer, config, method="pqcache")
        session.load(text)
        per_turn = {t: {"seq_len": s, "turn": t + 1} for t in range(turns)}
        try:
            for method in METHODS:
                talk = Conversation(session, method)
                for t in range(turns):
                    question = QUESTIONS[t % len(QUESTIONS)]
                    before = (list(talk.ids), talk.question_ids(question))  # what a re-prefill of this turn reads
                    answer = talk.ask(question, max_new_tokens=max_new_tokens)
                    ms = step_ms(answer)
                    per_turn[t].update(
                        {
                            "tokens": session.n_tokens + len(before[0]),  # in the cache before the turn
                            f"{method}_ttft_s": round(answer.first_s, 3),
                            f"{method}_ms_tok": None if ms is None else round(ms, 1),
                        }
                    )
                    if method == "pqcache":
                        per_turn[t]["answer"] = answer.text.strip()[:24]
                        last = before
                talk.close()
            earlier, q_ids = last
            ids = torch.tensor([session.doc_ids + earlier], dtype=torch.long)
            first_s, ready_s = _reprefill(model, config, torch.cat([ids, q_ids], 1).to(device))
        finally:
            session.close()
        for t in range(turns):
            per_turn[t]["reprefill_ttft_s"] = None
        per_turn[0]["reprefill_ttft_s"] = round(session.prefill_s + per_turn[0]["pqcache_ttft_s"], 3)  # the load
        per_turn[turns - 1]["reprefill_ttft_s"] = round(first_s, 3)
        rows += per_turn.values()
        first, final = per_turn[0]["pqcache_ttft_s"], per_turn[turns - 1]["pqcache_ttft_s"]
        summary.append(
            {
                "seq_len": s,
                "document_prefill_s": round(session.prefill_s, 2),
                f"turn{turns}_over_turn1": round(final / first, 2),
                f"reprefill_over_turn{turns}": round(first_s / final, 1),
                "reprefill_pq_ready_s": round(ready_s, 2),
            }
        )
    return rows, summary
