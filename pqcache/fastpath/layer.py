"""Gemma 3 decoder layers' decode steps in few operators (CPU, quantized decode weights).

A CPU decode step of the bundled model runs 18 decoder layers of about 125 small torch operators each (six
RMSNorms of ten operators, the rotary embedding's slices and concatenations, view/transpose/cast around each
projection), and each operator costs microseconds of dispatch whatever its size: more than the layer's weights
take to read. This forward computes the same thing in about 45: one quantized matmul for q/k/v and one for
gate/up (fastpath/weights.py's stacked copies), both head norms on the stacked q and k heads at once, the rotary
embedding as one roll and two products. Every value is computed by the same arithmetic in the same order as
transformers' Gemma3DecoderLayer with fastpath/weights.py's linears, so the output is bit-identical
(tests/test_decode_layer.py), and the cache and the attention function (PQCache's, SDPA) are called exactly as
the model calls them. Forwards of more rows (prefill chunks, a question), other devices and dtypes, and layers
without the quantized copies run the model's own forward. `step` is the same forward for one real token of one
row, called by fastpath/step.py with the layer's cache and attention reached directly.

Where pqcache/native built and the copies are its int8 rows, `step` runs the layer in three C calls instead
(native.LayerStep, layer_step.c: 0.25 against 0.40 ms a sliding layer's step here, warm caches, ad hoc): the same
products, the rest in another summation order, so its logits are within 1e-4 of the torch step's, not
bit-identical, and greedy tokens are the same (tests/test_decode_layer.py). The cache update and PQCache's
attention stay in Python.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.gemma3.modeling_gemma3 import eager_attention_forward

from pqcache import native
from pqcache.engine.layer.layer import PQLayer
from pqcache.fastpath.weights import DecodeLinear

LAYER_CLASSES = ("Gemma3DecoderLayer",)  # the layers whose forward this file reproduces
ONE_REAL = torch.ones((1, 1), dtype=torch.bool)  # a step's new token is a real one (PQLayer.attend's new_valid)
NATIVE_STEP = True  # `step` in C where it can (the tests switch it off to compare with the torch step to the bit)


def _norm(x: torch.Tensor, weight_plus_one: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma3RMSNorm's arithmetic (in float32, weight applied as 1 + w) for a float32 x: torch's rms_norm is
    x * rsqrt(mean(x^2) + eps) * w in the same order (bit-identical, tests/test_decode_layer.py) in one operator
    instead of five. weight_plus_one (D,) or one row per head (n, D), applied after."""
    if weight_plus_one.dim() == 1:
        return F.rms_norm(x, x.shape[-1:], weight_plus_one, eps)
    return F.rms_norm(x, x.shape[-1:], None, eps) * weight_plus_one


def _mm(x: torch.Tensor, weights) -> torch.Tensor:
    """x (R, K) float -> (R, N) in x's dtype, as DecodeLinear computes it (weights: Int8Rows or Int4Groups)."""
    return weights.mm(x).to(x.dtype)


