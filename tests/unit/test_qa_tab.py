"""The Document Q&A tab's handlers in-process on a tiny model (no server): one status line with one source of
truth, a failed load that keeps (and names) the active document, a question asked while loading, the method
named in the chat, Stop when idle, panels redrawn only when their data changed."""

import copy
import threading
import types
from dataclasses import replace

import gradio as gr
import plotly.graph_objects as go
import pytest

from pqcache.serving.pool import SessionPool
from pqcache.serving.server_settings import ServerSettings
from pqcache.serving.session import DocumentSession
from pqcache.serving.settings import LoadSettings
from tests.tiny import WordTokenizer, tiny_model

ANN = types.SimpleNamespace(session_hash="ann")
TEXT = " ".join(f"w{i % 41}" for i in range(300))
SKIP = gr.skip()


@pytest.fixture
def tab():
    from studio import Studio
    from studio.qa import QATab

    studio = Studio(
        tiny_model("llama"), WordTokenizer(), SessionPool(max_bytes=2**30, idle_s=None), ServerSettings(pq_timeout_s=60)
    )
    yield QATab(studio)
    studio.pool.close()


def outputs(gen):
    """Every update a handler yields, as the page receives it (each yield is sent before the next one)."""
    return [copy.deepcopy(out) for out in gen]


def load(tab, file=None, text=TEXT):
    return outputs(tab.loader.load_document(file, text, *LoadSettings().values(), request=ANN))


def ask(tab, question="what is w3", max_new=4, method="pqcache"):
    return outputs(tab.answers.ask(question, [], method, max_new, None, request=ANN))


def test_load_shows_one_progress_line_then_names_the_active_document(tab):
    outs = load(tab)
    lines = [out[0] for out in outs]
    assert lines[0].startswith("Loading **pasted text (") and "\u25b1" in lines[0]  # the progress bar
    assert all(line.startswith("Loading **pasted text") for line in lines[:-1])  # never "No document loaded"
    assert lines[-1].startswith("Loaded **300** tokens of **pasted text (") and "the active document" in lines[-1]
    assert all(out[1:] == (SKIP,) * 6 for out in outs[:-1])  # panels and layers untouched while loading
    assert outs[-1][1]["choices"] == ["0", "1", "2"] and outs[-1][1]["value"] == "0"
    assert all(isinstance(fig, go.Figure) for fig in outs[-1][2:])
    hits = outs[-1][4].layout.annotations[0].text  # 300 tokens: a quarter is under one 128-token block
    assert hits.startswith("No block cache for this document")


def test_a_failed_load_keeps_and_names_the_active_document(tab, tmp_path):
    load(tab)
    (tmp_path / "photo.txt").write_bytes(bytes(range(256)) * 10)
    final = load(tab, file=str(tmp_path / "photo.txt"))[-1]
    assert final[0].startswith("**Error:** photo.txt looks like a binary file")
    assert "Still active: **pasted text (" in final[0] and "(300 tokens)" in final[0]
    assert final[1:] == (SKIP,) * 6  # the layer choice and the panels stay as they were
    assert ask(tab)[-1][1].startswith("pqcache: 4 tokens")  # the active document still answers
    status, layers, *_ = tab.unload_document(request=ANN)
    assert status.startswith("No document loaded") and layers["choices"] == []


def test_a_failed_load_without_a_document_says_none_is_loaded(tab):
    final = load(tab, text="   ")[-1]
    assert final[0] == "**Error:** the document is empty\n\nNo document is loaded."


def test_a_question_asked_while_loading_waits_for_the_document(tab, monkeypatch):
    release, real_load = threading.Event(), DocumentSession.load

    def slow_load(self, *args, **kwargs):
        release.wait()  # the prefill starts when the test says so
        return real_load(self, *args, **kwargs)

    monkeypatch.setattr(DocumentSession, "load", slow_load)
    loading = tab.loader.load_document(None, TEXT, *LoadSettings().values(), request=ANN)
    assert next(loading)[0].startswith("Loading **pasted text")
    asking = tab.answers.ask("what is w3", [], "pqcache", 4, None, request=ANN)
    chat, status, *panels = next(asking)
    assert chat[0] == {"role": "user", "content": "what is w3"}  # the question stays in the chat
    assert chat[1]["content"].startswith("*Waiting for **pasted text (") and status == "waiting for the document"
    release.set()
    assert list(loading)[-1][0].startswith("Loaded **300** tokens")
    chat, status, *_ = outputs(asking)[-1]
    assert [m["role"] for m in chat] == ["user", "assistant"]
    assert chat[1]["content"].split("\n\n")[-1].startswith("*pqcache: 4 tokens in ")
    assert status.startswith("pqcache: 4 tokens")


