"""Reliability through gradio_client against a running app: bad input, the cache cap, the queue, Stop."""

import time
from dataclasses import replace
from pathlib import Path

import pytest
from gradio_client import Client, handle_file
from gradio_client.utils import Status

from pqcache.eval.passkey import LONG_QUESTION, QUESTION, passkey_context
from pqcache.serving.settings import LoadSettings
from tests.unit.test_documents import BAD_FILES

ROOT = Path(__file__).resolve().parents[2]
PASSKEY = ROOT / "assets" / "passkey_1k.txt"  # 1005 tokens, 12 MiB reserved, 10.7 held: one fits in 18.4 MiB
SETTINGS = LoadSettings()  # the load form's defaults


def load(client, path=None, text="", *, encoding="utf-8", too_long="refuse", settings=SETTINGS):
    file = handle_file(str(path)) if path else None
    form = replace(settings, encoding=encoding, too_long=too_long)
    return client.predict(file, text, *form.values(), api_name="/load_document")[0]


def answer(client, question=QUESTION, max_new=8):
    final = list(client.submit(question, [], "pqcache", max_new, "5", api_name="/ask"))[-1]
    return final[0][-1]["content"][0]["text"], final[1]


def wait_for(predicate, timeout=120.0, every=0.2):
    deadline = time.time() + timeout
    while not predicate():
        assert time.time() < deadline, "timed out waiting"
        time.sleep(every)


@pytest.fixture
def client(small_app_url):
    return Client(small_app_url, verbose=False)


@pytest.mark.parametrize("name,data,error,message", BAD_FILES, ids=[b[0] for b in BAD_FILES])
def test_bad_files_get_a_message(client, tmp_path, name, data, error, message):
    """Each bad file gets its message on the status line, whatever its type (the upload widget takes any file: a
    filter of types would drop a .docx or a file without an extension without a word)."""
    path = tmp_path / name
    path.write_bytes(data)
    status = load(client, path)
    assert status.startswith("**Error:**")
    assert message.replace("\\", "") in status


def test_bad_input_leaves_the_session_working(client, tmp_path):
    text, _ = answer(client)
    assert text == "Load a document first."  # a question before any document
    assert load(client, PASSKEY).startswith("Loaded **1005** tokens")
    bad = {  # what a user types -> what the page says
        "whitespace": load(client, text=" \n\t "),
        "no m": load(client, text="x", settings=replace(SETTINGS, m=None)),
        "m=3": load(client, text="x", settings=replace(SETTINGS, m=3)),
        "budget": load(client, text="x", settings=replace(SETTINGS, budget=-1)),
        "budget text": load(client, text="x", settings=replace(SETTINGS, budget="a lot")),
        "window": load(client, text="x", settings=replace(SETTINGS, budget=40, n_init=32, n_local=20)),
    }
    assert "the document is empty" in bad["whitespace"]
    assert "m must be a number, got None" in bad["no m"]
    assert "m=3 must divide the model's head size 256" in bad["m=3"]
    assert "token budget must be above 0: a fraction like 0.1 or a count like 1024, got -1" in bad["budget"]
    assert "token budget must be a number, got 'a lot'" in bad["budget text"]
    assert "a token budget of 40 tokens cannot hold 32 sink tokens plus a window of 20" in bad["window"]
    assert all(s.startswith("**Error:**") for s in bad.values()), bad
    path = tmp_path / "latin.txt"
    path.write_bytes(PASSKEY.read_bytes().replace(b"Find it", "Find it, café".encode("cp1252")))
    assert "not UTF-8 text" in load(client, path)
    assert "unknown text encoding 'klingon'" in load(client, path, encoding="klingon")
    big = tmp_path / "big.txt"
    big.write_bytes(b"word " * (2 * 2**20 + 1))  # over the 10 MiB upload limit
    with pytest.raises(ValueError, match="exceeds the maximum file size"):
        load(client, big)
    text, _ = answer(client)
    assert "68422" in text  # the document loaded before the errors is still there
    assert load(client, path, encoding="cp1252").startswith("Loaded")  # the file, read as the user says


