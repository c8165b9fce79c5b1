"""Cost model: the analytic estimate of pqcache.tools.costmodel for a model, a GPU and a host link."""

from __future__ import annotations

import gradio as gr

from pqcache import InputError, PQCacheConfig, PQCacheConfigError
from pqcache.serving.settings import number
from pqcache.tools import costmodel
from viz import figures

DEFAULT = ("Llama-3.1-8B", 131072, 1, "RTX 4090", "PCIe 4.0 x16", 0.2)  # model, context, batch, gpu, link, budget


def cost(model, context, batch, gpu, link, budget):
    """The estimate as table rows, and its curves over the context length."""
    try:
        config = PQCacheConfig(token_budget=number(budget, "token budget"))
        context, batch = number(context, "context", True), number(batch, "batch", True)
        if context < 1 or batch < 1:
            raise PQCacheConfigError("context and batch must be at least 1")
        e = costmodel.estimate(model, context, batch, gpu, link, config)
    except (InputError, KeyError) as exc:
        return [["error", str(exc)]], None
    rows = [
        ["device KV, full attention (GiB)", f"{e['full_kv_gib']:.2f}"],
        ["device KV, PQCache (GiB)", f"{e['pqcache_device_gib']:.2f}"],
        ["PQ codes + centroids (GiB)", f"{e['pq_gib']:.3f}"],
        ["weights (GiB)", f"{e['weights_gib']:.1f}"],
        ["fits on the GPU: full / PQCache", f"{e['full_fits']} / {e['pqcache_fits']}"],
        ["host link per output token (MiB)", f"{e['link_mib_per_token']:.1f}"],
        ["attention per token: full / PQCache (ms)", f"{e['full_attention_ms']:.2f} / {e['pqcache_attention_ms']:.2f}"],
        ["prefill (s)", f"{e['prefill_s']:.2f}"],
        ["K-Means iterations hidden behind prefill (T_max)", str(e["t_max"])],
    ]
    return rows, figures.cost_curves(costmodel.curve(model, batch, gpu, link, config))


def build_cost_tab():
    """The Cost model tab's components and events (inside a gr.Blocks); returns the outputs the page fills on
    load."""
    gr.Markdown(
        "A **model**, not a measurement: "
        + costmodel.__doc__.split("\n\n")[0].replace("\n", " ")
        + "\n\n```\n"
        + costmodel.__doc__.split("\n\n")[1]
        + "\n```"
    )
    model, context, batch, gpu, link, budget = DEFAULT
    with gr.Row():
        c_model = gr.Dropdown(list(costmodel.MODELS), value=model, label="Model")
        c_gpu = gr.Dropdown(list(costmodel.GPUS), value=gpu, label="GPU")
        c_link = gr.Dropdown(list(costmodel.LINKS), value=link, label="Host link")
    with gr.Row():
        c_ctx = gr.Number(context, label="context (tokens)", precision=0)
        c_batch = gr.Number(batch, label="batch", precision=0)
        c_budget = gr.Number(budget, label="token budget")
    c_btn = gr.Button("Estimate")
    c_table = gr.Dataframe(headers=["quantity", "value"], interactive=False)
    c_plot = gr.Plot()
    c_btn.click(cost, [c_model, c_ctx, c_batch, c_gpu, c_link, c_budget], [c_table, c_plot], api_name="cost")
    return [c_table, c_plot]
