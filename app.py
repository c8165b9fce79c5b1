"""PQCache Studio: ask questions about a long document and watch PQ-retrieved attention at work.

python app.py [--host 127.0.0.1] [--port 7860] [--model default|PATH] [--concurrency 2]
              [--max-cache-gib G] [--idle-minutes 30] [--max-document-tokens N] [--pq-timeout 120]

Tabs: Document Q&A (upload or paste, prefill once, streamed answers, live cache panels), Teaching
(one prefill, several methods side by side, token spotlight, step-through walkthrough), Cost model.
This file is UI only: the engine is pqcache/, the figures viz/.

Many users: every browser tab (or gradio_client) is a user with its own document cache in a
SessionPool (one memory cap, least recently used idle caches evicted, idle caches freed, a closed
tab's cache freed); the model is shared and model work queues with a visible position.
"""
from __future__ import annotations

import argparse
import math
import os
import queue
import threading
import time
import traceback

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
for var in ("NO_PROXY", "no_proxy"):  # the browser and the client talk to localhost directly
    os.environ[var] = ",".join(filter(None, [os.environ.get(var, ""), "localhost", "127.0.0.1"]))

import gradio as gr  # noqa: E402

from pqcache import METHODS, Instrumentation, PQCacheConfig, PQCacheConfigError, load_model  # noqa: E402
from pqcache.tools import costmodel  # noqa: E402
from pqcache.serving.documents import MAX_DOCUMENT_BYTES, read_document  # noqa: E402
from pqcache.engine.errors import Cancelled, InputError, PQCacheError  # noqa: E402
from pqcache.serving.pool import SessionPool, limit_malloc_arenas  # noqa: E402
from pqcache.serving.session import DocumentSession  # noqa: E402
from viz import figures  # noqa: E402

ASSETS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets")
TEACHING_DOC = os.path.join(ASSETS, "teaching_doc.txt")
TEACHING_FACTS = {"the code to open the blue door": "What is the code to open the blue door? The code is",
                  "the treasure is buried under": "Where is the treasure buried? The treasure is buried under",
                  "the captain's cat is named": "What is the name of the captain's cat? The cat is named"}
REFRESH_S = 0.25  # panels update several times a second while tokens stream
ENCODINGS = ["utf-8", "cp1252", "latin-1", "utf-16"]
MODEL: dict = {}
POOL = SessionPool(max_bytes=2 * 2**30, idle_s=1800)  # replaced in main() from the command line
SETTINGS = {"pq_timeout_s": 120.0}


# ---- helpers (no tensors) --------------------------------------------------------------------------
def number(value, name: str, integer: bool = False):
    """A setting typed into the page (or sent through the API) as a finite number."""
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise PQCacheConfigError(f"{name} must be a number, got {value!r}") from None
    if not math.isfinite(x) or (integer and not x.is_integer()):
        raise PQCacheConfigError(f"{name} must be a {'whole ' if integer else ''}number, got {value!r}")
    return int(x) if integer else x


def make_config(m, bits, budget, n_init, n_local, policy, capacity) -> PQCacheConfig:
    budget = number(budget, "token budget")
    return PQCacheConfig(m=number(m, "m", True), bits=number(bits, "bits", True),
                         token_budget=int(budget) if budget > 1 else budget,
                         n_init=number(n_init, "sink tokens", True), n_local=number(n_local, "window", True) or None,
                         cache_policy=policy, block_cache_tokens=number(capacity, "block cache", True) // 128 * 128,
                         pq_timeout_s=SETTINGS["pq_timeout_s"])


def describe(exc: Exception) -> str:
    """The message for the page: ours as written; anything unexpected logged with its traceback on the
    server, and named on the page without one."""
    if isinstance(exc, (PQCacheError, OSError)):
        return str(exc)
    traceback.print_exception(exc)
    return f"unexpected {type(exc).__name__} on the server ({exc}); the details are in the server log"


