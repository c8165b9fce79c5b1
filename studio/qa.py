"""Document Q&A: upload or paste, prefill once, streamed answers, live cache panels, Stop, notices."""

from __future__ import annotations

import queue
import threading
import time

import gradio as gr

from pqcache import Cancelled, Instrumentation, PQCacheError
from pqcache.serving.documents import read_document
from pqcache.serving.session import DocumentSession
from pqcache.serving.settings import ENCODINGS, TOO_LONG, LoadSettings
from studio.common import describe, notices, panels, pq_layer_choices, sentence, user_of
from studio.state import Studio

REFRESH_S = 0.25  # panels update several times a second while tokens stream


class QATab:
    """The Q&A tab's handlers; each user's document lives in the pool's "qa" slot."""

    def __init__(self, studio: Studio):
        self.studio = studio
        self.pool = studio.pool

    def load_document(
        self,
        file,
        pasted,
        method,
        m,
        bits,
        budget,
        n_init,
        n_local,
        policy,
        capacity,
        encoding,
        too_long,
        request: gr.Request,
        progress=gr.Progress(),
    ):
        """Prefill the document once; later questions reuse it."""
        user, studio = user_of(request), self.studio
        settings = LoadSettings(method, m, bits, budget, n_init, n_local, policy, capacity, encoding, too_long)
        with self.pool.use(user) as entry:
            entry.stop.clear()
            try:
                config = settings.to_config(pq_timeout_s=studio.pq_timeout_s)
                text = read_document(file, pasted, encoding=settings.text_encoding)
                session = DocumentSession(
                    studio.model,
                    studio.tokenizer,
                    config,
                    method=settings.method,
                    max_tokens=studio.max_document_tokens,
                )
                progress(0.0, desc="tokenizing")
                info = session.load(
                    text,
                    progress=lambda f, msg: progress(f, desc=msg),
                    stop=entry.stop,
                    truncate=settings.truncate,
                    reserve=lambda n: self.pool.reserve(user, "qa", n),
                )
            except Cancelled:
                self.pool.unreserve(user, "qa")
                return (
                    "Stopped: the document was not loaded.",
                    gr.update(choices=[], value=None),
                    *panels(None, None, None),
                )
            except Exception as exc:  # the page and any loaded document stay as they were
                self.pool.unreserve(user, "qa")
                return f"**Error:** {describe(exc)}", gr.update(), *panels(self.current_session(user), None, None)
            self.pool.store(user, "qa", session)
        choices = pq_layer_choices(session)
        cut = (
            f" The document had {info['document_tokens']} tokens: its middle was cut to fit the model."
            if session.truncated
            else ""
        )
        status = (
            f"Loaded **{info['tokens']}** tokens, prefill **{info['prefill_s']:.2f} s**; PQ on layers "
            f"{', '.join(choices)}; device KV {info['device_kv_bytes'] / 2**20:.1f} MiB, host KV "
            f"{info['host_kv_bytes'] / 2**20:.1f} MiB, PQ {info['pq_bytes'] / 2**10:.0f} KiB.{cut}"
            f"{notices(info)}"
        )
        return (
            status,
            gr.update(choices=choices, value=choices[0] if choices else None),
            *panels(session, None, choices[0] if choices else None),
        )

    def current_session(self, user: str):
        try:
            return self.pool.session(user)
        except PQCacheError:
            return None

    def ask(self, question, chat, method, max_new_tokens, layer, request: gr.Request):
        """Stream the answer and refresh the panels while it is generated."""
        chat = list(chat or [])
        user = user_of(request)
        with self.pool.use(user) as entry:  # busy: the pool will not evict this document meanwhile
            try:
                session = self.pool.session(user)
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
                    result["answer"] = session.ask(
                        question,
                        method=method,
                        max_new_tokens=int(max_new_tokens),
                        stop=stop,
                        observer=obs,
                        on_token=lambda a: updates.put(a.text),
                    )
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
        status = (
            f"{method}: {n} tokens in {answer.seconds:.2f} s ({n / max(answer.seconds, 1e-9):.1f} tokens/s)"
            + (" (stopped)" if answer.stopped else "")
            + notices(session.last_stats)
        )
        yield chat, status, *panels(session, obs, layer)

    def stop_generation(self, request: gr.Request):
        """Stop this user's prefill or answer (runs outside the queue, so it is never stuck behind them)."""
        self.pool.entry(user_of(request)).stop.set()
        return "stopped"

    def unload_document(self, request: gr.Request):
        self.pool.free(user_of(request), "qa")
        return "No document loaded.", gr.update(choices=[], value=None), *panels(None, None, None)

    def pool_notice(self, request: gr.Request):
        """Polled by the page: tells a user whose cache the server freed while they were away."""
        note = self.pool.notice(user_of(request))
        return gr.update() if note is None else f"**Notice:** {sentence(note)}"

    def refresh_panels(self, layer, request: gr.Request):
        return panels(self.current_session(user_of(request)), None, layer)

    def server_status(self) -> dict:
        """Users holding a document, users being served, cache bytes against the cap (polled by the page)."""
        return self.pool.summary()

    def server_line(self) -> str:
        s = self.pool.summary()
        return (
            f"Server: {s['users']} user(s) with a document, {s['busy']} being served; caches "
            f"{s['cache_bytes'] / 2**20:.0f} of {s['max_bytes'] / 2**20:.0f} MiB."
        )

    def end_user(self, request: gr.Request):
        """The tab closed: free its caches."""
        self.pool.end(user_of(request))


