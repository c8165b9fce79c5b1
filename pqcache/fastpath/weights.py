"""Quantized copies of the decoder linears for decode steps: a CPU decode step reads every weight once per token.

The bundled model's 18 decoder layers hold 100M weights: 400 MB to read per token in float32, 100 MB as int8 rows
(one bf16 scale each), 56 MB as int4 groups of 32 (a bf16 scale and zero each); quantize.py has the kernels, the
end-to-end effect is in docs/benchmarks.md. Forwards with more rows than `max_rows` (a prefill chunk, scoring)
use the model's own weights, so the prompt's keys and values, and with them the PQ codes, are the model's;
only the few-row decode steps read the quantized copy. Greedy answers can differ from float32 decoding
(W8A16 / W4A16 rounding); the quality guard in docs/results.md measures that, and `decode_weights="model"` turns
it off.
"""

from __future__ import annotations

import torch
from torch import nn

from pqcache.engine.hugepages import into_arena
from pqcache.engine.kernels import DEFAULT_KERNELS, Kernels
from pqcache.fastpath.choices import DEFAULT_DECODE_WEIGHTS
from pqcache.fastpath.pages import Pages
from pqcache.fastpath.quantize import WEIGHT_KINDS, Int8Rows, is_four_bit

# Sibling projections that read the same input: one matmul over their stacked rows serves them all.
FUSED_SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class DecodeLinear(nn.Module):
    def __init__(
        self, linear: nn.Linear, kind: str = "int8", max_rows: int = 4, quantize: bool = True, release: bool = True
    ):
        """linear: the model's layer (kept, not copied: longer forwards use it). kind: "int8" or "int4"
        (quantize.py). max_rows: forwards with more rows than this use the model's layer too. quantize=False: a
        member of FusedSiblings, which holds the copy."""
        super().__init__()
        self.linear, self.kind, self.max_rows = linear, kind, max_rows
        self.release = release  # a longer forward gives the float weights' file pages back after use
        self.weights = WEIGHT_KINDS[kind][0](linear.weight) if quantize else None  # Int8Rows or Int4Groups
        # the model's weights, where they are a file's pages: read by longer forwards only, then given back
        self.pages = Pages(linear.weight)
        self.pages.release()
        self.group: FusedSiblings | None = None
        self.cols = slice(0, linear.out_features)  # this projection's columns of the group's output

    @property
    def weight(self):  # transformers and PEFT-style code read .weight / .bias of a projection
        return self.linear.weight

    @property
    def bias(self):
        return self.linear.bias

    def float_weight(self) -> torch.Tensor:
        return self.linear.weight.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., K) -> (..., N)."""
        rows = x.numel() // x.shape[-1]
        if rows > self.max_rows or x.device.type != "cpu":
            y = self.linear(x)
            if self.release:
                self.pages.release()
            return y
        if self.group is not None:
            y = self.group.output(x, rows)[:, self.cols].contiguous()  # its own tensor, not a view of the group's
        else:
            y = self.weights.mm(x.reshape(rows, -1))
        y = y.to(x.dtype)
        if self.linear.bias is not None:
            y = y + self.linear.bias
        return y.view(*x.shape[:-1], -1)


class FusedSiblings:
    """q/k/v (or gate/up) of one layer as one quantized matrix: the first of them called with an input computes
    every sibling's output in one kernel call; the others, called with the same tensor (same object, not
    modified since), take their columns. An input seen by one sibling only (another architecture's wiring)
    still gets the right answer, at the cost of the whole group's matmul."""

    def __init__(self, members: list[DecodeLinear]):
        # rows are quantized one by one (int8) or in groups within a row (int4): the stacked copy holds exactly
        # each member's own copy, which the members drop
        self.members = members
        self.weights = WEIGHT_KINDS[members[0].kind][0](self.float_weight())
        start = 0
        for m in members:
            n = m.linear.out_features
            m.weights, m.cols, m.group = None, slice(start, start + n), self
            m.pages.release()  # read again for the stacked copy
            start += n
        # (input, its version, output): one tuple, swapped whole, so that threads sharing the model
        # (several sessions decoding at once) never pair one input with another's output
        self.last: tuple | None = None

    def float_weight(self) -> torch.Tensor:
        return torch.cat([m.float_weight() for m in self.members])  # (sum N, K)

    def output(self, x: torch.Tensor, rows: int) -> torch.Tensor:
        last = self.last
        if last is not None and last[0] is x and last[1] == x._version:
            return last[2]
        y = self.weights.mm(x.reshape(rows, -1))
        self.last = (x, x._version, y)
        return y


def install_decode_weights(model, kind: str = DEFAULT_DECODE_WEIGHTS, kernels: Kernels = DEFAULT_KERNELS) -> int:
    """Wrap every nn.Linear inside the model's decoder layers (not the LM head, not the embeddings; not one whose
    input width the kernel cannot take) in a DecodeLinear of `kind` ("auto", "int8" or "int4"), and stack the
    siblings of FUSED_SIBLINGS. Returns how many were wrapped (0 where the kernel is missing). kernels: whether a
    longer forward gives the float weights' pages back after use (engine/kernels.py)."""
    release = kernels.release_weights_after_use
    from pqcache.engine.cache import decoder_layers

    takes = WEIGHT_KINDS["int8" if kind == "auto" else kind][1]
    wrapped = 0
    for _, layer in decoder_layers(model):
        for parent in list(layer.modules()):
            linears = {n: c for n, c in parent.named_children() if isinstance(c, nn.Linear) and takes(c.in_features)}
            made = {}
            for names in FUSED_SIBLINGS:  # siblings of the same input width: quantized once, stacked
                if all(n in linears for n in names) and len({linears[n].in_features for n in names}) == 1:
                    group_kind = kind_for([linears[n].weight for n in names], kind)
                    made.update(
                        {n: DecodeLinear(linears[n], group_kind, quantize=False, release=release) for n in names}
                    )
                    FusedSiblings([made[n] for n in names])
            for name, child in linears.items():
                setattr(
                    parent,
                    name,
                    made[name]
                    if name in made
                    else DecodeLinear(child, kind_for([child.weight], kind), release=release),
                )
                wrapped += 1
    # every int8 copy in one buffer on huge pages (a step streams all of them): views of it replace the copies
    linears = [m for m in model.modules() if isinstance(m, DecodeLinear)]
    held = {id(w): w for w in (m.group.weights if m.group else m.weights for m in linears)}  # a group's copy once
    copies = [w for w in held.values() if isinstance(w, Int8Rows)]
    for w, q in zip(copies, into_arena([w.q for w in copies])):
        w.use(q)
    return wrapped


def kind_for(weights: list[torch.Tensor], kind: str) -> str:
    """The copy a linear (or a stack of siblings) gets under `kind`: "auto" -> "int4" when every group of its
    weights lies on a 4-bit grid and the int4 kernel takes them, "int8" otherwise."""
    if kind != "auto":
        return kind
    four_bit = all(WEIGHT_KINDS["int4"][1](w.shape[1]) and is_four_bit(w) for w in weights)
    return "int4" if four_bit else "int8"
