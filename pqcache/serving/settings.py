"""The document form's settings: one dataclass for the app, its tests and the load test.

The values arrive as typed into the page (or sent through the Gradio API): numbers may come as
floats, strings or None. `to_config()` checks them and builds the PQCacheConfig; `values()` gives
them in the order of the app's `/load_document` endpoint (after the file and the pasted text).
No gradio here: the load test and the tests import it without a server.
"""

from __future__ import annotations

import math
from dataclasses import astuple, dataclass

from pqcache.engine.config import DEVICE_BLOCK_CACHE_TOKENS, PQCacheConfig
from pqcache.engine.errors import PQCacheConfigError
from pqcache.engine.instrument import Instrumentation

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


@dataclass
class LoadSettings:
    """The load form, in the order of its fields on the page and in the API call."""

    method: str = "pqcache"
    m: object = 0  # sub-spaces; 0: chosen from the model's head size (sub-spaces of at most 64 dimensions)
    bits: object = 0  # per code; 0: chosen from the document's length
    budget: object = PQCacheConfig.token_budget  # a fraction of the document (1/10), or a count
    n_init: object = 32  # sink tokens
    n_local: object = 0  # recent window; 0: half of what the budget leaves after the sinks
    policy: str = "lfu"  # block-cache eviction
    # block cache (tokens), rounded down to whole blocks; set even on a CPU, where the engine's default is none: the
    # page's panel shows what it does on a GPU
    capacity: object = DEVICE_BLOCK_CACHE_TOKENS
    encoding: str | None = "utf-8"  # of an uploaded text file
    too_long: str = "refuse"  # or "cut the middle"

    def values(self) -> list:
        """The form's values in the order `/load_document` takes them."""
        return list(astuple(self))

    def to_config(
        self, pq_timeout_s: float | None = PQCacheConfig.pq_timeout_s, block_size: int = PQCacheConfig.block_size
    ) -> PQCacheConfig:
        """The engine's config (PQCacheConfigError names the field typed wrong). The block cache holds whole
        blocks of `block_size` tokens: its capacity is rounded down to a multiple of it."""
        budget = number(self.budget, "token budget")
        return PQCacheConfig(
            m=number(self.m, "m", True) or None,
            bits=number(self.bits, "bits", True) or None,
            token_budget=int(budget) if budget > 1 else budget,
            n_init=number(self.n_init, "sink tokens", True),
            n_local=number(self.n_local, "window", True) or None,
            cache_policy=self.policy,
            block_size=block_size,
            block_cache_tokens=number(self.capacity, "block cache", True) // block_size * block_size,
            pq_timeout_s=pq_timeout_s,
        )

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
