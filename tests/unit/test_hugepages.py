"""Large host buffers on transparent huge pages (pqcache/engine/hugepages.py): the LM head's int8 rows, the decoder's
int8 copies (one arena) and the host tier's keys and values, with the same numbers as before."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pqcache.engine import hugepages
from pqcache.engine.hugepages import HUGE_PAGE, MIN_BYTES, huge_empty, into_arena
from tests.tiny import tiny_model

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_eligible(t: torch.Tensor) -> bool:
    """Whether the mapping holding t's first byte is eligible for huge pages (/proc/self/smaps' THPeligible)."""
    address, inside = t.data_ptr(), False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and head == "THPeligible:":
            return line.split()[1] == "1"
    raise AssertionError("no mapping holds the tensor")


@pytest.mark.skipif(not THP.exists() or "[never]" in THP.read_text(), reason="no transparent huge pages here")
def test_a_large_buffer_is_aligned_advised_and_kept_alive():
    t = huge_empty((MIN_BYTES // 4 + 5,), torch.float32)
    assert t.data_ptr() % HUGE_PAGE == 0 and _thp_eligible(t)
    t.fill_(1.5)  # writable, and the mapping lives as long as the tensor
    assert float(t.sum()) == 1.5 * t.numel()
    small = huge_empty((100, 10), torch.int8)  # under MIN_BYTES: torch's allocator, no mapping of its own
    assert small.shape == (100, 10) and small.dtype == torch.int8


def test_a_copy_and_arena_views_hold_the_same_numbers():
    g = torch.Generator().manual_seed(0)
    big = torch.randint(-127, 128, (MIN_BYTES // 640 + 3, 640), dtype=torch.int8, generator=g)
    copy = huge_empty(tuple(big.shape), torch.int8).copy_(big)
    assert torch.equal(copy, big) and copy.data_ptr() % HUGE_PAGE == 0
    parts = [torch.randn(n, 64, generator=g).to(torch.int8) for n in (300, 7, 33000)]
    views = into_arena(parts)
    assert all(torch.equal(v, p) and v.is_contiguous() for v, p in zip(views, parts))
    # one buffer, in order, no gaps
    assert views[1].data_ptr() == views[0].data_ptr() + parts[0].numel()
    assert views[2].data_ptr() == views[1].data_ptr() + parts[1].numel()
    assert into_arena([]) == []


def test_decode_weights_in_the_arena_give_the_same_steps(monkeypatch):
    """install_decode_weights moves every int8 copy into one arena: the decode step's logits are those of copies
    left where quantize_rows put them (the arena's threshold lowered so that a tiny model uses it)."""
    from transformers import DynamicCache

    from pqcache.fastpath.quantize import Int8Rows
    from pqcache.fastpath.weights import DecodeLinear, install_decode_weights

    ids = torch.randint(1, 96, (1, 40), generator=torch.Generator().manual_seed(2))
    outs = []
    for threshold in (1 << 62, 1024):
        monkeypatch.setattr(hugepages, "MIN_BYTES", threshold)
        model = tiny_model("gemma3")
        install_decode_weights(model, "int8")
        linears = [m for m in model.modules() if isinstance(m, DecodeLinear)]
        copies = list({id(w): w for w in (m.group.weights if m.group else m.weights for m in linears)}.values())
        assert copies and all(isinstance(w, Int8Rows) for w in copies)
        qs = [w.q for w in copies]
        if threshold == 1024:  # views of one buffer
            base = min(q.data_ptr() for q in qs)
            assert max(q.data_ptr() + q.numel() for q in qs) - base == sum(q.numel() for q in qs)
        with torch.no_grad():
            cache = DynamicCache(config=model.config)
            model(ids, past_key_values=cache)
            outs.append(model(ids[:, -1:], past_key_values=cache).logits)
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)


def test_the_host_tiers_rows_on_huge_pages_read_the_same(monkeypatch):
    """The host tier's key and value stores on a CPU come from huge_empty: appends across a regrowth, the native
    re-rank scores and the values' weighted sums equal those of a tier on torch's allocator."""
    from pqcache.engine.layer.host import HostTier

    g = torch.Generator().manual_seed(5)
    k, v = torch.randn(1, 2, 900, 64, generator=g), torch.randn(1, 2, 900, 64, generator=g)
    pos, q, p = torch.randint(0, 900, (1, 2, 50), generator=g), torch.randn(1, 2, 3, 64), torch.rand(1, 2, 50, 3)
    results = []
    for threshold in (1 << 62, 1024):
        monkeypatch.setattr(hugepages, "MIN_BYTES", threshold)
        tier = HostTier(1, 2, 64, torch.float16, torch.device("cpu"), compute_dtype=torch.float32)
        tier.append(k[:, :, :500], v[:, :, :500])
        tier.append(k[:, :, 500:], v[:, :, 500:])  # past the first reservation: a new store, the rows copied over
        assert (tier.own_k.data_ptr() % HUGE_PAGE == 0) == (threshold == 1024)
        results.append((tier.keys(), tier.key_scores(pos, q), tier.value_sums(pos, p)))
    for a, b in zip(*results):
        assert torch.equal(a, b)
