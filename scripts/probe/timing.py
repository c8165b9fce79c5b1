"""Where a CPU decode step's time goes: per module kind (forward hooks), in the profiler's operator events, in the
PQ layers' parts (wall clock), and beside a thread that keeps OpenMP helpers."""

from __future__ import annotations

import collections
import functools
import statistics
import time

import torch

from pqcache.bench.e2e import prompt_ids
from pqcache.serving.generate import prefill
from pqcache.serving.loading import load_model

from .common import prefilled, steps


def hooks(args):
    model, _, cache, token = prefilled(args.seq_len, args.method)
    token = steps(model, cache, token, 3)
    kinds = model.config.get_text_config().layer_types
    total, start = collections.defaultdict(float), {}

    def timed(name, module):
        module.register_forward_pre_hook(lambda m, a: start.__setitem__(name, time.perf_counter()))
        module.register_forward_hook(
            lambda m, a, o: total.__setitem__(name, total[name] + time.perf_counter() - start[name])
        )

    for i, layer in enumerate(model.model.layers):
        timed(
            "attention, full-attention layers" if kinds[i] == "full_attention" else "attention, sliding",
            layer.self_attn,
        )
        timed("MLPs", layer.mlp)
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            timed("q/k/v/o projections", getattr(layer.self_attn, name))
    timed("LM head", model.lm_head)
    timed("whole step", model)
    steps(model, cache, token, args.steps)
    for name, s in total.items():
        print(f"{name:34s} {s / args.steps * 1e3:7.2f} ms/step")


def ops(args):
    from torch.profiler import profile, record_function

    import pqcache.engine.layer.blockcache as blockcache
    import pqcache.engine.layer.layer as layer
    import pqcache.engine.layer.window as window
    import pqcache.engine.methods.pqcache as method

    model, _, cache, token = prefilled(args.seq_len, "pqcache")
    token = steps(model, cache, token, 3)
    parts = [
        (layer.PQLayer, "attend"),
        (layer.PQLayer, "select"),
        (method, "rerank_exact"),
        (method, "approx_scores"),
        (window.DeviceWindow, "fetch"),
        (blockcache.BlockCache, "admit"),
        (window.DeviceWindow, "assemble"),
        (layer.PQLayer, "_append"),
    ]
    for owner, name in parts:
        setattr(owner, name, labelled(getattr(owner, name), "PQ::" + name, record_function))
    with profile() as prof:
        steps(model, cache, token, 1)
    events = prof.events()
    aten = [e for e in events if e.name.startswith("aten::")]
    print(f"operator events in one step (nested calls counted): {len(aten)}")
    for r in (e for e in events if e.name.startswith("PQ::")):
        inside = sum(
            1 for e in aten if r.time_range.start <= e.time_range.start and e.time_range.end <= r.time_range.end
        )
        print(f"{r.name:22s} {inside:5d} events {r.cpu_time_total / 1e3:7.2f} ms")


