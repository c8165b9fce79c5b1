"""Weights read from a memory-mapped file give their resident pages back once the decode path holds its own copy.

transformers maps a safetensors file into memory (one private mapping of the file) and the model's parameters are
views into it: a page counts in the process's resident memory from its first read until the process ends. Building
the decode path's int8 copies reads every weight once (the LM head's 671 MB in float32 for the bundled model), after
which a decode step reads the copies only: the float32 pages stay resident for nothing. `release` tells the kernel
(madvise MADV_DONTNEED) that this process no longer needs a tensor's pages: they leave its resident set, stay in the
page cache, and come back from the file on the next read (an embedding row, a few exact LM-head rows, a prefill's
matmul), unchanged, since they were never written.

It only acts where that is true: the tensor lies in one private mapping of a file (not anonymous memory, whose pages
MADV_DONTNEED would zero) and no page of that mapping was ever written (its smaps "Anonymous" is 0: a written page
would revert to the file's bytes). Elsewhere (a model built in memory, not Linux) it does nothing.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os

import torch

MADV_DONTNEED = 4
PAGE = mmap.PAGESIZE


def _mapping(address: int) -> dict | None:
    """The /proc/self/smaps entry of the mapping that holds `address`: its range, perms, path and fields (kB)."""
    try:
        with open("/proc/self/smaps", encoding="utf-8") as f:
            text = f.read()
    except OSError:
        return None
    entry = None
    for line in text.splitlines():
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5 and ":" not in head[0]:
            start, end = (int(x, 16) for x in head[0].split("-"))
            entry = {"start": start, "end": end, "perms": head[1], "inode": head[4], "path": " ".join(head[5:])}
            entry["holds"] = start <= address < end
        elif entry is not None and entry["holds"] and head and head[0].endswith(":") and len(head) >= 2:
            entry[head[0][:-1]] = int(head[1]) if head[1].isdigit() else head[1]
        if entry is not None and entry["holds"] and line.startswith("VmFlags"):
            return entry
    return entry if entry is not None and entry["holds"] else None


def releasable(tensor: torch.Tensor) -> bool:
    """Whether `tensor`'s bytes lie in an unwritten private mapping of a file (then `release` is safe)."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous() or os.name != "posix":
        return False
    m = _mapping(tensor.data_ptr())
    if m is None or m["inode"] == "0" or not m["path"].startswith("/") or m["perms"][3] != "p":
        return False
    return tensor.data_ptr() + tensor.nbytes <= m["end"] and m.get("Anonymous", 1) == 0


def release(tensor: torch.Tensor) -> int:
    """Give `tensor`'s whole pages back (see above) -> the bytes advised (0 where it is not releasable)."""
    return Pages(tensor).release()


class Pages:
    """A tensor's whole pages, checked once (releasable) and then given back as often as wanted: a prefill's
    weights after each use (fastpath/weights.py), at the cost of reading them from the page cache next time."""

    def __init__(self, tensor: torch.Tensor):
        self.start = -(-tensor.data_ptr() // PAGE) * PAGE  # whole pages inside the tensor: a neighbour's stay
        self.end = (tensor.data_ptr() + tensor.nbytes) // PAGE * PAGE
        if self.end <= self.start or not releasable(tensor):
            self.start = self.end = 0

    def release(self) -> int:
        """-> the bytes advised (0: nothing to give back)."""
        if self.end <= self.start:
            return 0
        return self.end - self.start if _madvise()(self.start, self.end - self.start, MADV_DONTNEED) == 0 else 0


@functools.cache
def _madvise():
    """libc's madvise, looked up once (a prefill calls it for each decoder linear of each chunk)."""
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return madvise