def sentence(message: str) -> str:
    """An engine message ("your document was unloaded ...") as a sentence for the page."""
    return message[:1].upper() + message[1:] + "."


def user_of(request: gr.Request | None) -> str:
    return getattr(request, "session_hash", None) or "local"


def notices(stats: dict | None) -> str:
    return "".join(f"\n\n**Notice:** {n}" for n in (stats or {}).get("notices", []))


def merged_data(session: DocumentSession | None, obs: Instrumentation | None) -> dict:
    """The prefill's recorded data followed by the question's, on one clock."""
    data = {"lanes": [], "events": [], "attention": [], "recall": [], "blocks": [], "selected": []}
    if session is not None and session.prefill_obs is not None:
        data.update({k: list(v) if isinstance(v, list) else v for k, v in session.prefill_obs.to_dict().items()})
    if obs is not None:
        d = obs.to_dict()
        shift = obs.t0 - session.prefill_obs.t0 if session is not None and session.prefill_obs else 0.0
        data["events"] = data["events"] + [{**e, "start": e["start"] + shift, "end": e["end"] + shift}
                                           for e in d["events"]]
        for key in ("attention", "recall", "blocks", "selected"):
            data[key] = d[key]
    return data


def panels(session, obs, layer):
    data = merged_data(session, obs)
    stats = getattr(session, "last_stats", None) or (session.cache.stats() if session and session.cache else None)
    layer = int(layer) if layer not in (None, "") else None
    return (figures.power_law(data, layer), figures.recall(data), figures.hit_rate(data),
            figures.timeline(data), figures.memory(stats))


def pq_layer_choices(session) -> list[str]:
    if session is None or session.cache is None:
        return []
    return [str(layer.layer_idx) for layer in session.cache.pq_layers]


# ---- Document Q&A -----------------------------------------------------------------------------------
def load_document(file, pasted, method, m, bits, budget, n_init, n_local, policy, capacity, encoding, too_long,
                  request: gr.Request, progress=gr.Progress()):
    """Prefill the document once; later questions reuse it."""
    user = user_of(request)
    with POOL.use(user) as entry:
        entry.stop.clear()
        try:
            config = make_config(m, bits, budget, n_init, n_local, policy, capacity)
            text = read_document(file, pasted, encoding=None if encoding in (None, "", "utf-8") else encoding)
            session = DocumentSession(MODEL["model"], MODEL["tokenizer"], config, method=method,
                                      max_tokens=SETTINGS.get("max_document_tokens"))
            progress(0.0, desc="tokenizing")
            info = session.load(text, progress=lambda f, msg: progress(f, desc=msg), stop=entry.stop,
                                truncate="middle" if too_long == "cut the middle" else "refuse",
                                reserve=lambda n: POOL.reserve(user, "qa", n))
        except Cancelled:
            POOL.unreserve(user, "qa")
            return ("Stopped: the document was not loaded.", gr.update(choices=[], value=None),
                    *panels(None, None, None))
        except Exception as exc:  # the page and any loaded document stay as they were
            POOL.unreserve(user, "qa")
            current = current_session(user)
            return f"**Error:** {describe(exc)}", gr.update(), *panels(current, None, None)
        POOL.store(user, "qa", session)
    choices = pq_layer_choices(session)
    cut = (f" The document had {info['document_tokens']} tokens: its middle was cut to fit the model."
           if session.truncated else "")
    status = (f"Loaded **{info['tokens']}** tokens, prefill **{info['prefill_s']:.2f} s**; PQ on layers "
              f"{', '.join(choices)}; device KV {info['device_kv_bytes'] / 2**20:.1f} MiB, host KV "
              f"{info['host_kv_bytes'] / 2**20:.1f} MiB, PQ {info['pq_bytes'] / 2**10:.0f} KiB.{cut}{notices(info)}")
    return (status, gr.update(choices=choices, value=choices[0] if choices else None),
            *panels(session, None, choices[0] if choices else None))


