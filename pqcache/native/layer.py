"""A decoder layer's one-token step in C (layer_step.c; Gemma 3's or the Llama family's), for fastpath/layer.py: the
layer's weights by address once, then a few calls a step."""

from __future__ import annotations

import ctypes

import torch

from pqcache.native import KV_KINDS, library


class LayerWeights(ctypes.Structure):
    """layer_step.c's Layer: a decoder layer's sizes, norm weights and int8 products, by address."""

    _fields_ = [(name, ctypes.c_int64) for name in ("E", "Hq", "Hk", "D", "I", "act")] + [("eps", ctypes.c_double)]
    _fields_ += [(name, ctypes.c_void_p) for name in ("w_in", "w_qk", "w_post_attn", "w_pre_ff", "w_post_ff")]
    _fields_ += [("qkv_bias", ctypes.c_void_p)]
    _fields_ += [(name + "_q", ctypes.c_void_p) for name in ("qkv", "o", "gate_up", "down")]
    _fields_ += [(name + "_scale", ctypes.c_void_p) for name in ("qkv", "o", "gate_up", "down")]


class LayerStep:
    """One decoder layer's decode step for one token (layer_step.c; Gemma 3's or the Llama family's): qkv, then the
    caller's cache update, then attend (or the caller's own attention), then out. Needs library() (not None)."""

    def __init__(self, sizes: dict, eps: float, extras: dict, products: dict):
        """sizes: E, Hq, Hk, D, I, act (0 GELU tanh, 1 SiLU). extras: the norms' weights as applied w_in, w_qk
        (Hq + Hk, D), w_post_attn, w_pre_ff, w_post_ff, and qkv_bias ((Hq + 2 Hk) D,), float32, None where the
        layer has none. products: qkv, o, gate_up, down -> Int8Product. All kept: C reads their memory."""
        self.E, self.Hq, self.Hk, self.D, self.I = (sizes[k] for k in ("E", "Hq", "Hk", "D", "I"))
        self._keep = {k: w.to(torch.float32).contiguous() for k, w in extras.items() if w is not None}
        self._keep.update({k: (m.q, m.scale) for k, m in products.items()})
        fields = {k: w.data_ptr() for k, w in self._keep.items() if k in extras}  # missing ones stay NULL
        fields.update({f"{k}_q": m.q.data_ptr() for k, m in products.items()})
        fields.update({f"{k}_scale": m.scale.data_ptr() for k, m in products.items()})
        self.weights = LayerWeights(**sizes, eps=eps, **fields)
        self._pointer = ctypes.byref(self.weights)
        self._lib = library()

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
        """x (1, E) float32 contiguous, cos, sin_signed (D,) contiguous -> (Hq + 2 Hk, D): the normed, rotated q
        and k heads, then v (a new tensor each call: the cache may keep views of it)."""
        out = torch.empty(self.Hq + 2 * self.Hk, self.D)
        if self._lib.layer_qkv(self._pointer, x.data_ptr(), cos.data_ptr(), sin_signed.data_ptr(), out.data_ptr()):
            raise MemoryError("layer_qkv: no scratch memory")
        return out

    def attend(self, q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float) -> torch.Tensor:
        """q (Hq, D) contiguous, key, value (1, Hk, n, D) with contiguous rows (a window's view is fine), equal
        strides and one dtype of KV_KINDS (half rows widened as read) -> (1, Hq * D): softmax attention of the one
        query row over all n keys."""
        n = key.shape[2]
        same = value.stride() == key.stride() and value.dtype == key.dtype and key.dtype in KV_KINDS
        if key.stride()[2:] != (self.D, 1) or not same:
            raise ValueError(f"attend: keys {tuple(key.shape)} {key.dtype} {key.stride()}, values {value.stride()}")
        out = torch.empty(1, self.Hq * self.D)
        kind = KV_KINDS[key.dtype]
        args = (q.data_ptr(), self.Hq, key.data_ptr(), value.data_ptr(), kind, self.Hk, key.stride(1), n, self.D)
        if self._lib.attend_row(*args, scaling, out.data_ptr()):
            raise MemoryError("attend_row: no scratch memory")
        return out

    def out(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """x (1, E), attn (1, Hq * D) float32 contiguous -> the layer's output (1, E)."""
        y = torch.empty(1, self.E)
        if self._lib.layer_out(self._pointer, x.data_ptr(), attn.data_ptr(), y.data_ptr()):
            raise MemoryError("layer_out: no scratch memory")
        return y

    def window_step(self, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, window: tuple, scaling: float):
        """The whole step of a layer whose cache is a window buffer, in one call (layer_window_step): x, cos,
        sin_signed as for qkv; window = (keys, values, slot, n): buffers (1, Hk, N, D) of one kind of KV_KINDS, rows
        contiguous; the new key and value go into row `slot` (rounded to that kind as a copy rounds), the attention
        reads the n rows ending there -> the layer's output (1, E)."""
        keys, values, slot, n = window
        if keys.stride() != values.stride() or keys.dtype != values.dtype or keys.dtype not in KV_KINDS:
            raise ValueError(f"window_step: keys {keys.dtype} {keys.stride()}, values {values.dtype}")
        if keys.shape[0] != 1 or keys.stride()[2:] != (self.D, 1) or not 0 < n <= slot + 1 <= keys.shape[2]:
            raise ValueError(f"window_step: buffers {tuple(keys.shape)} {keys.stride()}, row {slot}, {n} rows")
        y = torch.empty(1, self.E)
        args = (self._pointer, x.data_ptr(), cos.data_ptr(), sin_signed.data_ptr(), keys.data_ptr(), values.data_ptr())
        args += (KV_KINDS[keys.dtype], keys.stride(1), slot, n, scaling)
        if self._lib.layer_window_step(*args, y.data_ptr()):
            raise MemoryError("layer_window_step: no scratch memory")
        return y
