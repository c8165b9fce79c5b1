"""The page's queue on a live Gradio server: an idle queue looks for work at most every 50 ms (each look takes the
GIL from a decoding answer), and as many requests use the model at once as the app was given."""

import asyncio
import threading
import types

import gradio as gr
import gradio.queueing
from gradio_client import Client

from studio.ui import queued


class RecordingAsyncio(types.ModuleType):
    """asyncio as gradio.queueing sees it, with every sleep's length recorded."""

    def __init__(self):
        super().__init__("asyncio")
        self.sleeps: list[float] = []
        self.enough = threading.Event()

    def __getattr__(self, name):
        return getattr(asyncio, name)

    async def sleep(self, delay, result=None):
        self.sleeps.append(delay)
        if len(self.sleeps) >= 20:
            self.enough.set()
        return await asyncio.sleep(delay, result)


def test_an_idle_queue_looks_for_work_at_most_every_50_ms(monkeypatch):
    recording = RecordingAsyncio()
    monkeypatch.setattr(gradio.queueing, "asyncio", recording)
    with gr.Blocks() as demo:
        gr.Textbox()
    queued(demo, 3).launch(prevent_thread_lock=True, server_name="127.0.0.1", quiet=True)
    try:
        assert recording.enough.wait(60), "the queue never looked for work"
    finally:
        demo.close()
    assert min(recording.sleeps) >= 0.05  # Gradio's own default is a millisecond


def test_as_many_requests_run_at_once_as_the_concurrency_given():
    active, peak = [0], [0]
    lock, three_in, release = threading.Lock(), threading.Event(), threading.Event()

    def work(text):
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
            if active[0] == 3:
                three_in.set()
        release.wait(60)
        with lock:
            active[0] -= 1
        return text

    with gr.Blocks() as demo:
        box = gr.Textbox()
        gr.Button().click(work, box, box, api_name="work")
    _, url, _ = queued(demo, 3).launch(prevent_thread_lock=True, server_name="127.0.0.1", quiet=True)
    try:
        client = Client(url, verbose=False)
        jobs = [client.submit(str(i), api_name="/work") for i in range(5)]
        assert three_in.wait(60), "three requests never ran at once"
        release.set()
        assert sorted(job.result(timeout=60) for job in jobs) == ["0", "1", "2", "3", "4"]
    finally:
        release.set()
        demo.close()
    assert peak[0] == 3  # five were asked at once: three ran, two waited their turn
