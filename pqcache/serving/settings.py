"""The document form's settings: one dataclass for the app, its tests and the load test.

The values arrive as typed into the page (or sent through the Gradio API): numbers may come as
floats, strings or None. `to_config()` checks them and builds the PQCacheConfig; `values()` gives
them in the order of the app's `/load_document` endpoint (after the file and the pasted text).
No gradio here: the load test and the tests import it without a server.
"""

from __future__ import annotations

import math
from dataclasses import astuple, dataclass

from pqcache.engine.config import DEVICE_BLOCK_CACHE_TOKENS, PQCacheConfig, described
from pqcache.engine.errors import InputError, PQCacheConfigError
from pqcache.engine.instrument import Instrumentation

# The longest question the app takes (a flag: app.py --max-question-chars): a question is read in full for every
# answer, on one of the model's few slots; a long passage belongs in the document, where it is read once.
MAX_QUESTION_CHARS = 4000
ENCODINGS = ["utf-8", "cp1252", "latin-1", "utf-16"]  # offered for a text file; any codec name is accepted
TOO_LONG = ["refuse", "cut the middle"]  # what to do with a document longer than the model reads


def number(value, name: str, integer: bool = False):
    """A setting typed into the page (or sent through the API) as a finite number."""
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise PQCacheConfigError(f"{name} must be a number, got {value!r}") from None
    if not math.isfinite(x) or (integer and not x.is_integer()):
        raise PQCacheConfigError(f"{name} must be a {'whole ' if integer else ''}number, got {value!r}")
    return int(x) if integer else x


# the engine's names of the form's fields, as the page labels them (each field's label is declared with it,
# engine/config.py), and the model's head size as the form says it
LABELS = {name: spec.metadata["label"] for name, spec in described().items() if spec.metadata["label"]}
FORM_WORDS = {"invalid PQCacheConfig: ": "", **LABELS, "head_dim=": "head size "}
POLICIES = described()["cache_policy"].metadata["choices"]  # the block cache's evictions, as the form offers them


def in_form_words(message: str) -> str:
    """An engine's settings message with the form's field names in place of the engine's."""
    for name, label in FORM_WORDS.items():
        message = message.replace(name, label)
    return message


def check_question(question: str, max_chars: int | None = MAX_QUESTION_CHARS) -> None:
    """InputError for a question longer than `max_chars` characters (None: any length)."""
    if max_chars and len(question) > max_chars:
        raise InputError(
            f"the question is {len(question):,} characters long; questions here take at most {max_chars:,}: "
            "ask it in fewer words, or add a long passage to the document"
        )


