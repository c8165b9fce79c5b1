"""What the short decode forward (layer.py) needs to know about a decoder layer: the few ways the layers of common
causal LMs differ, read once from a loaded layer.

Every layer it runs is the same pre-norm block: RMSNorm, q/k/v, rotary embedding, grouped-query attention, o,
residual, RMSNorm, a gated MLP, residual. Around that:

                      norm weight  q/k head norms  norms after attention / MLP  activation   q/k/v bias
    Gemma 3           1 + w        yes             yes                          GELU (tanh)  no
    Llama, Mistral    w            no              no                           SiLU         no (Llama: optional)
    Qwen2             w            no              no                           SiLU         yes

and what the attention function is given besides the tensors (Gemma 3 and Qwen2 pass their layer's sliding
window, Mistral its config's, Llama nothing). A layer of another class, or one of these with something the
table does not cover (an o or MLP bias, another activation, Gemma's attention soft-capping), gets None: it keeps
the model's own forward.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import SiLUActivation

GEMMA = ("Gemma3DecoderLayer",)
LLAMA_FAMILY = ("LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer")
ACTIVATIONS = ("gelu_tanh", "silu")  # layer_step.c's `act`: the index


@dataclass(frozen=True)
class LayerShape:
    eps: float
    act: str  # one of ACTIVATIONS
    w_in: torch.Tensor  # (E,) the input norm's weight as applied (Gemma: 1 + w)
    w_pre_ff: torch.Tensor  # (E,) the norm before the MLP (Llama's post_attention_layernorm)
    w_post_attn: torch.Tensor | None  # (E,) Gemma's norm of the attention's output, before its residual
    w_post_ff: torch.Tensor | None  # (E,) Gemma's norm of the MLP's output
    w_qk: torch.Tensor | None  # (Hq + Hk, D) Gemma's q and k head norms, one row per head
    qkv_bias: torch.Tensor | None  # ((Hq + 2 Hk) D,) the q, k and v biases stacked (Qwen2)
    attn_kwargs: dict  # what the model's attention passes the attention function besides the tensors


def layer_shape(layer) -> LayerShape | None:
    """-> the layer's LayerShape, or None where layer.py would not compute what the layer computes."""
    attn, mlp, kind = getattr(layer, "self_attn", None), getattr(layer, "mlp", None), type(layer).__name__
    if attn is None or mlp is None or kind not in GEMMA + LLAMA_FAMILY:
        return None
    if _bias(attn.o_proj) is not None or any(_bias(p) is not None for p in (mlp.gate_proj, mlp.up_proj, mlp.down_proj)):
        return None
    biases = [_bias(attn.q_proj), _bias(attn.k_proj), _bias(attn.v_proj)]
    if any(b is None for b in biases) and not all(b is None for b in biases):
        return None
    qkv_bias = None if biases[0] is None else torch.cat([b.detach().float() for b in biases]).contiguous()
    n_q, n_kv = attn.config.num_attention_heads, attn.config.num_key_value_heads
    if kind in GEMMA:
        if not _is_torch_tanh_gelu(mlp.act_fn) or attn.attn_logit_softcapping is not None:
            return None
        q_norm, k_norm = _plus_one(attn.q_norm), _plus_one(attn.k_norm)
        return LayerShape(
            eps=layer.input_layernorm.eps,
            act="gelu_tanh",
            w_in=_plus_one(layer.input_layernorm),
            w_pre_ff=_plus_one(layer.pre_feedforward_layernorm),
            w_post_attn=_plus_one(layer.post_attention_layernorm),
            w_post_ff=_plus_one(layer.post_feedforward_layernorm),
            w_qk=torch.cat([q_norm.expand(n_q, -1), k_norm.expand(n_kv, -1)]).contiguous(),
            qkv_bias=qkv_bias,
            attn_kwargs={"sliding_window": attn.sliding_window},
        )
    if not isinstance(mlp.act_fn, (SiLUActivation, nn.SiLU)):
        return None
    if kind == "MistralDecoderLayer":
        attn_kwargs = {"sliding_window": getattr(attn.config, "sliding_window", None)}
    elif kind == "Qwen2DecoderLayer":
        attn_kwargs = {"sliding_window": attn.sliding_window}
    else:
        attn_kwargs = {}
    return LayerShape(
        eps=layer.input_layernorm.variance_epsilon,
        act="silu",
        w_in=_weight(layer.input_layernorm),
        w_pre_ff=_weight(layer.post_attention_layernorm),
        w_post_attn=None,
        w_post_ff=None,
        w_qk=None,
        qkv_bias=qkv_bias,
        attn_kwargs=attn_kwargs,
    )


def activation(shape: LayerShape):
    """The activation as the model's MLP calls it (torch's own kernels: their rounding is the model's)."""
    if shape.act == "silu":
        return F.silu
    return functools.partial(F.gelu, approximate="tanh")


def _bias(linear) -> torch.Tensor | None:
    return getattr(linear, "bias", None)


def _plus_one(norm) -> torch.Tensor:
    """Gemma3RMSNorm applies (1 + w), in float32."""
    return (1.0 + norm.weight.detach().float()).contiguous()


def _weight(norm) -> torch.Tensor:
    return norm.weight.detach().float().contiguous()


def _is_torch_tanh_gelu(act_fn) -> bool:
    """transformers' GELUTanh calling torch's gelu(approximate="tanh"), what the short forward calls (not its
    Python formula, which rounds differently)."""
    act = getattr(act_fn, "act", None)
    return isinstance(act, functools.partial) and act.func is F.gelu and act.keywords == {"approximate": "tanh"}
