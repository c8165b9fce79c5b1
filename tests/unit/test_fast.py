"""The fast CPU path: chunked prefill, bf16, the exact-argmax LM head, and `bench e2e`'s rows."""

import json

import pytest
import torch
from transformers import DynamicCache, Gemma3ForCausalLM, Gemma3TextConfig

from pqcache import PQCache, PQCacheConfig, native
from pqcache.bench import e2e
from pqcache.engine.full_attention import full_attention_cache
from pqcache.fastpath import dtype as fast
from pqcache.fastpath import lmhead
from pqcache.fastpath.lmhead import ExactArgmaxHead, install_exact_argmax_head
from pqcache.fastpath.weights import DecodeLinear, FusedSiblings, install_decode_weights
from pqcache.serving.generate import decode_n_tokens, make_cache, prefill
from tests.tiny import COMMON, byte_tokenizer, greedy_generate, tiny_model

FULL_BUDGET = PQCacheConfig(token_budget=1.0, n_init=4, n_local=8, kmeans_iters=5, bits=4)


def _ids(n, seed=0):
    return torch.randint(1, 96, (1, n), generator=torch.Generator().manual_seed(seed))


def assert_full_budget_equals_full_attention(model, seed: int, tol: float):
    """Greedy decoding of 80 random ids: PQCache at a full budget gives full attention's tokens and scores."""
    ids = _ids(80, seed=seed)
    with torch.no_grad():
        ref_seq, ref_scores = greedy_generate(model, ids, full_attention_cache(model))
        cache = PQCache(model, FULL_BUDGET)
        seq, scores = greedy_generate(model, ids, cache)
    assert all(layer.stats["steps"] == 5 for layer in cache.pq_layers), "decode must run through the PQ path"
    torch.testing.assert_close(scores, ref_scores, rtol=tol, atol=tol)
    assert torch.equal(seq, ref_seq)


