"""The app's tabs in-process (no server): the load form's settings, the teaching tab's use of the pool and its
errors, the idle reaper's flags. The app through a running server: test_app*.py, test_browser.py."""

import inspect
import threading
import types
from dataclasses import fields, replace

import pytest

from pqcache import PQCacheConfigError
from pqcache.serving.pool import SessionPool
from pqcache.serving.server_settings import ServerSettings
from pqcache.serving.session import DocumentSession
from pqcache.serving.settings import LoadSettings
from tests.tiny import WordTokenizer, tiny_model

USER = types.SimpleNamespace(session_hash="teacher")  # what gradio passes as the request
FACT = "the code to open the blue door"


def quiet(*args, **kwargs):
    """A gr.Progress stand-in."""


# ---- the load form's settings ------------------------------------------------------------------------------
def test_load_settings_are_the_form_in_the_order_of_the_endpoint():
    from studio.qa_load import DocumentLoader

    params = list(inspect.signature(DocumentLoader.load_document).parameters)
    form = params[params.index("pasted") + 1 : params.index("request")]
    assert form == [f.name for f in fields(LoadSettings)]
    assert LoadSettings().values() == ["pqcache", 0, 0, 0.1, 32, 0, "lfu", 1024, "utf-8", "refuse", 0, False]
    config = LoadSettings().to_config(pq_timeout_s=8)
    assert (
        config.m,
        config.bits,
        config.token_budget,
        config.n_init,
        config.n_local,
        config.cache_policy,
        config.block_cache_tokens,
        config.pq_timeout_s,
    ) == (None, None, 0.1, 32, None, "lfu", 1024, 8)
    assert (LoadSettings(m=2, bits=6).to_config().m, LoadSettings(m=2, bits=6).to_config().bits) == (2, 6)
    assert LoadSettings(budget="300", n_local=40).to_config().token_budget == 300
    assert LoadSettings(too_long="cut the middle").truncate == "middle" and LoadSettings().truncate == "refuse"
    assert (config.mass, config.completion) == (None, False)  # 0 and off: the fixed top-k, nothing estimated
    settled = LoadSettings(mass=0.95, completion=True).to_config()
    assert (settled.mass, settled.completion) == (0.95, True)
    assert LoadSettings().text_encoding is None and LoadSettings(encoding="cp1252").text_encoding == "cp1252"
    with pytest.raises(PQCacheConfigError, match="token budget must be a number, got 'a lot'"):
        LoadSettings(budget="a lot").to_config()


def test_block_cache_is_rounded_to_the_configured_block_size():
    assert LoadSettings(capacity=1000).to_config().block_cache_tokens == 896  # the default block_size, 128
    assert LoadSettings(capacity=1000).to_config(block_size=100).block_cache_tokens == 1000
    config = LoadSettings(capacity=1000).to_config(block_size=48)
    assert (config.block_size, config.block_cache_tokens) == (48, 960)
    assert replace(LoadSettings(), capacity=40).to_config(block_size=64).block_cache_tokens == 0  # under one block


# ---- the document store's flags ----------------------------------------------------------------------------------
def test_the_store_flags_choose_where_documents_are_kept(tmp_path, monkeypatch, capsys):
    import app

    monkeypatch.setenv("PQCACHE_HOME", str(tmp_path))

    def store(*flags):
        return app.server_settings(app.parse_args(list(flags))).open_store()

    assert store().root == tmp_path / "documents" and store().cap_bytes > 0  # on by default, under PQCACHE_HOME
    elsewhere = store("--store", str(tmp_path / "elsewhere"), "--store-gib", "0.5")
    assert elsewhere.root == tmp_path / "elsewhere" and elsewhere.cap_bytes == 2**29
    assert store("--no-store") is None
    refused = [
        (["--store-gib", "0"], "--store-gib must be more than 0"),
        (["--no-store", "--store", "x"], "choose one"),
    ]
    for bad, said in refused:
        with pytest.raises(SystemExit):
            app.parse_args(bad)
        assert said in capsys.readouterr().err


def test_the_browser_lists_secret_is_made_once_and_kept(tmp_path, monkeypatch):
    """Your documents' listing is encrypted in the browser with this secret: a new one at each start would make every
    browser's list unreadable after a restart, so it is made once (only the app's account reads it) and read back."""
    import os

    from studio.your_documents import browser_secret

    monkeypatch.setenv("PQCACHE_HOME", str(tmp_path))
    first = browser_secret()
    assert len(first) == 64 and browser_secret() == first  # a restart reads the same one
    assert os.stat(tmp_path / "browser_secret").st_mode & 0o777 == 0o600 and os.listdir(tmp_path) == ["browser_secret"]