def test_stop_during_a_load_keeps_the_earlier_document(tab, monkeypatch):
    """A Stop while a second document loads: the first stays active (named on the line) and answers; the pool
    freed nothing of it while the two coexisted, and counts only the first afterwards."""
    load(tab)
    first = tab.documents.session("ann")
    bytes_before = tab.studio.pool.total_bytes()
    started, real_load = threading.Event(), DocumentSession.load

    def stopped_load(self, text, progress=None, stop=None, **kwargs):
        def progress_then_stop(fraction, message):
            if progress is not None:
                progress(fraction, message)
            if message.startswith("prefill"):
                started.set()
                assert tab.documents.session("ann") is first and first.cache is not None  # both are alive now
                assert tab.studio.pool.total_bytes() > bytes_before  # and both count under the cap
                tab.stop_generation(request=ANN)

        return real_load(self, text, progress=progress_then_stop, stop=stop, **kwargs)

    monkeypatch.setattr(DocumentSession, "load", stopped_load)
    outs = load(tab, text=" ".join(f"v{i % 23}" for i in range(200)))
    assert started.is_set()
    assert any("if it stops or fails, **pasted text (" in out[0] for out in outs[:-1])  # said while loading
    final = outs[-1][0]
    assert final.startswith("Stopped: the document was not loaded.")
    assert "Still active: **pasted text (" in final and "(300 tokens)" in final, final
    assert tab.documents.session("ann") is first and first.cache is not None
    assert tab.studio.pool.total_bytes() == bytes_before
    assert ask(tab)[-1][1].startswith("pqcache: 4 tokens")  # the earlier document still answers


def test_a_question_past_the_cap_is_refused_in_one_line_and_stays_in_its_box(tab):
    load(tab)
    tab.studio.server = replace(tab.studio.server, max_question_chars=100)
    outs = ask(tab, question="what is w3 " * 20)
    chat, status, *panels, box, sources = outs[-1]
    assert len(outs) == 1 and chat == []  # no model slot taken, nothing in the chat
    assert status.startswith("**Error:** the question is 220 characters long; questions here take at most 100")
    assert box == SKIP and all(p == SKIP for p in panels)
    assert ask(tab, question="what is w3")[-1][1].startswith("pqcache: 4 tokens")  # a short one is answered


def test_a_failed_answer_leaves_no_sources_of_the_last_one(tab):
    """The word tokenizer gives no passages: the last answer's kept sources are planted as the page had them."""
    load(tab)
    ask(tab)
    tab.answers.kept["ann"] = (TEXT, {"sources": [{"start": 0, "end": 8, "share": 0.5, "text": TEXT[:8]}]})
    tab.unload_document(request=ANN)
    outs = ask(tab)
    assert outs[0][-1] == {"__type__": "update", "choices": [], "value": None, "visible": False}
    assert outs[-1][0][-1]["content"] == "Load a document first."
    assert tab.answers.show_source(0, False, request=ANN) == tab.answers.show_source(
        None, False, request=ANN
    )  # nothing kept


def test_answers_name_the_method_and_questions_without_a_document_stay_in_the_chat(tab):
    chat = ask(tab)[-1][0]
    assert chat == [
        {"role": "user", "content": "what is w3"},
        {"role": "assistant", "content": "Load a document first."},
    ]
    load(tab)
    outs = ask(tab, max_new=3, method="snapkv")
    assert outs[0][0][-1]["content"] == "*snapkv is reading the question...*"
    final = outs[-1][0][-1]["content"]
    assert final.split("\n\n")[-1].startswith("*snapkv: 3 tokens in ") and outs[-1][1].startswith("snapkv: 3 tokens")


