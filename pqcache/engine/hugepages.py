"""Large host buffers that decode steps read on transparent huge pages: the weight copies and the host tier's keys
and values.

A decode step streams every byte of the LM head's int8 rows (168 MB for Gemma 3) and of the decoder's (100 MB),
and reads a few thousand scattered rows of each PQ layer's keys and values: with 4 KiB pages that is a TLB miss,
and a page walk, every 4 KiB of a stream and nearly every scattered row. On 2 MiB pages (Linux's transparent huge
pages, which the kernels here leave to `madvise`) the same bytes take 1/512 of the misses. The same native kernels
over the same numbers, alternating in one process on a busy Zen 3 (ad hoc): the LM head's int8 pass a median of
18.1 ms against 19.7 on 4 KiB pages, a step's 72 decoder products 12.4 against 13.2 (docs/benchmarks.md).

Only a buffer of at least MIN_BYTES gets its own mapping: a huge page is allocated whole when touched, so a small
matrix on its own mapping could waste most of 2 MiB. The decoder's matrices therefore share one arena
(`into_arena`). Elsewhere (no MADV_HUGEPAGE, THP off) the memory is the same private anonymous memory, on
whatever pages the kernel gives: nothing changes but the speed.
"""

from __future__ import annotations

import ctypes
import math
import mmap

import torch

HUGE_PAGE = 2 << 20
MIN_BYTES = 8 << 20  # below this a buffer keeps torch's allocator (a huge page is 1/4 of it)


def huge_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised contiguous tensor on 2 MiB-aligned private anonymous memory advised MADV_HUGEPAGE (the
    tensor keeps the mapping alive); torch.empty for buffers under MIN_BYTES or where the advice is unknown."""
    numel = math.prod(shape)
    nbytes = numel * dtype.itemsize
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if nbytes < MIN_BYTES or advice is None:
        return torch.empty(shape, dtype=dtype, device="cpu")
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        region.madvise(advice)
    except OSError:  # a kernel without THP: the region is still ordinary memory
        pass
    start = ctypes.addressof(ctypes.c_char.from_buffer(region))
    return torch.frombuffer(region, dtype=dtype, count=numel, offset=-start % HUGE_PAGE).view(shape)


def into_arena(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of `tensors` (contiguous, one dtype) as views of one huge_empty buffer, in order; the originals are
    left to the caller to drop."""
    if not tensors:
        return []
    arena = huge_empty((sum(t.numel() for t in tensors),), tensors[0].dtype)
    out, start = [], 0
    for t in tensors:
        view = arena[start : start + t.numel()].view(t.shape)
        view.copy_(t)
        out.append(view)
        start += t.numel()
    return out
