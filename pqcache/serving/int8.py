"""Int8 weight-only decoder linears for decode steps: a CPU decode step reads every weight once per token.

The bundled model's 18 decoder layers hold 100M weights: 400 MB to read per token in float32, 100 MB as int8 rows
with one bf16 scale each (torch's own `_weight_int8pack_mm` kernel, which wants bf16 activations; the end-to-end
effect is in docs/benchmarks.md). Forwards with more rows than `max_rows` (a prefill chunk, scoring)
use the model's own weights, so the prompt's keys and values, and with them the PQ codes, are the model's;
only the few-row decode steps read the int8 copy. Greedy answers can differ from float32 decoding
(W8A16 rounding); the quality guard in docs/results.md measures that, and `decode_weights="model"` turns it off.
"""

from __future__ import annotations

import torch
from torch import nn

DECODE_WEIGHTS = ("int8", "model")


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w (N, K) -> int8 rows q (N, K) and their bf16 scales (N,), round to nearest: w ~ q * scale."""
    w = w.detach().float()
    scale = (w.abs().amax(1).clamp(min=1e-12) / 127).to(torch.bfloat16)
    q = torch.round(w / scale.float()[:, None]).clamp(-127, 127).to(torch.int8)
    return q.contiguous(), scale


def int8_kernel_takes(in_features: int) -> bool:
    """Whether torch's int8-weight kernel exists and can take rows of this width (it reads past rows whose length
    is not a multiple of 16: garbage, or a crash)."""
    return hasattr(torch.ops.aten, "_weight_int8pack_mm") and in_features % 16 == 0


# Sibling projections that read the same input: one matmul over their stacked int8 rows serves them all.
FUSED_SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class Int8DecodeLinear(nn.Module):
    def __init__(self, linear: nn.Linear, max_rows: int = 4):
        """linear: the model's layer (kept, not copied: longer forwards use it). max_rows: forwards with more
        rows than this use it too."""
        super().__init__()
        self.linear, self.max_rows = linear, max_rows
        q, scale = quantize_rows(linear.weight)
        self.register_buffer("q", q, persistent=False)  # (N, K) int8
        self.register_buffer("scale", scale, persistent=False)  # (N,) bf16
        self.group: FusedSiblings | None = None
        self.cols = slice(0, q.shape[0])  # this projection's columns of the group's output

    @property
    def weight(self):  # transformers and PEFT-style code read .weight / .bias of a projection
        return self.linear.weight

    @property
    def bias(self):
        return self.linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., K) -> (..., N)."""
        rows = x.numel() // x.shape[-1]
        if rows > self.max_rows or x.device.type != "cpu":
            return self.linear(x)
        if self.group is not None:
            y = self.group.output(x, rows)[:, self.cols]
        else:
            y = torch.ops.aten._weight_int8pack_mm(x.reshape(rows, -1).to(torch.bfloat16), self.q, self.scale)
        y = y.to(x.dtype)
        if self.linear.bias is not None:
            y = y + self.linear.bias
        return y.view(*x.shape[:-1], -1)


class FusedSiblings:
    """q/k/v (or gate/up) of one layer as one int8 matrix: the first of them called with an input computes
    every sibling's output in one kernel call; the others, called with the same tensor (same object, not
    modified since), take their columns. An input seen by one sibling only (another architecture's wiring)
    still gets the right answer, at the cost of the whole group's matmul."""

    def __init__(self, members: list[Int8DecodeLinear]):
        self.q = torch.cat([m.q for m in members])  # (sum N, K) int8
        self.scale = torch.cat([m.scale for m in members])
        start = 0
        for m in members:  # the members keep views into the stacked copy, not their own
            n = m.q.shape[0]
            m.q, m.scale, m.cols, m.group = (
                self.q[start : start + n],
                self.scale[start : start + n],
                slice(start, start + n),
                self,
            )
            start += n
        # (input, its version, output): one tuple, swapped whole, so that threads sharing the model
        # (several sessions decoding at once) never pair one input with another's output
        self.last: tuple | None = None

    def output(self, x: torch.Tensor, rows: int) -> torch.Tensor:
        last = self.last
        if last is not None and last[0] is x and last[1] == x._version:
            return last[2]
        y = torch.ops.aten._weight_int8pack_mm(x.reshape(rows, -1).to(torch.bfloat16), self.q, self.scale)
        self.last = (x, x._version, y)
        return y


def install_int8_decode(model) -> int:
    """Wrap every nn.Linear inside the model's decoder layers (not the LM head, not the embeddings; not one whose
    input width the kernel cannot take) in an Int8DecodeLinear, and stack the siblings of FUSED_SIBLINGS.
    Returns how many were wrapped (0 where the kernel is missing)."""
    from pqcache.engine.cache import decoder_layers

    wrapped = 0
    for _, layer in decoder_layers(model):
        for parent in list(layer.modules()):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear) and int8_kernel_takes(child.in_features):
                    setattr(parent, name, Int8DecodeLinear(child))
                    wrapped += 1
            for names in FUSED_SIBLINGS:
                members = [getattr(parent, n, None) for n in names]
                if all(isinstance(m, Int8DecodeLinear) for m in members):
                    if len({m.q.shape[1] for m in members}) == 1:  # the same input width
                        FusedSiblings(members)
    return wrapped