def build_qa_tab(tab: QATab, methods: list[str]):
    """The Document Q&A tab's components and events (inside a gr.Blocks)."""
    d = LoadSettings()  # the form's defaults
    with gr.Row():
        with gr.Column(scale=2):
            file = gr.File(label="Document (.txt, .md, .pdf)", type="filepath")
            pasted = gr.Textbox(label="...or paste text", lines=4, max_lines=8)
            with gr.Accordion("Settings", open=False):
                method = gr.Dropdown(methods, value=d.method, label="Method")
                with gr.Row():
                    m = gr.Number(d.m, label="m (sub-spaces; 0: from the head size)", precision=0)
                    bits = gr.Number(d.bits, label="bits (0: from the length)", precision=0)
                    budget = gr.Number(d.budget, label="token budget (fraction or count)")
                with gr.Row():
                    n_init = gr.Number(d.n_init, label="sink tokens", precision=0)
                    n_local = gr.Number(d.n_local, label="window (0: half the budget)", precision=0)
                with gr.Row():
                    policy = gr.Radio(["lfu", "lru"], value=d.policy, label="block-cache policy")
                    capacity = gr.Number(d.capacity, label="block cache (tokens)", precision=0)
                max_new = gr.Slider(1, 256, value=48, step=1, label="max new tokens")
                with gr.Row():
                    encoding = gr.Dropdown(
                        ENCODINGS, value=d.encoding, label="text encoding of the file", allow_custom_value=True
                    )
                    too_long = gr.Radio(TOO_LONG, value=d.too_long, label="a document longer than the model reads")
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
    model_work = tab.studio.model_work
    form = [file, pasted, method, m, bits, budget, n_init, n_local, policy, capacity, encoding, too_long]
    load.click(tab.load_document, form, [status, layer, *plots], api_name="load_document", **model_work)
    asking = [question, chat, method, max_new, layer]
    ask_btn.click(tab.ask, asking, [chat, gen_status, *plots], api_name="ask", **model_work)
    question.submit(tab.ask, asking, [chat, gen_status, *plots], **model_work)
    stop_btn.click(tab.stop_generation, None, [gen_status], api_name="stop", queue=False)
    unload.click(tab.unload_document, None, [status, layer, *plots], api_name="unload_document", concurrency_limit=None)
    layer.change(tab.refresh_panels, [layer], plots, api_name=False, concurrency_limit=None)
    server = gr.Markdown(tab.server_line(), elem_id="server-status")
    timer = gr.Timer(5.0)
    timer.tick(tab.pool_notice, None, [status], api_name="notice", concurrency_limit=None, show_progress="hidden")
    timer.tick(tab.server_line, None, [server], api_name=False, concurrency_limit=None, show_progress="hidden")
    gr.api(tab.server_status, api_name="server_status", concurrency_limit=None)