def test_stop_when_idle_keeps_the_last_timing_line(tab):
    load(tab)
    ask(tab)
    assert tab.stop_generation(request=ANN) == "nothing to stop"  # and the timing line is not touched
    assert not tab.documents.entry("ann").stop.is_set()


def test_panels_are_redrawn_only_when_their_data_changed(tab):
    from pqcache import Instrumentation
    from studio.panels import PanelFeed

    load(tab)
    session = tab.documents.session("ann")
    feed = PanelFeed("cpu")
    feed.show(session)
    first = feed.figures()
    assert all(isinstance(f, go.Figure) for f in first)
    assert feed.figures() == (SKIP,) * 5  # nothing changed: nothing sent
    feed.show(window="whole run")
    again = feed.figures()
    assert again[:3] == (SKIP,) * 3 and isinstance(again[3], go.Figure) and again[4] == SKIP  # the timeline only
    assert "whole run" in again[3].layout.title.text and "CPU" in again[3].layout.title.text
    obs = Instrumentation(timeline=True, attention_every=1, recall_every=1)
    feed.show(session, obs, "full")
    session.ask("what is w3", method="full", max_new_tokens=3, observer=obs)
    figs = feed.figures()
    for fig in figs[1:3]:  # recall and hit rate do not apply to full attention, and say so
        assert "Does not apply to full attention" in fig.layout.annotations[0].text
    assert isinstance(figs[0], go.Figure) and figs[0].data  # the power law does
    assert feed.draws["memory"] == 2  # drawn for the document, then for the answer's statistics only


def test_while_tokens_stream_one_panel_is_redrawn_at_a_time(tab):
    from pqcache import Instrumentation
    from studio.panels import PanelFeed

    load(tab)
    session, feed = tab.documents.session("ann"), PanelFeed("cpu")
    feed.show(session)
    feed.figures()
    obs = Instrumentation(timeline=True, attention_every=1, recall_every=1)
    feed.show(session, obs, "pqcache")
    session.ask("what is w3", max_new_tokens=3, observer=obs)
    drawn = []
    for _ in range(5):
        figs = feed.figures(limit=1, hold=("memory",))  # as stream_answer calls it
        assert sum(isinstance(f, go.Figure) for f in figs) <= 1
        drawn += [i for i, f in enumerate(figs) if isinstance(f, go.Figure)]
    assert sorted(drawn) == sorted(set(drawn)) and len(drawn) == 4  # each changed panel once, in turn
    assert 4 not in drawn  # the answer's statistics changed memory's data, but it waits for the last update
    last = feed.figures()
    assert isinstance(last[4], go.Figure) and last[:4] == (SKIP,) * 4
    assert feed.figures() == (SKIP,) * 5


def test_a_new_document_shows_its_own_memory_not_the_last_answers(tab):
    from studio.panels import stats_of

    load(tab)
    session = tab.documents.session("ann")
    session.ask("what is w3", max_new_tokens=3)
    assert stats_of(session) is session.last_stats  # the answer's cache, with its tokens
    load(tab, text="w7 w8 w9 " * 40)  # the page's load: a new session for the new document
    fresh = tab.documents.session("ann")
    assert fresh is not session and stats_of(fresh) == fresh.cache.stats()
    session.load("w7 w8 w9 " * 40)  # the Python API's: the same session reads another document
    assert session.last_stats is None and stats_of(session) == session.cache.stats()