def current_session(user: str):
    try:
        return POOL.session(user)
    except PQCacheError:
        return None


def ask(question, chat, method, max_new_tokens, layer, request: gr.Request):
    """Stream the answer and refresh the panels while it is generated."""
    chat = list(chat or [])
    user = user_of(request)
    with POOL.use(user) as entry:  # busy: the pool will not evict this document meanwhile
        try:
            session = POOL.session(user)
        except PQCacheError as exc:  # evicted or freed: tell them, keep the page working
            chat.append({"role": "assistant", "content": sentence(str(exc))})
            yield chat, "", *panels(None, None, None)
            return
        if session is None:
            chat.append({"role": "assistant", "content": "Load a document first."})
            yield chat, "", *panels(None, None, None)
            return
        if not question or not question.strip():
            yield chat, "Type a question.", *panels(session, None, layer)
            return
        stop = entry.stop
        stop.clear()
        obs = Instrumentation(timeline=True, attention_every=4, recall_every=4)
        updates: queue.Queue = queue.Queue()
        result = {}

        def work():
            try:
                result["answer"] = session.ask(question, method=method, max_new_tokens=int(max_new_tokens),
                                               stop=stop, observer=obs, on_token=lambda a: updates.put(a.text))
            except Exception as exc:  # shown in the chat; the session stays usable
                result["error"] = describe(exc)
            updates.put(None)

        chat += [{"role": "user", "content": question}, {"role": "assistant", "content": ""}]
        worker = threading.Thread(target=work, daemon=True, name="pqcache-answer")
        worker.start()
        t0, last, done = time.perf_counter(), 0.0, False
        try:
            while not done:
                try:
                    item = updates.get(timeout=REFRESH_S)
                    done = item is None
                    if item:
                        chat[-1]["content"] = item
                except queue.Empty:
                    pass
                now = time.perf_counter()
                if done or now - last >= REFRESH_S:
                    last = now
                    yield chat, f"{method}: generating... {now - t0:.1f} s", *panels(session, obs, layer)
        finally:  # the page went away mid-answer (GeneratorExit): stop the worker, do not leak it
            if not done:
                stop.set()
                worker.join(timeout=30)
    if "error" in result:
        chat[-1]["content"] = f"Error: {result['error']}"
        yield chat, "", *panels(session, obs, layer)
        return
    answer = result["answer"]
    n = len(answer.tokens)
    status = (f"{method}: {n} tokens in {answer.seconds:.2f} s ({n / max(answer.seconds, 1e-9):.1f} tokens/s)"
              + (" (stopped)" if answer.stopped else "") + notices(session.last_stats))
    yield chat, status, *panels(session, obs, layer)


def stop_generation(request: gr.Request):
    """Stop this user's prefill or answer (runs outside the queue, so it is never stuck behind them)."""
    POOL.entry(user_of(request)).stop.set()
    return "stopped"


def unload_document(request: gr.Request):
    POOL.free(user_of(request), "qa")
    return "No document loaded.", gr.update(choices=[], value=None), *panels(None, None, None)


def pool_notice(request: gr.Request):
    """Polled by the page: tells a user whose cache the server freed while they were away."""
    note = POOL.notice(user_of(request))
    return gr.update() if note is None else f"**Notice:** {sentence(note)}"


def refresh_panels(layer, request: gr.Request):
    return panels(current_session(user_of(request)), None, layer)


def server_status() -> dict:
    """Users holding a document, users being served, cache bytes against the cap (polled by the page)."""
    return POOL.summary()


def server_line() -> str:
    s = POOL.summary()
    return (f"Server: {s['users']} user(s) with a document, {s['busy']} being served; caches "
            f"{s['cache_bytes'] / 2**20:.0f} of {s['max_bytes'] / 2**20:.0f} MiB.")


def end_user(request: gr.Request):
    POOL.end(user_of(request))