def parts(args):
    """Wall-clock time (no profiler) of the PQ layers' attention and its parts, summed over the 3 layers, per step; the
    decoder layers' steps and their C calls; the LM head."""
    import pqcache.engine.layer.blockcache as blockcache
    import pqcache.engine.layer.host as host
    import pqcache.engine.layer.index as index
    import pqcache.engine.layer.layer as layer
    import pqcache.engine.layer.onerow as onerow
    import pqcache.engine.layer.sliding as sliding
    import pqcache.engine.layer.window as window
    import pqcache.engine.methods.pqcache as method
    import pqcache.native.pq_step as native_step
    import pqcache.native.select as native_select
    from pqcache.fastpath.layer import FastDecodeLayer
    from pqcache.fastpath.lmhead import ExactArgmaxHead
    from pqcache.native.layer import LayerStep

    total, calls = collections.Counter(), collections.Counter()

    def timed(owner, name):
        f = getattr(owner, name)
        label = f"{owner.__name__.rsplit('.', 1)[-1]}.{name}"  # a class's or a module's name: PQLayer.attend

        @functools.wraps(f)
        def call(*a, **k):
            t0 = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                total[label] += time.perf_counter() - t0
                calls[label] += 1

        setattr(owner, name, call)

    for owner, name in [
        (layer.PQLayer, "attend"),
        (method.PQCacheMethod, "search"),
        (method, "rerank_exact"),
        (window.DeviceWindow, "fetch"),
        (blockcache.BlockCache, "admit"),
        (onerow, "attend"),  # the one-row step (layer/onerow.py) and its parts
        (onerow, "search"),
        (onerow, "rerank_exact"),
        (onerow, "masked_attention"),
        (onerow, "_append"),
        (window.DeviceWindow, "look_up"),
        (window.DeviceWindow, "admit"),
        (native_select, "attend_picks"),
        (index.PQIndex, "append"),
        (index.PQIndex, "encode"),  # ... the new key's codes
        (native_select, "pq_top"),  # the first stage's C call
        (native_select, "tables"),  # ... and its tables (pq_codes.c)
        (host.HostTier, "key_scores"),  # the re-rank's exact scores (gather_dot.c)
        (native_select, "combined_top"),  # ... their combine and top-k
        (host.HostTier, "append"),  # the new token stored
        (window.DeviceWindow, "ring_write"),
        (window.DeviceWindow, "candidates"),
        (layer.PQLayer, "topk_counts"),
        (FastDecodeLayer, "step"),  # every decoder layer's step, and its C calls (fastpath/layer.py)
        (LayerStep, "qkv"),
        (LayerStep, "attend"),  # the sliding layers' attention
        (LayerStep, "out"),
        (LayerStep, "window_step"),  # a sliding layer's whole step in one call
        (native_step, "pq_step"),  # a PQ layer's selection and attention in one call
        (sliding.AppendSlidingWindowLayer, "update_stored"),
        (ExactArgmaxHead, "forward"),  # the LM head
    ]:
        timed(owner, name)
    model, _, cache, token = prefilled(args.seq_len, "pqcache")
    token = steps(model, cache, token, 3)
    total.clear()
    calls.clear()
    t0 = time.perf_counter()
    steps(model, cache, token, args.steps)
    print(f"whole step {(time.perf_counter() - t0) / args.steps * 1e3:7.2f} ms")
    for name, s in total.most_common():
        print(f"{name:36s} {s / args.steps * 1e3:7.2f} ms/step ({calls[name] // args.steps} calls a step)")


def omp(args):
    """Decode steps with transformers' cache on this thread: alone, while another live thread has run a parallel
    torch operator without confinement (what the K-Means builder did before pqcache/engine/threads.py), and after
    that thread ended. libgomp's throttled waiting shows in the middle one."""
    import threading

    from transformers import DynamicCache

    model, tok = load_model("default", device="cpu", progress=lambda *_: None)
    cache = DynamicCache(config=model.config)
    token = prefill(model, torch.tensor([prompt_ids(tok, args.seq_len)]), cache).argmax(-1, keepdim=True)

    def median_step() -> float:
        nonlocal token
        token = steps(model, cache, token, 3)
        ts = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            token = steps(model, cache, token, 1)
            ts.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(ts)

    alone = median_step()
    ready, leave = threading.Event(), threading.Event()

    def other():
        (torch.randn(512, 512) @ torch.randn(512, 512)).sum()  # starts this thread's OpenMP team
        ready.set()
        leave.wait()

    worker = threading.Thread(target=other, daemon=True)
    worker.start()
    ready.wait()
    beside = median_step()
    leave.set()
    worker.join()
    after = median_step()
    print(f"median decode step: alone {alone:.1f} ms, beside a thread with OpenMP helpers {beside:.1f} ms, ", end="")
    print(f"after it ended {after:.1f} ms")


def labelled(f, label: str, record_function):
    """f, its calls shown as a `label` range in the profiler."""

    @functools.wraps(f)
    def call(*a, **k):
        with record_function(label):
            return f(*a, **k)

    return call