class FastDecodeLayer:
    """Installed as `layer.forward`: few-row CPU forwards take the short path, the rest the model's forward."""

    def __init__(self, layer, rotary_memo: dict):
        attn, mlp = layer.self_attn, layer.mlp
        self.layer, self.attn, self.model_forward = layer, attn, layer.forward
        self.max_rows = attn.q_proj.max_rows
        self.eps = layer.input_layernorm.eps
        self.n_q, self.n_kv = attn.config.num_attention_heads, attn.config.num_key_value_heads
        self.I = mlp.down_proj.linear.in_features  # intermediate size

        def plus_one(norm):
            return (1.0 + norm.weight.detach().float()).contiguous()

        self.w_in, self.w_post_attn = plus_one(layer.input_layernorm), plus_one(layer.post_attention_layernorm)
        self.w_pre_ff, self.w_post_ff = (
            plus_one(layer.pre_feedforward_layernorm),
            plus_one(layer.post_feedforward_layernorm),
        )
        # q heads then the k heads: each row normalised with its own norm's weights
        self.w_qk = torch.cat([plus_one(attn.q_norm).expand(self.n_q, -1), plus_one(attn.k_norm).expand(self.n_kv, -1)])
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
        attn_kwargs = {"position_ids": position_ids, **kwargs}  # what Gemma3Attention receives as **kwargs
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
            sliding_window=attn.sliding_window,
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
            window = attn.sliding_window
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
        else:  # every key the token attends to, its mask all ones
            key, value = cache_layer.update(key, value)  # (1, Hk, n, D)
            out = layer.attend(qkv[:Hq], key, value, self.attn.scaling)
        return layer.out(x, out)

    def _qkv(self, x: torch.Tensor, position_embeddings) -> tuple[torch.Tensor, torch.Tensor]:
        """x (R, E) -> the normed, rotated query and key heads (R, Hq + Hk, D) and all heads (R, Hq + 2 Hk, D)."""
        Hq, Hk = self.n_q, self.n_kv
        qkv = _mm(_norm(x, self.w_in, self.eps), self.qkv)  # (R, (Hq + 2 Hk) * D)
        R, D = len(x), qkv.shape[-1] // (Hq + 2 * Hk)
        qkv = qkv.view(R, Hq + 2 * Hk, D)
        qk = _norm(qkv[:, : Hq + Hk], self.w_qk, self.eps)
        cos, sin = position_embeddings  # (B, Q, D), B * Q = R
        sin = self._signed_sin(sin)
        return qk * cos.reshape(R, 1, D) + torch.roll(qk, D // 2, -1) * sin.reshape(R, 1, D), qkv

    def _mlp(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """x (R, E), the attention's output out (R, Hq * D) -> the layer's output (R, E)."""
        x = x + _norm(_mm(out, self.o), self.w_post_attn, self.eps)
        gate_up = _mm(_norm(x, self.w_pre_ff, self.eps), self.gate_up)  # (R, 2 I)
        h = F.gelu(gate_up[:, : self.I], approximate="tanh") * gate_up[:, self.I :]
        return x + _norm(_mm(h, self.down), self.w_post_ff, self.eps)

    def bind(self):
        """Read the layer's quantized copies (again, after they were swapped)."""
        attn, mlp = self.attn, self.layer.mlp
        self.qkv, self.gate_up = attn.q_proj.group.weights, mlp.gate_proj.group.weights  # stacked (FusedSiblings)
        self.o, self.down = attn.o_proj.weights, mlp.down_proj.weights
        self.native = None  # native.LayerStep where every product is a native int8 one
        products = {"qkv": self.qkv, "o": self.o, "gate_up": self.gate_up, "down": self.down}
        if NATIVE_STEP and all(getattr(w, "native", None) is not None for w in products.values()):
            D = self.w_qk.shape[-1]
            sizes = {"E": self.o.native.N, "Hq": self.n_q, "Hk": self.n_kv, "D": D, "I": self.I}
            norms = {"w_in": self.w_in, "w_qk": self.w_qk, "w_post_attn": self.w_post_attn}
            norms |= {"w_pre_ff": self.w_pre_ff, "w_post_ff": self.w_post_ff}
            self.native = native.LayerStep(sizes, self.eps, norms, {k: w.native for k, w in products.items()})

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


def _is_torch_tanh_gelu(act_fn) -> bool:
    """transformers' GELUTanh calling torch's gelu(approximate="tanh"), what the short forward calls (not its
    Python formula, which rounds differently)."""
    act = getattr(act_fn, "act", None)
    return isinstance(act, functools.partial) and act.func is F.gelu and act.keywords == {"approximate": "tanh"}


def fast_decode_ready(layer) -> bool:
    """A Gemma 3 decoder layer whose projections are quantized decode linears with q/k/v and gate/up stacked."""
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if type(layer).__name__ not in LAYER_CLASSES or attn is None or mlp is None:
        return False
    linears = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
    if not all(isinstance(m, DecodeLinear) and m.linear.bias is None for m in linears):
        return False
    return (
        attn.q_proj.group is not None
        and attn.q_proj.group is attn.v_proj.group
        and mlp.gate_proj.group is not None
        and mlp.gate_proj.group is mlp.up_proj.group
        and _is_torch_tanh_gelu(mlp.act_fn)
        and attn.attn_logit_softcapping is None
    )
