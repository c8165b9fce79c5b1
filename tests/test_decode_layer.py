"""The short decode forward of Gemma 3 layers (pqcache/serving/decode_layer.py): bit-identical to the model's
forward with the quantized decode linears (int8, int4), under full attention and PQCache, and only where it
applies."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from pqcache import PQCache, PQCacheConfig, native
from pqcache.serving.decode_layer import FastDecodeLayer, install_fast_decode
from pqcache.serving.decode_weights import install_decode_weights
from pqcache.serving.generate import decode_one_token, prefill

from .conftest import tiny_model

FULL_BUDGET = PQCacheConfig(token_budget=1.0, n_init=4, n_local=8, kmeans_iters=5, bits=4)
SMALL_BUDGET = PQCacheConfig(token_budget=0.2, n_init=4, n_local=8, kmeans_iters=5, bits=4)


def _gemma3(seed: int = 0, kv_heads: int | None = None):
    """The tiny Gemma 3 with random norm weights (they start at zero: 1 + w would be 1 and hide a mixed-up norm)."""
    model = tiny_model("gemma3", seed=seed, **({} if kv_heads is None else {"num_key_value_heads": kv_heads}))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model


def _decode(model, cache, ids, n=8):
    """Prefill ids (1, S) and decode n greedy steps: the logits of every step, (n + 1, V)."""
    out = [prefill(model, ids, cache, chunk_tokens=32)]
    if isinstance(cache, PQCache):
        cache.wait()
    for _ in range(n):
        out.append(decode_one_token(model, out[-1].argmax(-1, keepdim=True), cache))
    return torch.cat(out)


def _fast_steps(model) -> int:
    return sum(layer.forward.steps for layer in model.model.layers if isinstance(layer.forward, FastDecodeLayer))


@pytest.mark.parametrize(
    "make_cache",
    [
        lambda m: DynamicCache(config=m.config),
        lambda m: PQCache(m, FULL_BUDGET),
        lambda m: PQCache(m, SMALL_BUDGET),
    ],
    ids=["full", "pqcache-full-budget", "pqcache-budget-0.2"],
)
@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_fast_decode_layer_is_bit_identical_to_the_models_forward(make_cache, kind):
    model = _gemma3()
    assert install_decode_weights(model, kind) == 7 * len(model.model.layers)
    ids = torch.randint(1, 96, (1, 70), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = _decode(model, make_cache(model), ids)
        assert install_fast_decode(model) == len(model.model.layers)
        assert install_fast_decode(model) == 0  # installed once
        got = _decode(model, make_cache(model), ids)
    assert _fast_steps(model) == 8 * len(model.model.layers)  # every decode step, no prefill chunk
    assert model.fast_decode_step.steps == 8  # without the model's forward around the layers (decode_step.py)
    assert torch.equal(got, ref)


@pytest.mark.parametrize("prompt_tokens", [10, 23, 24, 70])
@pytest.mark.parametrize("kv_heads", [2, 4])
def test_one_row_decode_step_is_bit_identical_to_the_models_forward(prompt_tokens, kv_heads):
    """The step without the model's forward (decode_step.py) against the layers' short forward inside the model's
    forward: the same logits from contexts shorter than the sliding window (24 tokens: its mask, which the step
    does not pass, is all ones either way) to longer ones, with grouped query heads and without, for full
    attention and PQCache at full and small budgets; with an observer attached (the app's live panels) the
    model's forward runs, with the same logits again."""
    model = _gemma3(seed=2, kv_heads=kv_heads)
    install_decode_weights(model)
    install_fast_decode(model)
    step = model.fast_decode_step
    ids = torch.randint(1, 96, (1, prompt_tokens), generator=torch.Generator().manual_seed(prompt_tokens))
    for make_cache in (
        lambda: DynamicCache(config=model.config),
        lambda: PQCache(model, FULL_BUDGET),
        lambda: PQCache(model, SMALL_BUDGET),
    ):
        with torch.no_grad():
            model.fast_decode_step = None
            ref = _decode(model, make_cache(), ids)
            model.fast_decode_step = step
            before = step.steps
            got = _decode(model, make_cache(), ids)
            assert step.steps == before + 8
            watched = make_cache()
            if isinstance(watched, PQCache):
                watched.instrument(timeline=True)
                observed = _decode(model, watched, ids)
                assert step.steps == before + 8 and watched.observer.events  # the model's forward, with its hooks
                watched.close()  # detaches the hooks: the next cache's steps take the short path again
                assert torch.equal(observed, ref)
        assert torch.equal(got, ref)


@pytest.mark.parametrize("kernel, tol", [("torch", 1e-5), ("native", 1e-4)])
def test_fast_decode_layer_keeps_pqcache_at_full_budget_equal_to_full_attention(monkeypatch, kernel, tol):
    """Full attention and PQCache at a full budget attend in different orders: float noise (1e-7) in the inputs
    of the next decode linears. Torch's kernel rounds them to bf16, whose steps (2**-8 of each value) rarely move;
    the native one to int16 steps of max|x| / 32767, which often move by one: 1e-5 of the logits."""
    if kernel == "torch":
        monkeypatch.setattr(native, "library", lambda: None)
    model = _gemma3(seed=1)
    install_decode_weights(model)
    assert (model.model.layers[0].mlp.down_proj.weights.native is None) == (kernel == "torch")
    install_fast_decode(model)
    ids = torch.randint(1, 96, (1, 80), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        full = _decode(model, DynamicCache(config=model.config), ids)
        cache = PQCache(model, FULL_BUDGET)
        pq = _decode(model, cache, ids)
    assert all(layer.stats["steps"] == 8 for layer in cache.pq_layers), "decode must run through the PQ path"
    torch.testing.assert_close(pq, full, rtol=tol, atol=tol)
    assert torch.equal(pq.argmax(-1), full.argmax(-1))


def test_fast_decode_layer_applies_only_where_it_reproduces_the_forward():
    """Other architectures, model weights (no int8 copies) and the model's bf16 keep the model's own forward."""
    llama = tiny_model("llama")
    install_decode_weights(llama)
    assert install_fast_decode(llama) == 0
    assert install_fast_decode(tiny_model("gemma3")) == 0  # no int8 decode linears
    model = tiny_model("gemma3")
    install_decode_weights(model)
    install_fast_decode(model)
    model.to(torch.bfloat16)
    ids = torch.randint(1, 96, (1, 40), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        _decode(model, DynamicCache(config=model.config), ids, n=2)
    assert _fast_steps(model) == 0
