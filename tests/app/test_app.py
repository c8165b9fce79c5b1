"""The app through gradio_client: upload, prefill, streamed answers, stop, a second question, bad input."""

import time
from pathlib import Path

import pytest
from gradio_client import Client, handle_file

from pqcache.serving.settings import LoadSettings

ROOT = Path(__file__).resolve().parents[2]
PASSKEY = ROOT / "assets" / "passkey_1k.txt"
QUESTION = "What is the pass key?"  # in plain words: the app frames it (pqcache/serving/prompt.py)
LONG_QUESTION = "List the numbers from 1 to 100."  # an answer that runs long enough to be stopped
SETTINGS = LoadSettings().values()  # the load form's defaults, in the endpoint's order


@pytest.fixture(scope="module")
def client(app_url):
    client = Client(app_url, verbose=False)
    status = client.predict(handle_file(str(PASSKEY)), "", *SETTINGS, api_name="/load_document")[0]
    assert "Loaded" in status and "PQ on layers 5, 11, 17" in status
    return client


def _answer(outputs):
    return outputs[0][-1]["content"][0]["text"]


def test_answer_streams_and_panels_fill(client):
    job = client.submit(QUESTION, [], "pqcache", 12, "5", api_name="/ask")
    outputs = list(job)
    assert len(outputs) >= 2  # streamed: several updates, not one
    assert "68422" in _answer(outputs[-1])
    assert "tokens/s" in outputs[-1][1]
    # power law, recall, hit rate, timeline, memory: all drawn. A panel is sent only when its data changed
    # (a no-op update otherwise), so each panel's latest drawing is the last output that carried one.
    for i in range(2, 7):
        drawn = [out[i] for out in outputs if isinstance(out[i], dict) and "plot" in out[i]]
        assert drawn, f"panel {i - 2} was never drawn"


def test_second_question_reuses_the_document(client):
    first = list(client.submit(QUESTION, [], "pqcache", 6, "5", api_name="/ask"))[-1]
    chat = first[0]
    second = list(client.submit("Repeat the pass key: 6", chat, "snapkv", 4, "5", api_name="/ask"))[-1]
    # both turns in the chat, and between them the notice that another method starts a new conversation
    assert [m["role"] for m in second[0]] == ["user", "assistant", "assistant", "user", "assistant"]
    assert "The method is now snapkv: a new conversation starts" in second[0][2]["content"][0]["text"]
    assert second[1].startswith("snapkv:")


def test_stop_halts_generation(client):
    job = client.submit(LONG_QUESTION, [], "pqcache", 256, "5", api_name="/ask")
    deadline = time.time() + 120
    # let tokens stream: the chat shows generated text, not the placeholder (on a busy machine the question's
    # prefill alone can outlast several 0.3 s updates, and a Stop then would halt it before any token)
    while not any(", generating..." in _answer(out) for out in job.outputs()) and time.time() < deadline:
        time.sleep(0.2)
    assert client.predict(api_name="/stop") == "stopped"
    while not job.done():
        time.sleep(0.2)
    final = job.outputs()[-1]
    assert "(stopped)" in final[1]
    n_tokens = int(final[1].split(": ")[1].split(" tokens")[0])
    assert 0 < n_tokens < 256


def test_bad_input_gives_a_message_and_the_session_survives(client):
    status = client.predict(None, "   ", *SETTINGS, api_name="/load_document")[0]
    assert status.startswith("**Error:**") and "empty" in status
    bad = client.predict(None, "some text", *LoadSettings(m=3).values(), api_name="/load_document")[0]
    assert "m=3 must divide" in bad
    out = list(client.submit(QUESTION, [], "pqcache", 8, "5", api_name="/ask"))[-1]
    assert "68422" in _answer(out)  # the loaded document is still there


def test_cost_model_endpoint(client):
    table, plot = client.predict("Llama-3.1-8B", 131072, 1, "RTX 4090", "PCIe 4.0 x16", 0.2, api_name="/cost")
    rows = dict((r[0], r[1]) for r in table["data"])
    assert rows["device KV, full attention (GiB)"] == "16.00"
    assert plot is not None