def test_a_document_longer_than_allowed_is_refused_or_cut(client):
    long_doc = passkey_context("31415", n_filler=80, depth=0.1)  # ~1970 tokens; the app takes 1200
    refused = load(client, text=long_doc)
    assert refused.startswith("**Error:** the document has") and "at most 1200 fit" in refused
    cut = load(client, text=long_doc, too_long="cut the middle")
    assert cut.startswith("Loaded **1200** tokens") and "its middle was cut" in cut
    text, _ = answer(client)
    assert "31415" in text  # the key sits in the kept first half


def test_memory_cap_evicts_the_idle_user_and_tells_them(small_app_url):
    ann, bob = Client(small_app_url, verbose=False), Client(small_app_url, verbose=False)
    assert load(ann, PASSKEY).startswith("Loaded")
    assert load(bob, PASSKEY).startswith("Loaded")  # 12 MiB beside ann's 10.7 > 18.4 MiB: ann (idle) makes room
    status = bob.predict(api_name="/server_status")
    assert status["users"] == 1 and 0 < status["cache_bytes"] <= status["max_bytes"]
    notice = ann.predict(api_name="/notice")
    assert "unloaded to make room for another user" in notice  # what ann's page shows, unprompted
    text, _ = answer(ann)
    assert "Your document was unloaded to make room" in text and "load it again" in text
    assert "68422" in answer(bob)[0]
    assert load(ann, PASSKEY).startswith("Loaded")  # and ann can come back (now bob is evicted)
    assert "68422" in answer(ann)[0]


def test_requests_queue_with_a_visible_position(small_app_url):
    ann, bob = Client(small_app_url, verbose=False), Client(small_app_url, verbose=False)
    assert load(ann, PASSKEY).startswith("Loaded")
    long = ann.submit(LONG_QUESTION, [], "pqcache", 256, "5", api_name="/ask")
    wait_for(lambda: len(long.outputs()) >= 2)  # ann holds the only model slot
    waiting = bob.submit(QUESTION, [], "pqcache", 4, "5", api_name="/ask")
    seen = []

    def queued():
        status = waiting.status()
        if status.code == Status.IN_QUEUE and status.rank is not None:
            seen.append((status.rank, status.queue_size))
        return bool(seen)

    wait_for(queued)
    assert seen[0][0] == 0 and seen[0][1] >= 1  # first in line
    assert ann.predict(api_name="/stop") == "stopped"
    wait_for(waiting.done)
    assert waiting.outputs()[-1][0][-1]["content"][0]["text"] == "Load a document first."
    wait_for(long.done)
    assert "(stopped)" in long.outputs()[-1][1]


def test_stop_during_prefill_then_everything_works(client):
    long_doc = passkey_context("27182", n_filler=80, depth=0.1)
    job = client.submit(
        None, long_doc, *replace(SETTINGS, too_long="cut the middle").values(), api_name="/load_document"
    )
    # the load shows its progress in the status line it streams (no gr.Progress bar): wait for it to start
    wait_for(lambda: job.status().code in (Status.PROGRESS, Status.ITERATING) or job.done(), every=0.05)
    assert client.predict(api_name="/stop") == "stopped"
    wait_for(job.done)
    assert job.outputs()[-1][0] == "Stopped: the document was not loaded."
    assert client.predict(api_name="/server_status")["busy"] == 0
    assert load(client, PASSKEY).startswith("Loaded")
    assert "68422" in answer(client)[0]


def test_load_test_script_runs_clean_against_the_app(small_app_url):
    from pqcache.bench import loadtest

    report = loadtest.run(clients=3, duration=8, url=small_app_url, rounds=1, request_timeout=180)
    assert report["failures"] == 0, report["failure_replies"]
    assert report["hung_clients"] == 0 and report["caches_drained"] and report["requests"] >= 6
    assert set(report["by_kind"]) >= {"load", "unload"}