@pytest.mark.parametrize("method", ["full", "pqcache"])
@pytest.mark.parametrize("chunk", [10, 48])  # smaller and larger than the tiny Gemma 3's window of 24
def test_chunked_prefill_equals_one_forward(arch, method, chunk):
    model = tiny_model(arch)
    ids = _ids(150)
    with torch.no_grad():
        one = make_cache(model, method, FULL_BUDGET)
        ref = prefill(model, ids, one, chunk_tokens=None)
        ref_tokens = decode_n_tokens(model, ref, one, 6).tokens
        seen = []
        many = make_cache(model, method, FULL_BUDGET)
        logits = prefill(model, ids, many, chunk_tokens=chunk, on_chunk=lambda i, n: seen.append((i, n)))
        tokens = decode_n_tokens(model, logits, many, 6).tokens
    n = -(-150 // chunk)
    assert seen == [(i, n) for i in range(n)]
    torch.testing.assert_close(logits, ref, rtol=1e-5, atol=1e-5)
    assert tokens == ref_tokens


def test_chunked_prefill_keeps_sliding_layers_banded_and_builds_pq_once():
    model = tiny_model("gemma3")  # layers: sliding (window 24), full, sliding
    ids = _ids(150)
    sizes = []
    hook = model.model.layers[0].self_attn.register_forward_hook(
        lambda m, a, kw, out: sizes.append(kw["attention_mask"].shape[-1]), with_kwargs=True
    )
    with torch.no_grad():
        cache = PQCache(model, PQCacheConfig(token_budget=0.5, kmeans_iters=2), keep_queries=True)
        prefill(model, ids, cache, chunk_tokens=32)
    hook.remove()
    assert max(sizes) <= 32 + 24  # each chunk attends to the window and itself, not to the whole prompt
    (layer,) = cache.pq_layers
    assert layer.prefilled and layer.S == 150
    assert layer.prefill_q.shape[2] == 150  # every chunk's queries, for forks into other methods
    assert len(layer.method_state["index"].segments) <= 1  # one K-Means over the whole prompt
    cache.wait()
    assert len(layer.method_state["index"].segments) == 1
    cache.close()


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_full_budget_equals_full_attention_in_bf16(arch):
    assert_full_budget_equals_full_attention(tiny_model(arch).to(torch.bfloat16), seed=1, tol=2e-2)


def test_resolve_dtype(monkeypatch):
    assert fast.resolve_dtype("float32") == torch.float32
    assert fast.resolve_dtype(torch.bfloat16) == torch.bfloat16
    assert fast.resolve_dtype("auto", "cuda") == torch.bfloat16 and fast.resolve_dtype(None, "cuda") == torch.bfloat16
    monkeypatch.setattr(fast, "cpu_has_native_bf16", lambda: False)
    assert fast.resolve_dtype("auto") == torch.float32
    monkeypatch.setattr(fast, "cpu_has_native_bf16", lambda: True)
    assert fast.resolve_dtype("auto") == torch.bfloat16
    assert fast.resolve_dtype(None) == torch.float32  # the default on a CPU, native bf16 or not
    with pytest.raises(ValueError, match="dtype must be one of"):
        fast.resolve_dtype("float16")


@pytest.mark.parametrize("use_native", [True, False], ids=["native", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_exact_argmax_head_picks_the_exact_heads_argmax(dtype, use_native):
    g = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(64, 5000, bias=False).to(dtype)
    with torch.no_grad():
        head.weight.copy_(torch.randn(5000, 64, generator=g) * 0.05)
        # near-ties: rows that differ from others by less than the int8 step
        head.weight[1:50] = head.weight[0] + 1e-4 * torch.randn(49, 64, generator=g).to(dtype)
    fast_head = ExactArgmaxHead(head, use_native=use_native)
    assert (fast_head.native is not None) == use_native  # a C compiler is part of the set-up (test_native.py)
    assert fast_head.int4 != use_native  # the int4 stage runs only with torch's kernels
    with torch.no_grad():
        for i in range(50):
            h = (torch.randn(1, 1, 64, generator=g) * (1 + i)).to(dtype)
            if i % 5 == 0:
                h = head.weight[None, None, 0] * 20  # a hidden state that points at the near-tied rows
            exact, approx = head(h), fast_head(h)
            assert int(approx.argmax(-1)) == int(exact.argmax(-1))
            torch.testing.assert_close(approx.max(), exact.max())  # the winner's logit is exact (summation order)
        assert fast_head(torch.randn(1, 10, 64).to(dtype)).shape == (1, 10, 5000)  # many rows: the exact head
    assert fast_head.stats["steps"] == 50 and fast_head.stats["candidates"] < 50 * 5000 // 4


def test_exact_argmax_head_keeps_a_models_greedy_tokens():
    model = tiny_model("gemma3")
    ids = _ids(60)
    with torch.no_grad():
        ref, _ = greedy_generate(model, ids, DynamicCache(config=model.config), n=8)
        assert install_exact_argmax_head(model) is not None
        seq, _ = greedy_generate(model, ids, DynamicCache(config=model.config), n=8)
    assert isinstance(model.lm_head, ExactArgmaxHead) and model.lm_head.stats["steps"] >= 7
    assert torch.equal(seq, ref)


def _near_tied_head(dtype, V=4000, D=64, tied=50, noise=1e-4):
    """A random head (V not a multiple of the int4 kernel's 64-row blocks) whose rows 1..tied-1 differ from row 0
    by far less than an int4 or int8 step."""
    g = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(D, V, bias=False).to(dtype).requires_grad_(False)
    head.weight.copy_(torch.randn(V, D, generator=g) * 0.05)
    head.weight[1:tied] = head.weight[0] + noise * torch.randn(tied - 1, D, generator=g).to(dtype)
    return head, g


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_exact_argmax_head_int4_then_int8_stages_keep_the_exact_argmax(dtype):
    """The int4 pass narrows the vocabulary, the int8 pass scores only its survivors, and the argmax is still the
    exact head's, near-ties included (rows closer than an int4 step, hidden states pointing at them). Torch's
    kernels: with the native one the head reads every int8 row instead."""
    head, g = _near_tied_head(dtype)
    fast_head = ExactArgmaxHead(head, use_native=False)
    assert fast_head.int4, "torch's int4 CPU kernel is missing"
    tied_wins = 0
    with torch.no_grad():
        for i in range(200):
            h = torch.randn(1, 1, 64, generator=g) * (0.5 + i / 20)
            if i % 4 == 0:  # towards the near-tied rows, off by a little
                h = head.weight[None, None, 0].float() * 20 + 0.05 * torch.randn(1, 1, 64, generator=g)
            h = h.to(dtype)
            exact, fast_logits = head(h), fast_head(h)
            assert int(fast_logits.argmax(-1)) == int(exact.argmax(-1)), i
            torch.testing.assert_close(fast_logits.max(), exact.max())  # the winner's logit is exact
            tied_wins += int(exact.argmax(-1)) < 50
    stats = fast_head.stats
    assert tied_wins >= 40 and stats["steps"] == 200
    assert stats["int4_fallbacks"] == 0 and stats["exact_fallbacks"] == 0
    # stage 1 ran and narrowed (under 5% of the rows survive it); stage 2 narrowed its survivors further
    assert 200 <= stats["int4_candidates"] < 200 * 4000 // 20
    assert 200 <= stats["candidates"] < stats["int4_candidates"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_exact_argmax_head_bounds_hold_and_are_tight(dtype):
    """Each stage's bound covers |exact logit - score| for every row, and is nearly reached when the hidden
    state points along a row's quantization error (Cauchy-Schwarz is tight there): a bound half as big fails.
    The stages: torch's int4 and int8 kernels (h rounded to bf16), and the native int8 kernel (h to int16)."""
    head, g = _near_tied_head(dtype)
    fast_head = ExactArgmaxHead(head, use_native=False)
    native_head = ExactArgmaxHead(head)
    assert native_head.native is not None
    w = head.weight.float()
    D = w.shape[1]
    # the dequantized weights as the kernels see them (to bf16 precision): their products with the unit vectors
    w4 = torch.ops.aten._weight_int4pack_mm_for_cpu(
        torch.eye(D, dtype=torch.bfloat16),
        fast_head.packed,
        D // len(fast_head.scales_and_zeros),
        fast_head.scales_and_zeros,
    ).T.float()  # (V', D)
    w8 = fast_head.q.float() * fast_head.scale.float()[:, None]  # (V, D)
    with torch.no_grad():
        for stage, deq in (("int4", w4), ("int8", w8), ("int8, native", w8)):
            for i in torch.randint(0, 4000, (20,), generator=g).tolist():
                err = w[i] - deq[i]
                # bf16 already: no rounding of h in torch's bound, whose weight-error term is then nearly reached
                # (native: the int16 rounding's share is under 2**-15 of h's largest entry)
                h = (err / err.norm() * (1 + i % 7)).bfloat16().to(dtype)
                exact = head(h[None, None])[0, 0].float()  # (V,)
                stager = native_head if stage == "int8, native" else fast_head
                acts = stager.activations(h[None])
                score, bound = stager.int4_scores(acts) if stage == "int4" else stager.int8_scores(acts)
                gap = (exact - score[0]).abs()
                assert bool((gap <= bound[0]).all()), (stage, i)
                assert float(gap[i]) >= 0.5 * float(bound[0, i]), (stage, i, float(gap[i]), float(bound[0, i]))


def test_the_native_one_pass_test_keeps_the_rows_the_torch_test_keeps():
    """A decode step's scores, bounds and candidate test in one C pass (Int8Product.candidates) against the same
    test in torch over int8_scores' scores and bounds: the same scores to the bit, the same rows, in order; a cap
    below their count gives None; a hidden state with a NaN leaves no row."""
    head, g = _near_tied_head(torch.float32)
    fast = ExactArgmaxHead(head)
    with torch.no_grad():
        for i in range(40):
            h = torch.randn(1, 64, generator=g) * (0.5 + i / 4)
            if i % 4 == 0:
                h = head.weight[None, 0] * 20 + 0.05 * torch.randn(1, 64, generator=g)
            acts = fast.activations(h)
            score, bound = fast.int8_scores(acts)
            rows = ((score + bound) >= (score - bound).amax()).nonzero()[:, 1]
            coef = fast.int8_coef(acts)
            y, cand = fast.native.candidates(acts[0], fast.slack, coef, lmhead.OUTPUT_ROUNDING, 4000)
            assert torch.equal(y, score) and torch.equal(cand, rows), i
            if len(rows) > 1:
                capped = fast.native.candidates(acts[0], fast.slack, coef, lmhead.OUTPUT_ROUNDING, len(rows) - 1)
                assert capped[1] is None
        nan = torch.full((1, 64), float("nan"))
        acts = fast.activations(nan)
        coef = fast.int8_coef(acts)
        assert len(fast.native.candidates(acts[0], fast.slack, coef, lmhead.OUTPUT_ROUNDING, 10)[1]) == 0


def test_exact_argmax_head_falls_back_on_flat_distributions(monkeypatch):
    """A flat top (2,000 rows within an int8 step of each other) leaves more int4 survivors than the cap: the int8
    pass reads every row, and more final candidates than max_candidates: the exact head. Without the int4
    kernel the head skips stage 1, and with the native one (it reads every int8 row) it has no stage 1. The argmax
    is the exact head's each time."""
    head, g = _near_tied_head(torch.float32, tied=2000, noise=1e-5)
    flat = head.weight[None, None, 0] * 20  # all 2,000 tied rows score about the same
    spiky = torch.randn(3, 1, 64, generator=g) * 3
    with torch.no_grad():
        native_head = ExactArgmaxHead(head)
        for h in (flat, *spiky.split(1)):
            assert int(native_head(h).argmax(-1)) == int(head(h).argmax(-1))
        assert native_head.stats["candidates"] > 1000 and native_head.stats["int4_candidates"] == 0
        exact_only = ExactArgmaxHead(head, max_candidates=100)
        assert torch.equal(exact_only(flat), head(flat)) and exact_only.stats["exact_fallbacks"] == 1
        capped = ExactArgmaxHead(head, max_int4_candidates=1000, use_native=False)
        for h in (flat, *spiky.split(1)):
            assert int(capped(h).argmax(-1)) == int(head(h).argmax(-1))
        assert capped.stats["int4_fallbacks"] == 1 and capped.stats["exact_fallbacks"] == 0
        assert capped.stats["candidates"] > 1000  # the flat step's exact logits were computed for the tied rows
        nan = torch.full((1, 1, 64), float("nan"))  # no int4 candidate at all: the full int8 pass, no error
        assert capped(nan).shape == (1, 1, 4000) and capped.stats["int4_fallbacks"] == 2
        exact_only = ExactArgmaxHead(head, max_candidates=100, use_native=False)
        assert torch.equal(exact_only(flat), head(flat)) and exact_only.stats["exact_fallbacks"] == 1
        monkeypatch.setattr("pqcache.fastpath.lmhead.int4_kernel_available", lambda: False)
        int8_only = ExactArgmaxHead(head, use_native=False)
        assert not int8_only.int4
        for h in (flat, *spiky.split(1)):
            assert int(int8_only(h).argmax(-1)) == int(head(h).argmax(-1))
        assert int8_only.stats["int4_candidates"] == 0 and int8_only.stats["steps"] == 4


@pytest.mark.parametrize("kind, tol", [("int8", 0.02), ("int4", 0.1)])
def test_decode_linear_is_close_for_few_rows_and_exact_for_many(kind, tol):
    g = torch.Generator().manual_seed(0)
    linear = torch.nn.Linear(64, 48).requires_grad_(False)
    linear.weight.copy_(torch.randn(48, 64, generator=g) * 0.1)
    fast_linear = DecodeLinear(linear, kind, max_rows=4)
    assert fast_linear.weight is linear.weight and fast_linear.bias is linear.bias
    x = torch.randn(1, 3, 64, generator=g)
    with torch.no_grad():
        approx, exact = fast_linear(x), linear(x)
        assert approx.shape == exact.shape and approx.dtype == exact.dtype
        assert not torch.equal(approx, exact)  # the decode rows really read the quantized copy
        # int8 rows (error <= half a step of the row's scale) and bf16 activations: about 1% of the output's size;
        # int4 groups (16 levels over each group's range): several times that
        torch.testing.assert_close(approx, exact, rtol=0, atol=tol * float(exact.abs().max()))
        many = torch.randn(1, 5, 64, generator=g)  # more rows than max_rows: a prefill chunk
        assert torch.equal(fast_linear(many), linear(many))


@pytest.mark.parametrize("kind, wrapped", [("int8", {"q_proj", "k_proj"}), ("int4", {"q_proj"})])
def test_decode_weights_leave_linears_the_kernel_cannot_take(kind, wrapped):
    """_weight_int8pack_mm needs an input width that is a multiple of 16, the int4 kernel one of 32 (its groups):
    other linears keep the model's weights."""
    model = torch.nn.Module()
    model.model = torch.nn.Module()
    block = torch.nn.Module()
    block.self_attn = torch.nn.Module()
    attn = block.self_attn
    attn.q_proj, attn.k_proj, attn.o_proj = torch.nn.Linear(64, 32), torch.nn.Linear(48, 32), torch.nn.Linear(24, 64)
    attn.layer_idx = 0
    model.model.layers = torch.nn.ModuleList([block])
    assert install_decode_weights(model, kind) == len(wrapped)
    for name in ("q_proj", "k_proj", "o_proj"):
        assert isinstance(getattr(attn, name), DecodeLinear) == (name in wrapped), name


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_fused_siblings_give_each_projection_its_own_output(kind):
    """q/k/v stacked into one quantized matmul: each sibling's output equals its own quantized matmul, whichever
    is called first, and an input changed in place (or a different input) is computed afresh."""
    g = torch.Generator().manual_seed(1)
    linears = [
        torch.nn.Linear(64, n, bias=bias).requires_grad_(False) for n, bias in ((32, True), (16, False), (16, True))
    ]
    alone = [DecodeLinear(lin, kind) for lin in linears]
    fused = [DecodeLinear(lin, kind, quantize=False) for lin in linears]
    FusedSiblings(fused)
    assert all(m.group is fused[0].group and m.weights is None for m in fused)
    x = torch.randn(1, 1, 64, generator=g)
    with torch.no_grad():
        for order in ([0, 1, 2], [2, 0, 1]):
            for i in order:
                assert torch.equal(fused[i](x), alone[i](x)), i
        x.mul_(2)  # same tensor, new values: the stacked output is stale and must not be reused
        assert torch.equal(fused[1](x), alone[1](x))
        y = torch.randn(1, 1, 64, generator=g)
        assert torch.equal(fused[2](y), alone[2](y)) and torch.equal(fused[0](x), alone[0](x))


@pytest.mark.parametrize(
    "kind, kernel, tol", [("int8", "native", 1e-4), ("int8", "torch", 1e-5), ("int4", "torch", 1e-5)]
)
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_decode_weights_keep_full_budget_equal_to_full_attention(monkeypatch, arch, kind, kernel, tol):
    """Both caches decode through the same quantized linears: at a full budget PQCache still equals full
    attention. The two attend in different summation orders (float noise in the next linears' inputs): torch's
    kernels round those inputs to bf16, whose steps rarely move; the native int8 kernel to int16 steps of
    max|x| / 32767, which often move by one (1e-5 of the scores; tests/unit/test_decode_layer.py has the same pair)."""
    if kernel == "torch":
        monkeypatch.setattr(native, "library", lambda: None)
    model = tiny_model(arch)
    n_linear = sum(isinstance(m, torch.nn.Linear) for m in model.model.layers.modules())
    assert install_decode_weights(model, kind) == n_linear == 7 * len(model.model.layers)
    assert not isinstance(model.lm_head, DecodeLinear)  # the head has its own exact-argmax form
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert attn.q_proj.group is attn.v_proj.group is not None and attn.o_proj.group is None
    assert mlp.gate_proj.group is mlp.up_proj.group is not None and mlp.down_proj.group is None
    assert (getattr(mlp.down_proj.weights, "native", None) is None) == (kernel == "torch")
    assert_full_budget_equals_full_attention(model, seed=2, tol=tol)


def _on_four_bit_grid(rows: int, cols: int, g: torch.Generator, levels=(2, 13)) -> torch.Tensor:
    """Weights as a 4-bit model stores them (a GGUF Q4_K block): each group of 32 is step * q - offset, q an integer
    in levels (here not all 16 of them, as in many real blocks)."""
    n = rows * cols // 32
    step = torch.rand(n, 1, generator=g) * 0.01 + 0.001
    offset = step * torch.randint(0, 16, (n, 1), generator=g)  # Q4_K: dmin * m, of the order of 16 steps
    q = torch.randint(levels[0], levels[1], (n, 32), generator=g).float()
    return (step * q - offset).view(rows, cols)


def test_int4_copies_of_four_bit_weights_keep_their_grid():
    """Groups already on a 4-bit grid keep it (their step as the scale): the int4 copy is the weights up to the bf16
    rounding of scale and zero, far inside half a step, where the (max - min) / 15 scale of a group using 11 of the
    16 levels misplaces them by up to a third of a step; weights off any 4-bit grid are recognised as such."""
    from pqcache.fastpath.quantize import grid_steps, is_four_bit, quantize_int4

    g = torch.Generator().manual_seed(4)
    w = _on_four_bit_grid(64, 128, g)
    step, on_grid = grid_steps(w.view(-1, 32))
    assert bool(on_grid.all()) and is_four_bit(w)
    _, _, err = quantize_int4(w, keep_grid=True)  # (64, 4): ||w - w~|| over each row's groups of 32
    assert float((err / (step.view(64, 4) * 32**0.5)).max()) < 0.05
    five_bit = _on_four_bit_grid(64, 128, g, levels=(0, 32))  # 32 levels: a Q5_0 block
    assert float(grid_steps(five_bit.view(-1, 32))[1].float().mean()) < 0.01
    assert not is_four_bit(five_bit) and not is_four_bit(torch.randn(64, 128, generator=g))
    w[5, 40] += 0.3 * float(step[0])  # one weight off the grid: the tensor is not 4-bit any more
    assert not is_four_bit(w)


def test_auto_decode_weights_take_int4_where_the_model_is_four_bit():
    """ "auto": int4 for the linears whose weights lie on a 4-bit grid (both MLP siblings must), int8 for the others;
    PQCache at a full budget still equals full attention through them."""
    model = tiny_model("gemma3")
    g = torch.Generator().manual_seed(5)
    layer = model.model.layers[1]
    with torch.no_grad():
        for lin in (layer.self_attn.o_proj, layer.mlp.gate_proj):
            lin.weight.copy_(_on_four_bit_grid(*lin.weight.shape, g))
    assert install_decode_weights(model, "auto") == 7 * len(model.model.layers)
    kinds = {
        name: getattr(layer.self_attn if "_proj" in name and name[0] in "qkvo" else layer.mlp, name).kind
        for name in ("q_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    }
    assert kinds == {"q_proj": "int8", "o_proj": "int4", "gate_proj": "int8", "up_proj": "int8", "down_proj": "int8"}
    assert model.model.layers[0].self_attn.o_proj.kind == "int8"
    assert_full_budget_equals_full_attention(model, seed=2, tol=1e-5)


def test_load_model_rejects_unknown_decode_weights():
    from pqcache import load_model

    with pytest.raises(ValueError, match="decode_weights must be one of int8, auto, int4, model"):
        load_model("default", decode_weights="int2")


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    """A tiny random Gemma 3 (sliding and full layers) and a byte tokenizer, saved as a model folder."""
    tok = byte_tokenizer()
    torch.manual_seed(0)
    cfg = Gemma3TextConfig(
        **{**COMMON, "vocab_size": len(tok)},
        sliding_window=24,
        query_pre_attn_scalar=16,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    )
    path = tmp_path_factory.mktemp("tiny_gemma3")
    Gemma3ForCausalLM(cfg).eval().save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _well_formed(rows, seq_lens, runners):
    assert [(r["seq_len"], r["runner"]) for r in rows] == [(s, r) for s in seq_lens for r in runners]
    for r in rows:
        if r["runner"] == "llama.cpp":
            assert r["prefill_tok_s"] is None and r["decode_ms"] is None and r["note"]
            continue
        assert r["prefill_tok_s"] > 0 and r["decode_ms"] > 0 and r["peak_rss_bytes"] > 2**20
        assert len(r["tokens"]) == 3 and r["tokens_as_full"] >= 0
        assert "prefill_vs_llama" not in r  # no llama.cpp row to compare with


def test_e2e_bench_without_llama_cpp(tiny_model_dir, monkeypatch, capsys):
    monkeypatch.setattr(e2e, "llama_cpp_installed", lambda: False)
    rows = e2e.bench_e2e(model=str(tiny_model_dir), seq_lens=[40, 90], decode_tokens=3, chunk_tokens=32, isolate=False)
    _well_formed(rows, [40, 90], e2e.RUNNERS)
    assert rows[0]["note"].startswith("not installed")
    assert all(r["tokens_as_full"] == 3 for r in rows if r["runner"] == "full")
    e2e.print_table(rows)
    assert "not installed" in capsys.readouterr().out


def test_e2e_bench_cli_runs_each_runner_in_its_own_process(tiny_model_dir, capsys):
    """Each runner's process prefills, then they decode in turns (e2e_runner.serve): every row whole, and each
    runner's greedy tokens the same as when it decodes alone (in this process)."""
    from pqcache.cli.main import main

    capsys.readouterr()
    code = main(
        ["bench", "e2e", "--model", str(tiny_model_dir), "--seq-lens", "50", "--decode-tokens", "3"]
        + ["--runners", "llama.cpp,full,pqcache", "--dtype", "float32", "--json"]
    )
    assert code == 0
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rows"]
    _well_formed(rows, [50], ["llama.cpp", "full", "pqcache"])  # llama.cpp: not installed, or no GGUF for it
    assert rows[1]["settings"].startswith("float32, int8 decode weights")
    alone = e2e.bench_e2e(
        model=str(tiny_model_dir),
        seq_lens=[50],
        runners=("full", "pqcache"),
        dtype="float32",
        decode_tokens=3,
        isolate=False,
    )
    assert [rows[1]["tokens"], rows[2]["tokens"]] == [alone[0]["tokens"], alone[1]["tokens"]]


def test_bench_kernels_rows():
    """`bench kernels`: the decode step's matrices as fastpath/weights.py stacks them, and one row per kernel with its
    bytes, rate and one-thread time, the memory's streaming rate first (the rate the others are compared with)."""
    from pqcache.bench.kernels import bench_kernels, decoder_shapes

    bundled = Gemma3TextConfig(
        hidden_size=640, intermediate_size=2048, num_attention_heads=4, num_key_value_heads=1, head_dim=256
    )
    assert decoder_shapes(bundled) == [(1536, 640), (640, 1024), (4096, 640), (640, 2048)]
    # the tests' tiny shapes, wide enough that the int4 copies' bytes show at 0.1 MB
    overrides = dict(hidden_size=128, intermediate_size=256, num_key_value_heads=1, head_dim=32, vocab_size=4000)
    config = Gemma3TextConfig(**{**COMMON, **overrides})
    rows = bench_kernels(config, repeats=2, threads=2)
    assert native.library() is not None  # a C compiler is part of the set-up (test_native.py)
    assert [(r["kernel"], r["weights"]) for r in rows] == [
        ("memory", "float32 sum"),
        ("decoder linears", "int8 rows"),
        ("decoder linears", "int8 rows, native"),
        ("decoder linears", "int4 groups"),
        ("LM head", "int4 groups"),
        ("LM head", "int8 rows"),
        ("LM head", "int8 rows, native"),
        ("re-rank scores", "float32 keys, gathered"),
        ("re-rank scores", "float32 keys, native"),
        ("PQ search", "codes, torch"),
        ("PQ search", "codes, native"),
    ]
    by = {(r["kernel"], r["weights"]): r for r in rows}
    int8_mb = 3 * sum(n * k + 2 * n for n, k in decoder_shapes(config)) / 2**20  # int8 weights, bf16 row scales
    assert by["decoder linears", "int8 rows"]["mb"] == by["memory", "float32 sum"]["mb"] == round(int8_mb, 1)
    native_mb = 3 * sum(n * k + 4 * n for n, k in decoder_shapes(config)) / 2**20  # float32 row scales
    assert by["decoder linears", "int8 rows, native"]["mb"] == round(native_mb, 1)
    assert by["decoder linears", "int4 groups"]["mb"] < 0.7 * int8_mb
    assert by["LM head", "int4 groups"]["mb"] < by["LM head", "int8 rows"]["mb"]
    assert by["memory", "float32 sum"]["of_stream"] == 1.0
    # 3 layers' first stages at 32K tokens with the defaults: 4 x the top-k (the budget, 3,277 tokens, less 32 sinks
    # and a local window of 1,622), keys of head_dim 32
    rerank_mb = round(3 * 4 * 1623 * 32 * 4 / 2**20, 1)
    assert by["re-rank scores", "float32 keys, native"]["mb"] == by["re-rank scores", "float32 keys, gathered"]["mb"]
    assert by["re-rank scores", "float32 keys, native"]["mb"] == rerank_mb
    # and the codes they are searched in: m = 1 sub-space of 32 dimensions, a byte a token
    assert (
        by["PQ search", "codes, native"]["mb"] == by["PQ search", "codes, torch"]["mb"] == round(3 * 32768 / 2**20, 1)
    )
    for r in rows:
        assert r["threads"] == 2  # the times are this machine's, noisy: their values are not asserted
        assert all(r[key] >= 0 for key in ("ms", "ms_1_thread", "gb_s", "thread_speedup", "of_stream"))
