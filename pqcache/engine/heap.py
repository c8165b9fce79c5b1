"""Freed host memory handed back to the OS: glibc keeps what a process freed in its heaps, so its resident set stays
at the high-water mark of its temporaries (a prefill chunk's activations, a load's copies) unless told otherwise."""

from __future__ import annotations

import ctypes


def release_host_memory() -> None:
    """Hand freed heap pages back to the OS (glibc's malloc_trim; nothing where there is no glibc)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
