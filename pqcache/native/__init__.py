"""Native kernels for the CPU decode step, built from C at first use: where torch's own operators leave the
memory's speed on the table.

    int8_rows.c    int8 weight rows times a few float rows (the decode linears: quantize.Int8Rows). torch 2.13's
                   kernel reads the weights at a fifth to a third of the rate the memory streams; no maintained
                   PyPI package has a faster one-row weight-only kernel for x86 (tried: torchao 0.18, ONNX
                   Runtime, fbgemm, torch.compile's generated code). This one rounds the row to int16 (finer than
                   the bf16 rounding of torch's kernel) and sums exact integer products, with AVX-512 VNNI where
                   the CPU has it.
    gather_dot.c   the re-rank's exact scores read straight from the key store (methods/pqcache.rerank_exact),
                   instead of a gathered copy of every candidate's key and a matmul over it; and the attention's
                   weighted sum over the picks' values, read where they lie (layer/onerow.py).
    layer_step.c   a decoder layer's one-token step in three calls (Gemma 3's, the Llama family's; fastpath/layer.py):
                   the norms, rotary embedding, attention over a window, GELU or SiLU and residuals around
                   int8_rows.c's products, instead of two hundred small torch operators; and a PQ layer's attention
                   over its window and its picks, the picks' values read where they lie (attend_picks,
                   layer/onerow.py).
    pq_select.c    PQCache's selection (methods/pqcache.py): the PQ scores, the GQA combine and the top-k in one
                   call instead of about 140 torch operators a layer (wrapped in native/select.py).
    pq_codes.c     a decode step's PQ lookup tables and the new key's codes, instead of a batched matmul and
                   the reshapes around it (native/select.py).
    pq_step.c      a PQ layer's whole selection and attention for one token in one call, the kernels above in turn
                   (native/pq_step.py, layer/fused.py), without the Python between them.
    pq_complete.c  that call's estimate of the candidates it does not pick (completion) and its budget in mass
                   (pq_step.h: what the two share).

`python -m pqcache bench kernels` times each against torch's way (docs/benchmarks.md). The sources are compiled
together once per machine with the system's C compiler (`cc`, or $CC; 0.6 s here) into $PQCACHE_KERNEL_DIR
(default $PQCACHE_HOME/kernels, ~/.cache/pqcache/kernels), named by a hash of the sources, the flags and the CPU's
flags, since -march=native code may not run on another CPU sharing the folder. They link OpenMP, which resolves to
the libgomp torch has already loaded, so their threads are torch's (same count, same team: engine/threads.py).
Where there is no compiler, the build fails, or PQCACHE_NATIVE=0, `library()` is None and callers use torch's
operators; `status()` says which and why.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import torch

from pqcache.native.signatures import declare

SOURCES = [
    Path(__file__).with_name(name)
    for name in (
        "int8_rows.c",
        "gather_dot.c",
        "layer_step.c",
        "pq_select.c",
        "pq_codes.c",
        "pq_step.c",
        "pq_complete.c",
    )
]
HEADERS = [
    Path(__file__).with_name(name) for name in ("lanes16.h", "half_rows.h", "exp_poly.h", "pq_step.h")
]  # included by the sources: part of the build's name too
# -fno-trapping-math: the compiler may compute both sides of a float select (pq_select.c's exponentials, masked);
# without it that loop stayed scalar (0.69 against 0.44 ms a PQ search at 32K tokens, Zen 3). It changes no value:
# the kernels do not read the floating-point exception flags, and it allows no reordering of arithmetic.
FLAGS = ("-O3", "-march=native", "-fno-trapping-math", "-fopenmp", "-std=c11", "-shared", "-fPIC")
OPERANDS = (torch.int8, torch.float32)  # q, scale
# the element kinds of a key or value store the kernels read in place (half_rows.h's KV_F32, KV_F16, KV_BF16)
KV_KINDS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_why_not: list[str] = []  # why library() is None (set when it is)


def kernel_dir() -> Path:
    """$PQCACHE_KERNEL_DIR, else kernels/ in $PQCACHE_HOME (~/.cache/pqcache, where the models are converted)."""
    default = Path(os.environ.get("PQCACHE_HOME", Path.home() / ".cache" / "pqcache")) / "kernels"
    return Path(os.environ.get("PQCACHE_KERNEL_DIR", default))


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


def build(compiler: str | None = None) -> Path:
    """Compile the sources (if this machine's copy is not there yet) -> the shared library's path. Raises
    RuntimeError with the compiler's message when it fails."""
    compiler = compiler or os.environ.get("CC", "cc")
    if shutil.which(compiler) is None:
        raise RuntimeError(f"no C compiler: {compiler!r} is not on PATH (set CC, or install gcc)")
    parts = [path.read_bytes() for path in SOURCES + HEADERS] + [" ".join(FLAGS).encode(), _cpu_flags().encode()]
    key = hashlib.sha256(b"\0".join([*parts, compiler.encode()]))
    target = kernel_dir() / f"kernels-{platform.machine()}-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # a private name, then one rename: processes building at once never load a half-written file
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        command = [compiler, *FLAGS, *map(str, SOURCES), "-o", tmp, "-lm"]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=300)
        except subprocess.TimeoutExpired as error:
            raise RuntimeError(f"{compiler} took over {error.timeout:.0f} s on the native kernels") from error
        if done.returncode != 0:
            raise RuntimeError(f"{compiler} failed on the native kernels: {done.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return target


@cache
def library() -> ctypes.CDLL | None:
    """The built kernel, or None (torch's kernels then): PQCACHE_NATIVE=0, no C compiler, or a failed build (the
    reason in status())."""
    if os.environ.get("PQCACHE_NATIVE", "1") == "0":
        _why_not.append("off (PQCACHE_NATIVE=0)")
        return None
    try:
        lib = ctypes.CDLL(str(build()))
    except (RuntimeError, OSError) as error:
        _why_not.append(str(error))
        return None
    declare(lib)
    return lib


def status() -> str:
    """One line for logs and benchmarks: whether decode steps use the native kernels, and why not."""
    if library() is not None:
        return "native kernels (" + ", ".join(path.name for path in SOURCES) + ")"
    return "torch's operators (native kernels unavailable: " + "; ".join(_why_not) + ")"


class Int8Product:
    """y = x . (q * scale)^T for one int8 matrix: its operands checked once, then each call is one C call (about
    11 us a call here for a small matrix, 13 with the checks made every call, ad hoc; a decode step of the bundled model
    makes 72). Needs library() (not None)."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor):
        """q (N, K) int8, scale (N,) float32, both contiguous: kept, since the kernel reads their memory."""
        if q.dim() != 2 or scale.shape != q.shape[:1] or (q.dtype, scale.dtype) != OPERANDS:
            raise ValueError(f"Int8Product: q {tuple(q.shape)} {q.dtype}, scale {tuple(scale.shape)} {scale.dtype}")
        self.q, self.scale = q.contiguous(), scale.contiguous()
        self.N, self.K = q.shape
        self._lib = library()
        self._kernel = self._lib.int8_rows_mm
        self._operands = (self.q.data_ptr(), self.scale.data_ptr())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x (R, K) float -> (R, N) float32, x rounded to int16 per row (int8_rows.c)."""
        x = x.to(torch.float32).contiguous()  # the same tensor when it already is
        if x.dim() != 2 or x.shape[1] != self.K:
            raise ValueError(f"Int8Product: x {tuple(x.shape)} for weights of {self.K} columns")
        R = x.shape[0]
        y = torch.empty(R, self.N)
        if self._kernel(x.data_ptr(), *self._operands, y.data_ptr(), R, self.N, self.K) != 0:
            raise MemoryError("int8_rows_mm: no memory for the rounded rows")
        return y

    def candidates(self, x: torch.Tensor, slack: torch.Tensor, coef: torch.Tensor, rounding: float, max_cand: int):
        """One row x (1, K) -> its scores y (1, N) as __call__ computes them, and the rows that can win (k,) int64
        in order: y + bound >= max(y - bound), bound = coef @ slack + |y| * rounding (slack (2, N), coef (1, 2)
        float32), or None when more than max_cand can (int8_rows.c's int8_rows_candidates, one pass)."""
        x = x.to(torch.float32).contiguous()
        slack, coef = slack.to(torch.float32).contiguous(), coef.to(torch.float32).contiguous()
        if x.shape != (1, self.K) or slack.shape != (2, self.N) or coef.numel() != 2:
            raise ValueError(f"candidates: x {tuple(x.shape)}, slack {tuple(slack.shape)} for {self.N} x {self.K}")
        y, cand = torch.empty(1, self.N), torch.empty(max_cand, dtype=torch.int64)
        args = (x.data_ptr(), *self._operands, slack.data_ptr(), coef.data_ptr(), rounding, y.data_ptr())
        count = self._lib.int8_rows_candidates(*args, cand.data_ptr(), max_cand, self.N, self.K)
        if count < 0:
            raise MemoryError("int8_rows_candidates: no memory for the rounded row")
        return y, (cand[:count] if count <= max_cand else None)


def int8_rows_mm(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x (R, K) float, q (N, K) int8, scale (N,) float32 -> (R, N) float32 (Int8Product, once)."""
    return Int8Product(q, scale)(x)


def gather_weighted_sum(store: torch.Tensor, pos: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """store (S', D) float32, float16 or bfloat16 with unit column stride, pos (n,) int64 rows of it, p (n, R)
    float32 weights -> (R, D) float32: p.T @ store[pos] without the gathered copy (gather_dot.c; half rows widened
    to float32 first). Positions outside the store raise IndexError. Needs library() (not None)."""
    if store.dtype not in KV_KINDS or store.stride(1) != 1 or p.shape[0] != pos.numel():
        raise ValueError(f"gather_weighted_sum: store {tuple(store.shape)} {store.dtype}, p {tuple(p.shape)}")
    p, pos = p.to(torch.float32).contiguous(), pos.to(torch.int64).contiguous()
    n, R = p.shape
    if n:
        low, high = torch.aminmax(pos)
        if low < 0 or high >= store.shape[0]:
            raise IndexError(f"gather_weighted_sum: positions {int(low)}..{int(high)} outside {store.shape[0]} rows")
    out = torch.empty(R, store.shape[1])
    args = (store.data_ptr(), KV_KINDS[store.dtype], store.stride(0), pos.data_ptr(), n, p.data_ptr(), R)
    if library().gather_weighted_sum(*args, store.shape[1], out.data_ptr()):
        raise MemoryError("gather_weighted_sum: no memory for the partial sums")
    return out


def int16_rounding(x: torch.Tensor) -> torch.Tensor:
    """x (R, K) float32 -> x as int8_rows.c rounds it, a * xs (R, K) float32: a the nearest integer to
    x * (32767 / max|x|), xs = max|x| / 32767, per row, in the same fp32 operations (so the same a). For the
    bounds of the exact-argmax LM head, which need the rounding the kernel applied. Rows with an inf or a NaN: NaN."""
    top = x.abs().amax(-1, keepdim=True)  # (R, 1)
    finite, positive = x.isfinite().all(-1, keepdim=True), top > 0
    xs = torch.where(positive, top / 32767, 1.0)
    # a true division, as C's 32767.0f / top (`32767 / top` would be a reciprocal, then a product: rounded twice)
    inverse = torch.where(positive, torch.div(torch.full_like(top, 32767.0), top), 1.0)
    return torch.where(finite, torch.round(x * inverse) * xs, float("nan"))


def gather_dot(store: torch.Tensor, pos: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """store (S', D) float32, float16 or bfloat16 with unit column stride (rows may be further apart: a view of a
    larger buffer), pos (n,) int64 rows of it, q (R, D) float32 -> (n, R) float32: store[pos] @ q.T without the
    gathered copy (gather_dot.c; half rows widened to float32 first). A position outside the store raises
    IndexError, as an index would (C would read outside the buffer). Needs library() (not None)."""
    if store.dtype not in KV_KINDS or store.stride(1) != 1 or q.shape[1] != store.shape[1]:
        raise ValueError(f"gather_dot: store {tuple(store.shape)} {store.dtype}, q {tuple(q.shape)}")
    q, pos = q.to(torch.float32).contiguous(), pos.to(torch.int64).contiguous()
    n, (R, D) = pos.numel(), q.shape
    if n:
        low, high = torch.aminmax(pos)
        if low < 0 or high >= store.shape[0]:
            raise IndexError(f"gather_dot: positions {int(low)}..{int(high)} outside a store of {store.shape[0]} rows")
    out = torch.empty(n, R)
    args = (store.data_ptr(), KV_KINDS[store.dtype], store.stride(0), pos.data_ptr(), n, q.data_ptr(), R, D)
    library().gather_dot(*args, out.data_ptr())
    return out
