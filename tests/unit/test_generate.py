"""The one greedy loop (prefill / decode_one_token / decode_n_tokens), the stop rules, the EOS set and head_dim_of."""

import threading
from types import SimpleNamespace

import pytest
import torch
from transformers import DynamicCache, Gemma3Config

from pqcache.engine.shapes import head_dim_of
from pqcache.serving.generate import Decoded, decode_n_tokens, eos_token_ids, prefill
from pqcache.serving.prompt import END_OF_ANSWER
from pqcache.serving.stopping import StopRule, looping, repeated_tail
from tests.tiny import WordTokenizer, byte_tokenizer, tiny_model


class CountingLock:
    """A lock that counts how many forwards ran under it."""

    entered = 0

    def __enter__(self):
        self.entered += 1

    def __exit__(self, *exc):
        return False


def _prompt(n=40, seed=0):
    return torch.randint(1, 96, (1, n), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def _reference(model, ids, n):
    """Greedy tokens recomputed from scratch (no cache) at every step."""
    seq, out = ids, []
    for _ in range(n):
        tid = int(model(seq).logits[0, -1].argmax())
        out.append(tid)
        seq = torch.cat([seq, torch.tensor([[tid]])], 1)
    return out


def test_decode_n_tokens_is_greedy_and_runs_no_forward_past_the_last_token():
    model, ids = tiny_model("llama"), _prompt()
    cache, lock, seen = DynamicCache(config=model.config), CountingLock(), []
    out = decode_n_tokens(
        model, prefill(model, ids, cache), cache, 6, on_token=lambda t: seen.append(list(t)), lock=lock
    )
    assert out.tokens == _reference(model, ids, 6) and not out.stopped and out.ended == "max_new_tokens"
    assert seen == [out.tokens[:i] for i in range(1, 7)]  # on_token after each token, with the tokens so far
    assert lock.entered == 5  # the 6th token needs no forward


def test_decode_n_tokens_ends_at_eos_without_keeping_it():
    model, ids = tiny_model("llama"), _prompt()
    ref = _reference(model, ids, 6)
    cache = DynamicCache(config=model.config)
    out = decode_n_tokens(model, prefill(model, ids, cache), cache, 6, eos={ref[2]})
    assert out.tokens == ref[: ref.index(ref[2])] and not out.stopped and out.ended == "eos"


def test_decode_n_tokens_stops_at_the_next_token():
    model, ids = tiny_model("llama"), _prompt()
    cache, stop, lock = DynamicCache(config=model.config), threading.Event(), CountingLock()

    def on_token(tokens):
        if len(tokens) == 2:
            stop.set()

    out = decode_n_tokens(model, prefill(model, ids, cache), cache, 6, on_token=on_token, stop=stop, lock=lock)
    assert out.stopped and out.tokens == _reference(model, ids, 2) and out.ended == "stopped"
    assert lock.entered == 2
    fresh = DynamicCache(config=model.config)  # a stop set before the first token: no token at all
    assert decode_n_tokens(model, prefill(model, ids, fresh), fresh, 6, stop=stop) == Decoded(
        stopped=True, ended="stopped"
    )


def test_eos_token_ids_merges_model_and_tokenizer():
    model = SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=[1, 106]))
    assert eos_token_ids(model, SimpleNamespace(eos_token_id=1)) == {1, 106}
    assert eos_token_ids(SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=7)), WordTokenizer()) == {7}
    assert eos_token_ids(SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=None))) == set()


def test_head_dim_of_model_config_and_composite_config():
    model = tiny_model("gemma3")
    assert head_dim_of(model) == head_dim_of(model.config) == 16
    composite = Gemma3Config(text_config=dict(hidden_size=64, num_attention_heads=4, head_dim=32, num_hidden_layers=1))
    assert head_dim_of(composite) == 32
    assert head_dim_of(SimpleNamespace(hidden_size=96, num_attention_heads=4, head_dim=None)) == 24


# ---- stop rules: a scripted model says a given text, the rule decides where the answer ends ----------------------
TOK = byte_tokenizer()


class Scripted:
    """A stand-in for a model that says `text` token by token (then the pad token forever); counts forwards."""

    def __init__(self, text: str):
        self.ids, self.forwards = TOK(text, add_special_tokens=False).input_ids, 0

    def logits(self, i: int) -> torch.Tensor:
        out = torch.zeros(1, len(TOK))
        out[0, self.ids[i] if i < len(self.ids) else 0] = 1.0
        return out

    def __call__(self, input_ids=None, cache=None, use_cache=True, **kwargs):
        self.forwards += 1
        return SimpleNamespace(logits=self.logits(self.forwards)[:, None])


