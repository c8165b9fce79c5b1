"""A document session: prefill a document once, then answer questions about it with any method.

Each question continues a fork of the prefilled document cache (so questions do not see each
other), runs as one chunk (see layer.py: a chunk picks one top-k set), and decodes greedily. The
app drives this from a worker thread and reads the observer's data while tokens stream.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch

from .cache import PQCache
from .config import PQCacheConfig
from .instrument import Instrumentation



@dataclass
class Answer:
    text: str = ""
    tokens: list[int] = field(default_factory=list)
    seconds: float = 0.0
    done: bool = False
    stopped: bool = False


class DocumentSession:
    def __init__(self, model, tokenizer, config: PQCacheConfig | None = None, method: str = "pqcache"):
        self.model, self.tokenizer = model, tokenizer
        self.config = config or PQCacheConfig()
        self.method = method
        self.cache: PQCache | None = None
        self.n_tokens = 0
        self.prefill_s = 0.0
        self.prefill_obs: Instrumentation | None = None
        self.lock = threading.Lock()  # one forward at a time through the model

    @property
    def device(self):
        return next(self.model.parameters()).device

    @torch.no_grad()
    def load(self, text: str, progress=None) -> dict:
        """Prefill `text` (progress(fraction, message) per layer and per clustered layer)."""
        if not text or not text.strip():
            raise ValueError("the document is empty")
        ids = self.tokenizer(text, return_tensors="pt").input_ids.to(self.device)
        limit = getattr(self.model.config.get_text_config(decoder=True), "max_position_embeddings", None)
        if limit and ids.shape[1] + 512 > limit:  # room left for the question and the answer
            raise ValueError(f"the document has {ids.shape[1]} tokens; this model reads at most {limit} "
                             f"(including the question and answer): shorten the document")
        cache = PQCache(self.model, self.config, method=self.method, keep_queries=True)
        obs = cache.instrument(timeline=True)
        n_layers = len(cache.layers)
        hooks = []
        if progress is not None:
            for module in self.model.modules():
                idx = getattr(getattr(module, "self_attn", None), "layer_idx", None)
                if idx is not None:
                    hooks.append(module.register_forward_hook(
                        lambda m, a, o, idx=idx: progress(0.9 * (idx + 1) / n_layers,
                                                          f"prefill: {ids.shape[1]} tokens, layer {idx + 1}/{n_layers}")))
        try:
            with self.lock:
                t0 = time.perf_counter()
                self.model(ids, cache=cache, logits_to_keep=1)
                self.prefill_s = time.perf_counter() - t0
        finally:
            for h in hooks:
                h.remove()
        for i, layer in enumerate(cache.pq_layers):
            if progress is not None:
                progress(0.9 + 0.1 * i / max(1, len(cache.pq_layers)), f"clustering layer {layer.layer_idx}")
            layer.wait_pq()
        self.cache, self.n_tokens, self.prefill_obs = cache, int(ids.shape[1]), obs
        self.doc_ids = ids[0].tolist()
        return {"tokens": self.n_tokens, "prefill_s": self.prefill_s, **cache.stats()}

    @torch.no_grad()
    def ask(self, question: str, method: str | None = None, max_new_tokens: int = 64,
            stop: threading.Event | None = None, observer: Instrumentation | None = None, on_token=None) -> Answer:
        """Answer `question` about the loaded document; on_token(answer) after each token."""
        if self.cache is None:
            raise ValueError("load a document first")
        if not question or not question.strip():
            raise ValueError("the question is empty")
        cache = self.cache.fork(method or self.method)
        if observer is not None:
            cache.instrument(observer)
        q_ids = self.tokenizer("\n\n" + question.strip(), add_special_tokens=False, return_tensors="pt").input_ids
        eos = self.model.generation_config.eos_token_id
        eos = set(eos if isinstance(eos, list) else [eos]) | {self.tokenizer.eos_token_id}
        answer = Answer()
        t0 = time.perf_counter()
        try:
            with self.lock:
                logits = self.model(q_ids.to(self.device), cache=cache, logits_to_keep=1).logits[:, -1]
            for _ in range(max_new_tokens):
                if stop is not None and stop.is_set():
                    answer.stopped = True
                    break
                token = int(logits.argmax(-1))
                if token in eos:
                    break
                answer.tokens.append(token)
                answer.text = self.tokenizer.decode(answer.tokens, skip_special_tokens=True)
                answer.seconds = time.perf_counter() - t0
                if on_token is not None:
                    on_token(answer)
                if len(answer.tokens) == max_new_tokens:
                    break
                with self.lock:
                    logits = self.model(torch.tensor([[token]], device=self.device), cache=cache).logits[:, -1]
        finally:
            self.last_stats = cache.stats()
            cache.close()
        answer.seconds = time.perf_counter() - t0
        answer.done = True
        return answer
