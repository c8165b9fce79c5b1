"""One-process A/B runs: bursts of 5 timed decode steps alternate between settings A and B after one prefill, so
the machine's drifts hit both; each prints the median, lower quartile and minimum step. `ab` flips the switches of
switches.py on the whole model; `head` compares the LM head's kernels and stages alone."""

from __future__ import annotations

import functools
import statistics
import time

import torch

from pqcache.bench.e2e import prompt_ids
from pqcache.engine.config import PQCacheConfig
from pqcache.serving.loading import load_model

from .common import prefilled, steps
from .switches import settings


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
    (pqcache/fastpath/lmhead.py) with its int4 stage and without it (the int8 pass over every row), A/B in one
    process, and how many candidates each stage leaves on real hidden states. The head the model runs with the
    native kernel: `ab --what lmhead`."""
    from pqcache.fastpath.lmhead import GROUP, ExactArgmaxHead

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