def say(text: str, max_new_tokens: int = 200, eos=frozenset()):
    """-> (answer text, why it ended, texts shown while streaming, forwards run)."""
    model, shown = Scripted(text), []
    out = decode_n_tokens(
        model,
        model.logits(0),
        None,
        max_new_tokens,
        eos,
        on_token=lambda tokens: shown.append(TOK.decode(tokens)),
        stop_rule=StopRule(TOK, END_OF_ANSWER),
    )
    return TOK.decode(out.tokens), out.ended, shown, model.forwards


@pytest.mark.parametrize(
    "said,answer",
    [
        (" 4721.\n\nQuestion: What is the code?", " 4721."),  # a blank line
        (" Pepper\nQuestion: What is the name", " Pepper"),  # the next question frame on the next line
        (" 4721.\nAnswer: 4722.\nAnswer:", " 4721."),
        ("\n\n In the third oak tree.\n\nSeptember 2017", "\n\n In the third oak tree."),  # leading blanks are kept
        (" Barley and rye.\nThey sell it on Saturday.\n\nThe town", " Barley and rye.\nThey sell it on Saturday."),
        (" In the third oak tree.\nQuestion\n\nWhere", " In the third oak tree."),  # a label cut short: not kept
        (" 68422.\nQuestion\nQuestion", " 68422."),  # the field's word alone on its line
        (" 68422.\nAnswer\n68422.", " 68422."),
    ],
)
def test_the_answer_ends_at_the_end_of_answer_without_the_stop_text(said, answer):
    text, ended, shown, forwards = say(said)
    assert (text, ended) == (answer, "end_of_answer")
    assert shown[-1] == answer  # the stream ends on the final answer
    assert not any(s.strip() and s.endswith("\n") for s in shown)  # a newline that may start a stop text is held
    assert forwards < len(said)  # nothing is decoded past the stop text


def test_no_forward_runs_after_the_token_that_ends_the_answer():
    assert say(" 4721.\n\nQuestion:")[3] == len(" 4721.\n")  # a forward after each kept token and the first newline


def test_a_verbatim_loop_ends_with_its_first_copy():
    text, ended, _, forwards = say("The copyright holder is the FSF. " * 6)
    assert (text, ended) == ("The copyright holder is the FSF. ", "repetition")
    assert forwards < 2 * len("The copyright holder is the FSF. ")  # cut at the second copy, not at the cap
    text, ended, _, _ = say("ab" * 40)  # a short block: cut once it has covered 16 tokens
    assert (text, ended) == ("ab", "repetition")


@pytest.mark.parametrize(
    "said",
    [
        " ".join(f"{i}." for i in range(1, 60)),  # counting is not a loop
        " 1000000000000 is the number, and 1000000000000 is the number again",  # zeros, one phrase twice apart
        " 68422. Remember 68422.",
    ],
)
def test_answers_that_are_not_loops_run_to_max_new_tokens(said):
    text, ended, shown, forwards = say(said, max_new_tokens=len(said) - 3)
    assert (text, ended) == (said[:-3], "max_new_tokens") and forwards == len(said) - 4  # the hard cap
    assert shown == [said[:i] for i in range(1, len(said) - 2)]


@pytest.mark.parametrize("said", [" 10240 bytes.\nQuestion</s>", " 10240 bytes.\nQues</s>", " 10240 bytes.\n</s>"])
def test_an_answer_that_ends_on_the_start_of_the_next_field_does_not_keep_it(said):
    """EOS (or the cap) right after the start of "\nQuestion:": the answer is what came before it, as streamed."""
    model = Scripted(said)
    out = decode_n_tokens(model, model.logits(0), None, 50, eos={2}, stop_rule=StopRule(TOK, END_OF_ANSWER))
    assert TOK.decode(out.tokens) == " 10240 bytes." and out.ended == "eos"
    text, ended, shown, _ = say(said.removesuffix("</s>"), max_new_tokens=len(said) - 4)
    assert (text, ended) == (" 10240 bytes.", "max_new_tokens") and shown[-1] == text


def test_eos_ends_the_answer_before_any_stop_text():
    model = Scripted(" 4721</s>\n\nQuestion:")
    out = decode_n_tokens(model, model.logits(0), None, 50, eos={2}, stop_rule=StopRule(TOK, END_OF_ANSWER))
    assert TOK.decode(out.tokens) == " 4721" and out.ended == "eos"


def test_repeated_tail_and_looping():
    assert repeated_tail([1, 2, 3, 1, 2, 3, 1, 2]) == (8, 3)
    assert repeated_tail([5, 1, 2, 3, 4]) == (0, 0)
    assert repeated_tail([7] * 5) == (5, 1)
    assert looping([1, 2, 3, 4] * 2) and not looping([1, 2, 3, 4, 1, 2, 3]) and not looping([0] * 7)
