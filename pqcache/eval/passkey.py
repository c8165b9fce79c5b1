"""Passkey retrieval prompts (the long-context sanity check of the paper's needle tests)."""

from __future__ import annotations

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
INTRO = "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
QUESTION = "What is the pass key?"  # in plain words: the app, the CLI and the load test frame it (serving/prompt.py)
CUE = " The pass key is"  # a raw prompt, read by the model with no frame around it, needs the answer cue
LONG_QUESTION = "List the numbers from 1 to 100."  # an answer that runs long (to try Stop): it counts, no loop


def passkey_context(key: str, n_filler: int = 40, depth: float = 0.4) -> str:
    """Filler sentences with the key stated at `depth` (0 = start, 1 = end) of the text."""
    parts = [FILLER] * n_filler
    parts.insert(int(depth * n_filler), f"The pass key is {key}. Remember it. {key} is the pass key. ")
    return INTRO + "".join(parts)


def passkey_prompt(key: str, n_filler: int = 40, depth: float = 0.4) -> str:
    """The raw prompt (no prompt builder): the context, the question and the answer cue."""
    return passkey_context(key, n_filler, depth) + QUESTION + CUE
