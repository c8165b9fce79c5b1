"""A cheaper LM head whose greedy argmax stays exact: int8 (or int4, then int8) scores, exact scores for the few
that can win.

Gemma 3's head is a 262,144 x 640 projection: one decode step reads all of it (671 MB in float32, 335 MB in
bf16), more than the 18 decoder layers together. Each step narrows the vocabulary to the rows that can win, with
a bound on each approximate score:
    |h . w_i - score_i| <= sum_g ||h~_g||_2 ||w_ig - w~_ig||_2 + ||h - h~||_1 max_j |w_ij| + roundings
(w~: the dequantized row, h~: h as the kernel rounds it, g: a group of dimensions, Cauchy-Schwarz in each). A row
can win when its score plus bound reaches the best score minus its bound.

With pqcache/native (the default where it built): the int8 copy (one scale per row) scores every row with
int8_rows.c (h rounded to int16), which reads it near the memory's pace, and a decode step's bounds and candidate test
are computed in the same pass (int8_rows_candidates); a median of 1 row is left (7 of 262,144
at most, on 10 steps of a 32K-token context, ad hoc), and the model's own weights score those exactly.
With torch's kernels (h rounded to bf16), whose int8 kernel reads at a third of that pace, three stages:
1. an int4 copy (groups of 32 weights with a bf16 scale and zero each) scores every row (C1: a median of 4,500
   of 262,144 on real hidden states at 1K tokens, `decode_probe.py head`; 1,600-14,500 at 32K, ad hoc: the
   per-group bound is loose);
2. the int8 copy scores C1 only, gathered, with the same bound over one group -> C2 (a few hundred at most);
   when C1 is large (a flat distribution) the int8 pass reads every row instead (and does wherever torch lacks
   the int4 CPU kernel or D is not a multiple of 32);
3. the model's own weights score C2 exactly.

The argmax of the returned logits is the argmax of the exact head (up to floating-point summation order); every
other entry is an int4 or int8 score that failed a candidate test, so it is below the winner's exact logit.
Rows of a longer forward (prefill without logits_to_keep, scoring) use the exact head throughout.
Memory: the int8 copy is 168 MB; the int4 stage (torch's kernels only) adds about 127 MB (84 MB packed weights,
21 MB scales and zeros, 22 MB of per-group error norms).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pqcache import native
from pqcache.engine.hugepages import huge_empty
from pqcache.fastpath.pages import Pages, release
from pqcache.fastpath.quantize import GROUP, int4_kernel_available, int8_kernel_takes, quantize_int4, quantize_rows

BF16_UNIT = 2.0**-8  # unit roundoff of bf16 (8 significant bits, round to nearest): |bf16(v) - v| <= 2**-8 |v|
# x |score|: torch's kernels' bf16 output rounding (native's output is float32: a few 2**-24 inside this) and, in a
# bf16 model, the exact head's (of |h.w| <= |score| + bound, the bound's share in SLACK); the extra 2**-6 covers the
# fp32 rounding of the candidate test itself
OUTPUT_ROUNDING = 2 * BF16_UNIT * (1 + 2.0**-6)
# x the bound: a bf16 model's exact head rounds the error too (2**-8), and the fp32 arithmetic of the bound
# (norms, sums, one small matmul) is far inside another 2**-8
SLACK = 1 + 2.0**-7
# x D * ||h~||_1 max|w_i|: fp32 accumulation over D terms in a kernel and in the exact head (D * 2**-24 each),
# and the kernels' fused dequantization (2**-23 of each weight) against ours (native: exact integer sums, then
# three fp32 roundings, and h~ = a * xs rounded once in fp32)
ACCUMULATION = 3 * 2.0**-24
QUANTIZE_ROWS = 16384  # rows quantized at a time when the copies are built (40 MB of float temporaries for Gemma 3)
# More exact rows than this in a step and the head's file pages are given back after it: each row read from the mapped
# file brings its neighbours in too (the kernel maps up to 64 KB around a fault), so a step of 1,433 candidates (a
# flat distribution, 32K tokens of the bundled model) left 87 MiB resident for the rest of the answer.
RELEASE_AFTER_ROWS = 64
# GROUP (quantize.py): groups of 64 would save 0.3 ms of the int4 kernel but leave 5x the candidates (25K vs 4.5K)


class ExactArgmaxHead(nn.Module):
    def __init__(
        self,
        head: nn.Linear,
        max_rows: int = 4,
        max_candidates: int = 16384,
        max_int4_candidates: int = 49152,
        use_native: bool = True,
    ):
        """head: the model's LM head (weight (V, D), possibly tied to the embedding; kept, not copied).
        use_native: score with pqcache/native's int8 kernel where it built (then there is no int4 stage).
        max_rows: forwards with more rows than this use the exact head. max_int4_candidates: when more rows than
        this survive the int4 stage, the int8 stage reads every row (gathering 48K rows of 640 int8 costs under half
        of the full pass here; above 32 MB the gathered copy gets fresh pages from the OS each step and costs more
        than the full pass). max_candidates (per hidden row): more final candidates than this and the step
        computes the exact head."""
        super().__init__()
        self.head, self.max_rows = head, max_rows
        self.max_candidates, self.max_int4_candidates = max_candidates, max_int4_candidates
        w = head.weight.detach()  # (V, D)
        V, D = w.shape
        self.accumulation = ACCUMULATION * D
        # each bound is (N, stage's groups + 1) @ slack: the weights' error norms per group, then max|w_i|, which
        # multiplies h's bf16 rounding and the accumulation term (computed once, so a step spends one small matmul)
        # the int8 rows on huge pages (engine/hugepages.py): every decode step streams all of them
        q, scale, slack = huge_empty((V, D), torch.int8), torch.empty(V, dtype=torch.bfloat16), torch.empty(2, V)
        row_max = torch.empty(V, 1)  # max|w_i|
        self.released_bytes = 0
        for start in range(0, V, QUANTIZE_ROWS):  # row by row alike: the float temporaries of a slice, not of all V
            part = w[start : start + QUANTIZE_ROWS].float()
            rows = slice(start, start + len(part))
            q[rows], scale[rows] = quantize_rows(part)
            # the error uses the scale the kernel really multiplies by (bf16), so it covers its rounding too
            slack[0, rows] = (part - q[rows].float() * scale[rows].float()[:, None]).norm(dim=1) * SLACK
            row_max[rows] = part.abs().amax(1, keepdim=True)
            slack[1, rows] = row_max[rows, 0] * SLACK
            # a step reads the copies and a few exact rows: the float weights' pages leave the resident set as they
            # are quantized (pages.py; nothing where they are not a file's)
            self.released_bytes += release(w[rows])
        self.pages = Pages(w)  # the float weights' pages, when they are a file's (nothing to give back otherwise)
        self.register_buffer("q", q, persistent=False)  # (V, D) int8
        self.register_buffer("scale", scale, persistent=False)  # (V,) bf16
        self.register_buffer("slack", slack, persistent=False)  # (2, V)
        # the native kernel reads the same int8 rows and scales (in float32: the bf16 values, so `err` holds)
        self.native = native.Int8Product(q, scale.float()) if use_native and native.library() is not None else None
        # torch's int4 stage runs (decode_probe.py head A/Bs it); never beside the native kernel, which reads every
        # int8 row in about the time torch's int4 kernel takes, with its own rounding of h (activations)
        self.int4 = self.native is None and int4_kernel_available() and D % GROUP == 0
        if self.int4:
            w = w.float()
            packed, sz, err4 = quantize_int4(F.pad(w, (0, 0, 0, -V % 64)))  # zero rows up to the kernel's blocks
            self.register_buffer("packed", packed, persistent=False)  # (V', D/2) uint8
            self.register_buffer("scales_and_zeros", sz, persistent=False)  # (G, V', 2) bf16
            slack4 = torch.cat([err4[:V], row_max], 1) * SLACK  # (V, G + 1)
            # (G + 1, V): the step's product reads it in order. fp32 (about 1 ms a step here): a bf16 copy would
            # need rounding arguments about the GEMM, and an int8 one (rounded up) leaves 30% more candidates
            self.register_buffer("slack4", slack4.T.contiguous(), persistent=False)
            self.pages.release()  # the int4 copy read every row again
        self.stats = {"steps": 0, "int4_candidates": 0, "candidates": 0, "int4_fallbacks": 0, "exact_fallbacks": 0}

    @property
    def weight(self):  # transformers reads lm_head.weight (tying, dtype checks)
        return self.head.weight

    def activations(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (N, D) -> what the stages read: the kernels' input (N, D) (float32 for native, bf16 for torch's), x as
        the kernel rounds it h~ (N, D) fp32, and what max|w_i| is multiplied by in a bound (N, 1): that rounding's
        actual size ||x - h~||_1 and the accumulation term."""
        x = x.float()
        if self.native is not None:
            xk, xq = x, native.int16_rounding(x)
        else:
            xk = x.to(torch.bfloat16)
            xq = xk.float()
        spill = (x - xq).abs().sum(-1, keepdim=True) + xq.abs().sum(-1, keepdim=True) * self.accumulation
        return xk, xq, spill

    def int4_scores(self, acts) -> tuple[torch.Tensor, torch.Tensor]:
        """-> int4 scores (N, V) and bounds (N, V): |the exact head's logit - score| <= bound."""
        xb, xq, spill = acts
        N, V = xq.shape[0], self.q.shape[0]
        score = torch.ops.aten._weight_int4pack_mm_for_cpu(xb, self.packed, GROUP, self.scales_and_zeros)
        score = score[:, :V].float()
        coef = torch.cat([xq.view(N, -1, GROUP).norm(dim=-1), spill], 1)  # (N, G + 1)
        return score, (coef @ self.slack4).add_(score.abs(), alpha=OUTPUT_ROUNDING)  # one pass fewer over V

    def int8_scores(self, acts, rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """-> int8 scores (N, k) of the vocabulary rows `rows` (k,) (None: all, k = V) and their bounds (N, k)."""
        xk = acts[0]
        q, scale, slack = self.q, self.scale, self.slack
        if self.native is not None:  # every row (rows is None: there is no int4 stage)
            score = self.native(xk)
        else:
            if rows is not None:
                # embedding's row gather: 0.36 against 0.48 ms for index_select on 4,000 cold int8 rows (ad hoc)
                q, scale, slack = F.embedding(rows, q), scale.index_select(0, rows), slack.index_select(1, rows)
            score = torch.ops.aten._weight_int8pack_mm(xk, q, scale).float()
        return score, (self.int8_coef(acts) @ slack).add_(score.abs(), alpha=OUTPUT_ROUNDING)

    def int8_coef(self, acts) -> torch.Tensor:
        """-> (N, 2): what the int8 stage's slack (2, V) is multiplied by in a bound, ||h~||_2 and the spill."""
        _, xq, spill = acts
        return torch.cat([xq.norm(dim=-1, keepdim=True), spill], 1)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (B, T, D) -> logits (B, T, V)."""
        B, T, D = hidden.shape
        if B * T > self.max_rows or hidden.device.type != "cpu":
            return self.head(hidden)
        x = hidden.reshape(B * T, D)
        acts = self.activations(x)
        self.stats["steps"] += 1
        if self.native is not None and x.shape[0] == 1:  # a decode step: one C pass for the int8 stage
            return self._one_row(hidden, x, acts)
        floor = torch.full((x.shape[0], 1), -float("inf"))  # lower bounds of each row's winning exact logit
        rows = None  # the vocabulary rows the int8 stage scores (None: all of them)
        if self.int4:
            out, bound = self.int4_scores(acts)  # (N, V) each
            floor = (out - bound).amax(-1, keepdim=True)  # (N, 1)
            # one gather serves all rows: a row scores the others' candidates too (its test stays valid)
            can_win = (out + bound) >= floor  # (N, V)
            rows = (can_win[0] if len(can_win) == 1 else can_win.any(0)).nonzero().squeeze(1)  # (k,) C1
            self.stats["int4_candidates"] += len(rows)
            # a flat distribution (gathering would cost more), or none at all (h not finite): read every row
            if not 0 < len(rows) <= self.max_int4_candidates:
                self.stats["int4_fallbacks"] += 1
                rows = None
        approx, bound = self.int8_scores(acts, rows)  # (N, k) or (N, V)
        floor = torch.maximum(floor, (approx - bound).amax(-1, keepdim=True))  # both bound the winner from below
        maybe = (approx + bound) >= floor  # (N, k) C2
        n_cand = int(maybe.sum())
        self.stats["candidates"] += n_cand
        if n_cand > self.max_candidates * x.shape[0]:
            self.stats["exact_fallbacks"] += 1
            return self.head(hidden)
        # every int8 score written here is below its row's floor or replaced by the exact logit just after
        out = approx if rows is None else out.index_copy_(1, rows, approx)
        winners = [maybe[r].nonzero().squeeze(1) for r in range(x.shape[0])]  # (c,) the tokens that can win row r
        return self._exact(out, x, winners if rows is None else [rows[idx] for idx in winners]).view(B, T, -1)

    def _exact(self, out: torch.Tensor, x: torch.Tensor, winners: list[torch.Tensor]) -> torch.Tensor:
        """out (N, V) approximate logits -> out in the head's dtype, with row r's candidates winners[r] scored by the
        model's weights; the head's file pages given back after a step of many exact rows."""
        out = out.to(self.head.weight.dtype)
        for r, idx in enumerate(winners):
            out[r, idx] = (x[r : r + 1] @ self.head.weight[idx].T).squeeze(0)  # exact, the model's weights
        if sum(len(idx) for idx in winners) > RELEASE_AFTER_ROWS:
            self.pages.release()
        return out

    def _one_row(self, hidden: torch.Tensor, x: torch.Tensor, acts) -> torch.Tensor:
        """forward's int8 stage for one row x (1, D) in one native call (Int8Product.candidates: the same scores,
        bounds and test as int8_scores and forward compute in torch), then the same exact scores."""
        coef = self.int8_coef(acts)  # (1, 2)
        out, idx = self.native.candidates(acts[0], self.slack, coef, OUTPUT_ROUNDING, self.max_candidates)
        if idx is None or len(idx) == 0:  # a flat distribution (or h not finite): the exact head
            self.stats["exact_fallbacks"] += 1
            return self.head(hidden)
        self.stats["candidates"] += len(idx)
        return self._exact(out, x, [idx]).view(hidden.shape[0], hidden.shape[1], -1)


def install_exact_argmax_head(model) -> ExactArgmaxHead | None:
    """Swap the model's LM head for an ExactArgmaxHead (CPU only; None when the model has no plain head, the
    int8 kernel is missing or cannot take the hidden size). The original head is kept inside it."""
    head = getattr(model, "lm_head", None)
    if not isinstance(head, nn.Linear) or head.bias is not None or not int8_kernel_takes(head.in_features):
        return None
    fast = ExactArgmaxHead(head)
    model.lm_head = fast
    return fast
