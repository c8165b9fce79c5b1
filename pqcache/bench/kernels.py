"""`bench kernels`: how fast the decode step's kernels (torch's and pqcache/native's) read their bytes, against the
memory.

A one-row decode step reads every decoder weight and the LM head once. If the kernels ran at the rate the memory
streams, the step's weight time would be bytes / bandwidth; this benchmark measures, in one run on the machine it
runs on, that streaming rate (a float32 sum over a buffer as large as the int8 decoder copies) and each kernel's
effective rate on the bundled model's shapes: the decoder linears of every layer as fastpath/weights.py stacks them
(q/k/v and gate/up one matrix each), cycled so that each call finds its weights out of the caches as a decode step
does, and the LM head; the re-rank's exact scores of a 32K-token context (native.gather_dot against a gathered
copy and a matmul); and PQCache's first stage over the same context (the codes' lookups, the GQA combine, the top-k:
torch's operators against native/select.pq_top, bytes counted as the codes' only). `of_stream` is a kernel's rate
over the stream's on as many threads: 1 would mean the memory sets the pace (only fewer bytes would gain), well
below 1 that the kernel's arithmetic or its access pattern does (a kernel that streamed its bytes would take
of_stream of the time). `thread_speedup` (its time on one thread over its time on all) says the same from another
side when compared with the stream's own: one core alone does not saturate the memory.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from pqcache import native
from pqcache.bench.attention import median_ms
from pqcache.fastpath.quantize import GROUP, Int4Groups, Int8Rows, int4_kernel_takes, quantize_int4


def decoder_shapes(config) -> list[tuple[int, int]]:
    """(rows, columns) of one decoder layer's matrices as a decode step multiplies them (siblings stacked)."""
    E, inter = config.hidden_size, config.intermediate_size
    D = getattr(config, "head_dim", None) or E // config.num_attention_heads
    q, kv = config.num_attention_heads * D, config.num_key_value_heads * D
    return [(q + 2 * kv, E), (E, q), (2 * inter, E), (E, inter)]


def _ms(fn, repeats: int) -> float:
    fn()  # first call: allocations
    return median_ms(fn, repeats)