def test_an_answers_first_words_are_sent_at_once_not_at_the_next_tick(monkeypatch):
    """The chat is sent at most every CHAT_EVERY_S seconds, but the first text goes out as soon as the model has it:
    with the tick set to a day, the first token's text reaches the page while the answer is still running."""
    import studio.answering as answering
    from pqcache.serving.answer import Answer
    from studio.panels import PanelFeed

    monkeypatch.setattr(answering, "CHAT_EVERY_S", 86400.0)
    release = threading.Event()

    class Session:  # the first token, then it waits until the test has seen it
        last_stats = None

        def ask(self, max_new_tokens, stop, observer, on_token):
            answer = Answer(text="Paris", tokens=[1])
            on_token(answer)
            assert release.wait(30), "the first words were not sent"
            answer.done = True
            return answer

    session = Session()
    stream = answering.stream_answer(session.ask, session, [], "pqcache", 8, threading.Event(), None, PanelFeed("cpu"))
    assert next(stream)[0][-1]["content"].startswith("*pqcache is reading")
    chat = next(stream)[0]
    assert chat[-1]["content"].startswith("Paris") and not release.is_set()
    release.set()
    last = list(stream)[-1]
    assert last[0][-1]["content"].startswith("Paris\n\n*pqcache: 1 tokens")


def test_follow_ups_continue_one_conversation_until_a_new_one(tab):
    """The second question continues the first's cache (the timing line counts both turns); New conversation goes
    back to the document; another method starts a new conversation and says so; Unload ends it."""
    load(tab)
    first = ask(tab)[-1][1]
    assert "; conversation: " in first and "(turn 1; at most 1,024)" in first
    talk = tab.documents.conversations[("ann", "chat")]
    n_after_first = talk.n_tokens
    second = ask(tab, question="and w7")[-1][1]
    assert (
        "(turns 1-2;" in second
        and tab.documents.conversations[("ann", "chat")] is talk
        and talk.n_tokens > n_after_first
    )
    counted = tab.studio.pool.entry("ann").nbytes["qa"]
    assert counted > talk.session.nbytes()  # the conversation's growth counts under the cap
    chat, line = tab.conversation.new_conversation(request=ANN)
    assert chat == [] and line.startswith("A new conversation about **pasted text (")
    assert "turn 1;" in ask(tab)[-1][1]  # a fresh conversation on the same document, no prefill
    outs = ask(tab, method="h2o")
    assert any("The method is now h2o: a new conversation starts" in m["content"] for m in outs[-1][0])
    assert tab.documents.conversations[("ann", "chat")].method == "h2o"
    tab.unload_document(request=ANN)
    assert ("ann", "chat") not in tab.documents.conversations


def add(tab, file=None, pasted=""):
    """Add to the conversation, as the page runs it: every (status line, timing line) it yields."""
    return outputs(tab.conversation.add_to_conversation(file, pasted, "utf-8", "pqcache", request=ANN))


def test_a_document_added_to_the_conversation_is_read_once_and_asked_about(tab, tmp_path):
    assert add(tab, pasted="v1 v2")[-1][1].startswith("Load a document")
    load(tab)
    ask(tab)
    second = tmp_path / "second.txt"
    second.write_text(" ".join(f"v{i % 17}" for i in range(300)), encoding="utf-8")
    outs = add(tab, str(second))
    assert outs[0][0].startswith("Adding **second.txt** to the conversation: ")  # as a load: its progress first
    status, said = outs[-1]
    assert said.startswith("Added **second.txt** (300 tokens) to the conversation") and "added: second.txt" in said
    assert "The conversation holds **pasted text (" in status and "added: **second.txt**" in status
    assert "(turns 1-3; added: second.txt" in ask(tab, question="what is v3")[-1][1]
    (tmp_path / "bin.txt").write_bytes(bytes(range(256)) * 4)
    status, said = add(tab, str(tmp_path / "bin.txt"))[-1]
    assert "**Error:** bin.txt looks like a binary file" in status and said == ""
    assert len(tab.documents.conversations[("ann", "chat")].turns) == 3  # kept as it was


def test_a_conversation_past_the_models_context_says_so_and_offers_a_new_one(tab, tmp_path):
    load(tab)
    big = tmp_path / "big.txt"
    big.write_text(" ".join(f"v{i % 17}" for i in range(400)), encoding="utf-8")
    assert add(tab, str(big))[-1][1].startswith("Added")
    full, _ = add(tab, str(big))[-1]
    assert full.startswith("**Error:** this conversation holds 700 tokens") and "start a new conversation" in full
    chat = ask(tab)[-1][0]
    assert chat[-1]["content"].startswith("*") or "tokens in" in chat[-1]["content"]  # it still answers
    tab.conversation.new_conversation(request=ANN)
    assert add(tab, str(big))[-1][1].startswith("Added")


