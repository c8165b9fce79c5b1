"""The native kernels (pqcache/native): they build here; int8_rows.c's products are the exact integer sums its
rounding defines (any width, any thread count, sums past int32); gather_dot.c's scores are a gathered matmul's, read
in place, across a fork's two parts too; both run on torch's OpenMP threads, and without them decode falls back to
torch's operators."""

from __future__ import annotations

import shutil

import pytest
import torch

from pqcache import native
from pqcache.fastpath.quantize import Int8Rows
from pqcache.native.layer import LayerStep


def _reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """int8_rows.c's arithmetic in torch: x rounded to int16 per row (nearest, ties to even, as lrintf), the
    products summed exactly in int64, then float(sum) * xs * scale in float32, in that order."""
    top = x.abs().amax(1, keepdim=True)  # (R, 1)
    xs = torch.where(top > 0, top / 32767, torch.ones_like(top))
    inverse = torch.where(top > 0, torch.div(torch.full_like(top, 32767.0), top), torch.ones_like(top))  # as C: no
    # reciprocal-then-product, which `32767 / top` is in torch (a different last bit for a quarter of the rows)
    xq = torch.round(x * inverse).long()  # (R, K)
    sums = (xq[:, None, :] * q.long()[None]).sum(-1)  # (R, N), exact
    return sums.float() * xs * scale


def test_the_kernel_builds_where_there_is_a_compiler():
    """A C compiler is part of the set-up (README): without one decode steps would quietly run 2x slower."""
    assert shutil.which("cc") is not None, "install a C compiler (Debian: apt install gcc)"
    assert native.library() is not None, native.status()
    assert native.status().startswith("native")


@pytest.mark.parametrize(
    "R, N, K",
    [(1, 70, 16), (2, 33, 48), (3, 1536, 640), (1, 640, 2048), (1, 5, 4100), (4, 3, 8208)],
)
def test_products_are_the_exact_integer_sums_of_the_rounded_rows(R, N, K):
    """Widths that are and are not multiples of the vector path's 128 and 32 columns, and past its int32 block
    (4,096 columns): the same numbers as the reference, to the bit."""
    g = torch.Generator().manual_seed(R * N + K)
    x = torch.randn(R, K, generator=g) * torch.rand(R, 1, generator=g) * 10
    q = torch.randint(-127, 128, (N, K), generator=g, dtype=torch.int8)
    scale = torch.rand(N, generator=g) / 100
    assert torch.equal(native.int8_rows_mm(x, q, scale), _reference(x, q, scale))


def test_sums_past_int32_and_odd_rows():
    """Every product at its largest (127 x 32767, same sign) over 70,000 columns: 2.9e11, far past int32; a row of
    zeros gives zeros, a row with an inf or a NaN gives NaN, not garbage."""
    K = 70_000
    q = torch.full((3, K), 127, dtype=torch.int8)
    x = torch.ones(4, K)
    x[1] = 0
    x[2, 5] = float("inf")
    x[3, 7] = float("nan")
    y = native.int8_rows_mm(x, q, torch.ones(3))
    assert torch.equal(y[:2], _reference(x[:2], q, torch.ones(3)))
    torch.testing.assert_close(y[0], torch.full((3,), 127.0 * K))  # an int32 sum would have wrapped around
    assert torch.equal(y[1], torch.zeros(3))
    assert y[2:].isnan().all()


def test_int16_rounding_is_the_kernels():
    """native.int16_rounding (what the exact-argmax LM head's bounds use) is the x the kernel multiplies, to the bit:
    through an identity matrix the kernel returns a * xs, rounded once, as int16_rounding does. Scales from tiny
    to large, a row with one large entry, a row of zeros, a row with a NaN."""
    g = torch.Generator().manual_seed(3)
    K = 640
    eye = native.Int8Product(torch.eye(K, dtype=torch.int8), torch.ones(K))
    for size in (1e-3, 1.0, 71.0, 1e5):
        x = torch.randn(64, K, generator=g) * size
        x[0, 3] *= 50
        x[1] = 0
        assert torch.equal(eye(x), native.int16_rounding(x))
        # at most half a step of max|x| / 32767, and the fp32 roundings of x * inverse (2**-24 of 32767) and of xs
        err = (x - native.int16_rounding(x)).abs()
        assert bool((err <= x.abs().amax(1, keepdim=True) / 32767 * (0.5 + 2**-8)).all())
    x[2, 5] = float("nan")
    assert eye(x)[2].isnan().all() and native.int16_rounding(x)[2].isnan().all()


