"""Shapes read off a model's config, in one place (models that do not set `head_dim` derive it)."""

from __future__ import annotations


def text_config_of(model_or_config):
    """The decoder's text config of a model, a config, or a composite (e.g. vision-language) config."""
    config = getattr(model_or_config, "config", model_or_config)
    get_text_config = getattr(config, "get_text_config", None)
    return get_text_config(decoder=True) if get_text_config is not None else config


def head_dim_of(model_or_config) -> int:
    """Dimension of one attention head: the config's `head_dim`, else hidden_size // num_attention_heads."""
    text = text_config_of(model_or_config)
    return int(getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads)
