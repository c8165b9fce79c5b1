"""Decoder layers' decode steps in few operators (CPU, quantized decode weights): Gemma 3's and the Llama
family's (Llama, Mistral, Qwen2), their differences read once into a LayerShape (shape.py).

A CPU decode step of the bundled model runs 18 decoder layers of about 125 small torch operators each (six
RMSNorms of ten operators, the rotary embedding's slices and concatenations, view/transpose/cast around each
projection), and each operator costs microseconds of dispatch whatever its size: more than the layer's weights
take to read. This forward computes the same thing in about 45: one quantized matmul for q/k/v and one for
gate/up (fastpath/weights.py's stacked copies), both head norms on the stacked q and k heads at once (Gemma), the
rotary embedding as one roll and two products. Every value is computed by the same arithmetic in the same order as
transformers' decoder layer with fastpath/weights.py's linears, so the output is bit-identical
(tests/unit/test_decode_layer.py), and the cache and the attention function (PQCache's, SDPA) are called exactly as
the model calls them. Forwards of more rows (prefill chunks, a question), other devices and dtypes, and layers
without the quantized copies run the model's own forward. `step` is the same forward for one real token of one
row, called by fastpath/step.py with the layer's cache and attention reached directly.

Where pqcache/native built and the copies are its int8 rows, `step` runs the layer in three C calls instead
(native/layer.py, layer_step.c: 0.25 against 0.40 ms a Gemma sliding layer's step here, warm caches, ad hoc): the
same products, the rest in another summation order, so its logits are within 1e-4 of the torch step's, not
bit-identical, and greedy tokens are the same (tests/unit/test_decode_layer.py). The cache update and PQCache's
attention stay in Python; a sliding-window layer's step whose window has a row ready (AppendSlidingWindowLayer's
in-place path) is one C call with its window's write (layer_window_step, the same arithmetic: the same logits).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import eager_attention_forward

from pqcache.engine.kernels import Kernels
from pqcache.engine.layer.layer import PQLayer
from pqcache.engine.layer.sliding import AppendSlidingWindowLayer
from pqcache.fastpath.shape import ACTIVATIONS, LayerShape, activation, layer_shape
from pqcache.fastpath.weights import DecodeLinear
from pqcache.native.layer import LayerStep

ONE_REAL = torch.ones((1, 1), dtype=torch.bool)  # a step's new token is a real one (PQLayer.attend's new_valid)


def _norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """An RMSNorm's arithmetic for a float32 x (Gemma3RMSNorm's, weight = 1 + w, and LlamaRMSNorm's): torch's
    rms_norm is x * rsqrt(mean(x^2) + eps) * w in the same order (bit-identical, tests/unit/test_decode_layer.py) in one
    operator instead of five. weight (D,) or one row per head (n, D), applied after; None: no norm there (x)."""
    if weight is None:
        return x
    if weight.dim() == 1:
        return F.rms_norm(x, x.shape[-1:], weight, eps)
    return F.rms_norm(x, x.shape[-1:], None, eps) * weight


def _mm(x: torch.Tensor, weights) -> torch.Tensor:
    """x (R, K) float -> (R, N) in x's dtype, as DecodeLinear computes it (weights: Int8Rows or Int4Groups)."""
    return weights.mm(x).to(x.dtype)