def test_the_result_does_not_depend_on_the_thread_count():
    g = torch.Generator().manual_seed(0)
    x, q = torch.randn(2, 640, generator=g), torch.randint(-127, 128, (4099, 640), generator=g, dtype=torch.int8)
    scale = torch.rand(4099, generator=g)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = native.int8_rows_mm(x, q, scale)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, native.int8_rows_mm(x, q, scale))


def test_the_kernel_uses_torchs_openmp_runtime():
    """The library links libgomp.so.1, which must resolve to the copy torch loaded (one thread team, as
    pqcache/engine/threads.py relies on): no second libgomp.so.1 from the system in this process."""
    native.int8_rows_mm(torch.ones(1, 64), torch.ones(64, 64, dtype=torch.int8), torch.ones(64))
    with open("/proc/self/maps", encoding="utf-8") as f:
        gomp = {line.split()[-1] for line in f if line.rstrip().endswith("libgomp.so.1")}
    assert len(gomp) == 1 and "/torch/lib/" in next(iter(gomp)), gomp


def test_int8_rows_is_closer_to_float_than_torchs_bf16_kernel_and_falls_back_to_it():
    """Int8Rows with the native kernel (x rounded to int16) against torch's (x rounded to bf16): both near the
    float product of the dequantized weights, the native one closer; use_native=False takes torch's kernel."""
    g = torch.Generator().manual_seed(1)
    w, x = torch.randn(512, 640, generator=g) * 0.05, torch.randn(3, 640, generator=g)
    fast, fallback = Int8Rows(w), Int8Rows(w, use_native=False)
    assert fast.native is not None and fallback.native is None
    exact = x @ (fast.q.float() * fast.scale.float()[:, None]).T
    native_error = (fast.mm(x) - exact).abs().max()
    torch_error = (fallback.mm(x) - exact).abs().max()
    assert fast.mm(x).dtype == fallback.mm(x).dtype == torch.float32
    assert native_error < 1e-3 * exact.abs().max() and native_error < torch_error / 10


def test_a_failed_build_says_why(monkeypatch, tmp_path):
    monkeypatch.setenv("PQCACHE_KERNEL_DIR", str(tmp_path))
    with pytest.raises(RuntimeError, match="no C compiler"):
        native.build(compiler="no-such-compiler-here")
    with pytest.raises(RuntimeError, match="false failed on the native kernels"):
        native.build(compiler="false")  # a "compiler" that exits 1
    assert not list(tmp_path.glob("*.so"))  # its private output is gone
    assert native.build() == native.build()  # built once into the folder, then found there
    assert len(list(tmp_path.glob("kernels-*.so"))) == 1


@pytest.mark.parametrize("D, R", [(256, 4), (72, 1), (8, 3)])
def test_gather_dot_scores_the_rows_where_they_lie(D, R):
    """Rows of a view into a larger buffer (the host tier's storage), widths that are and are not multiples of
    its 16 lanes: the gathered copy's matmul, up to float32 summation order; the same on one thread."""
    g = torch.Generator().manual_seed(D)
    buffer = torch.randn(2, 3, 500, D, generator=g)
    store = buffer[1, 2]  # (500, D), rows D apart inside the buffer
    pos = torch.randint(0, 500, (777,), generator=g)
    q = torch.randn(R, D, generator=g)
    got = native.gather_dot(store, pos, q)
    torch.testing.assert_close(got, store[pos] @ q.T, rtol=1e-5, atol=1e-5)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(native.gather_dot(store, pos, q), got)
    finally:
        torch.set_num_threads(before)
    with pytest.raises(ValueError, match="gather_dot"):  # a kind it does not read (half rows: the test below)
        native.gather_dot(store.to(torch.float64), pos, q)
    for outside in (-1, 500):
        with pytest.raises(IndexError, match="outside a store of 500 rows"):
            native.gather_dot(store, torch.tensor([3, outside]), q)


