"""The short decode forward of Gemma 3 and Llama-family layers (pqcache/fastpath/layer.py): bit-identical to the
model's forward with the quantized decode linears (int8, int4), under full attention and PQCache, on tiny Gemma 3,
Llama, Mistral and Qwen2 models, and only where it applies; its step in C (native/layer.py) within 1e-4 of the
torch step, with the same greedy tokens. SmolLM2's real weights: tests/model/test_smollm2.py."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from transformers import DynamicCache

import pqcache.fastpath.layer as decode_layer
from pqcache import PQCache, PQCacheConfig, native
from pqcache.engine.full_attention import full_attention_cache
from pqcache.engine.kernels import Kernels
from pqcache.fastpath.install import install_fast_decode
from pqcache.fastpath.layer import FastDecodeLayer
from pqcache.fastpath.weights import install_decode_weights
from pqcache.serving.generate import decode_one_token, prefill
from tests.tiny import tiny_model

FULL_BUDGET = PQCacheConfig(token_budget=1.0, n_init=4, n_local=8, kmeans_iters=5, bits=4)
SMALL_BUDGET = PQCacheConfig(token_budget=0.2, n_init=4, n_local=8, kmeans_iters=5, bits=4)


ARCHS = ("gemma3", "llama", "mistral", "qwen2")


def _tiny(arch: str = "gemma3", seed: int = 0, kv_heads: int | None = None):
    """A tiny model with random norm weights and biases (they start at one, or zero: Gemma's 1 + w, and a zero bias,
    would hide a mixed-up norm or bias)."""
    model = tiny_model(arch, seed=seed, **({} if kv_heads is None else {"num_key_value_heads": kv_heads}))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.3 + (0.0 if arch == "gemma3" else 1.0))
            elif name.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model


def _gemma3(seed: int = 0, kv_heads: int | None = None):
    return _tiny("gemma3", seed, kv_heads)


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
        lambda m: full_attention_cache(m),  # its full-attention layers at the float16 KV dtype
        lambda m: PQCache(m, FULL_BUDGET),
        lambda m: PQCache(m, SMALL_BUDGET),
    ],
    ids=["full", "full-float16-kv", "pqcache-full-budget", "pqcache-budget-0.2"],
)
@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("arch", ARCHS)
def test_fast_decode_layer_is_bit_identical_to_the_models_forward(make_cache, kind, arch):
    model = _tiny(arch)
    assert install_decode_weights(model, kind) == 7 * len(model.model.layers)
    ids = torch.randint(1, 96, (1, 70), generator=torch.Generator().manual_seed(3))
    in_torch = Kernels(native_step=False)  # the step in torch (the C step: test_native_step_...)
    with torch.no_grad():
        ref = _decode(model, make_cache(model), ids)
        assert install_fast_decode(model, in_torch) == len(model.model.layers)
        assert install_fast_decode(model) == 0  # installed once
        got = _decode(model, make_cache(model), ids)
    assert _fast_steps(model) == 8 * len(model.model.layers)  # every decode step, no prefill chunk
    assert model.fast_decode_step.steps == 8  # without the model's forward around the layers (fastpath/step.py)
    assert torch.equal(got, ref)


@pytest.mark.parametrize(
    "arch, prompt_tokens, kv_heads",
    [("gemma3", n, h) for n in (10, 23, 24, 70) for h in (2, 4)] + [(a, 70, 2) for a in ARCHS[1:]],
)
def test_one_row_decode_step_is_bit_identical_to_the_models_forward(arch, prompt_tokens, kv_heads):
    """The step without the model's forward (fastpath/step.py) against the layers' short forward inside the model's
    forward: the same logits from contexts shorter than the sliding window (24 tokens: its mask, which the step
    does not pass, is all ones either way) to longer ones, with grouped query heads and without, for full
    attention and PQCache at full and small budgets; with an observer attached (the app's live panels) the step
    runs too, with the same logits again and the same records as the observed model's forward (its layers' spans,
    block hits, sampled attention and recall). The layers' step in torch (in C: the next test), the picks' values
    copied as the general step copies them (the observed layers take it)."""
    kernels = Kernels(native_step=False, values_in_place=False)
    model = _tiny(arch, seed=2, kv_heads=kv_heads)
    install_decode_weights(model)
    install_fast_decode(model, kernels)
    step = model.fast_decode_step
    ids = torch.randint(1, 96, (1, prompt_tokens), generator=torch.Generator().manual_seed(prompt_tokens))
    for pq, make_cache in (
        (False, lambda: DynamicCache(config=model.config)),
        (True, lambda: PQCache(model, replace(FULL_BUDGET, kernels=kernels))),
        (True, lambda: PQCache(model, replace(SMALL_BUDGET, kernels=kernels))),
    ):
        with torch.no_grad():
            model.fast_decode_step = None
            ref = _decode(model, make_cache(), ids)
            model.fast_decode_step = step
            before = step.steps
            got = _decode(model, make_cache(), ids)
            assert step.steps == before + 8
            if pq:
                observed = {}
                for name, fast in (("forward", None), ("step", step)):
                    model.fast_decode_step = fast
                    watched = make_cache()
                    obs = watched.instrument(timeline=True, attention_every=2, recall_every=2)
                    observed[name] = _decode(model, watched, ids), obs
                    watched.close()  # detaches its hooks
                model.fast_decode_step = step
                assert step.steps == before + 16  # the observed cache's steps took the step too
                (by_forward, seen), (by_step, seen_by_step) = observed["forward"], observed["step"]
                assert torch.equal(by_forward, ref) and torch.equal(by_step, ref)
                assert _observed(seen_by_step) == _observed(seen)
                assert len(_observed(seen)[0]) >= 9 * len(model.model.layers) and seen.attention and seen.blocks
        assert torch.equal(got, ref)


def _observed(obs) -> tuple:
    """What an observer recorded, without its times and values: the layers of its "device compute" spans in order,
    and the (layer, step) of its block, attention and recall records."""
    spans = [e["layer"] for e in obs.events if e["lane"] == "device compute"]
    return spans, *([(r["layer"], r["step"]) for r in getattr(obs, kind)] for kind in ("blocks", "attention", "recall"))


@pytest.mark.parametrize("arch", ARCHS)
def test_native_step_parts_match_the_torch_steps_parts(arch):
    """layer_qkv (input norm, q/k/v product and bias, head norms, rotary embedding) and layer_out (o product,
    norms, residuals, gate/up, GELU or SiLU, down) of one layer against FastDecodeLayer's torch parts on the same
    input."""
    model = _tiny(arch, seed=6, kv_heads=2)
    install_decode_weights(model)
    install_fast_decode(model)
    fast = model.model.layers[1].forward
    assert fast.native is not None, native.status()
    g = torch.Generator().manual_seed(6)
    E, Hq, Hk = model.config.hidden_size, fast.n_q, fast.n_kv
    D = fast.D
    x = torch.randn(1, E, generator=g) * 3
    angle = torch.rand(1, 1, D, generator=g) * 6
    cos, sin = angle.cos(), angle.sin()
    qk, qkv = fast._qkv(x, (cos, sin))  # (1, Hq + Hk, D), (1, Hq + 2 Hk, D)
    got = fast.native.qkv(x, cos.reshape(-1), fast._signed_sin(sin).reshape(-1))
    torch.testing.assert_close(got[: Hq + Hk], qk[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[Hq + Hk :], qkv[0, Hq + Hk :], rtol=1e-5, atol=1e-5)
    attn = torch.randn(1, Hq * D, generator=g)
    torch.testing.assert_close(fast.native.out(x, attn), fast._mlp(x, attn), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", [torch.float16, torch.bfloat16])
def test_native_attention_reads_a_half_window_as_float32_rows_of_the_same_numbers(kind):
    """A sliding window kept at the KV dtype (layer/sliding.py) is attended where it lies, its rows widened a tile
    at a time: the output equals attention over float32 rows of the same rounded numbers within float32 rounding
    (the tiles add their sums to the output in turn), over windows shorter and longer than a tile, grouped heads."""
    model = _tiny("gemma3", seed=7, kv_heads=2)
    install_decode_weights(model)
    install_fast_decode(model)
    step = model.model.layers[0].forward.native
    assert step is not None, native.status()
    Hq, Hk, D = step.Hq, step.Hk, step.D
    g = torch.Generator().manual_seed(7)
    q = torch.randn(Hq, D, generator=g)
    for n in (5, 16, 37, 300):
        buffer_k, buffer_v = (torch.randn(1, Hk, n + 9, D, generator=g).to(kind) for _ in range(2))
        key, value = buffer_k[:, :, 2 : 2 + n], buffer_v[:, :, 2 : 2 + n]  # a window's view inside its buffer
        want = step.attend(q, key.float(), value.float(), 0.25)
        torch.testing.assert_close(step.attend(q, key, value, 0.25), want, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="attend"):
        step.attend(q, key, value.float(), 0.25)


@pytest.mark.parametrize(
    "arch, prompt_tokens, kv_heads",
    [("gemma3", n, h) for n in (10, 70) for h in (1, 2, 4)] + [(a, 70, h) for a in ARCHS[1:] for h in (1, 4)],
)
def test_native_step_is_close_to_the_torch_step_with_the_same_tokens(arch, prompt_tokens, kv_heads):
    """The layers' one-token step in C (layer_step.c) against the same step in torch, on the same int8 products:
    logits within 1e-4 (summation orders differ, and the int16 rounding of the next product can turn a last-bit
    difference into 1e-5), the same greedy tokens, for full attention (the keys of a window shorter and longer
    than the sliding window, all of a full-attention layer's) and PQCache at full and small budgets, with one,
    two and four query heads a key/value head."""
    ids = torch.randint(1, 96, (1, prompt_tokens), generator=torch.Generator().manual_seed(prompt_tokens))
    makers = (
        lambda m: DynamicCache(config=m.config),
        lambda m: PQCache(m, FULL_BUDGET),
        lambda m: PQCache(m, SMALL_BUDGET),
    )
    logits = {}
    for in_c in (False, True):
        model = _tiny(arch, seed=4, kv_heads=kv_heads)
        install_decode_weights(model)
        install_fast_decode(model, Kernels(native_step=in_c))
        assert all((layer.forward.native is not None) == in_c for layer in model.model.layers)
        with torch.no_grad():
            logits[in_c] = [_decode(model, make(model), ids, n=12) for make in makers]
        assert model.fast_decode_step.steps == 12 * len(makers)
    for torch_step, c_step in zip(logits[False], logits[True]):
        torch.testing.assert_close(c_step, torch_step, rtol=1e-4, atol=1e-4)
        assert torch.equal(c_step.argmax(-1), torch_step.argmax(-1))


@pytest.mark.parametrize("kernel, tol", [("torch", 1e-5), ("native", 1e-4)])
@pytest.mark.parametrize("arch", ARCHS)
def test_fast_decode_layer_keeps_pqcache_at_full_budget_equal_to_full_attention(monkeypatch, kernel, tol, arch):
    """Full attention and PQCache at a full budget attend in different orders: float noise (1e-7) in the inputs
    of the next decode linears. Torch's kernel rounds them to bf16, whose steps (2**-8 of each value) rarely move;
    the native one to int16 steps of max|x| / 32767, which often move by one: 1e-5 of the logits."""
    if kernel == "torch":
        monkeypatch.setattr(native, "library", lambda: None)
    model = _tiny(arch, seed=1)
    install_decode_weights(model)
    assert (model.model.layers[0].mlp.down_proj.weights.native is None) == (kernel == "torch")
    install_fast_decode(model)
    ids = torch.randint(1, 96, (1, 80), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        full = _decode(model, full_attention_cache(model), ids)  # at the same KV dtype as PQCache's host tier
        cache = PQCache(model, FULL_BUDGET)
        pq = _decode(model, cache, ids)
    assert all(layer.stats["steps"] == 8 for layer in cache.pq_layers), "decode must run through the PQ path"
    torch.testing.assert_close(pq, full, rtol=tol, atol=tol)
    assert torch.equal(pq.argmax(-1), full.argmax(-1))


def test_fast_decode_layer_applies_only_where_it_reproduces_the_forward():
    """Layers it does not reproduce (an activation other than SiLU in a Llama, an o projection with a bias), model
    weights (no int8 copies) and the model's bf16 keep the model's own forward."""
    for odd in (tiny_model("llama", hidden_act="gelu"), tiny_model("llama", attention_bias=True)):
        install_decode_weights(odd)
        assert install_fast_decode(odd) == 0 and getattr(odd, "fast_decode_step", None) is None
    assert install_fast_decode(tiny_model("llama")) == 0  # no int8 decode linears
    assert install_fast_decode(tiny_model("gemma3")) == 0  # no int8 decode linears
    model = tiny_model("gemma3")
    install_decode_weights(model)
    install_fast_decode(model)
    model.to(torch.bfloat16)
    ids = torch.randint(1, 96, (1, 40), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        _decode(model, DynamicCache(config=model.config), ids, n=2)
    assert _fast_steps(model) == 0


def test_the_step_records_to_its_own_caches_observer_and_other_hooks_keep_the_forward():
    """Two users' observed caches on one model: a step of one records its layers' spans in its own observer only.
    A hook that is not an observer's (it expects the layers' forwards) sends the step through the model's forward."""
    model = _gemma3(seed=4)
    install_decode_weights(model)
    install_fast_decode(model)
    step, layers = model.fast_decode_step, model.model.layers
    ids = torch.randint(1, 96, (1, 40), generator=torch.Generator().manual_seed(4))
    ann, bob = PQCache(model, SMALL_BUDGET), PQCache(model, SMALL_BUDGET)
    ann_obs, bob_obs = ann.instrument(timeline=True), bob.instrument(timeline=True)
    with torch.no_grad():
        logits = prefill(model, ids, ann, chunk_tokens=32)
        ann.wait()
        seen, before = len(ann_obs.events), step.steps
        token = logits.argmax(-1, keepdim=True)
        decode_one_token(model, token, ann)
        assert step.steps == before + 1 and bob_obs.events == []
        spans = [e for e in ann_obs.events[seen:] if e["lane"] == "device compute"]
        assert [e["layer"] for e in spans] == list(range(len(layers)))
        assert all(e["end"] >= e["start"] for e in spans)
        calls = []
        hook = layers[0].register_forward_hook(lambda *args: calls.append(1))
        decode_one_token(model, token, ann)
        hook.remove()
    assert step.steps == before + 1 and calls == [1]  # the model's forward ran, and its hook with it
    ann.close(), bob.close()


