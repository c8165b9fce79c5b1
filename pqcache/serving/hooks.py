"""Per-layer hooks on a model shared by several threads: progress and Stop for the thread that installed them."""

from __future__ import annotations

import threading
from contextlib import contextmanager

from pqcache.engine.cache import decoder_layers
from pqcache.engine.errors import Cancelled


@contextmanager
def layer_hooks(model, on_layer=None, stop: threading.Event | None = None):
    """Per decoder layer of `model`, on this thread only: raise Cancelled before it runs if `stop` is set,
    call on_layer(idx) after it ran."""
    me, hooks = threading.get_ident(), []

    def pre(module, args):
        if stop is not None and stop.is_set() and threading.get_ident() == me:
            raise Cancelled("stopped")

    for idx, module in decoder_layers(model):
        if stop is not None:
            hooks.append(module.register_forward_pre_hook(pre))
        if on_layer is not None:
            hooks.append(
                module.register_forward_hook(
                    lambda m, a, o, idx=idx: on_layer(idx) if threading.get_ident() == me else None
                )
            )
    try:
        yield
    finally:
        for h in hooks:
            h.remove()
