"""How the model runs fast on the machine at hand: one `dtype` setting for weights and compute.

None (the default): float32 on a CPU, bfloat16 on CUDA. On a CPU bf16 is faster (prefill 1.2-1.3x, half the
weight bytes) but not the default: with it the bundled model misread the sample pass key at a 1/5 budget (then
the app's default) in tests/model/test_real_model.py, which float32 answers. "auto" picks bfloat16 where the CPU has
native bf16 arithmetic (AVX-512 BF16 or AMX) and on CUDA, float32 elsewhere (where bf16 would be emulated and
slower). "float32" and "bfloat16" force one.
"""

from __future__ import annotations

import os
from functools import cache

import torch

from pqcache.fastpath.choices import DTYPE_CHOICES

DTYPES = {name: getattr(torch, name) for name in DTYPE_CHOICES if name != "auto"}
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")  # /proc/cpuinfo flags of native bf16 dot products


@cache
def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bf16 dot products natively (Linux: the flags in /proc/cpuinfo)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return any(flag in line.split() for flag in BF16_CPU_FLAGS)
    except OSError:
        pass
    return False


def resolve_dtype(dtype, device: str = "cpu") -> torch.dtype:
    """A dtype setting (None, "auto", "float32", "bfloat16" or a torch.dtype) -> torch.dtype."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None:
        return torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    if dtype == "auto":
        if str(device).startswith("cuda") or cpu_has_native_bf16():
            return torch.bfloat16
        return torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}, got {dtype!r}")
    return DTYPES[dtype]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def available_cpus() -> int:
    """CPUs this process may run on (its affinity mask: a container's share, not the host's)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1