# ---- Teaching ----------------------------------------------------------------------------------------
def run_teaching(methods, fact, budget, state, request: gr.Request, progress=gr.Progress()):
    """One prefill of the preset document, then each method answers the same question."""
    if not methods:
        return state, "Pick at least one method.", [], figures.heat_strip({}, 1), []
    with open(TEACHING_DOC, encoding="utf-8") as f:
        text = f.read()
    user = user_of(request)
    with POOL.use(user):
        try:
            config = PQCacheConfig(token_budget=number(budget, "token budget"), pq_timeout_s=SETTINGS["pq_timeout_s"])
            session = DocumentSession(MODEL["model"], MODEL["tokenizer"], config, method="pqcache")
            session.load(text, progress=lambda f, msg: progress(0.5 * f, desc=msg),
                         reserve=lambda n: POOL.reserve(user, "teaching", n))
        except Exception as exc:
            POOL.unreserve(user, "teaching")
            return state, f"**Error:** {describe(exc)}", [], figures.heat_strip({}, 1), []
        POOL.store(user, "teaching", session)
        return teaching_answers(session, text, methods, fact, progress)


def teaching_answers(session, text, methods, fact, progress):
    tok = MODEL["tokenizer"]
    char = text.lower().find(fact)
    fact_pos = len(tok(text[:char]).input_ids) if char >= 0 else None
    rows, selections, texts = [], {}, {}
    for i, method in enumerate(methods):
        progress(0.5 + 0.5 * i / len(methods), desc=f"{method} answering")
        obs = Instrumentation(timeline=False, selections=True)
        answer = session.ask(TEACHING_FACTS[fact], method=method, max_new_tokens=8, observer=obs)
        layer0 = min((r["layer"] for r in obs.selected), default=None)
        last = [r for r in obs.selected if r["layer"] == layer0]
        positions = sorted({p for head in last[0]["positions"][0] for p in head}) if last else []
        selections[method] = [p for p in positions if p < session.n_tokens]
        rows.append([method, answer.text.strip(), len(selections[method])])
        texts[method] = selections[method]
    state = {"teaching": session, "selections": texts, "fact_pos": fact_pos}
    marks = [fact_pos] if fact_pos is not None else []
    return (state, f"Prefilled {session.n_tokens} tokens once; the fact starts at token {fact_pos}.", rows,
            figures.heat_strip(selections, session.n_tokens, marks), spotlight_text(state, methods[0]))


def spotlight_text(state, method):
    """The document tokens around the fact, marked where `method` attended at its first step."""
    if not state or "teaching" not in state or method not in state["selections"]:
        return []
    session = state["teaching"]
    chosen = set(state["selections"][method])
    fact = state["fact_pos"] or 0
    lo, hi = max(0, fact - 60), min(session.n_tokens, fact + 60)
    tok = MODEL["tokenizer"]
    return [(tok.decode([session.doc_ids[p]]), "attended" if p in chosen else None) for p in range(lo, hi)]


WALKTHROUGH = {
    "1. Prefill": ("Every layer computes exact attention over the whole document. Each full-attention layer's K/V "
                   "is copied to host memory as soon as the layer is done.", "timeline"),
    "2. PQ build": ("While later layers compute, a background worker clusters each layer's keys: m sub-spaces, "
                    "2^bits centroids each (faiss K-Means). Orange bars overlap blue ones: the clustering hides "
                    "behind compute.", "timeline"),
    "3. Search": ("For a new token, q . centroids gives a small table; every document token's approximate score is "
                  "a sum of table entries picked by its uint8 codes; the top-k are the candidates.", "recall"),
    "4. Fetch": ("Only the top-k tokens' K/V come back from host memory, hot blocks straight from the device "
                 "block cache.", "hit_rate"),
    "5. Attention": ("Attention runs over sinks + top-k + the recent window. Attention scores follow a power law: "
                     "a few tokens carry most of the mass, which is why this works.", "power_law"),
}


