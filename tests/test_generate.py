"""The one greedy loop (prefill / decode_one_token / decode_n_tokens), the EOS set and head_dim_of."""

import threading
from types import SimpleNamespace

import torch
from transformers import DynamicCache, Gemma3Config

from pqcache.engine.shapes import head_dim_of
from pqcache.serving.generate import Decoded, decode_n_tokens, eos_token_ids, prefill

from .conftest import WordTokenizer, tiny_model


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
    assert out.tokens == _reference(model, ids, 6) and not out.stopped
    assert seen == [out.tokens[:i] for i in range(1, 7)]  # on_token after each token, with the tokens so far
    assert lock.entered == 5  # the 6th token needs no forward


def test_decode_n_tokens_ends_at_eos_without_keeping_it():
    model, ids = tiny_model("llama"), _prompt()
    ref = _reference(model, ids, 6)
    cache = DynamicCache(config=model.config)
    out = decode_n_tokens(model, prefill(model, ids, cache), cache, 6, eos={ref[2]})
    assert out.tokens == ref[: ref.index(ref[2])] and not out.stopped


def test_decode_n_tokens_stops_at_the_next_token():
    model, ids = tiny_model("llama"), _prompt()
    cache, stop, lock = DynamicCache(config=model.config), threading.Event(), CountingLock()

    def on_token(tokens):
        if len(tokens) == 2:
            stop.set()

    out = decode_n_tokens(model, prefill(model, ids, cache), cache, 6, on_token=on_token, stop=stop, lock=lock)
    assert out.stopped and out.tokens == _reference(model, ids, 2)
    assert lock.entered == 2
    fresh = DynamicCache(config=model.config)  # a stop set before the first token: no token at all
    assert decode_n_tokens(model, prefill(model, ids, fresh), fresh, 6, stop=stop) == Decoded(stopped=True)


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
