"""The first-cut app: launched as users launch it, asked through gradio_client."""
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def app_url():
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "app.py", "--port", str(port)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}/"
    deadline = time.time() + 300
    while time.time() < deadline:  # wait for the server to accept connections
        if proc.poll() is not None:
            raise RuntimeError(proc.stdout.read())
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            time.sleep(0.5)
    yield url
    proc.terminate()
    proc.wait(timeout=30)


def test_app_answers_passkey_and_survives_bad_input(app_url):
    from gradio_client import Client

    client = Client(app_url, verbose=False)
    doc = (ROOT / "assets" / "passkey_1k.txt").read_text()
    text, stats = client.predict(None, doc, "What is the pass key? The pass key is", "pqcache", 0.2, 6,
                                 api_name="/answer")
    assert "68422" in text
    assert "prompt tokens" in stats and "host KV" in stats
    text, _ = client.predict(None, doc, "   ", "pqcache", 0.2, 6, api_name="/answer")
    assert "Please type a question" in text
    text, _ = client.predict(None, doc, "What is the pass key? The pass key is", "full", 0.2, 6, api_name="/answer")
    assert "68422" in text
