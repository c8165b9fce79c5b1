"""The one prompt builder: a document and a question in the user's words -> the text the model reads.

Used by the CLI's generate, the document session (the app's Q&A and teaching tabs) and the evaluation.

- A tokenizer without a chat template (a base model, such as the bundled Gemma 3 270M) gets a frame base models
  follow::

      <document>

      Answer the question from the text above. The answer is in the text.
      Question: <question>
      Answer:

  and the answer ends at the end of the answer (a blank line, or a new ``Question:`` / ``Answer:`` line: the
  model starting the next frame) as well as at EOS. The instruction line was measured on the bundled model:
  without it, "What is the pass key?" on assets/passkey_1k.txt (key 68422) was answered "18422"; with its first
  sentence only, a password needle at 1.5K tokens got "I'm not sure." and a platform needle at 8K got "Lisp"; with
  both sentences all three were right (docs/results.md, "Natural questions").
- A tokenizer with a chat template (an instruct model) gets the same words as one user turn, rendered by its
  template with the generation prompt after it; the answer ends at the model's end of turn (EOS).
- Without a document the prompt is the question alone (``Question: ...`` / ``Answer:`` for a base model).

Every prompt is two parts: the **document part**, which does not depend on the question (it is what a
DocumentSession prefills once and caches), and the **question part**, which runs after it (as a second chunk on a
fork of the cached document). Their token ids are encoded separately, so the cached prefix is the same for every
question.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pqcache.serving.stopping import StopRule

INSTRUCTION = "Answer the question from the text above. The answer is in the text."
QUESTION_LABEL = "Question:"
ANSWER_LABEL = "Answer:"
# the end of a base model's answer: a blank line, or the model starting the next frame on the next line
# the end of an answer: a blank line, the frame's next field, or a line of that field's word alone (a base model
# writes "68422.\nQuestion\nQuestion" as often as "\nQuestion: ...")
END_OF_ANSWER = (
    "\n\n",
    f"\n{QUESTION_LABEL}",
    f"\n{ANSWER_LABEL}",
    f"\n{QUESTION_LABEL[:-1]}\n",
    f"\n{ANSWER_LABEL[:-1]}\n",
)
_DOC, _QUESTION = "\u2063PQDOC\u2063", "\u2063PQQUESTION\u2063"  # sentinels rendered through a chat template
_ANSWER = "\u2063PQANSWER\u2063"


@dataclass(frozen=True)
class Prompt:
    """document + question is the whole prompt; `document` does not depend on the question."""

    document: str
    question: str
    chat: bool  # rendered with the tokenizer's chat template
    source: str = ""  # the user's document as given (the sources' character ranges are in it)

    @property
    def text(self) -> str:
        return self.document + self.question

    def encode(self, tokenizer) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (document ids (1, S), question ids (1, Q)): the document with the tokenizer's special tokens (BOS)
        unless a chat template wrote them, the question without."""
        doc = tokenizer(self.document, add_special_tokens=not self.chat, return_tensors="pt").input_ids
        question = tokenizer(self.question, add_special_tokens=False, return_tensors="pt").input_ids
        return doc, question

    def stop_rule(self, tokenizer) -> StopRule:
        return StopRule(tokenizer, () if self.chat else END_OF_ANSWER)


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None)) and hasattr(tokenizer, "apply_chat_template")


