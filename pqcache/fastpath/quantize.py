"""Weight-only quantized copies for decode steps: int8 rows and int4 groups.

    Int8Rows    one bf16 scale per output row, round to nearest: w ~ q * scale       (pqcache/native, or
                                                                                   _weight_int8pack_mm)
    Int4Groups  groups of 32 weights with a bf16 scale and zero, 16 levels each:
                w ~ (q - 8) * scale + zero                                              (_weight_int4pack_mm_for_cpu)

Int8Rows multiplies with pqcache/native's int8_rows.c where it built (x rounded to int16), with torch's otherwise (x
rounded to bf16); Int4Groups with torch's (x rounded to bf16). Both return float32. A decode step reads every
weight once: 18 layers of the bundled model's decoder linears took 10 ms a step as int8 through torch's kernel and
4 ms as int4 here; the native int8 kernel reads them near the memory's streaming rate (docs/benchmarks.md, `bench
kernels`). Used by the decode linears (fastpath/weights.py) and the LM head (lmhead.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pqcache import native

GROUP = 32  # int4 group size: the kernel takes 32..256; 32 keeps the error smallest
PACK_ROWS = 16384  # rows quantized at a time (bounds the memory of quantizing the LM head), a multiple of 64
ROW_BLOCK = 64  # the int4 kernel packs rows in blocks of 64


def int8_kernel_takes(in_features: int) -> bool:
    """Whether torch's int8-weight kernel exists and can take rows of this width (it reads past rows whose length
    is not a multiple of 16: garbage, or a crash)."""
    return hasattr(torch.ops.aten, "_weight_int8pack_mm") and in_features % 16 == 0


def int4_kernel_available() -> bool:
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")


def int4_kernel_takes(in_features: int) -> bool:
    return int4_kernel_available() and in_features % GROUP == 0


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w (N, K) -> int8 rows q (N, K) and their bf16 scales (N,), round to nearest: w ~ q * scale."""
    w = w.detach().float()
    scale = (w.abs().amax(1).clamp(min=1e-12) / 127).to(torch.bfloat16)
    q = torch.round(w / scale.float()[:, None]).clamp(-127, 127).to(torch.int8)
    return q.contiguous(), scale