def test_a_document_loaded_again_is_read_from_the_store_and_the_line_says_so(tmp_path):
    """With a store (app.py's default), the second load of the same text, as after a page reload, reads it back
    with no prefill; the status line says so and with what time; the answers are the first load's."""
    from pqcache.serving.store import DocumentStore
    from studio import Studio
    from studio.qa import QATab

    pool = SessionPool(max_bytes=2**30, idle_s=None)
    tab = QATab(
        Studio(
            tiny_model("llama"), WordTokenizer(), pool, ServerSettings(pq_timeout_s=60), store=DocumentStore(tmp_path)
        )
    )
    try:
        first = load(tab)[-1][0]
        assert "Prefill **" in first and "document store" not in first
        said = ask(tab)[-1][0][-1]["content"].split("\n")[0]  # the answer, without its timing line
        second = load(tab)[-1][0]
        assert second.startswith("Loaded **300** tokens") and "Read from the document store in **" in second
        assert "(no prefill)" in second and "Prefill **" not in second
        assert ask(tab)[-1][0][-1]["content"].split("\n")[0] == said
    finally:
        pool.close()


def test_your_documents_lists_reopens_from_the_store_and_deletes(tmp_path):
    """The browser's list of its documents (what gr.BrowserState keeps): a load adds the document, a reopen reads it
    back from the store with no prefill, a delete removes it from the store and the list; a listing the store no
    longer holds says so in one line, and the active document stays."""
    from pqcache.serving.store import DocumentStore
    from studio import Studio
    from studio.qa import QATab

    pool, store = SessionPool(max_bytes=2**30, idle_s=None), DocumentStore(tmp_path)
    tab = QATab(Studio(tiny_model("llama"), WordTokenizer(), pool, ServerSettings(pq_timeout_s=60), store=store))
    try:
        load(tab)
        listing, shown = tab.your_documents.remember([], request=ANN)
        (entry,) = listing
        assert entry["tokens"] == 300 and shown["choices"] == [(f"{entry['name']} (300 tokens)", entry["key"])]
        asked = ask(tab)[-1][0]  # a question about it: the conversation is kept beside it in the store
        load(tab, text=" ".join(f"v{i % 37}" for i in range(200)))
        listing, _ = tab.your_documents.remember(listing, request=ANN)
        assert [e["tokens"] for e in listing] == [200, 300]  # the newest first
        assert tab.your_documents.resumed(entry["key"], "pqcache", request=ANN) == (
            gr.skip(),
            gr.skip(),
        )  # not the active one
        lines = [
            out[0]
            for out in outputs(tab.your_documents.reopen(entry["key"], listing, *LoadSettings().values(), request=ANN))
        ]
        assert lines[-1].startswith("Loaded **300** tokens") and "Read from the document store" in lines[-1]
        chat, line = tab.your_documents.resumed(entry["key"], "pqcache", request=ANN)  # and its conversation with it
        assert [m["content"] for m in chat] == [asked[-2]["content"], asked[-1]["content"].split("\n\n*")[0]]
        assert line.startswith("Reopened the conversation kept with this document (1 question(s))")
        assert "(turns 1-2;" in ask(tab, question="and w7")[-1][1]  # the next question is a follow-up
        listing, _ = tab.your_documents.remember(listing, request=ANN)
        assert [e["tokens"] for e in listing] == [300, 200]
        listing, shown = tab.your_documents.forget(entry["key"], listing, request=ANN)
        assert [e["tokens"] for e in listing] == [200] and not store.has(entry["key"])
        gone = outputs(tab.your_documents.reopen(entry["key"], [entry], *LoadSettings().values(), request=ANN))
        assert len(gone) == 1 and gone[0][0].startswith("Loaded **300** tokens")  # still active, nothing reloaded
        assert (
            tab.your_documents.remember([{"key": 3}, "junk"], request=ANN)[0][0]["tokens"] == 300
        )  # a tampered list is cleaned
    finally:
        pool.close()
