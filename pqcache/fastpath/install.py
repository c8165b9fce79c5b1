"""Installing the fast decode path on a loaded model: each ready decoder layer gets the short decode forward
(layer.py), and a model of STEP_MODELS whose layers all have it gets the one-row decode step around them (step.py)."""

from __future__ import annotations

from pqcache.engine.cache import decoder_layers
from pqcache.engine.kernels import DEFAULT_KERNELS, Kernels
from pqcache.fastpath.layer import FastDecodeLayer, fast_decode_ready
from pqcache.fastpath.step import STEP_MODELS, FastDecodeStep


def install_fast_decode(model, kernels: Kernels = DEFAULT_KERNELS) -> int:
    """Give every ready decoder layer (fast_decode_ready) the short decode forward, and a model of STEP_MODELS
    whose layers all have it the one-row decode step around them (fastpath/step.py, `model.fast_decode_step`);
    returns how many layers were given it. kernels: whether their steps run in C where they can."""
    memo: dict = {}
    installed = 0
    layers = [layer for _, layer in decoder_layers(model)]
    for layer in layers:
        if isinstance(layer.forward, FastDecodeLayer):
            continue
        shape = fast_decode_ready(layer)
        if shape is not None:
            layer.forward = FastDecodeLayer(layer, memo, shape, kernels)
            installed += 1
    if type(model).__name__ in STEP_MODELS and all(isinstance(x.forward, FastDecodeLayer) for x in layers):
        model.fast_decode_step = FastDecodeStep(model)
    return installed
