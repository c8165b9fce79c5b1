"""Cost model: the analytic estimate of pqcache.costmodel for a model, a GPU and a host link, recomputed on
every change, with a verdict per memory row (weights + KV against the GPU's memory)."""

from __future__ import annotations

import gradio as gr

from pqcache import InputError, PQCacheConfig, PQCacheConfigError, costmodel
from pqcache.serving.settings import number
from viz import studies

# model, context, batch, gpu, link, budget (the engine's default)
DEFAULT = ("Llama-3.1-8B", 131072, 1, "RTX 4090", "PCIe 4.0 x16", PQCacheConfig.token_budget)
HEADERS = ["quantity", "value", "verdict"]


def budget_words(budget: float, context: int, per_step: int) -> str:
    """The budget with its unit: a fraction of the context, or a count of tokens."""
    if budget <= 1:
        return f"{budget:g} of the context = {per_step:,} tokens per step"
    return f"{int(budget):,} tokens per step (a count; a fraction is written 0.1)"


def fits(need_gib: float, gpu_gib: float) -> str:
    return (
        f"fits ({need_gib:.1f} of {gpu_gib:g} GiB)"
        if need_gib <= gpu_gib
        else f"does not fit ({need_gib:.1f} > {gpu_gib:g} GiB)"
    )


def cost(model, context, batch, gpu, link, budget):
    """The estimate as table rows (quantity, value, verdict), and its curves over the context length."""
    try:
        budget = number(budget, "token budget")
        config = PQCacheConfig(token_budget=int(budget) if budget > 1 else budget)
        context, batch = number(context, "context", True), number(batch, "batch", True)
        if context < 1 or batch < 1:
            raise PQCacheConfigError("context and batch must be at least 1")
        e = costmodel.estimate(model, context, batch, gpu, link, config)
    except (InputError, KeyError) as exc:
        return [["error", str(exc), ""]], None
    n_init, k, n_local = e["budget_split"]
    gpu_gib, weights = e["gpu_gib"], e["weights_gib"]
    full_need = weights + e["full_kv_gib"]
    pq_need = weights + e["pqcache_device_gib"] + e["pq_gib"]
    rows = [
        [
            "token budget",
            budget_words(budget, context, n_init + k + n_local),
            f"{n_init} sinks + {k} top-k + {n_local} window",
        ],
        ["weights (GiB)", f"{weights:.1f}", fits(weights, gpu_gib)],
        ["device KV, full attention (GiB)", f"{e['full_kv_gib']:.2f}", f"weights + KV: {fits(full_need, gpu_gib)}"],
        [
            "device KV, PQCache (GiB)",
            f"{e['pqcache_device_gib']:.2f}",
            f"weights + KV + PQ: {fits(pq_need, gpu_gib)}",
        ],
        ["PQ codes + centroids (GiB)", f"{e['pq_gib']:.3f}", "counted in the PQCache row"],
        ["host link per output token (MiB)", f"{e['link_mib_per_token']:.1f}", ""],
        [
            "attention per token: full / PQCache (ms)",
            f"{e['full_attention_ms']:.2f} / {e['pqcache_attention_ms']:.2f}",
            "",
        ],
        ["prefill (s)", f"{e['prefill_s']:.2f}", ""],
        ["K-Means iterations hidden behind prefill (T_max)", str(e["t_max"]), ""],
    ]
    return rows, studies.cost_curves(costmodel.curve(model, batch, gpu, link, config), context)


def intro() -> str:
    """The cost model's own description (pqcache/costmodel.py), said once."""
    first, formulas, rest = costmodel.__doc__.strip().split("\n\n")[:3]
    first = first.replace("A cost MODEL (not a measurement) of ", "").replace("\n", " ")
    return f"**A model, not a measurement**: the cost of {first}\n\n```\n{formulas}\n```\n\n{rest}"


def build_cost_tab():
    """The Cost model tab's components and events (inside a gr.Blocks); returns the outputs the page fills on
    load."""
    gr.Markdown(intro(), elem_id="cost-intro")
    model, context, batch, gpu, link, budget = DEFAULT
    with gr.Row():
        c_model = gr.Dropdown(list(costmodel.MODELS), value=model, label="Model")
        c_gpu = gr.Dropdown(list(costmodel.GPUS), value=gpu, label="GPU")
        c_link = gr.Dropdown(list(costmodel.LINKS), value=link, label="Host link")
    with gr.Row():
        c_ctx = gr.Number(context, label="context (tokens)", precision=0)
        c_batch = gr.Number(batch, label="batch", precision=0)
        c_budget = gr.Number(budget, label="token budget: a fraction of the context (0.1) or a count of tokens (2048)")
    # wrapped, the verdict column widest: a verdict ("does not fit (140.3 GiB > 79.6 GiB)") is read whole
    c_table = gr.Dataframe(
        headers=HEADERS, interactive=False, wrap=True, column_widths=["34%", "22%", "44%"], elem_id="cost-table"
    )
    c_plot = gr.Plot(label="memory vs context", show_label=False, elem_id="cost-plot")
    inputs = [c_model, c_ctx, c_batch, c_gpu, c_link, c_budget]
    gr.on(
        [c.change for c in inputs],
        cost,
        inputs,
        [c_table, c_plot],
        api_name="cost",
        show_progress="hidden",
        trigger_mode="always_last",
    )
    return [c_table, c_plot]