# ---- --idle-minutes 0 -------------------------------------------------------------------------------------------
def test_idle_minutes_zero_never_reaps_and_starts_no_reaper_thread(monkeypatch):
    import app

    before = set(threading.enumerate())
    pool = app.server_settings(app.parse_args(["--idle-minutes", "0", "--max-cache-gib", "1"])).make_pool()
    try:
        assert pool.idle_s is None and pool._reaper is None
        assert [t for t in threading.enumerate() if t not in before and t.name == "pqcache-reaper"] == []
        entry = pool.entry("ann")
        entry.sessions["qa"], entry.last_used = types.SimpleNamespace(close=quiet), pool.clock() - 10**6
        assert pool.reap() == [] and "qa" in pool.entry("ann").sessions  # idle for days: kept
    finally:
        pool.close()
    pool = SessionPool(max_bytes=2**30, idle_s=0)  # the pool on its own: 0 means the same
    pool.start_reaper(every_s=0)
    try:
        assert pool.idle_s is None and pool._reaper is None
    finally:
        pool.close()
    with pytest.raises(ValueError, match="every_s"):  # a reaper that would spin is refused
        SessionPool(max_bytes=2**30, idle_s=60).start_reaper(every_s=0)
    with pytest.raises(SystemExit):  # a negative time is refused at the command line
        app.parse_args(["--idle-minutes", "-1"])
    pool = app.server_settings(app.parse_args(["--idle-minutes", "30", "--max-cache-gib", "1"])).make_pool()
    try:
        assert pool.idle_s == 1800 and pool._reaper.is_alive()
    finally:
        pool.close()


# ---- teaching -----------------------------------------------------------------------------------------------
@pytest.fixture
def teaching(tmp_path):
    """The teaching tab on a tiny model and a short document with the first fact in it."""
    from studio import Studio
    from studio.teaching import TeachingTab

    words = [f"w{i % 37}" for i in range(240)]
    words[150:150] = f"{FACT} is 4721 .".split()
    doc = tmp_path / "teaching.txt"
    doc.write_text(" ".join(words), encoding="utf-8")
    studio = Studio(
        tiny_model("llama"), WordTokenizer(), SessionPool(max_bytes=2**30, idle_s=None), ServerSettings(pq_timeout_s=60)
    )
    yield TeachingTab(studio, document=str(doc))
    studio.pool.close()


def run(tab, methods=("pqcache", "streaming"), step="1. Prefill and PQ build"):
    state, status, rows, strip, spotlight, text, picture, missed_line, missed_plot = tab.run_teaching(
        list(methods), FACT, 0.2, step, None, request=USER, progress=quiet
    )
    return state, status, rows


def test_teaching_runs_side_by_side_with_the_right_answer(teaching):
    from studio.teaching import question_line

    state, status, rows = run(teaching)
    assert status.startswith("Prefilled 250 tokens once; the fact starts at token 150")
    assert [r[0] for r in rows] == ["pqcache", "streaming"] and all(r[3] > 0 for r in rows)
    assert all(r[2] in ("yes", "no") for r in rows)  # right or not, against the answer on screen
    assert question_line(FACT).endswith("**Right answer:** 4721")
    assert teaching.studio.pool.session("teacher", "teaching") is not None
    spotlight = teaching.spotlight_text(state, "streaming")  # the tokens around the fact, by colour, no tags
    assert {kind for _, kind in spotlight} <= {None, "attended", "the fact", "the fact, attended"}
    assert any(kind and "the fact" in kind for _, kind in spotlight)


def test_teaching_reads_the_document_once_and_keeps_its_queries_for_the_picture(teaching, monkeypatch):
    """The one prefill keeps the queries, for SnapKV (no second read of the document) and for the picture of what the
    selection missed, which replays the document's last queries (serving/fidelity.py): kept with PQCache and
    StreamingLLM alone too."""
    import pqcache.serving.session as session_module

    reads = []
    real = session_module.read_queries
    monkeypatch.setattr(session_module, "read_queries", lambda *a: reads.append(1) or real(*a))
    for methods in (("pqcache", "snapkv"), ("pqcache", "streaming")):
        run(teaching, methods=methods)
        session = teaching.studio.pool.session("teacher", "teaching")
        assert reads == [] and session.cache.stats()["query_bytes"] > 0


def test_teaching_shows_what_the_selection_missed_and_what_the_estimate_put_back(teaching):
    """The picture's line names the run's budget, the share PQCache's selection held and the three errors, from the
    run's rows; the figure has a line per setting. Before a run: a line saying where the picture comes from."""
    from studio.teaching import missed_picture

    state, _, _ = run(teaching)
    line, figure = missed_picture(state)
    assert line.startswith("At this run's budget (0.2), PQCache's selection held **") and "Oracle" in line
    assert {trace.name for trace in figure.data} == {"oracle", "pqcache", "pqcache+completion"}
    assert missed_picture(None)[0].startswith("*Press Run side by side")


def test_teaching_spotlight_shows_what_each_method_attended_within_the_budget(teaching):
    state, _, rows = run(teaching)
    attended = {r[0]: r[3] for r in rows}
    asked = state["walk"]["n_tokens"] - 250  # the question's tokens, in the cache after the document
    assert 0 < attended["streaming"] <= 0.2 * 250 + asked + 1  # the budget, the question and the new token
    assert 0 < attended["pqcache"] < 250  # not the whole document
    assert state["selections"]["streaming"] == sorted(state["selections"]["streaming"])
    assert not any(110 <= p < 150 for p in state["selections"]["streaming"])  # far from both sinks and window


