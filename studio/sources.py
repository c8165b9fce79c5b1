"""An answer's sources on the page: quotes under the answer in the chat, a list to click, and the document view with
the passage outlined and the tokens the answer attended to shaded (and, on request, the tokens of the exact top-k that
PQCache's search missed, underlined). Plain data in (the Answer's sources, attended and missed character ranges), HTML
and Markdown out: no tensors here."""

from __future__ import annotations

import bisect
import html

VIEW_ID = "doc-view"
# scrolls the document view to the outlined passage (run in the browser after the view is drawn)
SCROLL_JS = (
    "() => { const m = document.querySelector('#doc-view .src-passage');"
    " if (m) m.scrollIntoView({block: 'center', behavior: 'instant'}); }"
)
EMPTY_VIEW = "<div class='doc-view-empty'>Click a source of an answer to see it in the document.</div>"
STYLE = """<style>
#doc-view .doc-text { white-space: pre-wrap; font-family: ui-monospace, monospace; font-size: 12px; max-height: 360px;
  overflow-y: auto; border: 1px solid #ddd; padding: 8px; line-height: 1.5; }
#doc-view .src-passage { outline: 2px solid #1f77b4; border-radius: 2px; }
#doc-view .missed { text-decoration: underline wavy #d62728; }
#doc-view .legend > span { margin-right: 1.2em; }
#doc-view .shade { background: rgba(255, 140, 0, .6); }
</style>"""


def quote(text: str, limit: int = 140) -> str:
    """A passage on one line, cut at `limit` characters."""
    one = " ".join(text.split())
    return one if len(one) <= limit else one[: limit - 1].rstrip() + "\u2026"


def chat_quotes(sources: list[dict]) -> str:
    """The sources as Markdown quotes with their share (and the added document they are in), for under the answer
    in the chat."""
    lines = [
        f"> \u201c{_md(quote(s['text']))}\u201d ({100 * s['share']:.0f}% of the attention{_in(s, _md)})"
        for s in sources
    ]
    return ("\n>\n".join(lines)) if lines else ""


def choices(sources: list[dict]) -> list[str]:
    """The labels of the clickable sources."""
    return [f"{i}. ({100 * s['share']:.0f}%{_in(s)}) {quote(s['text'], 90)}" for i, s in enumerate(sources, 1)]


def _in(source: dict, escape=str) -> str:
    """ ", in NAME" for a source in a document added to the conversation."""
    return f", in {escape(source['document'])}" if source.get("document") else ""


def document_view(text: str, answer: dict, index: int | None, show_missed: bool = False) -> str:
    """The document as HTML: source `index` outlined (and scrolled to by SCROLL_JS), the attended tokens shaded by
    their weight, the missed tokens underlined when show_missed. answer: {"sources", "attended", "missed", "method"}."""
    sources = answer.get("sources") or []
    if not text or index is None or not 0 <= index < len(sources):
        return STYLE + EMPTY_VIEW
    src = sources[index]
    if src.get("document"):  # in a document added to the conversation: the view holds the first one's text
        where = f"<div class='legend'><span><b>{html.escape(src['document'])}</b> (added to the conversation)"
        return (
            f"{STYLE}{where}</span></div><div class='doc-text'>{_piece(html.escape(src['text']), True, False, 0)}</div>"
        )
    attended = sorted(answer.get("attended") or [])  # [start, end, weight] of tokens: they do not overlap
    missed = sorted(answer.get("missed") or []) if show_missed else []
    cuts = {0, len(text), src["start"], src["end"]}
    cuts.update(p for span in attended + missed for p in span[:2])
    cuts = sorted(p for p in cuts if 0 <= p <= len(text))
    pieces = []
    for lo, hi in zip(cuts, cuts[1:]):
        weight = next((w for a, b, w in _covering(attended, lo)), 0.0)
        in_missed = any(True for _ in _covering(missed, lo))
        in_passage = src["start"] <= lo and hi <= src["end"]
        pieces.append(_piece(html.escape(text[lo:hi]), in_passage, in_missed, weight))
    legend = "<div class='legend'><span><b>outlined</b>: the source</span><span><span class='shade'>shaded</span>: "
    legend += "tokens the answer attended to (darker: more)</span>"
    if show_missed:
        n_missed = len(missed)
        legend += f"<span><span class='missed'>underlined</span>: {n_missed} tokens of the exact top-k it missed</span>"
    legend += "</div>"
    return f"{STYLE}{legend}<div class='doc-text'>{''.join(pieces)}</div>"


def _covering(spans: list, at: int):
    """The spans (sorted, not overlapping) that cover character `at`: at most one."""
    i = bisect.bisect_right(spans, [at, float("inf")]) - 1
    if i >= 0 and spans[i][0] <= at < spans[i][1]:
        yield spans[i]


def _piece(escaped: str, passage: bool, missed: bool, weight: float) -> str:
    if not (passage or missed or weight > 0):
        return escaped
    classes = " ".join(c for c, on in (("src-passage", passage), ("missed", missed)) if on)
    style = f" style='background:rgba(255,140,0,{0.15 + 0.6 * weight:.2f})'" if weight > 0 else ""
    return f"<span class='{classes}'{style}>{escaped}</span>"


def _md(text: str) -> str:
    """Plain text inside Markdown: the characters Markdown would read as formatting are escaped, angle brackets and
    ampersands as HTML entities (a backslash before ">" stays visible inside a link the chat finds in the text:
    "<https://json.org\\>")."""
    marks = {"&": "&amp;", "<": "&lt;", ">": "&gt;"}
    return "".join(marks.get(c) or ("\\" + c if c in "\\`*_[]#|" else c) for c in text)