def quantize_int4(w: torch.Tensor, keep_grid: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w (V, D) float, V a multiple of 64, D of GROUP -> (packed (V, D/2) uint8 in the CPU kernel's layout,
    scales_and_zeros (D/GROUP, V, 2) bf16, err (V, D/GROUP) float: ||w - w~||_2 over each row's group), asymmetric:
    w~ = (q - 8) * scale + zero, q in 0..15. err uses the bf16 scale and zero the kernel really multiplies by.
    keep_grid: groups already on a 4-bit grid keep it (grid_steps; it sorts every group: 0.7 s per 10M weights here,
    so the LM head's copy, whose weights are 8-bit, does without)."""
    V, D = w.shape
    packed, sz, err = [], [], []
    for start in range(0, V, PACK_ROWS):
        wg = w[start : start + PACK_ROWS].view(-1, D // GROUP, GROUP)  # (n, G, 32)
        lo, hi = wg.amin(-1), wg.amax(-1)  # (n, G)
        # without keep_grid no group is taken as on a grid (and `step` is never read)
        step, on_grid = grid_steps(wg) if keep_grid else (lo, torch.zeros_like(lo, dtype=torch.bool))
        scale = torch.where(on_grid, step, (hi - lo) / 15).clamp(min=1e-8).to(torch.bfloat16)
        s = scale.float()
        # the level stored as q = 8 (the zero) is a level of the group: lo for (hi - lo) / 15 scales; for a group on
        # a grid of fewer levels, the one nearest 0, so that the zero's bf16 rounding is smallest
        span = ((hi - lo) / s).round()
        first = torch.where(on_grid, (8 + lo / s).round().clamp(min=0).minimum(15 - span), torch.zeros_like(lo))
        zero = (lo + (8 - first) * s).to(torch.bfloat16)
        s, z = scale.float()[..., None], zero.float()[..., None]
        q = torch.round((wg - z) / s + 8).clamp(0, 15)  # (n, G, 32)
        err.append((wg - ((q - 8) * s + z)).pow(2).sum(-1).sqrt())
        packed.append(torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.view(-1, D).to(torch.int32), 1))
        sz.append(torch.stack([scale, zero], -1).transpose(0, 1))  # (G, n, 2)
    return torch.cat(packed), torch.cat(sz, 1).contiguous(), torch.cat(err)


def grid_steps(wg: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """wg (..., GROUP) groups of weights -> (step, on_grid) (...): whether each group's weights already lie on a
    grid of at most 16 levels lo + j * step (a 4-bit quantized model's group, e.g. a GGUF Q4_K block of 32), and the
    step. Such a group is stored with that step as its scale: its int4 copy is the model's own weights up to the
    bf16 rounding of scale and zero, where the (hi - lo) / 15 scale of a group that does not use all 16 levels
    would put the levels elsewhere."""
    ordered = wg.sort(-1).values
    gaps = ordered[..., 1:] - ordered[..., :-1]
    lo, hi = ordered[..., 0], ordered[..., -1]
    tiny = (hi - lo).abs()[..., None] * 1e-4  # gaps below this are one level (fp32 rounding of a dequantization)
    step = torch.where(gaps > tiny, gaps, torch.inf).amin(-1)  # (...): the smallest gap between levels
    level = (wg - lo[..., None]) / step[..., None]
    on_grid = torch.isfinite(step) & ((level - level.round()).abs() <= 1e-3).all(-1) & (level.round().amax(-1) <= 15)
    return torch.where(on_grid, step, torch.zeros_like(step)), on_grid


def is_four_bit(w: torch.Tensor, probe_groups: int = 256) -> bool:
    """w (N, K), K a multiple of GROUP -> whether every group of GROUP weights lies on a 4-bit grid (the first
    probe_groups are checked alone first: a 5- or 8-bit tensor fails there, without sorting all of it)."""
    groups = w.detach().float().reshape(-1, GROUP)
    return bool(grid_steps(groups[:probe_groups])[1].all()) and bool(grid_steps(groups)[1].all())


class Int8Rows:
    def __init__(self, w: torch.Tensor, use_native: bool = True):
        """w (N, K) float, K a multiple of 16. use_native: multiply with pqcache/native's kernel when it built."""
        self.q, self.scale = quantize_rows(w)  # (N, K) int8, (N,) bf16
        # the native kernel, with the same scales in float32 (it rounds x to int16, not bf16)
        self.native = None
        if use_native and native.library() is not None:
            self.native = native.Int8Product(self.q, self.scale.float())

    def use(self, q: torch.Tensor) -> None:
        """Read the same int8 rows from `q` from now on (a view of engine/hugepages.py's arena)."""
        self.q = q
        if self.native is not None:
            self.native = native.Int8Product(q, self.scale.float())

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        """x (R, K) float -> (R, N) float32."""
        if self.native is not None:
            return self.native(x)
        return torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), self.q, self.scale).float()

    @property
    def nbytes(self) -> int:
        """What a product reads: the int8 weights and the kernel's scales (bf16 for torch's, float32 native)."""
        return self.q.numel() + (2 if self.native is None else 4) * self.scale.numel()


class Int4Groups:
    def __init__(self, w: torch.Tensor):
        """w (N, K) float, K a multiple of GROUP (rows padded with zeros to the kernel's blocks of 64)."""
        w = w.detach().float()
        self.N = w.shape[0]
        self.packed, self.scales_and_zeros, _ = quantize_int4(F.pad(w, (0, 0, 0, -self.N % ROW_BLOCK)), keep_grid=True)

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        """x (R, K) float -> (R, N) float32 (x rounded to bf16)."""
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), self.packed, GROUP, self.scales_and_zeros)
        return (y if y.shape[1] == self.N else y[:, : self.N]).float()

    @property
    def nbytes(self) -> int:
        return self.packed.numel() + 2 * self.scales_and_zeros.numel()


WEIGHT_KINDS = {"int8": (Int8Rows, int8_kernel_takes), "int4": (Int4Groups, int4_kernel_takes)}
