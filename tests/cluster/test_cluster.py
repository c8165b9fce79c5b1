"""The Q&A tab on a real local Ray cluster (the tier's private instance: tests/cluster/conftest.py): two replicas
of the document worker, a tiny random chat model built in-process and saved to a temp folder. Users land on
different replicas and stay on theirs; a killed replica unloads its users' documents only (they are told, and load
again on a live replica); Stop reaches the replica; the panels' data crosses the boundary."""

import json
import os
import signal
import time
import types

import pytest

from pqcache.serving.pool import SessionPool
from pqcache.serving.server_settings import ServerSettings
from pqcache.serving.settings import LoadSettings
from tests.unit.test_qa_tab import outputs

SHORT = " ".join(f"w{i % 41}" for i in range(60))  # ~240 tokens: loads in a blink
LONG = " ".join(f"w{i % 97}" for i in range(1800))  # ~7000 tokens: seconds of prefill, time to press Stop


def user(name: str):
    return types.SimpleNamespace(session_hash=name)


def told(notice):
    """server_notice's reply when it has something to tell (a status line), else None (it skipped)."""
    return notice if isinstance(notice, str) else None


def wait_for(predicate, timeout=120.0, every=0.2):
    deadline = time.time() + timeout
    while not (result := predicate()):
        assert time.time() < deadline, "timed out waiting"
        time.sleep(every)
    return result


@pytest.fixture(scope="module")
def docs(local_ray, model_dir):
    """Two replicas on the tier's private Ray instance (tests/cluster/conftest.py), half a CPU each."""
    server = ServerSettings(model=str(model_dir), max_cache_bytes=2**28, idle_s=None, concurrency=1, pq_timeout_s=60)
    return local_ray(2, server, replica_cpus=0.5)


@pytest.fixture
def tab(docs):
    from studio import Studio
    from studio.qa import QATab

    studio = Studio(None, None, SessionPool(max_bytes=2**20, idle_s=None), documents=docs)
    tab = QATab(studio)
    yield tab
    for name in list(docs.homes):
        tab.end_user(user(name))


def feed_tokens(tab, name):
    return tab.documents.session(name).n_tokens


def load(tab, who, text=SHORT, **settings):
    return outputs(tab.loader.load_document(None, text, *LoadSettings(**settings).values(), request=who))[-1][0]


def ask(tab, who, max_new=8):
    chat, status, *panels, _ = outputs(tab.answers.ask("what is w3?", [], "pqcache", max_new, None, request=who))[-1]
    return chat[-1]["content"], status


def test_two_users_land_on_different_replicas_and_stay_there(tab, docs):
    ann, bob = user("ann"), user("bob")
    assert load(tab, ann).startswith("Loaded **")
    assert load(tab, bob).startswith("Loaded **")
    homes = {"ann": docs.replica_of("ann"), "bob": docs.replica_of("bob")}
    assert sorted(homes.values()) == [0, 1]  # the second user goes to the replica with no document
    for _ in range(2):  # a question reaches the replica holding its user's document (the other has none)
        for who in (ann, bob):
            answer, status = ask(tab, who)
            assert status.startswith("pqcache: ") and " tokens in " in status, (answer, status)
    assert {"ann": docs.replica_of("ann"), "bob": docs.replica_of("bob")} == homes
    summary = tab.server_status()
    assert summary["users"] == 2 and summary["up"] == 2 and summary["cache_bytes"] > 0
    assert [w["users"] for w in summary["workers"]] == [1, 1]
    home = docs.homes["ann"]  # what crosses the boundary is plain data (no tensors, no engine objects)
    reply = home.replica.call("document", "ann", home.incarnation, None)
    assert json.loads(json.dumps(reply))["view"]["n_tokens"] == feed_tokens(tab, "ann") > 0
    feed = tab.panels.of("ann")  # the panels' data came across: the prefill's and the answer's records
    assert feed.session.prefill_obs.events and feed.obs.events
    assert feed.obs.t0 != feed.session.prefill_obs.t0  # on the replica's clock, the answer after the prefill
    assert "Loaded **" in tab.status.line("ann") and "the active document" in tab.status.line("ann")


