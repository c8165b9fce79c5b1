"""The app's answers as a user gets them: `python app.py` driven through gradio_client, and its answer path in
process with the live panels' draw times."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

from pqcache.serving.loading import load_model


def app(args):
    """`python app.py` as a user starts it, through gradio_client: load the sample document (or, with
    --document-tokens N, a passkey document of about N tokens), then ask one plain question four times (pqcache,
    full, pqcache, full) and print the page's own load line and timing line of each answer."""
    import tempfile

    from gradio_client import Client, handle_file

    from pqcache.bench.app_process import running_app
    from pqcache.eval.passkey import passkey_context
    from pqcache.serving.settings import LoadSettings

    path = Path(__file__).resolve().parents[2] / "assets" / "passkey_1k.txt"
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
    from pqcache.eval.passkey import LONG_QUESTION, passkey_context
    from pqcache.serving.session import DocumentSession
    from pqcache.serving.settings import LoadSettings
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