class FastDecodeLayer:
    """Installed as `layer.forward`: few-row CPU forwards take the short path, the rest the model's forward."""

    def __init__(self, layer, rotary_memo: dict, shape: LayerShape, kernels: Kernels):
        attn, mlp = layer.self_attn, layer.mlp
        self.kernels = kernels  # whether `step` runs in C where it can (engine/kernels.py)
        self.layer, self.attn, self.model_forward, self.shape = layer, attn, layer.forward, shape
        self.max_rows = attn.q_proj.max_rows
        self.eps, self.act = shape.eps, activation(shape)
        self.n_q, self.n_kv = attn.config.num_attention_heads, attn.config.num_key_value_heads
        self.D = attn.head_dim
        self.I = mlp.down_proj.linear.in_features  # intermediate size
        self.rotary_memo = rotary_memo  # shared by the layers: the step's signed sin, made once
        self.steps = 0  # forwards that took the short path
        self.bind()

    def __call__(
        self, hidden_states, position_embeddings=None, attention_mask=None, position_ids=None, cache=None, **kwargs
    ):
        B, Q, E = hidden_states.shape
        if (
            B * Q > self.max_rows
            or hidden_states.device.type != "cpu"
            or hidden_states.dtype != torch.float32
            or position_embeddings is None
            or "past_key_values" in kwargs
        ):
            return self.model_forward(
                hidden_states,
                position_embeddings=position_embeddings,
                attention_mask=attention_mask,
                position_ids=position_ids,
                cache=cache,
                **kwargs,
            )
        self.steps += 1
        attn, Hq, Hk = self.attn, self.n_q, self.n_kv
        x = hidden_states.reshape(B * Q, E)
        qk, qkv = self._qkv(x, position_embeddings)  # (B*Q, Hq + Hk, D), (B*Q, Hq + 2 Hk, D)
        D = qk.shape[-1]
        query = qk[:, :Hq].view(B, Q, Hq, D).transpose(1, 2)  # (B, Hq, Q, D)
        key = qk[:, Hq:].view(B, Q, Hk, D).transpose(1, 2)  # (B, Hk, Q, D)
        value = qkv[:, Hq + Hk :].view(B, Q, Hk, D).transpose(1, 2)
        attn_kwargs = {"position_ids": position_ids, **kwargs}  # what the model's attention receives as **kwargs
        if cache is not None:
            key, value = cache.update(key, value, attn.layer_idx, kwargs=attn_kwargs)
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(attn.config._attn_implementation, eager_attention_forward)
        out, _ = attention(
            attn,
            query,
            key,
            value,
            attention_mask,
            dropout=0.0,
            scaling=attn.scaling,
            **self.shape.attn_kwargs,
            **attn_kwargs,
        )  # (B, Q, Hq, D)
        return self._mlp(x, out.reshape(B * Q, Hq * D)).view(B, Q, E)

    def step(self, x: torch.Tensor, position_embeddings, cache_layer) -> torch.Tensor:
        """x (1, E): one real token of one row -> (1, E), the arithmetic of __call__ with the layer's cache and
        attention reached directly (fastpath/step.py): cache_layer is this layer's PQLayer (its attend, as PQCache's
        attention function calls it) or a layer returning the keys the token attends to, all of them (a sliding
        window's, a full-attention layer's of a DynamicCache), with SDPA called as transformers calls it."""
        self.steps += 1
        if self.native is not None:
            if self.kernels.window_step and type(cache_layer) is AppendSlidingWindowLayer:
                y = self._window_step(x, position_embeddings, cache_layer)
                if y is not None:
                    return y
            return self._native_step(x, position_embeddings, cache_layer)
        attn, Hq, Hk = self.attn, self.n_q, self.n_kv
        qk, qkv = self._qkv(x, position_embeddings)
        D = qk.shape[-1]
        key, value = qk[0, Hq:].view(1, Hk, 1, D), qkv[0, Hq + Hk :].view(1, Hk, 1, D)
        if isinstance(cache_layer, PQLayer):
            cache_layer.update(key, value)
            out = cache_layer.attend(qk[0, :Hq].view(1, Hq, 1, D), ONE_REAL, attn.scaling)  # (1, 1, Hq, D)
        else:
            # transformers materializes a sliding layer's mask only once the keys reach the window (masking_utils'
            # _ignore_causal_mask_sdpa), measured before this token's update; the mask decides SDPA's form
            window = self.shape.attn_kwargs.get("sliding_window")
            masked = window is not None and cache_layer.get_mask_sizes(1)[0] >= window
            key, value = cache_layer.update(key, value)  # (1, Hk, n, D)
            out = _sdpa_one_row(qk[0, :Hq], key, value, attn.scaling, masked=masked)
        return self._mlp(x, out.reshape(1, Hq * D))

    def _native_step(self, x: torch.Tensor, position_embeddings, cache_layer) -> torch.Tensor:
        """`step` in layer_step.c's three calls, the cache update and a PQ layer's attention between them."""
        Hq, Hk, layer = self.n_q, self.n_kv, self.native
        cos, sin = position_embeddings  # (1, 1, D) each
        qkv = layer.qkv(x.contiguous(), cos.reshape(-1), self._signed_sin(sin).reshape(-1))  # (Hq + 2 Hk, D)
        D = qkv.shape[-1]
        key, value = qkv[Hq : Hq + Hk].view(1, Hk, 1, D), qkv[Hq + Hk :].view(1, Hk, 1, D)
        if isinstance(cache_layer, PQLayer):
            cache_layer.update(key, value)
            out = cache_layer.attend(qkv[:Hq].view(1, Hq, 1, D), ONE_REAL, self.attn.scaling)  # (1, 1, Hq, D)
            out = out.reshape(1, Hq * D).contiguous()
        else:  # every key the token attends to, its mask all ones; a window's as stored (half rows read as they lie)
            key, value = getattr(cache_layer, "update_stored", cache_layer.update)(key, value)  # (1, Hk, n, D)
            out = layer.attend(qkv[:Hq], key, value, self.attn.scaling)
        return layer.out(x, out)

    def _window_step(self, x: torch.Tensor, position_embeddings, cache_layer) -> torch.Tensor | None:
        """_native_step of a sliding-window layer in one C call (layer_window_step: the same qkv, the token written
        into the window's buffer as update_stored writes it, the same attention and out), or None where the window
        has no row ready for it (update_stored's in-place path does not apply)."""
        taken = cache_layer.take_slots(1, x.dtype, x.device)
        if taken is None:
            return None
        cos, sin = position_embeddings  # (1, 1, D) each
        buffers = (cache_layer.buf_k, cache_layer.buf_v, *taken)
        sin = self._signed_sin(sin).reshape(-1)
        return self.native.window_step(x.contiguous(), cos.reshape(-1), sin, buffers, self.attn.scaling)

    def _qkv(self, x: torch.Tensor, position_embeddings) -> tuple[torch.Tensor, torch.Tensor]:
        """x (R, E) -> the (normed,) rotated query and key heads (R, Hq + Hk, D) and all heads (R, Hq + 2 Hk, D)."""
        Hq, Hk, D, shape = self.n_q, self.n_kv, self.D, self.shape
        qkv = _mm(_norm(x, shape.w_in, self.eps), self.qkv)  # (R, (Hq + 2 Hk) * D)
        if shape.qkv_bias is not None:  # DecodeLinear's: after the product, in the model's dtype
            qkv = qkv + shape.qkv_bias
        R = len(x)
        qkv = qkv.view(R, Hq + 2 * Hk, D)
        qk = _norm(qkv[:, : Hq + Hk], shape.w_qk, self.eps)
        cos, sin = position_embeddings  # (B, Q, D), B * Q = R
        sin = self._signed_sin(sin)
        return qk * cos.reshape(R, 1, D) + torch.roll(qk, D // 2, -1) * sin.reshape(R, 1, D), qkv

    def _mlp(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """x (R, E), the attention's output out (R, Hq * D) -> the layer's output (R, E)."""
        shape = self.shape
        x = x + _norm(_mm(out, self.o), shape.w_post_attn, self.eps)
        gate_up = _mm(_norm(x, shape.w_pre_ff, self.eps), self.gate_up)  # (R, 2 I)
        h = self.act(gate_up[:, : self.I]) * gate_up[:, self.I :]
        return x + _norm(_mm(h, self.down), shape.w_post_ff, self.eps)

    def bind(self):
        """Read the layer's quantized copies (again, after they were swapped)."""
        attn, mlp = self.attn, self.layer.mlp
        self.qkv, self.gate_up = attn.q_proj.group.weights, mlp.gate_proj.group.weights  # stacked (FusedSiblings)
        self.o, self.down = attn.o_proj.weights, mlp.down_proj.weights
        self.native = None  # LayerStep where every product is a native int8 one
        products = {"qkv": self.qkv, "o": self.o, "gate_up": self.gate_up, "down": self.down}
        if self.kernels.native_step and all(getattr(w, "native", None) is not None for w in products.values()):
            shape = self.shape
            sizes = {"E": self.o.native.N, "Hq": self.n_q, "Hk": self.n_kv, "D": self.D, "I": self.I}
            sizes["act"] = ACTIVATIONS.index(shape.act)
            names = ("w_in", "w_qk", "w_post_attn", "w_pre_ff", "w_post_ff", "qkv_bias")
            extras = {name: getattr(shape, name) for name in names}  # None where the layer has none
            self.native = LayerStep(sizes, self.eps, extras, {k: w.native for k, w in products.items()})

    def _signed_sin(self, sin: torch.Tensor) -> torch.Tensor:
        """rotate_half(x) * sin == roll(x, D/2) * cat(-sin[:D/2], sin[D/2:]), exactly (a sign flip is exact).
        The rotary tensors of a step are shared by its layers of one kind: made once per step."""
        memo = self.rotary_memo.get(id(sin))
        if memo is None or memo[0] is not sin:
            half = sin.shape[-1] // 2
            memo = (sin, torch.cat([-sin[..., :half], sin[..., half:]], -1))
            if len(self.rotary_memo) > 4:
                self.rotary_memo.clear()
            self.rotary_memo[id(sin)] = memo
        return memo[1]


def _sdpa_one_row(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float, masked: bool):
    """query (Hq, D) of one real token, key, value (1, Hk, n, D) -> attention output (1, Hq, D) as transformers'
    sdpa_attention_forward computes it for one query row. That row's mask is all ones: a sliding-window layer whose
    keys reach the window gets it as a tensor (masked=True; SDPA's output is the same without it), the others get
    none, and that decides how grouped query heads are passed: with a mask (or a head size over 256), packed by KV
    head; without, as heads with enable_gqa (the two forms round differently)."""
    Hq, D = query.shape
    Hk = key.shape[1]
    if Hq != Hk and not masked and D <= 256:  # transformers' use_gqa_in_sdpa on a CPU
        return F.scaled_dot_product_attention(query.view(1, Hq, 1, D), key, value, scale=scaling, enable_gqa=True)
    # pack_gqa (nothing to pack when Hq == Hk): (1, Hk, Hq / Hk, D), the heads in order
    return F.scaled_dot_product_attention(query.view(1, Hk, Hq // Hk, D), key, value, scale=scaling)


def fast_decode_ready(layer) -> LayerShape | None:
    """A decoder layer this file reproduces (shape.py) whose projections are quantized decode linears with q/k/v
    and gate/up stacked -> its LayerShape, else None."""
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if attn is None or mlp is None:
        return None
    linears = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
    if not all(isinstance(m, DecodeLinear) for m in linears):
        return None
    stacked = (
        attn.q_proj.group is not None
        and attn.q_proj.group is attn.v_proj.group
        and mlp.gate_proj.group is not None
        and mlp.gate_proj.group is mlp.up_proj.group
    )
    return layer_shape(layer) if stacked else None
