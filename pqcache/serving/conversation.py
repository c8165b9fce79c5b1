"""A conversation over a cached document: a chain of turns on one cache, each continuing the one that holds the
earlier turns' questions and answers, so a follow-up sees what was asked and answered before it; nothing is read
twice.

    conversation = Conversation(session, "pqcache")  # on a loaded DocumentSession; its prefill is kept there
    conversation.ask("What is the default quality setting of cjpeg?").text
    conversation.ask("What is the range of that setting?").text     # sees the first turn
    branch = conversation.fork()                     # a copy that goes its own way
    conversation.add_document(text, "second.txt")    # read once into this conversation, asked about next
    conversation.reset()                             # back to the document alone

A turn's question is read as one chunk after the cache (short ones take codes from the existing centroids; one of at
least `turn_min_tokens`, an added document, gets a K-Means codebook of its own, built in the background as the
prefill's: PQIndex's segments), then the answer is decoded into the same cache. The cache then holds the answer as
the model produced it: its kept tokens, and (where the stop rule ended it on a stop text) the part of that text it had
already read; the transcript of record is `ids`, every token after the document. A conversation that would pass the
model's positions raises ConversationFullError before it reads anything; a read stopped (or failed) between layers
sends the conversation back to the document, as its cache no longer holds one text.
"""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass, field

import torch

from pqcache.engine.errors import Cancelled, InputError, NoDocumentError
from pqcache.engine.instrument import Instrumentation
from pqcache.engine.sources import AttentionTally
from pqcache.serving.answer import Answer
from pqcache.serving.generate import decode_n_tokens, decode_one_token, eos_token_ids, prefill, prefill_document
from pqcache.serving.hooks import layer_hooks


class ConversationFullError(InputError):
    """The next turn would pass the model's positions: a new conversation is needed."""


@dataclass
class Turn:
    kind: str  # "question" or "document"
    text: str  # the question as asked, or the added document's name
    answer: str = ""
    tokens: int = 0  # tokens this turn added to the cache (its question or document part, and its answer)


@dataclass
class AddedDocument:
    """A document read into a conversation: its name and text, where its tokens start in the conversation's
    positions, and each token's character range in the text (its answers' sources are found there)."""

    name: str
    text: str
    start: int
    after_question: bool  # read in the user's next turn (a question came before it), not straight after the first
    spans: list = field(default_factory=list)

    def part(self, prompt) -> str:
        """What was read: the text in its frame."""
        return prompt.added_document(self.text) if self.after_question else "\n\n" + self.text.strip()


