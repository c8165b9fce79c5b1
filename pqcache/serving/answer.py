"""An answer as the documents service returns it (in this process, or a replica's view of one with the same
fields), and the rate the page and the benchmarks quote from it. No torch: the page's process reads these."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Answer:
    text: str = ""
    tokens: list[int] = field(default_factory=list)
    seconds: float = 0.0
    first_s: float = 0.0  # seconds from the question to the first answer token (the question's prefill, then it)
    generated: int = 0  # tokens the model produced: the answer's and those the stop rule dropped
    done: bool = False
    stopped: bool = False
    ended: str = ""  # why the answer ended: eos, end_of_answer, repetition, max_new_tokens or stopped
    # the passages its attention read most: {"start", "end", "text", "share"}, highest share first (sources.py)
    sources: list[dict] = field(default_factory=list)
    # character ranges [start, end, weight] of the document tokens it attended to most (weight: of the most)
    attended: list[list] = field(default_factory=list)
    # [start, end] of tokens in the exact top-k that the selection did not attend to (sampled steps, observed)
    missed: list[list] = field(default_factory=list)
    # seconds spent reading the document again for the prefill's queries, which the method starts from and the
    # load did not keep (DocumentSession.ensure_queries); 0.0 when none
    reread_s: float = 0.0
    note: str = ""  # what the page should know first (a new conversation started for another method)


def step_ms(answer) -> float | None:
    """An answer's ms a step after its first token (every token the model produced, the stop rule's dropped ones
    too): an Answer, or a replica's view of one with the same fields; None without two steps."""
    first, steps = getattr(answer, "first_s", 0.0), getattr(answer, "generated", 0) or len(answer.tokens)
    return 1e3 * (answer.seconds - first) / (steps - 1) if first and steps > 1 else None