def _timed(fn, repeats: int, threads: int) -> tuple[float, float]:
    """(ms on `threads` threads, ms on one)."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        many = _ms(fn, repeats)
        torch.set_num_threads(1)
        return many, _ms(fn, repeats)
    finally:
        torch.set_num_threads(before)


def bench_kernels(config, repeats: int = 10, threads: int | None = None, head: bool = True) -> list[dict]:
    """config: a decoder config (hidden_size, intermediate_size, heads, num_hidden_layers, vocab_size). Random
    weights of its shapes (the kernels' speed does not depend on the values) -> one row per kernel."""
    threads = threads or torch.get_num_threads()
    g = torch.Generator().manual_seed(0)
    shapes = decoder_shapes(config)
    layers = [[torch.randn(n, k, generator=g) * 0.05 for n, k in shapes] for _ in range(config.num_hidden_layers)]
    acts = {k: torch.randn(1, k, generator=g) for _, k in shapes}
    kinds = {"int8 rows": functools.partial(Int8Rows, use_native=False)}
    if native.library() is not None:
        kinds["int8 rows, native"] = Int8Rows
    if all(int4_kernel_takes(k) for _, k in shapes):
        kinds["int4 groups"] = Int4Groups
    # (copy, its input width) for every matrix of every layer, by kind
    copies = {name: [(kind(w), w.shape[1]) for layer in layers for w in layer] for name, kind in kinds.items()}
    del layers
    int8_bytes = sum(m.nbytes for m, _ in copies["int8 rows"])
    stream = torch.rand(int8_bytes // 4, generator=g)  # float32, as many bytes as the int8 copies

    def run(mats):
        def step():  # every layer in turn: each matrix is out of the caches when its turn comes, as in a decode step
            for m, k in mats:
                m.mm(acts[k])

        return step

    cases = [("memory", "float32 sum", stream.numel() * 4, stream.sum)]
    cases += [("decoder linears", name, sum(m.nbytes for m, _ in mats), run(mats)) for name, mats in copies.items()]
    if head and int4_kernel_takes(config.hidden_size):
        V, E = config.vocab_size, config.hidden_size
        w = torch.randn(V, E, generator=g) * 0.05
        h = torch.randn(1, E, generator=g)
        packed, sz, _ = quantize_int4(F.pad(w, (0, 0, 0, -V % 64)))
        q8 = Int8Rows(w, use_native=False)
        q8n = Int8Rows(w) if native.library() is not None else None  # what the exact-argmax head reads with it
        del w
        hb = h.to(torch.bfloat16)

        def head4():
            torch.ops.aten._weight_int4pack_mm_for_cpu(hb, packed, GROUP, sz)

        cases += [
            ("LM head", "int4 groups", packed.numel() + 2 * sz.numel(), head4),
            ("LM head", "int8 rows", q8.nbytes, lambda: q8.mm(h)),
        ]
        if q8n is not None:
            cases.append(("LM head", "int8 rows, native", q8n.nbytes, lambda: q8n.mm(h)))
    cases += rerank_cases(config, g) + search_cases(config, g)
    rows, rates = [], []
    for what, weights, nbytes, fn in cases:
        many, one = _timed(fn, repeats, threads)
        rates.append(nbytes / many)  # unrounded: a tiny case on a busy machine would round to 0 GB/s
        rows.append(
            {
                "kernel": what,
                "weights": weights,
                "mb": round(nbytes / 2**20, 1),
                "ms": round(many, 2),
                "gb_s": round(nbytes / many / 1e6, 1),
                "threads": threads,
                "ms_1_thread": round(one, 2),
                "thread_speedup": round(one / many, 2),
            }
        )
    for row, rate in zip(rows, rates, strict=True):
        row["of_stream"] = round(rate / rates[0], 2)
    return rows


def _first_stage(config, context: int) -> tuple[int, int, int]:
    """(head_dim, query rows per KV head, first-stage candidates) of a PQ layer's decode step at `context` tokens with
    PQCache's defaults: rerank x the top-k, which is the budget less the sinks and the local window."""
    from pqcache.engine.config import PQCacheConfig
    from pqcache.engine.methods.pqcache import first_stage_count

    defaults = PQCacheConfig()
    D = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    group = config.num_attention_heads // config.num_key_value_heads
    n_init, k, n_local = defaults.split(context)
    return D, group, first_stage_count(defaults, k, context - n_init - n_local)


def rerank_cases(config, g: torch.Generator, context: int = 32768, layers: int = 3) -> list[tuple]:
    """The re-rank of a PQ layer's decode step at `context` tokens with PQCache's defaults: the exact scores of the
    first stage's candidates (sorted positions, as the first stage returns them) for a KV head's group of query
    rows, in `layers` layers' key stores in turn (out of the caches, as in a step). Torch's way (gather the keys,
    then a matmul) and, where it built, native.gather_dot."""
    D, group, wide = _first_stage(config, context)
    stores = [torch.randn(context, D, generator=g) for _ in range(layers)]
    picks = [torch.randperm(context, generator=g)[:wide].sort().values for _ in range(layers)]
    q = torch.randn(group, D, generator=g)

    def gathered():
        for store, pos in zip(stores, picks):
            F.embedding(pos, store) @ q.T

    def in_place():
        for store, pos in zip(stores, picks):
            native.gather_dot(store, pos, q)

    nbytes = layers * wide * D * 4
    cases = [("re-rank scores", "float32 keys, gathered", nbytes, gathered)]
    if native.library() is not None:
        cases.append(("re-rank scores", "float32 keys, native", nbytes, in_place))
    return cases


def search_cases(config, g: torch.Generator, context: int = 32768, layers: int = 3) -> list[tuple]:
    """PQCache's first stage in `layers` layers at `context` tokens: lookup tables from the query rows, every
    token's approximate scores from its codes (m sub-spaces of 256 centroids, as at 32K), the softmax_sum combine
    and the top first-stage candidates. Torch's operators (methods/base.select_top) and, where it built,
    native/select.pq_top."""
    from pqcache.engine import pq
    from pqcache.engine.config import PQCacheConfig
    from pqcache.engine.methods.base import select_top
    from pqcache.native import select

    D, group, wide = _first_stage(config, context)
    m = PQCacheConfig().for_head_dim(D).m
    centroids = [torch.randn(1, 1, m, 256, D // m, generator=g) for _ in range(layers)]
    codes = [torch.randint(0, 256, (1, 1, m, context), generator=g, dtype=torch.uint8) for _ in range(layers)]
    q = torch.randn(1, 1, group, D, generator=g) * D**-0.5
    cand = torch.ones(1, context, dtype=torch.bool)

    def torch_ops():
        for cents, c in zip(centroids, codes):
            select_top(pq.approx_scores(pq.lookup_tables(q, cents), c), cand, [wide], wide, "softmax_sum")

    def in_c():
        for cents, c in zip(centroids, codes):
            select.pq_top(pq.lookup_tables(q, cents), c, cand, [wide], wide, "softmax_sum")

    nbytes = layers * m * context
    cases = [("PQ search", "codes, torch", nbytes, torch_ops)]
    if native.library() is not None:
        cases.append(("PQ search", "codes, native", nbytes, in_c))
    return cases