@dataclass
class Conversation:
    session: object  # the DocumentSession whose document this conversation is about
    method: str
    cache: object = None  # a fork of the document's cache, grown by every turn
    turns: list[Turn] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)  # every token read after the document, in order
    open_user_turn: bool = False  # an added document was read into a user turn the next question closes
    # what was read into the cache, in order: ("ask" | "document" | "tell", ids) for a chunk (a question, an added
    # document, a turn with its given answer), ("fed", ids) for decoded tokens read one at a time: replaying it
    # rebuilds the same cache (record, replay)
    log: list = field(default_factory=list)
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:16])  # its name in the document store
    added: list[AddedDocument] = field(default_factory=list)  # the documents read in after the first

    def __post_init__(self):
        if self.cache is None:
            if self.session.cache is None:
                raise NoDocumentError("load a document first")
            self.session.ensure_queries(self.method)
            self.cache = self.session.cache.fork(self.method)

    # ---- what it holds -----------------------------------------------------------------------------------
    @property
    def n_tokens(self) -> int:
        """Tokens in the cache: the document's and every turn's."""
        return self.session.n_tokens + len(self.ids)

    @property
    def limit(self) -> int | None:
        config = self.session.model.config.get_text_config(decoder=True)
        return getattr(config, "max_position_embeddings", None)

    def _check_room(self, n_new: int, what: str):
        if self.limit and self.n_tokens + n_new > self.limit:
            raise ConversationFullError(
                f"this conversation holds {self.n_tokens:,} tokens; {what} needs {n_new:,} more and the model reads "
                f"at most {self.limit:,}: start a new conversation (the document stays loaded)"
            )

    def _read(self, ids: torch.Tensor, stop: threading.Event | None, kind: str, progress=None) -> torch.Tensor | None:
        """ids (1, Q) read into the cache -> the next token's logits (1, V); the tokens kept in `ids`, the read in
        `log` as `kind` ("ask", "document" or "tell"). A document is read as a load reads one (prefill_document:
        progress(fraction, words) per layer, then its codebook) into a fork of the cache, taken once read: stopped
        or failed, the conversation stays as it was (no logits are kept for it: a question follows)."""
        session, device = self.session, self.session.device
        if kind == "document":
            cache = self.cache.fork(self.method)
            try:
                prefill_document(session.model, ids.to(device), cache, session.lock, progress, stop)
            except BaseException:
                cache.close()
                raise
            self.cache.close()
            self.cache, logits = cache, None
        else:
            try:
                with session.lock, layer_hooks(session.model, None, stop):
                    logits = prefill(session.model, ids.to(device), self.cache)
            except BaseException:  # stopped or failed between layers: the cache is not one text any more
                self.reset()
                raise
        self.ids.extend(int(t) for t in ids[0])
        self.log.append((kind, [int(t) for t in ids[0]]))
        return logits

    def split_tiers(self):
        """The budget follows the conversation: sinks, top-k and window split anew for its length, each question."""
        for layer in self.cache.pq_layers:
            layer.split_tiers()

    def question_ids(self, question: str) -> torch.Tensor:
        """(1, Q): what ask(question) reads after the cache (the first question's part, or a follow-up's)."""
        prompt = self.session.prompt
        if any(t.kind == "question" for t in self.turns):
            return prompt.ids(prompt.follow_up(question, self.open_user_turn))
        return prompt.question_ids(question)

    # ---- turns ---------------------------------------------------------------------------------------------
    @torch.no_grad()
    def ask(
        self,
        question: str,
        method: str | None = None,
        max_new_tokens: int = 64,
        stop: threading.Event | None = None,
        observer: Instrumentation | None = None,
        on_token=None,
    ):
        """Answer `question` with every earlier turn in view; the turn is kept. Returns a session Answer (`method`:
        the conversation's own; another one raises, as the cache holds this method's state)."""
        if method not in (None, self.method):
            raise InputError(f"this conversation runs {self.method}; start a new one for {method}")
        if not question or not question.strip():
            raise InputError("the question is empty")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise InputError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        prompt, session = self.session.prompt, self.session
        q_ids = self.question_ids(question)
        self._check_room(q_ids.shape[1] + max_new_tokens, "this question and its answer")
        before = len(self.ids)
        self.split_tiers()
        self.cache.instrument(observer)
        tally = self.cache.tally_sources(AttentionTally(self.n_tokens))  # sources in any of its documents
        answer, t0 = Answer(), time.perf_counter()

        def show(tokens):
            answer.tokens = tokens
            answer.text = session.tokenizer.decode(tokens, skip_special_tokens=True)
            answer.seconds = time.perf_counter() - t0
            answer.first_s = answer.first_s or answer.seconds
            if on_token is not None:
                on_token(answer)

        try:
            try:
                logits = self._read(q_ids, stop, "ask")
            except Cancelled:  # stopped while reading the question: the conversation went back to the document
                answer.stopped, answer.ended, answer.done = True, "stopped", True
                return answer
            else:
                self.open_user_turn = False
                eos = eos_token_ids(session.model, session.tokenizer)
                decoded = decode_n_tokens(
                    session.model,
                    logits,
                    self.cache,
                    max_new_tokens,
                    eos,
                    show,
                    stop=stop,
                    lock=session.lock,
                    stop_rule=prompt.stop_rule(),
                )
                answer.tokens, answer.stopped, answer.ended = decoded.tokens, decoded.stopped, decoded.ended
                answer.generated = decoded.generated
                answer.text = session.tokenizer.decode(answer.tokens, skip_special_tokens=True)
                self.ids.extend(decoded.fed)
                self.log.append(("fed", list(decoded.fed)))
            answer.seconds = time.perf_counter() - t0
        finally:
            session.last_stats = self.cache.stats()
            self.cache.instrument(None)
            self.cache.tally_sources(None)
        self.turns.append(Turn("question", question, answer.text, len(self.ids) - before))
        spans = session.spans()
        from pqcache.serving.sources import highlights, passages_in

        received = tally.received
        documents = [(None, session.doc_text, spans, received[: session.n_tokens])]
        documents += [(a.name, a.text, a.spans, received[a.start : a.start + len(a.spans)]) for a in self.added]
        answer.sources = passages_in(documents)
        answer.attended, answer.missed = highlights(spans, tally)  # the document view shows the first document
        answer.done = True
        return answer

    @torch.no_grad()
    def tell(self, question: str, answer: str, stop: threading.Event | None = None):
        """Keep a turn whose answer is given, not generated (SCBench's multi-turn mode: each turn sees the earlier
        turns' golden answers): its question part and the answer are read into the cache, nothing is decoded."""
        prompt = self.session.prompt
        asked = any(t.kind == "question" for t in self.turns)
        part = prompt.follow_up(question, self.open_user_turn) if asked else prompt.question(question)
        ids = prompt.ids(part + " " + answer.strip())
        self._check_room(ids.shape[1], "this turn")
        self._read(ids, stop, "tell")
        self.open_user_turn = False
        self.turns.append(Turn("question", question, answer.strip(), int(ids.shape[1])))

    @torch.no_grad()
    def add_document(
        self, text: str, name: str = "a document", stop: threading.Event | None = None, progress=None
    ) -> int:
        """Read another document into the conversation (once, with a K-Means codebook of its own when it is at least
        `turn_min_tokens` long), to be asked about next, beside the first. Returns its tokens. progress(fraction,
        words) per layer, as a load's; a Stop (Cancelled) or a failure leaves the conversation as it was."""
        from pqcache.serving.documents import check_text

        check_text(text)
        prompt = self.session.prompt
        asked = any(t.kind == "question" for t in self.turns)
        added = AddedDocument(name, text, self.n_tokens, asked)
        ids = prompt.ids(added.part(prompt))
        self._check_room(ids.shape[1] + 1, f"{name} ({ids.shape[1]:,} tokens)")
        self._read(ids, stop, "document", progress)
        added.spans = prompt.part_spans(added.part(prompt), text)
        self.added.append(added)
        self.open_user_turn = True
        self.turns.append(Turn("document", name, tokens=int(ids.shape[1])))
        return int(ids.shape[1])

    # ---- branches --------------------------------------------------------------------------------------------
    def fork(self) -> Conversation:
        """A copy of the conversation so far that goes its own way (the document's tiers are shared)."""
        turns = [Turn(**vars(t)) for t in self.turns]
        cache = self.cache.fork(self.method)
        return Conversation(
            self.session,
            self.method,
            cache,
            turns,
            list(self.ids),
            self.open_user_turn,
            list(self.log),
            added=list(self.added),
        )

    def reset(self):
        """Back to the document alone (its prefill kept)."""
        self.cache.close()
        self.cache = self.session.cache.fork(self.method)
        self.turns, self.ids, self.log, self.open_user_turn, self.added = [], [], [], False, []

    # ---- kept and read back -----------------------------------------------------------------------------------
    def record(self) -> dict:
        """The conversation as plain data (the document store keeps it beside the document's entry)."""
        turns = [vars(t) for t in self.turns]
        added = [{k: v for k, v in vars(a).items() if k != "spans"} for a in self.added]
        return {
            "id": self.id,
            "method": self.method,
            "turns": turns,
            "log": self.log,
            "open": self.open_user_turn,
            "added": added,
        }

    @classmethod
    @torch.no_grad()
    def replay(cls, session, record: dict, stop: threading.Event | None = None) -> Conversation:
        """A recorded conversation on `session` (the same document): its reads and its decoded tokens run again in
        the same order through the same calls, so its cache is the cache the turns left, and the next answer is the
        one it would have been."""
        talk = cls(session, record["method"], id=record["id"])
        try:
            for kind, ids in record["log"]:
                if kind != "fed":  # a chunk, read as ask, add_document and tell read it
                    if kind == "ask":
                        talk.split_tiers()
                    talk._read(torch.tensor([ids]), stop, kind)
                    if kind == "document":
                        talk.cache.wait()
                    continue
                with layer_hooks(session.model, None, stop):
                    for tid in ids:
                        with session.lock:
                            decode_one_token(session.model, torch.tensor([[tid]], device=session.device), talk.cache)
                        talk.ids.append(tid)
                talk.log.append(("fed", list(ids)))
        except BaseException:
            talk.close()
            raise
        talk.turns = [Turn(**t) for t in record["turns"]]
        talk.open_user_turn = record["open"]
        for kept in record.get("added", []):  # their sources' places, found again (a record kept before has none)
            added = AddedDocument(**kept)
            added.spans = session.prompt.part_spans(added.part(session.prompt), added.text)
            talk.added.append(added)
        return talk

    def close(self):
        if self.cache is not None:
            self.cache.close()
        self.cache = None

    @property
    def last_stats(self):
        return self.session.last_stats
