"""Where a process's memory goes: file-backed weights given back (fastpath/pages.py), the LM head's copies built a
slice at a time, and the C heap trimmed after a prefill chunk."""

import numpy as np
import pytest
import torch

from pqcache.engine.heap import release_host_memory
from pqcache.fastpath import pages
from pqcache.fastpath.lmhead import QUANTIZE_ROWS, ExactArgmaxHead
from tests.tiny import tiny_model


def _mapped(tmp_path, n: int = 1 << 20) -> torch.Tensor:
    """n float32 values in a file, mapped privately as transformers maps a safetensors file."""
    path = tmp_path / "weights.bin"
    np.arange(n, dtype=np.float32).tofile(path)
    return torch.from_file(str(path), shared=False, size=n, dtype=torch.float32)


def _resident(t: torch.Tensor) -> int:
    return pages._mapping(t.data_ptr())["Rss"]  # kB of the mapping in this process's resident set


def test_a_files_pages_leave_the_resident_set_and_come_back_unchanged(tmp_path):
    weights = _mapped(tmp_path)
    total = float(weights.sum())  # every page read: resident
    assert pages.releasable(weights) and _resident(weights) >= 4000
    assert pages.release(weights) >= weights.nbytes - 2 * pages.PAGE
    assert _resident(weights) < 64  # gone from the resident set (a partial page at each end may stay)
    assert float(weights.sum()) == total and _resident(weights) >= 4000  # read back from the file, the same numbers


def test_memory_that_is_not_an_unwritten_file_is_never_released(tmp_path):
    """Anonymous memory would be zeroed and a written page would revert to the file's bytes: both are refused."""
    anonymous = torch.arange(1 << 20, dtype=torch.float32)
    assert not pages.releasable(anonymous) and pages.release(anonymous) == 0
    assert float(anonymous[-1]) == (1 << 20) - 1
    written = _mapped(tmp_path)
    written[10] = -1.0  # a copy-on-write page: the mapping now holds memory of its own
    assert not pages.releasable(written) and pages.release(written) == 0
    assert float(written[10]) == -1.0


@pytest.mark.parametrize("use_native", [True, False])
def test_the_heads_copies_built_a_slice_at_a_time_are_the_whole_matrixs(monkeypatch, use_native):
    """The int8 rows, scales and both bounds' columns do not depend on how many rows were quantized at once."""
    from pqcache.fastpath import lmhead

    head = torch.nn.Linear(64, 1000, bias=False)
    whole = ExactArgmaxHead(head, use_native=use_native)
    monkeypatch.setattr(lmhead, "QUANTIZE_ROWS", 96)  # 11 slices, the last one short
    sliced = ExactArgmaxHead(head, use_native=use_native)
    assert QUANTIZE_ROWS >= 1000
    for name in ("q", "scale", "slack"):
        assert torch.equal(getattr(whole, name), getattr(sliced, name)), name
    if whole.int4:
        assert torch.equal(whole.slack4, sliced.slack4)


def test_a_chunked_prefill_hands_its_temporaries_back_and_keeps_its_answer(monkeypatch):
    """release_host_memory after each chunk changes no number: the same logits with it as without."""
    from pqcache.engine import heap
    from pqcache.serving import generate

    model = tiny_model("llama")
    ids = torch.randint(1, 96, (1, 300), generator=torch.Generator().manual_seed(1))
    calls = []
    monkeypatch.setattr(generate, "release_host_memory", lambda: calls.append(1) or heap.release_host_memory())
    with torch.no_grad():
        chunked = generate.prefill(model, ids, generate.make_cache(model, "full"), chunk_tokens=64)
        whole = generate.prefill(model, ids, generate.make_cache(model, "full"), chunk_tokens=None)
    assert len(calls) == 5
    torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=1e-5)
    release_host_memory()  # callable anywhere, any number of times


@pytest.mark.parametrize("use_native", [True, False])
def test_a_step_with_many_exact_rows_gives_the_heads_file_pages_back(tmp_path, use_native):
    """Each exact row read from the mapped file brings its neighbours' pages in too: a step scoring more than
    RELEASE_AFTER_ROWS rows exactly hands the head's pages back after it, and its argmax and logits stay exact."""
    from pqcache.fastpath.lmhead import RELEASE_AFTER_ROWS

    V, D, tied = 8192, 64, 500  # rows 0..499 alike: a flat top that leaves them all candidates
    g = np.random.default_rng(0)
    w = (g.standard_normal((V, D)) * 0.01).astype(np.float32)
    w[:tied] = g.standard_normal(D).astype(np.float32)
    w[:tied] += np.arange(tied, dtype=np.float32)[:, None] * 1e-7  # row tied - 1 wins, by a hair
    path = tmp_path / "head.bin"
    w.tofile(path)
    weight = torch.from_file(str(path), shared=False, size=V * D, dtype=torch.float32).view(V, D)
    head = torch.nn.Linear(D, V, bias=False)
    head.weight = torch.nn.Parameter(weight, requires_grad=False)  # the file's pages, not a copy
    fast = ExactArgmaxHead(head, use_native=use_native)
    assert _resident(weight) < 64  # given back as the copies were built
    hidden = torch.from_numpy(w[0]).view(1, 1, D).clone()
    with torch.no_grad():
        exact = head(hidden)  # reads every row
        assert pages.release(weight) > 0 and _resident(weight) < 64
        logits = fast(hidden)
    assert fast.stats["candidates"] > RELEASE_AFTER_ROWS and fast.stats["exact_fallbacks"] == 0
    assert int(logits.argmax()) == int(exact.argmax())
    torch.testing.assert_close(logits[0, 0, :tied], exact[0, 0, :tied])  # the candidates: exact logits
    assert _resident(weight) < 64  # the rows' pages (and their neighbours') left the resident set again