@dataclass
class LoadSettings:
    """The load form, in the order of its fields on the page and in the API call."""

    method: str = "pqcache"
    m: object = 0  # sub-spaces; 0: chosen from the model's head size (sub-spaces of at most 64 dimensions)
    bits: object = 0  # per code; 0: chosen from the document's length
    budget: object = PQCacheConfig.token_budget  # a fraction of the document (1/10), or a count
    n_init: object = PQCacheConfig.n_init  # sink tokens
    n_local: object = 0  # recent window; 0: half of what the budget leaves after the sinks
    policy: str = "lfu"  # block-cache eviction
    # block cache (tokens), rounded down to whole blocks; set even on a CPU, where the engine's default is none: the
    # page's panel shows what it does on a GPU
    capacity: object = DEVICE_BLOCK_CACHE_TOKENS
    encoding: str | None = "utf-8"  # of an uploaded text file
    too_long: str = "refuse"  # or "cut the middle"
    mass: object = 0  # a budget in attention mass, in (0, 1]; 0: the fixed top-k
    completion: bool = False  # the unselected tokens' attention estimated from their codes

    def values(self) -> list:
        """The form's values in the order `/load_document` takes them."""
        return list(astuple(self))

    def to_config(
        self,
        pq_timeout_s: float | None = PQCacheConfig.pq_timeout_s,
        block_size: int = PQCacheConfig.block_size,
        kv_dtype: str = PQCacheConfig.kv_dtype,
    ) -> PQCacheConfig:
        """The engine's config; PQCacheConfigError in the form's own words, naming the field typed wrong. The block
        cache holds whole blocks of `block_size` tokens: its capacity is rounded down to a multiple of it."""
        from pqcache.engine.methods import METHODS

        def whole(value, name: str, least: int, meaning: str) -> int:
            x = number(value, name, True)
            if x < least:
                raise PQCacheConfigError(f"{name} must be {meaning}, got {x}")
            return x

        if self.method not in METHODS:
            raise PQCacheConfigError(f"method must be one of {', '.join(METHODS)}, got {self.method!r}")
        m = whole(self.m, "m", 0, "0 (chosen from the head size) or a whole number of sub-spaces")
        bits = whole(self.bits, "bits", 0, "0 (chosen from the length) or a whole number from 1 to 8")
        if bits > 8:
            raise PQCacheConfigError(
                f"bits must be 0 (chosen from the length) or a whole number from 1 to 8, got {bits}"
            )
        budget = number(self.budget, LABELS["token_budget"])
        if budget <= 0:
            raise PQCacheConfigError(
                f"{LABELS['token_budget']} must be above 0: a fraction like 0.1 or a count like 1024, got {budget:g}"
            )
        if budget > 1 and not budget.is_integer():
            raise PQCacheConfigError(
                f"{LABELS['token_budget']} {budget:g} is neither a fraction up to 1 nor a whole count of tokens"
            )
        n_init = whole(self.n_init, LABELS["n_init"], 0, "a whole number >= 0")
        n_local = whole(
            self.n_local, LABELS["n_local"], 0, "0 (half of what the budget leaves) or a whole number of tokens"
        )
        capacity = whole(self.capacity, LABELS["block_cache_tokens"], 0, "a whole number >= 0")
        if self.policy not in POLICIES:
            raise PQCacheConfigError(f"{LABELS['cache_policy']} must be {' or '.join(POLICIES)}, got {self.policy!r}")
        if self.too_long not in TOO_LONG:
            raise PQCacheConfigError(f"for a document longer than the model reads choose {' or '.join(TOO_LONG)}")
        mass = number(self.mass, LABELS["mass"])
        if not 0 <= mass <= 1:
            raise PQCacheConfigError(f"{LABELS['mass']} must be 0 (a fixed top-k) or a share up to 1, got {mass:g}")
        if budget > 1 and n_local and n_init + n_local > budget:
            sinks = f"{n_init} sink token" + ("s" if n_init != 1 else "")
            raise PQCacheConfigError(
                f"a token budget of {budget:g} tokens cannot hold {sinks} plus a window of {n_local}: "
                "raise the budget, or lower the sinks or the window"
            )
        try:
            return PQCacheConfig(
                m=m or None,
                bits=bits or None,
                token_budget=int(budget) if budget > 1 else budget,
                n_init=n_init,
                n_local=n_local or None,
                cache_policy=self.policy,
                block_size=block_size,
                block_cache_tokens=capacity // block_size * block_size,
                pq_timeout_s=pq_timeout_s,
                kv_dtype=kv_dtype,
                mass=mass or None,
                completion=bool(self.completion),
            )
        except PQCacheConfigError as exc:  # none expected past the checks above; if one is, in the form's words
            raise PQCacheConfigError(in_form_words(str(exc))) from None

    @property
    def text_encoding(self) -> str | None:
        """The codec for read_document: None for UTF-8 (with BOM detection)."""
        return None if self.encoding in (None, "", "utf-8") else self.encoding

    @property
    def truncate(self) -> str:
        """DocumentSession.load's `truncate`."""
        return "middle" if self.too_long == "cut the middle" else "refuse"


# What the app's live panels watch while an answer streams: the timeline of every step, and every 4th step's exact
# scores for the power-law and recall panels, within 5% of the answer's time (a sampled step of the bundled model at
# 8K costs about 10 ms, a quarter of a step: most of what watching costs, `bench app`'s observe share).
ANSWER_OBSERVER = dict(timeline=True, attention_every=4, recall_every=4, max_share=0.05)


def answer_observer() -> Instrumentation:
    """A new observer of one answer, as the app's Q&A tab attaches it."""
    return Instrumentation(**ANSWER_OBSERVER)


@dataclass(frozen=True)
class EngineSettings:
    """A load with the engine's whole config, as the command line gives it (`chat`: every engine flag), where the
    page sends its form (LoadSettings). The documents service takes either."""

    method: str
    config: PQCacheConfig
    truncate: str = "refuse"  # DocumentSession.load's: "refuse" a document longer than the model reads, or "middle"
