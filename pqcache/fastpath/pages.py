"""Weights read from a memory-mapped file give their resident pages back once the decode path holds its own copy.

transformers maps a safetensors file into memory (one private mapping of the file) and the model's parameters are
views into it: a page counts in the process's resident memory from its first read until the process ends. Building
the decode path's int8 copies reads every weight once (the LM head's 671 MB in float32 for the bundled model), after
which a decode step reads the copies only: the float32 pages stay resident for nothing. `release` tells the kernel
(madvise MADV_DONTNEED) that this process no longer needs a tensor's pages: they leave its resident set, stay in the
page cache, and come back from the file on the next read (an embedding row, a few exact LM-head rows, a prefill's
matmul), unchanged, since they were never written.

It only acts where that is true: the tensor lies in one private mapping of a file (not anonymous memory, whose pages
MADV_DONTNEED would zero) and none of its whole pages was ever written (each is still the file's page in
/proc/self/pagemap: a written page would revert to the file's bytes). Elsewhere (a model built in memory, not Linux)
it does nothing.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os

import numpy as np
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


def _region(address: int) -> dict | None:
    """The /proc/self/maps line of the mapping that holds `address`: its range, perms, inode and path. A tenth of
    smaps' cost (about 1 ms against 10 in a process with torch loaded): maps walks no page tables."""
    try:
        with open("/proc/self/maps", encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        head = line.split()
        start, end = (int(x, 16) for x in head[0].split("-"))
        if start <= address < end:
            return {"start": start, "end": end, "perms": head[1], "inode": head[4], "path": " ".join(head[5:])}
    return None


def _unwritten(start: int, end: int) -> bool:
    """Whether no page in [start, end) (whole pages of a private file mapping) was ever written: each page that is
    present is still the file's page (/proc/self/pagemap bit 61; a written page became anonymous memory) and none is
    in swap (bit 62: only anonymous pages go there). The kernel walks these pages alone, where smaps walks every
    mapping of the process (about 20 ms a call with torch loaded, 143 calls in a load of the bundled model)."""
    try:
        with open("/proc/self/pagemap", "rb") as f:
            f.seek(start // PAGE * 8)
            data = f.read((end - start) // PAGE * 8)
    except OSError:
        return False
    if len(data) != (end - start) // PAGE * 8:
        return False
    entries = np.frombuffer(data, dtype=np.uint64)
    present, swapped, file_page = (entries >> 63) & 1, (entries >> 62) & 1, (entries >> 61) & 1
    return not bool(((present & (file_page ^ 1)) | swapped).any())


def releasable(tensor: torch.Tensor) -> bool:
    """Whether `tensor`'s whole pages lie in a private mapping of a file and none was written (then `release` is
    safe)."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous() or os.name != "posix":
        return False
    region = _region(tensor.data_ptr())
    if region is None or region["inode"] == "0" or not region["path"].startswith("/") or region["perms"][3] != "p":
        return False  # anonymous memory (a model built in memory)
    if tensor.data_ptr() + tensor.nbytes > region["end"]:
        return False
    start, end = _whole_pages(tensor)
    return end > start and _unwritten(start, end)


def _whole_pages(tensor: torch.Tensor) -> tuple[int, int]:
    """The range of the whole pages inside the tensor (a neighbour's partial pages stay)."""
    return -(-tensor.data_ptr() // PAGE) * PAGE, (tensor.data_ptr() + tensor.nbytes) // PAGE * PAGE


def release(tensor: torch.Tensor) -> int:
    """Give `tensor`'s whole pages back (see above) -> the bytes advised (0 where it is not releasable)."""
    return Pages(tensor).release()


class Pages:
    """A tensor's whole pages, checked once (releasable) and then given back as often as wanted: a prefill's
    weights after each use (fastpath/weights.py), at the cost of reading them from the page cache next time."""

    def __init__(self, tensor: torch.Tensor):
        self.start, self.end = _whole_pages(tensor)
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