@pytest.mark.parametrize("D, R, n", [(256, 4, 3000), (72, 1, 50), (8, 3, 300)])
def test_gather_weighted_sum_sums_the_rows_where_they_lie(D, R, n):
    """p.T @ store[pos] for rows of a view into a larger buffer, widths on and off the vector path, few rows (one
    thread) and many (split between the threads), repeated positions: the gathered copy's matmul, up to float32
    summation order."""
    g = torch.Generator().manual_seed(D + n)
    store = torch.randn(2, 3, 500, D, generator=g)[1, 2]  # (500, D), rows D apart inside the buffer
    pos = torch.randint(0, 500, (n,), generator=g)
    p = torch.rand(n, R, generator=g)
    got = native.gather_weighted_sum(store, pos, p)
    torch.testing.assert_close(got, p.T @ store[pos], rtol=1e-5, atol=1e-4)
    with pytest.raises(IndexError, match="outside 500 rows"):
        native.gather_weighted_sum(store, torch.tensor([3, 500]), p[:2])
    with pytest.raises(ValueError, match="gather_weighted_sum"):
        native.gather_weighted_sum(store, pos, p[:-1])


@pytest.mark.parametrize("kind", [torch.float16, torch.bfloat16])
def test_gather_kernels_read_half_rows_as_the_float32_rows_of_the_same_numbers(kind):
    """A key or value store in float16 or bfloat16 (the host tier's default kv_dtype on a CPU) is read in place,
    each row widened to float32 first: the scores and weighted sums equal, bit for bit, those over a float32 store
    of the same rounded numbers (on the vector paths and off them: D 64 and 40; enough rows for the threads)."""
    g = torch.Generator().manual_seed(11)
    for D, n in ((64, 700), (40, 33)):
        buffer = torch.randn(2, 900, D, generator=g).to(kind)
        store = buffer[1]  # rows D apart inside a larger buffer
        pos = torch.randint(0, 900, (n,), generator=g)
        q, p = torch.randn(3, D, generator=g), torch.rand(n, 3, generator=g)
        assert torch.equal(native.gather_dot(store, pos, q), native.gather_dot(store.float(), pos, q))
        assert torch.equal(native.gather_weighted_sum(store, pos, p), native.gather_weighted_sum(store.float(), pos, p))
    with pytest.raises(ValueError, match="gather_dot"):
        native.gather_dot(store.to(torch.float64), pos, q)


def test_f16c_and_plain_widening_agree_on_every_half():
    """The kernels widen float16 with F16C where the CPU has it and bit by bit elsewhere (half_rows.h): every finite
    float16 (subnormals included) read through gather_dot against one-hot queries gives torch's own
    float32 value, on the vector path (D 16) and the scalar tail (D 8); infinities and NaN stay what they are."""
    every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.float16)
    finite = every[every.isfinite()]  # 63,490 values
    for D in (16, 8):
        store = torch.cat([finite, finite.new_zeros(-len(finite) % D)]).view(-1, D)
        got = native.gather_dot(store, torch.arange(store.shape[0]), torch.eye(D))  # (rows, D): each element once
        assert torch.equal(got, store.float())  # (a sum turns -0 into +0: equal values, not bits)
        special = torch.zeros(3, D, dtype=torch.float16)
        special[:, 0] = torch.tensor([float("inf"), float("-inf"), float("nan")])
        got = native.gather_dot(special, torch.arange(3), torch.eye(D)[:1])[:, 0]
        assert got[0] == float("inf") and got[1] == float("-inf") and got[2].isnan()