def walkthrough(step, state):
    text, fig = WALKTHROUGH[step]
    session = (state or {}).get("teaching")
    if session is not None and session.cache is None:  # the server freed it (memory cap or idle time)
        return f"**{step}.** {text}\n\nRun the methods again: the server unloaded this document.", None
    data = merged_data(session, None) if session else {}
    if session is not None and fig != "timeline":
        obs = Instrumentation(timeline=True, attention_every=1, recall_every=1)
        session.ask(next(iter(TEACHING_FACTS.values())), method="pqcache", max_new_tokens=3, observer=obs)
        data = merged_data(session, obs)
    builder = {"timeline": figures.timeline, "recall": figures.recall, "hit_rate": figures.hit_rate,
               "power_law": figures.power_law}[fig]
    return f"**{step}.** {text}", builder(data)


# ---- Cost model ------------------------------------------------------------------------------------------
def cost(model, context, batch, gpu, link, budget):
    try:
        config = PQCacheConfig(token_budget=number(budget, "token budget"))
        context, batch = number(context, "context", True), number(batch, "batch", True)
        if context < 1 or batch < 1:
            raise PQCacheConfigError("context and batch must be at least 1")
        e = costmodel.estimate(model, context, batch, gpu, link, config)
    except (InputError, KeyError) as exc:
        return [["error", str(exc)]], None
    rows = [["device KV, full attention (GiB)", f"{e['full_kv_gib']:.2f}"],
            ["device KV, PQCache (GiB)", f"{e['pqcache_device_gib']:.2f}"],
            ["PQ codes + centroids (GiB)", f"{e['pq_gib']:.3f}"],
            ["weights (GiB)", f"{e['weights_gib']:.1f}"],
            ["fits on the GPU: full / PQCache", f"{e['full_fits']} / {e['pqcache_fits']}"],
            ["host link per output token (MiB)", f"{e['link_mib_per_token']:.1f}"],
            ["attention per token: full / PQCache (ms)", f"{e['full_attention_ms']:.2f} / {e['pqcache_attention_ms']:.2f}"],
            ["prefill (s)", f"{e['prefill_s']:.2f}"],
            ["K-Means iterations hidden behind prefill (T_max)", str(e["t_max"])]]
    return rows, figures.cost_curves(costmodel.curve(model, batch, gpu, link, config))