@pytest.mark.parametrize("methods", [("pqcache", "streaming"), ("streaming",)])
def test_teaching_walkthrough_has_a_picture_per_step_from_the_run_and_no_model_work(teaching, monkeypatch, methods):
    from studio.teaching import WALKTHROUGH

    state, _, _ = run(teaching, methods)  # without pqcache among the methods it records a short answer of its own
    walk = state["walk"]
    assert walk["layer"] == 0 and walk["k"] > 0 and walk["n_wide"] >= walk["k"]
    monkeypatch.setattr(DocumentSession, "ask", lambda *a, **k: pytest.fail("the walkthrough asked the model"))
    titles = set()
    for step in WALKTHROUGH:
        text, figure = teaching.walkthrough(step, state, USER)
        assert text.startswith(f"**{step}.**") and "{" not in text  # every number filled in from the run
        names = [tr.name for tr in figure.data if tr.showlegend is not False]
        assert figure.data and len(names) == len(set(names))  # one legend entry per series
        titles.add(figure.layout.title.text.split(":")[0])
    assert len(titles) == 5  # five different pictures


def test_teaching_gives_one_count_of_attended_tokens_and_the_search_as_it_ran(teaching):
    """The results table, step 5's text and step 5's picture count the same tokens; step 3 says how the PQ stage's
    count came about (rerank x k, or the floor of rerank_min_tokens), in the run's own numbers."""
    state, _, rows = run(teaching)
    walk, counted = state["walk"], {r[0]: r[3] for r in rows}["pqcache"]
    text, figure = teaching.walkthrough("5. Attention", state, USER)
    total = walk["n_tokens"] + 1
    assert f"Here {counted} of {total} tokens" in text and figure.layout.title.text.startswith(
        f"5. Attention over {counted} of {total} tokens"
    )
    text, _ = teaching.walkthrough("3. Search", state, USER)
    times = walk["rerank"] * walk["k"]
    assert (
        f"PQ kept the {walk['n_wide']} best" in text
        and f"rerank x k = {walk['rerank']} x {walk['k']} = {times}" in text
    )
    if walk["n_wide"] > times:
        assert f"raised to the floor of {walk['rerank_min']} tokens" in text


def test_teaching_walkthrough_before_a_run_says_what_to_do(teaching):
    text, figure = teaching.walkthrough("3. Search", None, USER)
    assert "Press Run side by side" in text and figure is None


def test_teaching_errors_are_messages_without_a_traceback(teaching, monkeypatch):
    state, _, _ = run(teaching)

    def broken(self, *args, **kwargs):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory")

    monkeypatch.setattr(DocumentSession, "ask", broken)
    message = (
        "**Error:** unexpected RuntimeError on the server (DefaultCPUAllocator: can't allocate memory); "
        "the details are in the server log"
    )
    again, status, rows = run(teaching)
    assert status == message and rows == [] and again is None  # the page's state stays as it was
    assert teaching.studio.pool.entry("teacher").busy == 0


def test_teaching_walkthrough_after_the_server_freed_the_document(teaching):
    state, _, _ = run(teaching)
    teaching.studio.pool.free("teacher", "teaching")
    text, figure = teaching.walkthrough("4. Fetch", state, USER)  # the pictures are the run's, kept on the page
    assert text.startswith("**4. Fetch.**") and figure.data


# ---- cost model ---------------------------------------------------------------------------------------------
def test_cost_model_says_what_fits_and_the_budget_unit():
    from studio.costmodel_tab import cost, intro

    rows, figure = cost("Llama-3.1-8B", 131072, 1, "RTX 4090", "PCIe 4.0 x16", 0.2)
    table = {r[0]: r[1:] for r in rows}
    assert table["device KV, full attention (GiB)"] == ["16.00", "weights + KV: does not fit (30.9 > 24 GiB)"]
    assert table["device KV, PQCache (GiB)"][1].startswith("weights + KV + PQ: fits (")
    assert table["token budget"][0] == "0.2 of the context = 26,215 tokens per step"
    rows, _ = cost("Llama-3.1-8B", 131072, 1, "RTX 4090", "PCIe 4.0 x16", 3)
    assert rows[0][1].startswith("3 tokens per step (a count")
    assert figure is not None and intro().count("not a measurement") == 1  # said once


def test_the_spotlight_keeps_words_whole():
    """A word split into tokens of two colours is one span, coloured as its strongest token (the page would break a
    line between two spans: "in the s / hallow water")."""
    from studio.teaching import whole_words

    pieces = [("In", None), (" the", None), (" s", "attended"), ("hallow", None), (" water", "the fact"), (".", None)]
    assert whole_words(pieces) == [("In", None), (" the", None), (" shallow", "attended"), (" water.", "the fact")]
