"""Where a CPU decode step of the bundled model goes: the probes behind docs/benchmarks.md (issue 15).

python scripts/decode_probe.py hooks --seq-len 1024 --method pqcache   # ms per step by module kind (forward hooks)
python scripts/decode_probe.py ops --seq-len 4096                      # profiler events in the PQ layers' functions
python scripts/decode_probe.py ab --seq-len 8192 --what threads        # one-process A/B: 2 threads vs 1
python scripts/decode_probe.py ab --seq-len 4096 --what fused          # stacked q/k/v, gate/up vs separate
python scripts/decode_probe.py head                                    # LM head kernels and exact-argmax bounds

Each prefills one prompt (the passkey filler) and decodes greedily. A/B runs alternate bursts of 5 timed decode
steps between settings A and B after one prefill, so the machine's drifts hit both; they print the median,
lower quartile and minimum step. Timings on a shared machine are noisy: compare within one run only.
"""

from __future__ import annotations

import argparse
import collections
import functools
import statistics
import time

import torch

from pqcache.engine.config import PQCacheConfig
from pqcache.serving.generate import decode_one_token, make_cache, prefill
from pqcache.serving.loading import load_model
from pqcache.tools.e2e import prompt_ids


def prefilled(seq_len: int, method: str):
    model, tok = load_model("default", device="cpu", progress=lambda *_: None)
    cache = make_cache(model, method, PQCacheConfig())
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


def labelled(f, label: str, record_function):
    """f, its calls shown as a `label` range in the profiler."""

    @functools.wraps(f)
    def call(*a, **k):
        with record_function(label):
            return f(*a, **k)

    return call


def settings(model, what: str):
    """(A, B): callables that switch the running model to setting A or B."""
    if what == "threads":
        return (lambda: torch.set_num_threads(2)), (lambda: torch.set_num_threads(1))
    from pqcache.serving.int8 import Int8DecodeLinear

    linears = [m for m in model.modules() if isinstance(m, Int8DecodeLinear)]
    groups = {m: m.group for m in linears}

    def fused():
        for m, g in groups.items():
            m.group = g

    def separate():
        for m in linears:
            m.group = None

    return fused, separate


def ab(args):
    model, _, cache, token = prefilled(args.seq_len, args.method)
    setups = dict(zip("AB", settings(model, args.what)))
    times = {"A": [], "B": []}
    for rnd in range(8):
        for name in "AB" if rnd % 2 == 0 else "BA":
            setups[name]()
            token = steps(model, cache, token, 1)  # the first step after a switch is not timed
            for _ in range(5):
                t0 = time.perf_counter()
                token = steps(model, cache, token, 1)
                times[name].append((time.perf_counter() - t0) * 1e3)
    for name, ts in times.items():
        q1 = statistics.quantiles(ts, n=4)[0]
        print(
            f"{args.what} {args.seq_len} {name}: median {statistics.median(ts):.1f}  p25 {q1:.1f}  min {min(ts):.1f} ms"
        )


def head(args):
    """The LM head (262,144 x 640) as int8 and int4 kernels, and how many candidates each one's exact-argmax bound
    leaves on real hidden states."""
    model, tok = load_model("default", device="cpu", progress=lambda *_: None)
    w = model.lm_head.head.weight.detach().float()  # (V, D)
    V, D = w.shape
    with torch.no_grad():
        h = model.model(input_ids=torch.tensor([prompt_ids(tok, 512)])).last_hidden_state[0, ::8]  # (64, D)
    x = h[:1].bfloat16()

    def ms(f, n=20):
        f()
        t0 = time.perf_counter()
        for _ in range(n):
            f()
        return (time.perf_counter() - t0) / n * 1e3

    fast = model.lm_head
    print(f"int8 (_weight_int8pack_mm): {ms(lambda: torch.ops.aten._weight_int8pack_mm(x, fast.q, fast.scale)):.1f} ms")
    print(f"||h||_1 of the final hidden states: mean {h.abs().sum(-1).mean():.0f} over {D} dims")
    exact = h @ w.T
    for gs in (32, 128):
        g = D // gs
        wg = w.view(V, g, gs)
        lo, hi = wg.amin(-1), wg.amax(-1)
        scale = ((hi - lo) / 15).clamp(min=1e-8).bfloat16()
        zero = (lo + 8 * scale.float()).bfloat16()
        q = torch.round((wg - (zero.float() - 8 * scale.float())[..., None]) / scale.float()[..., None]).clamp(0, 15)
        err = (wg - ((q - 8) * scale.float()[..., None] + zero.float()[..., None])).abs().amax(-1)  # (V, g)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.view(V, D).to(torch.int32), 1)
        sz = torch.stack([scale, zero], -1).transpose(0, 1).contiguous()
        t = ms(functools.partial(torch.ops.aten._weight_int4pack_mm_for_cpu, x, packed, gs, sz))
        approx = torch.ops.aten._weight_int4pack_mm_for_cpu(h.bfloat16(), packed, gs, sz).float()
        bound = h.abs().view(-1, g, gs).sum(-1) @ err.T + (h - h.bfloat16().float()).abs().sum(
            -1, keepdim=True
        ) * w.abs().amax(1)
        bound += approx.abs() * 2**-7
        cand = ((approx + bound) >= (approx - bound).amax(-1, keepdim=True)).sum(-1).float()
        assert bool(
            ((approx + bound) >= (approx - bound).amax(-1, keepdim=True))
            .gather(1, exact.argmax(-1, keepdim=True))
            .all()
        )
        print(f"int4, groups of {gs}: {t:.1f} ms; exact-argmax candidates per row of {V}: ", end="")
        print(f"median {cand.median():.0f}, max {cand.max():.0f}")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", choices=["hooks", "ops", "ab", "head"])
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--method", default="pqcache", help="hooks, ab: full or pqcache")
    p.add_argument("--what", choices=["threads", "fused"], default="threads", help="ab: what A and B differ in")
    p.add_argument("--steps", type=int, default=10, help="hooks: decode steps timed")
    args = p.parse_args()
    torch.set_num_threads(2)
    {"hooks": hooks, "ops": ops, "ab": ab, "head": head}[args.mode](args)


if __name__ == "__main__":
    main()