class PromptBuilder:
    """Builds prompts for one tokenizer (the chat template, when there is one, is split once)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._parts = self._split_template(document=True) if has_chat_template(tokenizer) else None
        self._bare = self._split_template(document=False) if self._parts else None
        self._next = self._split_next_turn() if self._parts else None

    @property
    def chat(self) -> bool:
        return self._parts is not None

    def _split_template(self, document: bool) -> tuple[str, ...] | None:
        """The template rendered around sentinels -> (head, between, tail): the prompt is head + document +
        between + question + tail (without a document: head + question + tail). None when the template does not
        keep the user's text verbatim (the plain frame is used then)."""
        content = f"{_DOC}\n\n{INSTRUCTION}\n{QUESTION_LABEL} {_QUESTION}" if document else _QUESTION
        try:
            text = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
            )
        except Exception:  # a template that refuses a lone user turn: the plain frame
            return None
        if not isinstance(text, str) or text.count(_QUESTION) != 1 or (document and text.count(_DOC) != 1):
            return None
        if not document:
            head, tail = text.split(_QUESTION)
            return head, tail
        head, rest = text.split(_DOC)
        between, tail = rest.split(_QUESTION)
        return (head, between, tail) if _QUESTION not in head + between else None

    def _split_next_turn(self) -> tuple[str, str] | None:
        """The template around a second user turn -> (switch, tail): after the assistant's answer, switch + the
        user's words + tail is their next turn with the generation prompt. None when it cannot be read off."""
        turns = [{"role": "user", "content": _DOC}, {"role": "assistant", "content": _ANSWER}]
        try:
            text = self.tokenizer.apply_chat_template(
                [*turns, {"role": "user", "content": _QUESTION}], tokenize=False, add_generation_prompt=True
            )
        except Exception:  # a template that refuses a second turn: the plain frame for follow-ups
            return None
        if not isinstance(text, str) or text.count(_ANSWER) != 1 or text.count(_QUESTION) != 1:
            return None
        after = text.split(_ANSWER)[1]
        return tuple(after.split(_QUESTION)) if _QUESTION in after else None

    def follow_up(self, question: str, after_document: bool = False) -> str:
        """A later turn of a conversation: after an answer, or (after_document) after a document added to it."""
        question = question.strip()
        framed = f"\n\n{INSTRUCTION}\n{QUESTION_LABEL} {question}"
        if self._next is not None:
            switch, tail = self._next
            return (framed if after_document else switch + question) + tail
        return f"{framed}\n{ANSWER_LABEL}" if after_document else f"\n{QUESTION_LABEL} {question}\n{ANSWER_LABEL}"

    def added_document(self, text: str) -> str:
        """A document added to a conversation: in the user's next turn (the question that follows closes it)."""
        return (self._next[0] if self._next is not None else "\n\n") + (text or "").strip()

    def part_spans(self, part: str, text: str) -> list[tuple[int, int]]:
        """The character range in `text` of each token of `part` (ids(part)'s tokens), `part` being `text` stripped
        after a frame of its own (added_document): (0, 0) for the frame's tokens."""
        from pqcache.serving.sources import token_spans

        head = len(part) - len(text.strip())  # where the user's text starts in part
        shift = len(text) - len(text.lstrip()) - head
        spans = token_spans(self.tokenizer, part, add_special_tokens=False)
        return [(max(lo, head) + shift, hi + shift) if hi > max(lo, head) else (0, 0) for lo, hi in spans]

    def ids(self, part: str) -> torch.Tensor:
        """A part after the cached document -> ids (1, n), without special tokens."""
        return self.tokenizer(part, add_special_tokens=False, return_tensors="pt").input_ids

    def document(self, text: str) -> str:
        """The document part: the same for every question."""
        text = (text or "").strip()
        if self.chat:
            return self._parts[0] + text if text else self._bare[0]
        return text

    def question(self, question: str, with_document: bool = True) -> str:
        """The question part, after the document part; the question in the user's words."""
        question = question.strip()
        if self.chat:
            if with_document:
                return self._parts[1] + question + self._parts[2]
            return question + self._bare[1]
        frame = f"{QUESTION_LABEL} {question}\n{ANSWER_LABEL}"
        return f"\n\n{INSTRUCTION}\n{frame}" if with_document else frame

    def build(self, document: str, question: str) -> Prompt:
        has_doc = bool(document and document.strip())
        return Prompt(self.document(document), self.question(question, has_doc), self.chat, document or "")

    def document_ids(self, text: str) -> torch.Tensor:
        """The document part's ids (1, S), as a session prefills and caches them."""
        return self.build(text, "?").encode(self.tokenizer)[0]

    def document_spans(self, text: str) -> list[tuple[int, int]]:
        """The character range in `text` (the user's document, as given to document_ids) of each token of the
        document part; (0, 0) for tokens with no text of the user's (BOS, a chat template's head)."""
        from pqcache.serving.sources import token_spans

        text = text or ""
        part = self.document(text)  # text.strip(), after the chat template's head for a chat model
        head = len(self._parts[0]) if self.chat and text.strip() else 0  # where the user's text starts in part
        shift = len(text) - len(text.lstrip()) - head
        spans = token_spans(self.tokenizer, part, add_special_tokens=not self.chat)
        return [(max(lo, head) + shift, hi + shift) if hi > max(lo, head) else (0, 0) for lo, hi in spans]

    def question_ids(self, question: str) -> torch.Tensor:
        """The question part's ids (1, Q), run after a cached document."""
        return self.build("document", question).encode(self.tokenizer)[1]

    def stop_rule(self) -> StopRule:
        return StopRule(self.tokenizer, () if self.chat else END_OF_ANSWER)


def build_prompt(tokenizer, document: str, question: str) -> Prompt:
    """The prompt for `question` about `document` (which may be empty)."""
    return PromptBuilder(tokenizer).build(document, question)
