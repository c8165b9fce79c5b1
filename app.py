"""PQCache Studio (first cut): ask a question about a document and watch the answer stream.

The live cache panels and the teaching mode come with the app issue; this page already runs the
real engine. Run: python app.py [--host 127.0.0.1] [--port 7860] [--model default|PATH]
"""
from __future__ import annotations

import argparse
import os
import queue
import threading

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ.setdefault("NO_PROXY", "localhost,127.0.0.1")

import gradio as gr  # noqa: E402

from pqcache import PQCacheConfig, PQCacheConfigError, load_model  # noqa: E402
from pqcache.generate import build_prompt, generate  # noqa: E402

_model = {}
_lock = threading.Lock()  # one generation at a time on this 2-core machine


def read_document(path: str | None, pasted: str) -> str:
    if not path:
        return pasted or ""
    if path.lower().endswith(".pdf"):
        from pypdf import PdfReader

        return "\n".join(page.extract_text() or "" for page in PdfReader(path).pages)
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


def answer(file, pasted, question, method, budget, max_new_tokens):
    if not question or not question.strip():
        yield "Please type a question.", ""
        return
    try:
        config = PQCacheConfig(token_budget=float(budget))
        document = read_document(file, pasted)
    except (PQCacheConfigError, OSError, ValueError) as exc:
        yield f"Error: {exc}", ""
        return
    model, tok = _model["model"], _model["tokenizer"]
    pieces: queue.Queue = queue.Queue()

    def work():
        try:
            with _lock:
                result = generate(model, tok, build_prompt(tok, document, question), method=method, config=config,
                                  max_new_tokens=int(max_new_tokens), on_token=lambda text: pieces.put(("text", text)))
            pieces.put(("done", result))
        except Exception as exc:  # shown to the user, the session goes on
            pieces.put(("error", exc))

    threading.Thread(target=work, daemon=True).start()
    text = ""
    while True:
        kind, item = pieces.get()
        if kind == "text":
            text = item
            yield text, ""
        elif kind == "error":
            yield text, f"Error: {item}"
            return
        else:
            s = item.stats
            yield item.text, (f"{s['method']}: {s['prompt_tokens']} prompt tokens, prefill {s['prefill_s']:.2f} s, "
                              f"{1 / max(s['s_per_token'], 1e-9):.1f} tokens/s, device KV "
                              f"{s['device_kv_bytes'] / 2**20:.1f} MiB, host KV {s['host_kv_bytes'] / 2**20:.1f} MiB, "
                              f"PQ {s['pq_bytes'] / 2**10:.0f} KiB")
            return


def build_ui() -> gr.Blocks:
    with gr.Blocks(title="PQCache Studio") as demo:
        gr.Markdown("# PQCache Studio\nAttention reads only the tokens that product-quantization search picks.")
        with gr.Row():
            with gr.Column():
                file = gr.File(label="Document (.txt, .md, .pdf)", file_types=[".txt", ".md", ".pdf"], type="filepath")
                pasted = gr.Textbox(label="...or paste text", lines=8)
            with gr.Column():
                question = gr.Textbox(label="Question")
                method = gr.Radio(["pqcache", "full"], value="pqcache", label="Method")
                budget = gr.Slider(0.05, 1.0, value=0.2, step=0.05, label="Token budget (fraction of the context)")
                max_new = gr.Slider(1, 256, value=32, step=1, label="Max new tokens")
                ask = gr.Button("Ask", variant="primary")
                out = gr.Textbox(label="Answer", lines=6)
                stats = gr.Markdown()
        ask.click(answer, [file, pasted, question, method, budget, max_new], [out, stats])
    return demo


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=7860)
    p.add_argument("--model", default="default")
    args = p.parse_args()
    print("preparing the model (the first start converts the bundled GGUF, about a minute)...", flush=True)
    _model["model"], _model["tokenizer"] = load_model(args.model)
    build_ui().queue().launch(server_name=args.host, server_port=args.port)


if __name__ == "__main__":
    main()
