"""The stop rule on both bundled models' own tokenizers (Gemma 3's and SmolLM2's): an answer that runs on into the
frame's next field ("Question", "Answer", a label cut short) ends before it, as the app, `generate`, `chat` and
`eval` stream it (they all decode through generate.decode_n_tokens). The model's words are scripted, so the test
is about where the tokenizer splits them, not about what a small model happens to say."""

from types import SimpleNamespace

import pytest
import torch

from pqcache.serving.generate import decode_n_tokens, eos_token_ids
from pqcache.serving.prompt import END_OF_ANSWER
from pqcache.serving.stopping import StopRule

SAID = [
    (" 68422.\nQuestion\nQuestion", " 68422."),  # the field's word alone on its line (seen in the app)
    (" It is 10240 bytes.\nQuestion: What is the block size?", " It is 10240 bytes."),
    (" In the third oak tree.\n\nAnswer: In the", " In the third oak tree."),
    (" ZIP_STORED\nQuest", " ZIP_STORED"),  # cut at the cap inside the word: not kept
]


class Scripted:
    """A stand-in for a model that says `ids` one token a forward (then EOS)."""

    def __init__(self, ids: list[int], vocab: int, eos: int):
        self.ids, self.vocab, self.eos, self.forwards = ids, vocab, eos, 0

    def logits(self, i: int) -> torch.Tensor:
        out = torch.zeros(1, self.vocab)
        out[0, self.ids[i] if i < len(self.ids) else self.eos] = 1.0
        return out

    def __call__(self, input_ids=None, cache=None, use_cache=True, **kwargs):
        self.forwards += 1
        return SimpleNamespace(logits=self.logits(self.forwards)[:, None])


@pytest.mark.parametrize("bundled", ["real_model", "smollm2"])
@pytest.mark.parametrize("said,answer", SAID)
def test_the_answer_ends_before_the_frames_next_field(bundled, said, answer, request):
    model, tok = request.getfixturevalue(bundled)
    ids = tok(said, add_special_tokens=False).input_ids
    eos = min(eos_token_ids(model, tok))
    scripted = Scripted(ids, len(tok), eos)
    out = decode_n_tokens(
        scripted, scripted.logits(0), None, len(ids), eos={eos}, stop_rule=StopRule(tok, END_OF_ANSWER)
    )
    assert tok.decode(out.tokens) == answer
    assert scripted.forwards < len(ids)  # nothing decoded past the stop text