def test_bad_input_comes_back_as_a_message_and_the_document_stays(tab, docs):
    cat = user("cat")
    assert load(tab, cat).startswith("Loaded **")
    assert "m=3 must divide" in load(tab, cat, m=3)
    assert load(tab, cat, text="   ").startswith("**Error:** the document is empty")
    status = tab.status.line("cat")
    assert "Still active: **pasted text (" in status
    assert ask(tab, cat)[1].startswith("pqcache: ")


ENDED = "(the load ended)"


def until_prefill_or_end(loading) -> list[str]:
    """The status lines a load shows until one says its prefill has begun, or the load ended (ENDED last)."""
    seen = []

    def prefilling_or_ended() -> bool:
        seen.append(next(loading, (ENDED,))[0])
        return seen[-1] == ENDED or any(s in seen[-1] for s in ("tokenizing", "prefill:"))

    wait_for(prefilling_or_ended, timeout=60, every=0)
    return seen


def test_stop_reaches_the_replica_during_a_load(tab, docs):
    dan = user("dan")
    # the replica's progress streams back: once the prefill has begun, press Stop. The replicas idle first (a load
    # waiting for a model slot shows that instead). The page shows at most a line a second, so a fast replica may end
    # the whole load between two of them (2 runs in 10 did): then the load is undone and tried again
    for _attempt in range(3):
        wait_for(lambda: tab.server_status()["busy"] == 0)
        loading = tab.loader.load_document(None, LONG, *LoadSettings().values(), request=dan)
        seen = until_prefill_or_end(loading)
        if seen[-1] != ENDED:
            break
        tab.unload_document(dan)
    else:
        pytest.fail(f"three loads ended before the page showed their prefill; the last one's lines: {seen}")
    assert tab.stop_generation(request=dan) == "stopped"
    assert outputs(loading)[-1][0] == "Stopped: the document was not loaded."
    wait_for(lambda: tab.server_status()["busy"] == 0)  # the replica's request ends just after its reply
    tab.unload_document(dan)  # the app forgets dan's replica; the Stop must not linger there either
    assert load(tab, dan).startswith("Loaded **")  # the user's next load works
    assert ask(tab, dan)[1].startswith("pqcache: ")


def test_a_killed_replica_unloads_its_users_documents_only(tab, docs):
    eve, fay = user("eve"), user("fay")
    assert load(tab, eve).startswith("Loaded **") and load(tab, fay).startswith("Loaded **")
    victim, survivor = docs.replica_of("eve"), docs.replica_of("fay")
    assert victim != survivor
    os.kill(docs.replicas[victim].call("hello")["pid"], signal.SIGKILL)  # the replica's process dies
    # eve's page is told by its notice poll (as after an eviction), and her question says so too
    notice = wait_for(lambda: told(tab.server_notice(eve)))
    assert "Your document was unloaded" in notice and "load it again" in notice
    answer, _ = ask(tab, eve)
    assert answer.startswith("Your document was unloaded: the worker holding it") and "load it again" in answer
    # fay, on the other replica, is not affected
    assert told(tab.server_notice(fay)) is None and docs.replica_of("fay") == survivor
    assert ask(tab, fay)[1].startswith("pqcache: ")
    # eve loads again: on a live replica, and it answers
    assert load(tab, eve).startswith("Loaded **")
    assert docs.replica_of("eve") is not None
    assert ask(tab, eve)[1].startswith("pqcache: ")


def test_ray_flags_are_checked():
    import app

    args = app.parse_args(["--ray", "auto", "--replicas", "3", "--replica-cpus", "0.5"])
    assert (args.ray, args.replicas, args.replica_cpus) == ("auto", 3, 0.5)
    assert app.parse_args([]).ray is None  # without --ray: one process, as before
    for bad in (["--replicas", "0"], ["--replica-cpus", "0"]):
        with pytest.raises(SystemExit):
            app.parse_args(["--ray", "auto", *bad])


def test_a_cluster_too_small_for_the_replicas_is_said_before_anything_starts(docs):
    import app

    with pytest.raises(SystemExit, match="the Ray cluster has 2 CPUs; 3 replicas x 1 CPUs do not fit"):
        app.connect_ray(app.parse_args(["--ray", "local", "--replicas", "3"]))
