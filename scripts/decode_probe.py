"""Where a CPU decode step of the bundled model goes: the probes behind docs/benchmarks.md (issue 15).

python scripts/decode_probe.py hooks --seq-len 1024 --method pqcache   # ms per step by module kind (forward hooks)
python scripts/decode_probe.py ops --seq-len 4096                      # profiler events in the PQ layers' functions
python scripts/decode_probe.py ab --seq-len 8192 --what threads        # one-process A/B: 2 threads vs 1
python scripts/decode_probe.py ab --seq-len 4096 --what fused          # stacked q/k/v, gate/up vs separate
python scripts/decode_probe.py ab --seq-len 8192 --what layer          # the short decode forward vs transformers'
python scripts/decode_probe.py ab --seq-len 8192 --what int4           # int8 vs int4 decode weights
python scripts/decode_probe.py ab --seq-len 8192 --what int8           # auto decode weights vs int8 everywhere
python scripts/decode_probe.py ab --seq-len 32768 --what native        # the native kernels vs torch's operators
python scripts/decode_probe.py ab --seq-len 32768 --what lmhead        # the LM head: native int8 vs torch's int4+int8
python scripts/decode_probe.py ab --seq-len 32768 --what step          # layers' step in C (layer_step.c) vs in torch
python scripts/decode_probe.py ab --seq-len 32768 --what values        # picks' values summed in place vs copied
python scripts/decode_probe.py ab --seq-len 32768 --what select        # PQ search and re-rank's top-k in C vs torch
python scripts/decode_probe.py ab --seq-len 32768 --what attention     # PQ layers' attention in one C call vs torch
python scripts/decode_probe.py ab --seq-len 32768 --what scores        # re-rank scores for the picks vs their keys
python scripts/decode_probe.py ab --seq-len 8192 --what blocks         # a 1024-token block cache vs none (CPU default)
python scripts/decode_probe.py ab --seq-len 32768 --what budget        # default budget (1/10) vs 1/5 (two forks)
python scripts/decode_probe.py ab --seq-len 8192 --what onerow         # PQ layers' one-row step vs the general one
python scripts/decode_probe.py head                                    # LM head kernels and exact-argmax bounds
python scripts/decode_probe.py parts --seq-len 8192                    # wall-clock ms of the PQ layers' parts
python scripts/decode_probe.py omp --seq-len 1024                      # decode beside a thread with OpenMP helpers
python scripts/decode_probe.py app                                     # the app's own answer rate (gradio_client)
python scripts/decode_probe.py app --document-tokens 8192             # the same on a passkey document of ~8K tokens
python scripts/decode_probe.py panels --document-tokens 8192          # the app's answers in process; panels' draws

Each prefills one prompt (the passkey filler) and decodes greedily. A/B runs alternate bursts of 5 timed decode
steps between settings A and B after one prefill, so the machine's drifts hit both; they print the median,
lower quartile and minimum step. Timings on a shared machine are noisy: compare within one run only.
"""

from __future__ import annotations

import argparse
import collections
import functools
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout: the repo's pqcache
from pqcache.engine.config import PQCacheConfig  # noqa: E402
from pqcache.serving.generate import decode_one_token, make_cache, prefill  # noqa: E402
from pqcache.serving.loading import load_model  # noqa: E402
from pqcache.tools.e2e import prompt_ids  # noqa: E402


def prefilled(seq_len: int, method: str, config: PQCacheConfig | None = None, decode_weights: str = "int8"):
    model, tok = load_model("default", device="cpu", progress=lambda *_: None, decode_weights=decode_weights)
    cache = make_cache(model, method, config or PQCacheConfig())
    logits = prefill(model, torch.tensor([prompt_ids(tok, seq_len)]), cache)
    if method != "full":
        cache.wait()
    return model, tok, cache, logits.argmax(-1, keepdim=True)


