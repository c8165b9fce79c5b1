"""The sliding-window layers' cache (15 of Gemma 3's 18 layers) without copying the window every step.

transformers' DynamicSlidingWindowLayer concatenates the kept window (sliding_window - 1 tokens) with the new
token and slices the result: a decode step copies each sliding layer's whole window (1 MB per layer in
float32 for the bundled model). Here decode steps append into a preallocated buffer with `SPARE` free slots
and return a view of it; once the spare slots are used up, the window moves to the front of a new buffer.
The keys and values returned, their order and the mask sizes are exactly the parent's, so attention is
unchanged; longer forwards (a prefill chunk, a question) and recorded pasts use the parent's update.
Memory: SPARE more tokens per layer than the window (each layer's buffer is its own).

kv_dtype (PQCacheConfig.kv_dtype: float16 on a CPU by default) is the window's storage, as for the host tier: keys
and values are rounded to it as they arrive (the window then holds half the bytes) and `update` hands them back
in the model's dtype; `update_stored` hands back the stored rows themselves (the native decode step reads half
rows as they lie). Full attention at the same KV dtype (full_attention.py) keeps its windows the same way.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers.cache_utils import DynamicSlidingWindowLayer

SPARE = 64  # decode steps between two moves of the window: a copy of the window every 64 steps (0.5 MB a layer in
# float16 for the bundled model, about 8 KB a step) against 64 more tokens a layer held (the pool counts them)


class AppendSlidingWindowLayer(DynamicSlidingWindowLayer):
    max_append = 4  # tokens per update that take the in-place path

    def __init__(self, sliding_window: int, kv_dtype_for: Callable | None = None, **kwargs):
        """kv_dtype_for(compute_dtype, device) -> the window's storage dtype (PQCacheConfig.kv_dtype_for), asked at
        the first update; None: the dtype the keys arrive in."""
        super().__init__(sliding_window, **kwargs)
        self.kv_dtype_for, self.kv_dtype = kv_dtype_for, None
        self.buf_k = self.buf_v = None  # (B, H, keep + SPARE, D)
        self.end = 0  # tokens written into the buffers; the window is buf[:, :, end - len(window) : end]
        self._window_k = None  # the keys view this layer set last

    def update(self, key_states, value_states, *args, **kwargs):
        """The parent's update: every key and value the new tokens attend to, in key_states' dtype."""
        keys, values = self.update_stored(key_states, value_states, *args, **kwargs)
        return keys.to(key_states.dtype), values.to(value_states.dtype)

    def update_stored(self, key_states, value_states, *args, **kwargs):
        """`update`, its keys and values as stored (kv_dtype): views of the window where a decode step appended."""
        Q = key_states.shape[-2]
        taken = self.take_slots(Q, key_states.dtype, key_states.device)
        if taken is None:
            self.buf_k = self.buf_v = self._window_k = None
            if key_states.dtype != self.kv_dtype:
                key_states, value_states = key_states.to(self.kv_dtype), value_states.to(self.kv_dtype)
            return super().update(key_states, value_states, *args, **kwargs)
        start, n = taken
        self.buf_k[:, :, start : start + Q] = key_states  # rounded to kv_dtype by the copy, as .to() rounds
        self.buf_v[:, :, start : start + Q] = value_states
        return self.buf_k[:, :, start + Q - n : start + Q], self.buf_v[:, :, start + Q - n : start + Q]

    def take_slots(self, Q: int, dtype: torch.dtype, device) -> tuple[int, int] | None:
        """update_stored's in-place path for Q new tokens (of dtype, on device) without its copies: rows start ..
        start + Q - 1 of buf_k and buf_v are theirs (the caller writes them: a native layer step does) -> (start, n):
        the n rows ending there are every key they attend to (what the parent's cat would return). None where that
        path does not apply (the parent's update then)."""
        if self.kv_dtype is None:
            rule = self.kv_dtype_for
            self.kv_dtype = dtype if rule is None else rule(dtype, device)
        if not self.is_initialized or self.record_past or Q > self.max_append:
            return None
        keep = self.sliding_window - 1
        n = self.keys.shape[-2]  # the window held now (<= keep)
        # a new buffer when none is open, when it is full, or when anything else (the parent's update, crop,
        # reorder_cache, batch_select_indices) replaced the window since the last step
        if self.buf_k is None or self.end + Q > self.buf_k.shape[-2] or self.keys is not self._window_k:
            self._move_window(n, keep + max(SPARE, Q))
        start = self.end
        self.end += Q
        self.cumulative_length += Q
        full_k = self.buf_k[:, :, self.end - n - Q : self.end]  # what the parent's cat would return
        full_v = self.buf_v[:, :, self.end - n - Q : self.end]
        self.keys, self.values = full_k[:, :, -keep:], full_v[:, :, -keep:]
        self._window_k = self.keys
        return start, n + Q

    def _move_window(self, n: int, capacity: int):
        """The window (n tokens) to the front of new buffers of `capacity` tokens."""
        B, H, _, D = self.keys.shape
        self.buf_k = torch.empty((B, H, capacity, D), dtype=self.keys.dtype, device=self.keys.device)
        self.buf_v = torch.empty_like(self.buf_k)
        self.buf_k[:, :, :n], self.buf_v[:, :, :n] = self.keys, self.values
        self.end = n
