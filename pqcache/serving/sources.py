"""An answer's sources: the passages of the document that its attention read most.

An AttentionTally (pqcache.engine.sources) gives the attention each document token received while the answer was
generated. Here those weights become passages a person can check: the document is cut into segments (a line, or a
sentence of a long line, at most MAX_CHARS characters), each segment gets the attention of the tokens that start in
it, and the segments that got the most are the sources, with their character range in the document and their share
of the attention the document's text received. Adjacent chosen segments are merged while the merge stays within
MAX_CHARS.

The first token (BOS) has no text and the attention it absorbs (an "attention sink") is no one's source; the
other sink tokens are text and count like any other.
"""

from __future__ import annotations

import bisect
import re
from dataclasses import asdict, dataclass

import torch

MAX_CHARS = 300  # the longest passage shown
N_SOURCES = 3  # passages returned for an answer
MAX_HIGHLIGHTS = 400  # tokens the document view marks (the most attended, and the most often missed)
_BREAK = re.compile(r"\n|(?<=[.!?;:])\s+")  # a line end, or a sentence end followed by a space


@dataclass
class Source:
    start: int  # character range in the document: text[start:end]
    end: int
    text: str
    share: float  # of the attention the document's text received

    def to_dict(self) -> dict:
        return asdict(self)


def token_spans(tokenizer, text: str, add_special_tokens: bool = True) -> list[tuple[int, int]]:
    """The character range of each token of `tokenizer(text)` in text ((0, 0) for special tokens). A fast tokenizer
    says it (offsets mapping); for others each token's text is looked for after the previous one's."""
    try:
        enc = tokenizer(text, add_special_tokens=add_special_tokens, return_offsets_mapping=True)
        return [tuple(span) for span in enc["offset_mapping"]]
    except (TypeError, KeyError, NotImplementedError, ValueError):
        pass
    ids = tokenizer(text, add_special_tokens=add_special_tokens).input_ids
    ids = ids[0] if ids and isinstance(ids[0], list) else ids
    spans, cursor = [], 0
    for tid in ids:
        piece = tokenizer.decode([int(tid)], skip_special_tokens=True).strip()
        at = text.find(piece, cursor) if piece else -1
        spans.append((at, at + len(piece)) if at >= 0 else (cursor, cursor))
        cursor = at + len(piece) if at >= 0 else cursor
    return spans


def segments(text: str, max_chars: int = MAX_CHARS) -> list[tuple[int, int]]:
    """The document cut into lines, long lines into sentences, long sentences into pieces of at most max_chars
    (at a space where there is one): (start, end) character ranges covering every non-blank character."""
    out = []
    starts = [0] + [m.end() for m in _BREAK.finditer(text)]
    ends = [m.start() for m in _BREAK.finditer(text)] + [len(text)]
    for lo, hi in zip(starts, ends):
        while lo < hi and text[lo].isspace():
            lo += 1
        while hi > lo and text[hi - 1].isspace():
            hi -= 1
        while hi - lo > max_chars:
            cut = text.rfind(" ", lo + 1, lo + max_chars)
            cut = cut if cut > lo else lo + max_chars
            out.append((lo, cut))
            lo = cut + 1 if text[cut : cut + 1] == " " else cut
        if hi > lo:
            out.append((lo, hi))
    return out


def passages(
    text: str,
    spans: list[tuple[int, int]],
    received: torch.Tensor,
    n: int = N_SOURCES,
    max_chars: int = MAX_CHARS,
    total: float | None = None,
) -> list[Source]:
    """The n segments of `text` whose tokens received the most attention, highest share first. spans: each
    document position's character range (a token without text: (0, 0)); received (positions,) the attention by
    position (AttentionTally.received). total: the attention the shares are of (None: what this text received)."""
    cuts, mass = _segment_mass(text, spans, received, max_chars)
    total = sum(mass) if total is None else total
    if total <= 0:
        return []
    runs: list[list[int]] = []  # adjacent segments merged while they fit in max_chars, best segments first
    for i in sorted(range(len(cuts)), key=lambda i: -mass[i]):
        if mass[i] <= 0:
            break
        run = next((r for r in runs if (r[0] == i + 1 or r[-1] == i - 1) and _span(cuts, r, i) <= max_chars), None)
        if run is not None:
            run.insert(0, i) if run[0] == i + 1 else run.append(i)
        elif len(runs) < n:
            runs.append([i])
        else:
            break
    out = []
    for run in runs:
        lo, hi = cuts[run[0]][0], cuts[run[-1]][1]
        out.append(Source(lo, hi, text[lo:hi], round(sum(mass[i] for i in run) / total, 4)))
    return sorted(out, key=lambda s: -s.share)


def _segment_mass(text: str, spans, received: torch.Tensor, max_chars: int) -> tuple[list, list[float]]:
    """The segments of `text` and the attention the tokens starting in each received."""
    weights = received.double().tolist()
    cuts = segments(text, max_chars)
    starts = [lo for lo, _ in cuts]
    mass = [0.0] * len(cuts)
    for (lo, hi), w in zip(spans, weights):
        if hi <= lo or w <= 0:  # no text: BOS, padding
            continue
        i = bisect.bisect_right(starts, lo) - 1
        if i >= 0:
            mass[i] += w
    return cuts, mass


def passages_in(documents: list[tuple], n: int = N_SOURCES) -> list[dict]:
    """The n passages that received the most attention across a conversation's documents, [(name, text, spans,
    received)], the first the loaded one (name None); each share is of the attention all their text received, and a
    passage of an added document carries its name ("document"). One document: passages()' own."""
    if len(documents) == 1:
        _, text, spans, received = documents[0]
        return [p.to_dict() for p in passages(text, spans, received, n)]
    total = sum(sum(_segment_mass(text, spans, received, MAX_CHARS)[1]) for _, text, spans, received in documents)
    found = []
    for name, text, spans, received in documents:
        for p in passages(text, spans, received, n, total=total):
            found.append({**p.to_dict(), **({"document": name} if name else {})})
    return sorted(found, key=lambda s: -s["share"])[:n]


def _span(cuts, run: list[int], i: int) -> int:
    """Characters from the first to the last of `run` with segment i added."""
    return max(cuts[run[-1]][1], cuts[i][1]) - min(cuts[run[0]][0], cuts[i][0])


def highlights(spans: list[tuple[int, int]], tally, most: int = MAX_HIGHLIGHTS) -> tuple[list[list], list[list]]:
    """What the document view marks for an answer, as plain data: ([start, end, weight] of the `most` tokens that
    received the most attention, weight relative to the most; [start, end] of the tokens of the exact top-k the
    selection did not attend to, the most often missed first)."""
    received, missed = tally.received, tally.missed
    has_text = torch.tensor([hi > lo for lo, hi in spans] + [False] * (len(received) - len(spans)))[: len(received)]
    received = received.masked_fill(~has_text, 0)
    top = received.topk(min(most, int((received > 0).sum()))).indices.tolist() if len(received) else []
    peak = float(received.max()) if top else 1.0
    attended = [[*spans[i], round(float(received[i]) / peak, 4)] for i in sorted(top)]
    missed = missed.masked_fill(~has_text, 0)
    worst = missed.topk(min(most, int((missed > 0).sum()))).indices.tolist() if len(missed) else []
    return attended, [list(spans[i]) for i in sorted(worst)]
