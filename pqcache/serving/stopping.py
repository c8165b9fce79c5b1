"""When an answer ends: the StopRule (end of the answer, a verbatim loop) and the helpers that find a loop."""

from __future__ import annotations

from dataclasses import dataclass

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
        """Where the first stop text starts in `text` (after its leading blanks), or -1. A line that began a stop
        text and was cut short by another ("\nQuestion" then a blank line) is part of the stop, not the answer."""
        start = len(text) - len(text.lstrip())
        found = [i for i in (text.find(s, start) for s in self.stop_texts) if i >= 0]
        at = min(found, default=-1)
        if at > start:
            before = text[start:at]
            begun = [
                n for s in self.stop_texts if s.startswith("\n") for n in range(2, len(s)) if before.endswith(s[:n])
            ]
            at -= max(begun, default=0)
        return at

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