def test_the_host_tiers_key_scores_read_across_a_forks_two_parts():
    """A fork's tier keeps the parent's tokens (shared) and its own: scores of positions on both sides of the
    seam, for every row and head, match the gathered keys' products, and the values' weighted sums the gathered
    values'."""
    from pqcache.engine.layer.host import HostTier

    g = torch.Generator().manual_seed(3)
    B, H, D = 2, 3, 32
    parent = HostTier(B, H, D, torch.float32, torch.device("cpu"))
    parent.append(torch.randn(B, H, 40, D, generator=g), torch.randn(B, H, 40, D, generator=g))
    tier = parent.fork()
    tier.append(torch.randn(B, H, 9, D, generator=g), torch.randn(B, H, 9, D, generator=g))
    assert tier.S0 == 40 and tier.S == 49
    pos = torch.randint(0, 49, (B, H, 25), generator=g)
    q = torch.randn(B, H, 2, D, generator=g)
    got = tier.key_scores(pos, q)
    bh = torch.arange(B * H).repeat_interleave(25)
    keys = tier.key_rows(bh, pos.reshape(-1)).view(B, H, 25, D)
    torch.testing.assert_close(got, keys @ q.transpose(-1, -2), rtol=1e-5, atol=1e-5)
    assert HostTier(B, H, D, torch.bfloat16, torch.device("cpu")).key_scores(pos, q) is None  # torch's way there
    # the values' weighted sums across the same seam
    p = torch.rand(B, H, 25, 2, generator=g)
    values = tier.values(0, 49)  # (B, H, 49, D)
    want = p.transpose(-1, -2) @ torch.gather(values, 2, pos[..., None].expand(B, H, 25, D))
    torch.testing.assert_close(tier.value_sums(pos, p), want, rtol=1e-5, atol=1e-5)


def _step(Hq: int, Hk: int, D: int) -> LayerStep:
    """A LayerStep for attend alone (attend reads only the head counts and size)."""
    E, inter = 64, 96
    shapes = {"qkv": ((Hq + 2 * Hk) * D, E), "o": (E, Hq * D), "gate_up": (2 * inter, E), "down": (E, inter)}
    products = {
        name: native.Int8Product(torch.ones(shape, dtype=torch.int8), torch.ones(shape[0]))
        for name, shape in shapes.items()
    }
    norms = {name: torch.ones(E) for name in ("w_in", "w_post_attn", "w_pre_ff", "w_post_ff")}
    norms["w_qk"] = torch.ones(Hq + Hk, D)
    return LayerStep({"E": E, "Hq": Hq, "Hk": Hk, "D": D, "I": inter}, 1e-6, norms, products)


@pytest.mark.parametrize(
    "Hq, Hk, D, n",
    [(4, 1, 256, 512), (4, 1, 256, 1), (4, 2, 64, 37), (8, 1, 64, 100), (3, 3, 72, 50), (4, 1, 256, 3000)],
)
def test_attend_row_is_softmax_attention_over_every_key(Hq, Hk, D, n):
    """Grouped query heads (4 a key/value head as in the bundled model, 2, 8 beyond the vector path's 4, none),
    head sizes on and off the vector path (multiples of 64 and 16, or not), keys that are a view into a larger
    buffer (a sliding window's), and a context long enough to split between the threads (3,000 keys): SDPA's
    output, up to float32 summation order."""
    g = torch.Generator().manual_seed(n + D)
    buffer_k, buffer_v = torch.randn(2, 1, Hk, n + 20, D, generator=g) * 2
    key, value = buffer_k[:, :, 5 : 5 + n], buffer_v[:, :, 5 : 5 + n]  # (1, Hk, n, D), rows n + 20 apart per head
    q = torch.randn(Hq, D, generator=g)
    got = _step(Hq, Hk, D).attend(q, key, value, scaling=D**-0.5)
    want = torch.nn.functional.scaled_dot_product_attention(
        q.view(1, Hq, 1, D), key, value, scale=D**-0.5, enable_gqa=True
    )  # (1, Hq, 1, D)
    torch.testing.assert_close(got, want.reshape(1, Hq * D), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="attend: keys"):
        _step(Hq, Hk, D).attend(q, key.to(torch.bfloat16), value, scaling=1.0)
    if n > 1:  # columns not contiguous
        with pytest.raises(ValueError, match="attend: keys"):
            _step(Hq, Hk, D).attend(q, key.transpose(2, 3).contiguous().transpose(2, 3), value, scaling=1.0)