def steps(model, cache, token, n: int):
    for _ in range(n):
        token = decode_one_token(model, token, cache).argmax(-1, keepdim=True)
    return token


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
    """Wall-clock time (no profiler) of the PQ layers' attention and its parts, summed over the 3 layers, per step."""
    import pqcache.engine.layer.blockcache as blockcache
    import pqcache.engine.layer.layer as layer
    import pqcache.engine.layer.onerow as onerow
    import pqcache.engine.layer.window as window
    import pqcache.engine.methods.pqcache as method

    total, calls = collections.Counter(), collections.Counter()

    def timed(owner, name):
        f = getattr(owner, name)

        @functools.wraps(f)
        def call(*a, **k):
            t0 = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                total[name] += time.perf_counter() - t0
                calls[name] += 1

        setattr(owner, name, call)

    for owner, name in [
        (layer.PQLayer, "attend"),
        (method.PQCacheMethod, "search"),
        (method, "rerank_exact"),
        (window.DeviceWindow, "fetch"),
        (blockcache.BlockCache, "admit"),
        (layer, "masked_attention"),
        (layer.PQLayer, "_append"),
        (onerow, "search"),  # the one-row step's calls of the same functions (layer/onerow.py)
        (onerow, "rerank_exact"),
        (onerow, "masked_attention"),
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
        print(f"{name:18s} {s / args.steps * 1e3:7.2f} ms/step ({calls[name] // args.steps} calls a step)")


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


def app(args):
    """`python app.py` as a user starts it, through gradio_client: load the sample document (or, with
    --document-tokens N, a passkey document of about N tokens), then ask one plain question four times (pqcache,
    full, pqcache, full) and print the page's own load line and timing line of each answer."""
    import tempfile

    from gradio_client import Client, handle_file

    from pqcache.serving.settings import LoadSettings
    from pqcache.tools.loadtest import running_app
    from pqcache.tools.passkey import passkey_context

    path = Path(__file__).resolve().parent.parent / "assets" / "passkey_1k.txt"
    if args.document_tokens:
        path = Path(tempfile.mkdtemp()) / f"passkey_{args.document_tokens}.txt"
        # a filler is 24 tokens of the bundled model's tokenizer
        path.write_text(passkey_context("68422", n_filler=max(1, args.document_tokens // 24)))
    with running_app() as (url, _):
        client = Client(url, verbose=False)
        document = handle_file(str(path))
        print(client.predict(document, "", *LoadSettings().values(), api_name="/load_document")[0].splitlines()[0])
        for method in ("pqcache", "full", "pqcache", "full"):
            job = client.submit("List the numbers from 1 to 100.", [], method, 64, "5", api_name="/ask")
            print(list(job)[-1][1])


def panels(args):
    """The app's answer path in process, at its load settings (DocumentSession.ask, LoadSettings) on a passkey
    document of about --document-tokens tokens (default 8192): the first token's time and the answer's with the
    app's observer and without, alternating; then each live panel's draw time (median of 5) on the records of the
    last observed answer."""
    from pqcache import Instrumentation
    from pqcache.serving.session import DocumentSession
    from pqcache.serving.settings import LoadSettings
    from pqcache.tools.passkey import LONG_QUESTION, passkey_context
    from studio.panels import merged_data
    from viz import figures

    model, tok = load_model("default", device="cpu", progress=lambda *_: None)
    session = DocumentSession(model, tok, LoadSettings().to_config())
    session.load(passkey_context("68422", n_filler=max(1, (args.document_tokens or 8192) // 24)))
    session.cache.wait()
    seen = None  # the last observed answer's records
    for observed in (True, False, True, False):
        obs = Instrumentation(timeline=True, attention_every=4, recall_every=4) if observed else None  # the app's
        t0, first = time.perf_counter(), []
        answer = session.ask(
            LONG_QUESTION, "pqcache", 64, observer=obs, on_token=lambda a, f=first: f.append(time.perf_counter())
        )
        seen = obs or seen
        print(
            f"observer {observed!s:5}: first token {(first[0] - t0) * 1e3:.0f} ms, {len(answer.tokens)} tokens in "
            f"{answer.seconds:.2f} s"
        )
    data, stats = merged_data(session, seen), session.last_stats
    layer = min(r["layer"] for r in data["attention"])
    draws = {
        "power law": lambda: figures.power_law(data, layer),
        "recall": lambda: figures.recall(data, "pqcache"),
        "hit rate": lambda: figures.hit_rate(data, "pqcache"),
        "timeline (last 5 s)": lambda: figures.timeline(data, "cpu", 5.0),
        "memory": lambda: figures.memory(stats),
    }
    for name, draw in draws.items():
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            draw()
            times.append(time.perf_counter() - t0)
        print(f"{name}: {statistics.median(times) * 1e3:.1f} ms ({len(data['events'])} timeline events)")


def labelled(f, label: str, record_function):
    """f, its calls shown as a `label` range in the profiler."""

    @functools.wraps(f)
    def call(*a, **k):
        with record_function(label):
            return f(*a, **k)

    return call


def switch(owner, name: str, a, b):
    """(A, B): callables that set owner.name to a, or to b."""
    return (lambda: setattr(owner, name, a)), (lambda: setattr(owner, name, b))


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
        import pqcache.engine.layer.onerow as onerow

        return switch(onerow, "VALUES_IN_PLACE", True, False)
    if what == "select":  # A: PQCache's selection in C (native/select.py), B: in torch's operators
        import pqcache.engine.methods.pqcache as method

        return switch(method, "NATIVE_SELECT", True, False)
    if what == "attention":  # A: the one-row step's attention in one C call (attend_picks), B: torch's, values in place
        import pqcache.engine.layer.onerow as onerow

        return switch(onerow, "NATIVE_ATTENTION", True, False)
    if what == "threads":
        return (lambda: torch.set_num_threads(2)), (lambda: torch.set_num_threads(1))
    if what == "scores":  # A: the re-rank's scores stand in for the picks' keys, B: the picks' keys fetched too
        import pqcache.engine.methods.pqcache as method

        return switch(method, "PICKED_SCORES", method.PICKED_SCORES, "unread")
    from pqcache.serving.decode_layer import FastDecodeLayer
    from pqcache.serving.decode_weights import DecodeLinear
    from pqcache.serving.quantize import WEIGHT_KINDS

    layers = list(model.model.layers)
    fast = [layer.__dict__.get("forward") for layer in layers]

    def layer_forward(short: bool):
        for layer, f in zip(layers, fast):
            if short and isinstance(f, FastDecodeLayer):
                layer.forward = f
            else:
                layer.__dict__.pop("forward", None)

    if what == "layer":  # A: the short decode forward (decode_layer.py), B: transformers' layer forward
        return (lambda: layer_forward(True)), (lambda: layer_forward(False))
    if what == "step":  # A: the layers' one-token step in C (native.LayerStep), B: in torch (same int8 products)
        steps_in_c = {id(f): f.native for f in fast if isinstance(f, FastDecodeLayer)}

        def use(on: bool):
            for f in fast:
                if isinstance(f, FastDecodeLayer):
                    f.native = steps_in_c[id(f)] if on else None

        return (lambda: use(True)), (lambda: use(False))
    linears = [m for m in model.modules() if isinstance(m, DecodeLinear)]
    if what in ("lmhead", "native"):  # the exact-argmax head on the native int8 kernel (True) or on torch's (False)
        from pqcache.serving.lmhead import ExactArgmaxHead

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


def ab(args):
    config = PQCacheConfig(block_cache_tokens=1024) if args.what == "blocks" else PQCacheConfig()
    weights = "auto" if args.what == "int8" else "int8"  # "int8": the auto copies (A) against int8 everywhere (B)
    model, _, cache, token = prefilled(args.seq_len, args.method, config, weights)
    if args.what == "budget":  # A: the default budget (1/10), B: 1/5; two forks of one prefill, each decoding its own
        caches = {
            "A": cache.fork(args.method, PQCacheConfig()),
            "B": cache.fork(args.method, PQCacheConfig(token_budget=0.2)),
        }
        setups = {"A": lambda: None, "B": lambda: None}
    else:
        caches = {"A": cache, "B": cache}
        setups = dict(zip("AB", settings(model, args.what, cache)))
    import pqcache.engine.layer.layer as layer

    in_pq = [0.0]  # seconds inside the PQ layers' attention (PQLayer.attend) during the timed step
    attend = layer.PQLayer.attend

    def timed_attend(*a, **k):
        t0 = time.perf_counter()
        try:
            return attend(*a, **k)
        finally:
            in_pq[0] += time.perf_counter() - t0

    layer.PQLayer.attend = timed_attend
    tokens = {"A": token, "B": token}
    times, pq_times = {"A": [], "B": []}, {"A": [], "B": []}
    for rnd in range(8):
        for name in "AB" if rnd % 2 == 0 else "BA":
            setups[name]()
            token = steps(model, caches[name], tokens[name], 1)  # the first step after a switch is not timed
            for _ in range(5):
                in_pq[0] = 0.0
                t0 = time.perf_counter()
                token = steps(model, caches[name], token, 1)
                times[name].append((time.perf_counter() - t0) * 1e3)
                pq_times[name].append(in_pq[0] * 1e3)
            tokens[name] = token
    layer.PQLayer.attend = attend
    for name, ts in times.items():
        q1 = statistics.quantiles(ts, n=4)[0]
        print(
            f"{args.what} {args.seq_len} {name}: median {statistics.median(ts):.1f}  p25 {q1:.1f}  min {min(ts):.1f} ms"
            f"  (PQ layers' attention: median {statistics.median(pq_times[name]):.2f} ms)"
        )


def head(args):
    """The LM head (262,144 x 640): torch's int8 and int4 kernels, then the exact-argmax head on torch's kernels
    (pqcache/serving/lmhead.py) with its int4 stage and without it (the int8 pass over every row), A/B in one
    process, and how many candidates each stage leaves on real hidden states. The head the model runs with the
    native kernel: `ab --what lmhead`."""
    from pqcache.serving.lmhead import GROUP, ExactArgmaxHead

    model, tok = load_model("default", device="cpu", progress=lambda *_: None)
    fast = ExactArgmaxHead(model.lm_head.head, use_native=False)
    V = fast.q.shape[0]
    with torch.no_grad():
        h = model.model(input_ids=torch.tensor([prompt_ids(tok, 1024)])).last_hidden_state[0, ::4]  # (256, D)
    x = h[:1].bfloat16()

    def ms(f, n=20):
        f()
        t0 = time.perf_counter()
        for _ in range(n):
            f()
        return (time.perf_counter() - t0) / n * 1e3

    int8 = functools.partial(torch.ops.aten._weight_int8pack_mm, x, fast.q, fast.scale)
    print(f"int8 kernel (_weight_int8pack_mm) over all rows: {ms(int8):.1f} ms")
    if not fast.int4:
        print("no int4 stage here (torch lacks _weight_int4pack_mm_for_cpu): nothing to compare")
        return
    int4 = functools.partial(torch.ops.aten._weight_int4pack_mm_for_cpu, x, fast.packed, GROUP, fast.scales_and_zeros)
    print(f"int4 kernel (_weight_int4pack_mm_for_cpu, groups of {GROUP}) over all rows: {ms(int4):.1f} ms")
    c1, c2 = [], []
    with torch.no_grad():
        for row in h:  # one decode-sized forward per hidden state
            before = dict(fast.stats)
            fast(row.view(1, 1, -1))
            c1.append(fast.stats["int4_candidates"] - before["int4_candidates"])
            c2.append(fast.stats["candidates"] - before["candidates"])
    c1, c2 = torch.tensor(c1).float(), torch.tensor(c2).float()
    for name, c in (("int4 survivors (C1)", c1), ("int8 survivors (C2, exact logits)", c2)):
        p = [f"{c.quantile(q / 100):.0f}" for q in (50, 90, 99)]
        print(
            f"{name} per row of {V}, {len(c)} hidden states: median {p[0]}, p90 {p[1]}, p99 {p[2]}, max {c.max():.0f}"
        )
    n_big = int((c1 > fast.max_int4_candidates).sum())
    print(f"int8 stage over every row (C1 > {fast.max_int4_candidates}): {n_big} of {len(c1)}")
    times = {"int4+int8": [], "int8 only": []}
    with torch.no_grad():
        for rnd in range(10):  # alternating bursts of 5 calls; the first call after a switch is not timed
            for name in ("int4+int8", "int8 only") if rnd % 2 == 0 else ("int8 only", "int4+int8"):
                fast.int4 = name == "int4+int8"
                fast(h[rnd].view(1, 1, -1))
                for i in range(5):
                    row = h[(rnd * 5 + i) % len(h)].view(1, 1, -1)
                    t0 = time.perf_counter()
                    fast(row)
                    times[name].append((time.perf_counter() - t0) * 1e3)
    fast.int4 = True
    for name, ts in times.items():
        q1 = statistics.quantiles(ts, n=4)[0]
        print(
            f"exact-argmax head, {name}: median {statistics.median(ts):.2f}  p25 {q1:.2f}  min {min(ts):.2f} ms per row"
        )


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", choices=["hooks", "ops", "ab", "head", "parts", "omp", "app", "panels"])
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--method", default="pqcache", help="hooks, ab: full or pqcache")
    p.add_argument(
        "--what",
        choices=["threads", "fused", "layer", "int4", "scores", "blocks", "budget", "onerow", "int8", "native"]
        + ["lmhead", "step", "values", "select", "attention"],
        default="threads",
        help="ab: what A and B differ in",
    )
    p.add_argument("--steps", type=int, default=10, help="hooks, parts, omp: decode steps timed")
    p.add_argument(
        "--document-tokens", type=int, default=0, help="app, panels: a passkey document of about this many tokens"
    )
    args = p.parse_args()
    torch.set_num_threads(2)
    modes = {"hooks": hooks, "ops": ops, "ab": ab, "head": head, "parts": parts, "omp": omp, "app": app}
    modes["panels"] = panels
    modes[args.mode](args)


if __name__ == "__main__":
    main()
