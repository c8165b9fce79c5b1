"""The sliding-window layers' cache (15 of Gemma 3's 18 layers) without copying the window every step.

transformers' DynamicSlidingWindowLayer concatenates the kept window (sliding_window - 1 tokens) with the new
token and slices the result: a decode step copies each sliding layer's whole window (1 MB per layer in
float32 for the bundled model). Here decode steps append into a preallocated buffer with `SPARE` free slots
and return a view of it; once the spare slots are used up, the window moves to the front of a new buffer.
The keys and values returned, their order and the mask sizes are exactly the parent's, so attention is
unchanged; longer forwards (a prefill chunk, a question) and recorded pasts use the parent's update.
Memory: SPARE more tokens per layer than the window (each layer's buffer is its own).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicSlidingWindowLayer

SPARE = 256  # decode steps between two moves of the window


class AppendSlidingWindowLayer(DynamicSlidingWindowLayer):
    max_append = 4  # tokens per update that take the in-place path

    def __init__(self, sliding_window: int, **kwargs):
        super().__init__(sliding_window, **kwargs)
        self.buf_k = self.buf_v = None  # (B, H, keep + SPARE, D)
        self.end = 0  # tokens written into the buffers; the window is buf[:, :, end - len(window) : end]
        self._window_k = None  # the keys view this layer set last

    def update(self, key_states, value_states, *args, **kwargs):
        Q = key_states.shape[-2]
        if not self.is_initialized or self.record_past or Q > self.max_append:
            self.buf_k = self.buf_v = self._window_k = None
            return super().update(key_states, value_states, *args, **kwargs)
        keep = self.sliding_window - 1
        n = self.keys.shape[-2]  # the window held now (<= keep)
        # a new buffer when none is open, when it is full, or when anything else (the parent's update, crop,
        # reorder_cache, batch_select_indices) replaced the window since the last step
        if self.buf_k is None or self.end + Q > self.buf_k.shape[-2] or self.keys is not self._window_k:
            self._move_window(n, keep + max(SPARE, Q))
        self.buf_k[:, :, self.end : self.end + Q] = key_states
        self.buf_v[:, :, self.end : self.end + Q] = value_states
        self.end += Q
        self.cumulative_length += Q
        full_k = self.buf_k[:, :, self.end - n - Q : self.end]  # what the parent's cat would return
        full_v = self.buf_v[:, :, self.end - n - Q : self.end]
        self.keys, self.values = full_k[:, :, -keep:], full_v[:, :, -keep:]
        self._window_k = self.keys
        return full_k, full_v

    def _move_window(self, n: int, capacity: int):
        """The window (n tokens) to the front of new buffers of `capacity` tokens."""
        B, H, _, D = self.keys.shape
        self.buf_k = torch.empty((B, H, capacity, D), dtype=self.keys.dtype, device=self.keys.device)
        self.buf_v = torch.empty_like(self.buf_k)
        self.buf_k[:, :, :n], self.buf_v[:, :, :n] = self.keys, self.values
        self.end = n
