"""Kernels: which of the decode step's faster implementations a run uses, as one setting passed where it is used.

Each field picks between a fast path and the general one it must equal (to the bit, or within float rounding where
a C kernel sums in another order). The defaults are the fastest on the machine at hand; the tests switch one to
compare the two, and `scripts/probe` alternates them in one process. The engine's parts read it as
`PQCacheConfig.kernels`, the model's fast decode layers get it from `install_fast_decode(model, kernels)` and its
decode weights from `install_decode_weights(model, kind, kernels)`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Kernels:
    # the cache's one-row decode step (engine/layer/onerow.py)
    values_in_place: bool = True  # the picks' values read where the host tier holds them, not copied first
    native_attention: bool = True  # ...and the whole attention in one C call (native/select.attend_picks) on a CPU
    fused: bool = True  # ...and with it the selection, in the same C call (native/pq_step), where nothing is recorded
    file_in_step: bool = True  # ...and the new token filed in that call too (off: a call of its own, as observed)
    # PQCache's selection (engine/methods/pqcache.py): search and re-rank in C where the operands allow
    native_select: bool = True
    # a CPU's block cache keeps its books only, as both tiers are host memory; on: it holds copies, as on a GPU
    block_copies_on_cpu: bool = False
    # the model's decode layers (fastpath/layer.py): a layer's step in C where its weights are native int8 ones...
    native_step: bool = True
    window_step: bool = True  # ...and a sliding-window layer's step in one C call (off: three)
    # the decode weights (fastpath/weights.py): a longer forward (a prefill chunk, a question) reads the model's float
    # weights; where they are a mapped file's pages they are given back after each use (pages.py), so a process
    # holds one layer's float weights at a time, not all of them beside their int8 copies: 375 MB less for the
    # bundled model, for re-reading them from the page cache at the next chunk (docs/benchmarks.md's memory table)
    release_weights_after_use: bool = True


DEFAULT_KERNELS = Kernels()
