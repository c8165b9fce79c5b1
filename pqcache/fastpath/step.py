"""A decode step of one row and one token without the model's forward around the layers (CPU; Gemma 3 and the
Llama family, STEP_MODELS).

For each token, transformers' Gemma3TextModel.forward (LlamaModel's likewise) builds two attention masks (all ones
for a single real token), goes through its decorators and output dataclasses, and each decoder layer reaches its
cache and its attention through Cache.update and the attention interface (PQCache's function, then transformers'
SDPA wrapper for the sliding-window layers): about 1.6 ms of an 8K step on a 2-core CPU that computes nothing
(measured with the model's forward in place of this step). This step calls the model's own modules and functions on
the same tensors for everything that is arithmetic (the embedding, the rotary embeddings, the layers' short forward
through FastDecodeLayer.step, the final norm, the LM head and its soft-capping), so its logits are bit-identical to
the model's (tests/unit/test_decode_layer.py). It runs where the cache is a PQCache or full attention's DynamicCache;
anything else (a batch, a question's several tokens, hooks, other caches and models) takes the model's forward. An
observer attached to the PQCache (the app's live panels) stays attached: its PQ layers record inside PQLayer.attend
as they do under the model's forward, and each decoder layer's "device compute" span, which the observer's forward
hooks time there, is timed here.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from pqcache.engine.cache import ATTN_NAME, OBSERVER_HOOK, PQCache
from pqcache.engine.full_attention import RoundedLayer
from pqcache.engine.layer.layer import PQLayer
from pqcache.engine.layer.sliding import AppendSlidingWindowLayer
from pqcache.fastpath.layer import FastDecodeLayer

# the causal LMs whose forward __call__ reproduces around their layers' FastDecodeLayer.step
STEP_MODELS = ("Gemma3ForCausalLM", "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
# cache layers whose update returns every key the new token attends to (PQCache's sliding windows, a DynamicCache's,
# full attention's at a KV dtype: engine/full_attention.py)
PLAIN_LAYERS = (AppendSlidingWindowLayer, DynamicSlidingWindowLayer, DynamicLayer, RoundedLayer)


class FastDecodeStep:
    """Installed as `model.fast_decode_step` by install_fast_decode; generate.decode_one_token calls it when ready."""

    def __init__(self, model):
        self.model, self.text = model, model.model  # e.g. Gemma3ForCausalLM, its Gemma3TextModel
        config = self.text.config
        self.layers = list(self.text.layers[: config.num_hidden_layers])  # the ones the model's forward runs
        # Gemma 3's rotary embedding differs by layer type (local and global bases); the others' is one
        self.by_type = type(model).__name__ == "Gemma3ForCausalLM"
        types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
        self.layer_types = types[: config.num_hidden_layers] if self.by_type else [None] * len(self.layers)
        self.softcap = getattr(model.config, "final_logit_softcapping", None)
        self.steps = 0  # steps that took this path

    def ready(self, token: torch.Tensor, cache) -> bool:
        """Whether the step for `token` (B, 1) with `cache` can take this path."""
        text = self.text
        if token.shape != (1, 1) or token.device.type != "cpu" or not isinstance(cache, (PQCache, DynamicCache)):
            return False
        if text.config._attn_implementation not in (ATTN_NAME, "sdpa"):
            return False
        if text.embed_tokens.weight.dtype != torch.float32 or getattr(text.config, "use_bidirectional_attention", 0):
            return False
        if any(_hooked(m) for m in (self.model, text, *self.layers)):
            return False
        if not all(isinstance(layer.forward, FastDecodeLayer) for layer in self.layers):
            return False
        return all(
            (isinstance(c, PQLayer) and c.prefilled) or (type(c) in PLAIN_LAYERS and c.is_initialized)
            for c in cache.layers
        )

    def __call__(self, token: torch.Tensor, cache: PQCache | DynamicCache) -> torch.Tensor:
        """token (1, 1) -> next-token logits (1, V)."""
        text = self.text
        hidden = text.embed_tokens(token)  # (1, 1, E)
        position_ids = torch.tensor([[cache.get_seq_length()]], device=token.device)  # as the model counts it
        if self.by_type:
            rotary = {kind: text.rotary_emb(hidden, position_ids, kind) for kind in set(self.layer_types)}
        else:
            rotary = {None: text.rotary_emb(hidden, position_ids)}
        x = hidden.view(1, -1)  # (1, E)
        obs = getattr(cache, "observer", None)
        for layer, kind in zip(self.layers, self.layer_types):
            fast = layer.forward
            # the span the observer's hooks record around a layer's forward
            with obs.span("device compute", fast.attn.layer_idx) if obs is not None else nullcontext():
                x = fast.step(x, rotary[kind], cache.layers[fast.attn.layer_idx])
        logits = self.model.lm_head(text.norm(x.view(1, 1, -1)))  # (1, 1, V)
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        self.steps += 1
        return logits[:, -1]


def _hooked(module) -> bool:
    """Hooks other than an observer's (PQCache.instrument's record only their own cache's forwards: this step
    records them itself, and another cache's would ignore it)."""
    hooks = (*module._forward_hooks.values(), *module._forward_pre_hooks.values())
    return any(not getattr(hook, OBSERVER_HOOK, False) for hook in hooks)