# ---- layout ------------------------------------------------------------------------------------------------
def build_ui() -> gr.Blocks:
    methods = list(METHODS)
    with gr.Blocks(title="PQCache Studio") as demo:
        gr.Markdown("# PQCache Studio\nAttention that reads only the tokens product-quantization search picks.")
        with gr.Tab("Document Q&A"):
            with gr.Row():
                with gr.Column(scale=2):
                    file = gr.File(label="Document (.txt, .md, .pdf)", type="filepath")
                    pasted = gr.Textbox(label="...or paste text", lines=4, max_lines=8)
                    with gr.Accordion("Settings", open=False):
                        method = gr.Dropdown(methods, value="pqcache", label="Method")
                        with gr.Row():
                            m = gr.Number(2, label="m (sub-spaces)", precision=0)
                            bits = gr.Number(6, label="bits", precision=0)
                            budget = gr.Number(0.2, label="token budget (fraction or count)")
                        with gr.Row():
                            n_init = gr.Number(32, label="sink tokens", precision=0)
                            n_local = gr.Number(0, label="window (0: half the budget)", precision=0)
                        with gr.Row():
                            policy = gr.Radio(["lfu", "lru"], value="lfu", label="block-cache policy")
                            capacity = gr.Number(1024, label="block cache (tokens)", precision=0)
                        max_new = gr.Slider(1, 256, value=48, step=1, label="max new tokens")
                        with gr.Row():
                            encoding = gr.Dropdown(ENCODINGS, value="utf-8", label="text encoding of the file",
                                                   allow_custom_value=True)
                            too_long = gr.Radio(["refuse", "cut the middle"], value="refuse",
                                                label="a document longer than the model reads")
                    with gr.Row():
                        load = gr.Button("Load document", variant="secondary", elem_id="load")
                        unload = gr.Button("Unload", elem_id="unload")
                    status = gr.Markdown("No document loaded.", elem_id="doc-status")
                    chat = gr.Chatbot(label="Answers", height=300, elem_id="chat")
                    question = gr.Textbox(label="Question", placeholder="Ask about the document", elem_id="question")
                    with gr.Row():
                        ask_btn = gr.Button("Ask", variant="primary", elem_id="ask")
                        stop_btn = gr.Button("Stop", variant="stop", elem_id="stop")
                    gen_status = gr.Markdown("", elem_id="gen-status")
                with gr.Column(scale=3):
                    layer = gr.Dropdown([], label="Layer (power law)", allow_custom_value=True)
                    with gr.Row():
                        p_power = gr.Plot(elem_id="panel-power")
                        p_recall = gr.Plot(elem_id="panel-recall")
                    with gr.Row():
                        p_hits = gr.Plot(elem_id="panel-hits")
                        p_memory = gr.Plot(elem_id="panel-memory")
                    p_timeline = gr.Plot(elem_id="panel-timeline")
            plots = [p_power, p_recall, p_hits, p_timeline, p_memory]
            # Model work shares one concurrency group: later requests wait in the queue and see their place.
            model_work = dict(concurrency_id="model", concurrency_limit=SETTINGS.get("concurrency", 2))
            load.click(load_document, [file, pasted, method, m, bits, budget, n_init, n_local, policy, capacity,
                                       encoding, too_long], [status, layer, *plots], api_name="load_document",
                       **model_work)
            ask_btn.click(ask, [question, chat, method, max_new, layer], [chat, gen_status, *plots], api_name="ask",
                          **model_work)
            question.submit(ask, [question, chat, method, max_new, layer], [chat, gen_status, *plots], **model_work)
            stop_btn.click(stop_generation, None, [gen_status], api_name="stop", queue=False)
            unload.click(unload_document, None, [status, layer, *plots], api_name="unload_document",
                         concurrency_limit=None)
            layer.change(refresh_panels, [layer], plots, api_name=False, concurrency_limit=None)
            server = gr.Markdown(server_line(), elem_id="server-status")
            timer = gr.Timer(5.0)
            timer.tick(pool_notice, None, [status], api_name="notice", concurrency_limit=None, show_progress="hidden")
            timer.tick(server_line, None, [server], api_name=False, concurrency_limit=None, show_progress="hidden")
            gr.api(server_status, api_name="server_status", concurrency_limit=None)

        with gr.Tab("Teaching"):
            t_state = gr.State(None)
            gr.Markdown("One prefill of a preset document with three hidden facts; each method answers the same "
                        "question under the same budget. The strip shows where each method's attention went "
                        "(first full-attention layer, first generated token); the red line is the fact.")
            with gr.Row():
                t_methods = gr.CheckboxGroup(methods, value=["pqcache", "snapkv", "streaming", "oracle"],
                                             label="Methods")
                t_fact = gr.Dropdown(list(TEACHING_FACTS), value=list(TEACHING_FACTS)[0], label="Hidden fact")
                t_budget = gr.Slider(0.05, 0.5, value=0.1, step=0.05, label="token budget")
            t_run = gr.Button("Run side by side", variant="primary")
            t_status = gr.Markdown()
            t_table = gr.Dataframe(headers=["method", "answer", "tokens attended"], interactive=False,
                                   elem_id="teaching-table")
            t_strip = gr.Plot(elem_id="teaching-strip")
            t_pick = gr.Dropdown(methods, value="pqcache", label="Highlight the tokens this method attended to")
            t_text = gr.HighlightedText(label="Around the fact", combine_adjacent=True)
            t_pick.change(spotlight_text, [t_state, t_pick], [t_text])
            gr.Markdown("### Walkthrough of one decode step")
            w_step = gr.Radio(list(WALKTHROUGH), value="1. Prefill", label="Step")
            w_text = gr.Markdown()
            w_plot = gr.Plot()
            w_step.change(walkthrough, [w_step, t_state], [w_text, w_plot], **model_work)
            t_run.click(run_teaching, [t_methods, t_fact, t_budget, t_state],
                        [t_state, t_status, t_table, t_strip, t_text], **model_work).then(
                walkthrough, [w_step, t_state], [w_text, w_plot], **model_work)

        with gr.Tab("Cost model"):
            gr.Markdown("A **model**, not a measurement: " + costmodel.__doc__.split("\n\n")[0].replace("\n", " ")
                        + "\n\n```\n" + costmodel.__doc__.split("\n\n")[1] + "\n```")
            with gr.Row():
                c_model = gr.Dropdown(list(costmodel.MODELS), value="Llama-3.1-8B", label="Model")
                c_gpu = gr.Dropdown(list(costmodel.GPUS), value="RTX 4090", label="GPU")
                c_link = gr.Dropdown(list(costmodel.LINKS), value="PCIe 4.0 x16", label="Host link")
            with gr.Row():
                c_ctx = gr.Number(131072, label="context (tokens)", precision=0)
                c_batch = gr.Number(1, label="batch", precision=0)
                c_budget = gr.Number(0.2, label="token budget")
            c_btn = gr.Button("Estimate")
            c_table = gr.Dataframe(headers=["quantity", "value"], interactive=False)
            c_plot = gr.Plot()
            c_btn.click(cost, [c_model, c_ctx, c_batch, c_gpu, c_link, c_budget], [c_table, c_plot], api_name="cost")
        demo.load(lambda: cost("Llama-3.1-8B", 131072, 1, "RTX 4090", "PCIe 4.0 x16", 0.2), None, [c_table, c_plot])
        demo.unload(end_user)  # a closed tab frees its caches
    return demo


