"""The A/B switches of `decode_probe.py ab`: for each --what, two callables that put the running model (and its
cache) in setting A or B, so one process can alternate between them after a single prefill."""

from __future__ import annotations

from dataclasses import replace

import torch


def switch(owner, name: str, a, b):
    """(A, B): callables that set owner.name to a, or to b."""
    return (lambda: setattr(owner, name, a)), (lambda: setattr(owner, name, b))


def kernel_switch(model, cache, name: str):
    """(A, B): the kernel `name` on (A) or off (B) for the cache's PQ layers (their configs and indexes) and the
    model's fast decode layers (engine/kernels.py)."""
    from pqcache.fastpath.layer import FastDecodeLayer

    def use(on: bool):
        for layer in cache.pq_layers if cache is not None else []:
            layer.config = replace(layer.config, kernels=replace(layer.config.kernels, **{name: on}))
            index = layer.method_state.get("index")
            if index is not None:
                index.config = layer.config
        for layer in model.model.layers:
            fast = layer.__dict__.get("forward")
            if isinstance(fast, FastDecodeLayer):
                fast.kernels = replace(fast.kernels, **{name: on})
                fast.bind()

    return (lambda: use(True)), (lambda: use(False))


def settings(model, what: str, cache=None):
    """(A, B): callables that switch the running model (and its cache) to setting A or B."""
    if what == "blocks":  # A: the PQ layers' device block cache (explicit capacity), B: none (a CPU's default)
        layers = cache.pq_layers
        blocks = [layer.window.blocks for layer in layers]

        def use(on: bool):
            for layer, b in zip(layers, blocks):
                layer.window.blocks = b if on else None

        return (lambda: use(True)), (lambda: use(False))
    if what == "onerow":  # A: the PQ layers' one-row decode step (layer/onerow.py), B: PQLayer.attend's general step
        import pqcache.engine.layer.onerow as onerow

        return switch(onerow, "ready", onerow.ready, lambda *_: False)
    if what == "values":  # A: the picks' values summed where they lie (HostTier.value_sums), B: copied, then summed
        return kernel_switch(model, cache, "values_in_place")
    if what == "select":  # A: PQCache's selection in C (native/select.py), B: in torch's operators
        return kernel_switch(model, cache, "native_select")
    if what == "pqstep":  # A: the one-row step's selection and attention in one C call (pq_step), B: call by call
        return kernel_switch(model, cache, "fused")
    if what == "file":  # A: the fused step files its new token in its own C call (pq_step), B: in a call of its own
        return kernel_switch(model, cache, "file_in_step")
    if what == "window":  # A: a sliding layer's step in one C call (layer_window_step), B: three and the copies
        return kernel_switch(model, cache, "window_step")
    if what == "attention":  # A: the one-row step's attention in one C call (attend_picks), B: torch's, values in place
        return kernel_switch(model, cache, "native_attention")
    if what == "threads":
        return (lambda: torch.set_num_threads(2)), (lambda: torch.set_num_threads(1))
    if what == "scores":  # A: the re-rank's scores stand in for the picks' keys, B: the picks' keys fetched too
        import pqcache.engine.methods.pqcache as method

        return switch(method, "PICKED_SCORES", method.PICKED_SCORES, "unread")
    from pqcache.fastpath.layer import FastDecodeLayer
    from pqcache.fastpath.quantize import WEIGHT_KINDS
    from pqcache.fastpath.weights import DecodeLinear

    layers = list(model.model.layers)
    fast = [layer.__dict__.get("forward") for layer in layers]

    def layer_forward(short: bool):
        for layer, f in zip(layers, fast):
            if short and isinstance(f, FastDecodeLayer):
                layer.forward = f
            else:
                layer.__dict__.pop("forward", None)

    if what == "layer":  # A: the short decode forward (fastpath/layer.py), B: transformers' layer forward
        return (lambda: layer_forward(True)), (lambda: layer_forward(False))
    if what == "step":  # A: the layers' one-token step in C (LayerStep), B: in torch (same int8 products)
        steps_in_c = {id(f): f.native for f in fast if isinstance(f, FastDecodeLayer)}

        def use(on: bool):
            for f in fast:
                if isinstance(f, FastDecodeLayer):
                    f.native = steps_in_c[id(f)] if on else None

        return (lambda: use(True)), (lambda: use(False))
    linears = [m for m in model.modules() if isinstance(m, DecodeLinear)]
    if what in ("lmhead", "native"):  # the exact-argmax head on the native int8 kernel (True) or on torch's (False)
        from pqcache.fastpath.lmhead import ExactArgmaxHead

        heads = {True: model.lm_head, False: ExactArgmaxHead(model.lm_head.head, use_native=False)}
    if what == "lmhead":  # A: the exact-argmax head on the native int8 kernel, B: on torch's int4 and int8 kernels
        return switch(model, "lm_head", heads[True], heads[False])
    if what == "native":  # A: the native kernels (pqcache/native), B: torch's (int8 kernels, gathered re-rank keys)
        from pqcache import native

        library = native.library
        held = [w for m in linears for w in (m.weights, m.group and m.group.weights) if w is not None]
        copies = {id(w): (w, w.native) for w in held if getattr(w, "native", None) is not None}

        def use(on: bool):
            native.library = library if on else (lambda: None)
            model.lm_head = heads[on]
            for w, kernel in copies.values():
                w.native = kernel if on else None

        return (lambda: use(True)), (lambda: use(False))
    if what in ("int4", "int8"):  # A: the copies the model was loaded with (int8, or auto), B: int4 / int8 copies
        holders = {id(h): h for m in linears for h in (m, m.group) if h is not None and h.weights is not None}
        other = {k: WEIGHT_KINDS[what][0](h.float_weight()) for k, h in holders.items()}
        mine = {k: h.weights for k, h in holders.items()}

        def use(copies):
            for k, h in holders.items():
                h.weights = copies[k]
            for f in fast:  # the short forward holds the layer's copies too
                if isinstance(f, FastDecodeLayer):
                    f.bind()

        return (lambda: use(mine)), (lambda: use(other))
    # "fused": A: q/k/v and gate/up stacked, B: one matmul per projection (transformers' layer forward in both)
    groups = {m: m.group for m in linears}
    own = {}

    def fused():
        layer_forward(False)
        for m, g in groups.items():
            m.group = g

    def separate():
        layer_forward(False)
        for m in linears:
            if m.weights is None:
                m.weights = own.setdefault(m, WEIGHT_KINDS[m.kind][0](m.linear.weight))
            m.group = None

    return fused, separate
