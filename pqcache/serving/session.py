"""A document session: prefill a document once, then answer questions about it with any method.

Each question continues a fork of the prefilled document cache (so questions do not see each
other), runs as one chunk after it, and decodes greedily until the answer ends. The prompt builder
(pqcache.serving.prompt) gives the document part (cached, the same for every question) and the question part. The
app drives this from a worker thread and reads the observer's data while tokens stream.

The model may be shared by several sessions on several threads: per-layer hooks (progress, stop)
act only on the thread that installed them. A set `stop` event ends a prefill (at the next layer),
the clustering wait, or a generation (at the next token); a stopped prefill frees its cache.
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import torch

from pqcache.engine.cache import PQCache
from pqcache.engine.config import PQCacheConfig
from pqcache.engine.errors import Cancelled, DocumentTooLongError, InputError, NoDocumentError
from pqcache.engine.instrument import Instrumentation
from pqcache.engine.methods import make_method
from pqcache.engine.sources import AttentionTally
from pqcache.serving.answer import Answer
from pqcache.serving.documents import check_text
from pqcache.serving.footprint import document_bytes, read_queries
from pqcache.serving.generate import decode_n_tokens, eos_token_ids, prefill, prefill_document
from pqcache.serving.hooks import layer_hooks
from pqcache.serving.prompt import PromptBuilder
from pqcache.serving.restore import LoadedCache, load_or_restore
from pqcache.serving.sources import highlights, passages

ANSWER_ROOM = 512  # tokens kept free for the question and the answer


def truncate_middle(ids: torch.Tensor, max_tokens: int) -> torch.Tensor:
    """ids (1, S) -> (1, max_tokens): the first and last halves kept, the middle cut (as LongBench)."""
    head = max_tokens // 2
    return torch.cat([ids[:, :head], ids[:, ids.shape[1] - (max_tokens - head) :]], dim=1)


class DocumentSession:
    def __init__(
        self,
        model,
        tokenizer,
        config: PQCacheConfig | None = None,
        method: str = "pqcache",
        max_tokens: int | None = None,
        keep_queries: bool = False,
        store=None,
    ):
        """max_tokens: the longest document accepted (default: what the model reads, less ANSWER_ROOM). The load keeps
        the prefill's queries only for a method that starts from them (SnapKV, PyramidKV, H2O, InfLLM: 4x the keys'
        bytes for the bundled model); a question with such a method on a document loaded without them reads the
        document once more for them (ensure_queries). keep_queries: keep them at load whatever the method (a caller
        that will ask with several methods, as the Teaching tab does). store: a DocumentStore (serving/store.py) that
        a load reads its cache from when it holds this text for this model and settings, and saves it to otherwise."""
        self.model, self.tokenizer, self.max_tokens = model, tokenizer, max_tokens
        self.prompt = PromptBuilder(tokenizer)  # the document part is cached, each question runs after it
        self.config, self.method, self.keep_queries, self.store = config or PQCacheConfig(), method, keep_queries, store
        self.read_from, self.read_s = "prefill", 0.0  # how the loaded document was read, and in how long
        self.store_key = None  # the loaded document's entry in the store, when it has one
        self.cache: PQCache | None = None
        self.n_tokens, self.prefill_s = 0, 0.0
        self.prefill_obs: Instrumentation | None = None
        self.truncated: tuple[int, int] | None = None  # (tokens kept, document tokens) after a middle cut
        self.last_stats: dict | None = None
        self.lock = threading.Lock()  # one forward at a time through the model

    @property
    def device(self):
        return next(self.model.parameters()).device

    @property
    def max_document_tokens(self) -> int | None:
        limit = getattr(self.model.config.get_text_config(decoder=True), "max_position_embeddings", None)
        limit = None if not limit else max(1, limit - ANSWER_ROOM)
        return min(filter(None, [limit, self.max_tokens]), default=None)

    def estimate_bytes(self, n_tokens: int) -> int:
        """Bytes a prefill of n_tokens will hold: an upper bound of nbytes() after it (footprint.py)."""
        return document_bytes(self.model, self.config, self.method, n_tokens, self.device, self.keep_queries)

    @torch.no_grad()
    def load(
        self, text: str, progress=None, stop: threading.Event | None = None, truncate: str = "refuse", reserve=None
    ) -> dict:
        """Prefill `text` (progress(fraction, message) per layer and per clustered layer).

        A document longer than the model reads raises DocumentTooLongError, or with truncate="middle"
        keeps its first and last halves. A set `stop` raises Cancelled and frees the partial cache.
        reserve(nbytes) is called before the prefill (a SessionPool makes room or raises)."""
        if truncate not in ("refuse", "middle"):
            raise InputError(f"truncate must be 'refuse' or 'middle', got {truncate!r}")
        check_text(text)
        ids = self.prompt.document_ids(text).to(self.device)
        n_doc, limit = int(ids.shape[1]), self.max_document_tokens
        if limit and n_doc > limit:
            if truncate == "refuse":
                raise DocumentTooLongError(
                    f"the document has {n_doc} tokens; at most {limit} fit (with room for the "
                    "question and answer): shorten it, or choose to cut its middle",
                    n_doc,
                    limit,
                )
            ids = truncate_middle(ids, limit)
        cache = PQCache(self.model, self.config, method=self.method, keep_queries=self.keep_queries)  # checks config
        try:
            if reserve is not None:  # a pool makes room (the user's previous document stays while it fits) or refuses
                reserve(self.estimate_bytes(int(ids.shape[1])))
        except BaseException:
            cache.close()
            raise
        self.close()  # the new document replaces the old one
        observed, timed = [], []

        def from_text() -> PQCache:
            observed.append(cache.instrument(timeline=True))
            try:
                timed.append(prefill_document(self.model, ids, cache, self.lock, progress, stop))
            except BaseException:
                cache.close()
                raise
            return cache

        truncated = (int(ids.shape[1]), n_doc) if ids.shape[1] < n_doc else None
        args = (self.model, self.tokenizer, self.config, self.method, self.keep_queries, ids[0].tolist())
        loaded = load_or_restore(self.store, *args, from_text, text, truncated)
        if loaded.cache is not cache:  # read back from the store: no prefill, no K-Means
            cache.close()
        if timed:  # the prefill's own seconds, without the wait for the model's lock
            loaded = replace(loaded, seconds=timed[0])
        self.store_key = loaded.key
        return self._loaded(loaded, ids, n_doc, truncated, text, observed[0] if observed else None)

    def _loaded(self, loaded: LoadedCache, ids, n_doc: int, truncated, text: str, obs=None) -> dict:
        """The loaded document's state, and load()'s answer: tokens, how it was read and the cache's figures."""
        cache, seconds = loaded.cache, loaded.seconds
        self.cache, self.n_tokens = cache, int(ids.shape[1])
        self.prefill_obs = obs if obs is not None else cache.instrument(timeline=True)
        self.prefill_s = seconds if loaded.read_from == "prefill" else 0.0
        self.read_from, self.read_s = loaded.read_from, seconds
        self.doc_ids = ids[0].tolist()
        self.truncated = truncated
        self.doc_text, self._spans = text, None
        self.spans()  # each position's characters, for the answers' sources (a second tokenization, with offsets)
        info = {"tokens": self.n_tokens, "document_tokens": n_doc, "prefill_s": self.prefill_s}
        return {**info, "from": loaded.read_from, "read_s": seconds, "store_note": loaded.note, **cache.stats()}

    def ensure_queries(self, method, stop: threading.Event | None = None) -> float:
        """Give the loaded document its prefill queries if `method` starts from them and the load kept none
        (footprint.read_queries). Returns the seconds it took (0.0: nothing to do)."""
        layers = self.cache.pq_layers
        if not make_method(method).needs_prefill_queries or all(layer.prefill_q is not None for layer in layers):
            return 0.0
        t0 = time.perf_counter()
        with self.lock, layer_hooks(self.model, None, stop):
            read_queries(self.model, self.config, torch.tensor([self.doc_ids], device=self.device), layers)
        return time.perf_counter() - t0

    def spans(self) -> list[tuple[int, int]]:
        """Each cached document position's character range in the document's text ((0, 0): no text)."""
        if self._spans is None:
            spans = self.prompt.document_spans(self.doc_text)
            if self.truncated:  # the middle was cut: the first and last halves of the positions remain
                head = self.n_tokens // 2
                spans = spans[:head] + spans[len(spans) - (self.n_tokens - head) :]
            self._spans = spans
        return self._spans

    def nbytes(self) -> int:
        """Host + device bytes held by the loaded document's cache (0 when none)."""
        if self.cache is None:
            return 0
        stats = self.cache.stats()
        return stats["device_kv_bytes"] + stats["host_kv_bytes"] + stats["pq_bytes"] + stats["query_bytes"]

    def close(self):
        """Free the document cache (the session can load another document)."""
        if self.cache is not None:
            self.cache.close()
        self.cache, self.prefill_obs, self.n_tokens, self.store_key = None, None, 0, None
        self.last_stats = None  # an answer's statistics belong to the document it answered

    @torch.no_grad()
    def ask(
        self,
        question: str,
        method: str | None = None,
        max_new_tokens: int = 64,
        stop: threading.Event | None = None,
        observer: Instrumentation | None = None,
        on_token=None,
    ) -> Answer:
        """Answer `question` about the loaded document; on_token(answer) after each token."""
        if self.cache is None:
            raise NoDocumentError("load a document first")
        if not question or not question.strip():
            raise InputError("the question is empty")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise InputError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        reread_s = self.ensure_queries(method or self.method, stop)
        cache = self.cache.fork(method or self.method)
        if observer is not None:
            cache.instrument(observer)
        tally = cache.tally_sources(AttentionTally(self.n_tokens))
        q_ids = self.prompt.question_ids(question)
        answer = Answer(reread_s=reread_s)
        t0 = time.perf_counter()

        def show(tokens):
            answer.tokens = tokens
            answer.text = self.tokenizer.decode(tokens, skip_special_tokens=True)
            answer.seconds = time.perf_counter() - t0
            answer.first_s = answer.first_s or answer.seconds
            if on_token is not None:
                on_token(answer)

        try:
            try:
                with self.lock, layer_hooks(self.model, None, stop):
                    logits = prefill(self.model, q_ids.to(self.device), cache)
            except Cancelled:  # stopped while reading the question
                answer.stopped, answer.ended = True, "stopped"
            else:  # the next token's check of `stop` ends the answer (Stop halts at the next token)
                eos = eos_token_ids(self.model, self.tokenizer)
                rule = self.prompt.stop_rule()
                decoded = decode_n_tokens(
                    self.model, logits, cache, max_new_tokens, eos, show, stop=stop, lock=self.lock, stop_rule=rule
                )
                answer.tokens, answer.stopped, answer.ended = decoded.tokens, decoded.stopped, decoded.ended
                answer.generated = decoded.generated
                answer.text = self.tokenizer.decode(answer.tokens, skip_special_tokens=True)
            answer.seconds = time.perf_counter() - t0  # the answer's time: what follows is bookkeeping
        finally:
            self.last_stats = cache.stats()
            cache.close()
        spans = self.spans()
        answer.sources = [p.to_dict() for p in passages(self.doc_text, spans, tally.received)]
        answer.attended, answer.missed = highlights(spans, tally)
        answer.done = True
        return answer