@pytest.mark.parametrize("kv_dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("kv_heads", [1, 2])
def test_a_sliding_layers_step_in_one_call_equals_three(monkeypatch, kv_dtype, kv_heads):
    """A sliding-window layer's step in one C call (layer_window_step: qkv, the token written into the window, the
    attention, out) against the three calls and update_stored's copies: the same logits to the bit, the windows'
    buffers equal (the token rounded to the KV dtype as torch's copy rounds it), through the windows' moves."""
    ids = torch.randint(1, 96, (1, 40), generator=torch.Generator().manual_seed(5))
    cfg = PQCacheConfig(token_budget=0.2, n_init=4, n_local=8, kmeans_iters=5, bits=4, kv_dtype=kv_dtype)
    calls, real = [], decode_layer.FastDecodeLayer._window_step

    def counted(self, *args):
        out = real(self, *args)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(decode_layer.FastDecodeLayer, "_window_step", counted)
    runs = {}
    for one_call in (True, False):
        model = _tiny("gemma3", seed=6, kv_heads=kv_heads)
        install_decode_weights(model)
        install_fast_decode(model, Kernels(window_step=one_call))
        cache = PQCache(model, cfg)
        with torch.no_grad():
            runs[one_call] = (_decode(model, cache, ids, n=80), cache)  # 80 steps: the window's buffer moves
    n_sliding = model.config.layer_types.count("sliding_attention")
    assert calls.count(True) == 80 * n_sliding  # every step of every sliding layer took the one call
    (logits, cache), (ref_logits, ref_cache) = runs[True], runs[False]
    assert torch.equal(logits, ref_logits)
    sliding = [i for i, kind in enumerate(model.config.layer_types) if kind == "sliding_attention"]
    for i in sliding:
        got, want = cache.layers[i], ref_cache.layers[i]
        assert got.keys.dtype == getattr(torch, kv_dtype)
        assert torch.equal(got.keys, want.keys) and torch.equal(got.values, want.values)
        assert got.cumulative_length == want.cumulative_length