def main():
    p = argparse.ArgumentParser(description="PQCache Studio")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=7860)
    p.add_argument("--model", default="default", help="'default' (bundled Gemma 3 270M) or a local model folder")
    p.add_argument("--concurrency", type=int, default=2, help="requests using the model at once; the rest queue")
    p.add_argument("--max-cache-gib", type=float, default=None,
                   help="host memory for all users' document caches (default: a quarter of RAM, at most 8)")
    p.add_argument("--idle-minutes", type=float, default=30, help="free a user's caches after this long idle")
    p.add_argument("--max-document-tokens", type=int, default=None,
                   help="longest document accepted (default: what the model reads); longer ones are refused or cut")
    p.add_argument("--pq-timeout", type=float, default=120,
                   help="seconds a K-Means build may take before its layer falls back to exact attention")
    args = p.parse_args()
    limit_malloc_arenas()
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    max_bytes = int((args.max_cache_gib if args.max_cache_gib is not None else min(8.0, ram / 4 / 2**30)) * 2**30)
    POOL.max_bytes, POOL.idle_s = max_bytes, args.idle_minutes * 60
    SETTINGS.update(pq_timeout_s=args.pq_timeout, concurrency=args.concurrency,
                    max_document_tokens=args.max_document_tokens)
    print("preparing the model (the first start converts the bundled GGUF, about a minute)...", flush=True)
    MODEL["model"], MODEL["tokenizer"] = load_model(args.model, progress=lambda msg: print(msg, flush=True))
    print(f"model ready; caches capped at {max_bytes / 2**30:.2f} GiB, idle caches freed after "
          f"{args.idle_minutes:g} min", flush=True)
    POOL.start_reaper(every_s=min(5.0, POOL.idle_s / 4))
    build_ui().queue(default_concurrency_limit=args.concurrency).launch(
        server_name=args.host, server_port=args.port, show_error=False, max_file_size=MAX_DOCUMENT_BYTES)


if __name__ == "__main__":
    main()
