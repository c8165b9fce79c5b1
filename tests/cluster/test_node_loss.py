"""A lost node on a real multi-node Ray cluster (ray.cluster_utils.Cluster: a head and a worker node on this
machine, one CPU each, so one replica lands on each) with a document store the replicas share: the users of the
removed node lose no document, no turn and no question; their next follow-up is answered after a reopen of the
document and its conversation from the store on the live replica, with no prefill, token for token as it would have
been, and the page says so once; the other node's users are not affected."""

import pytest
import ray
from ray import serve

from pqcache.serving.pool import SessionPool
from pqcache.serving.server_settings import ServerSettings
from pqcache.serving.settings import LoadSettings
from tests.cluster.conftest import end_ray
from tests.cluster.test_cluster import LONG, SHORT, ask, load, told, user, wait_for


@pytest.fixture(scope="module")
def nodes(model_dir, tmp_path_factory):
    """Two Ray nodes, a replica on each (each reserves the node's one CPU), one store folder both replicas use."""
    from ray.cluster_utils import Cluster

    from pqcache.cluster import launch

    end_ray()  # the tier's single-node instance, if an earlier module started it
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    worker_node = cluster.add_node(num_cpus=1)
    store = tmp_path_factory.mktemp("store")
    try:
        launch.connect(cluster.address)
        server = ServerSettings(
            model=str(model_dir),
            max_cache_bytes=2**28,
            idle_s=None,
            concurrency=1,
            pq_timeout_s=60,
            store_dir=str(store),
        )
        docs = launch.start_workers(2, server, replica_cpus=1)
        yield cluster, worker_node, docs, store
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()


def engine_turns(folder, text, turns=2) -> list[str]:
    """The engine's own conversation on the replica's model (loaded as the replica loads it): the page's question
    asked `turns` times, each answer's text as the chat shows it."""
    from pqcache import load_model
    from pqcache.serving.conversation import Conversation
    from pqcache.serving.session import DocumentSession
    from studio.answering import literal

    model, tok = load_model(str(folder), device="cpu")
    session = DocumentSession(model, tok, LoadSettings().to_config(pq_timeout_s=60), method="pqcache")
    session.load(text)
    talk = Conversation(session, "pqcache")
    try:
        return [literal(talk.ask("what is w3?", max_new_tokens=8).text) for _ in range(turns)]
    finally:
        talk.close()
        session.close()


def test_a_removed_node_loses_no_document_and_no_turn(nodes, model_dir):
    """Each user asks once; the worker node goes; the lost user's follow-up is answered token for token as it would
    have been without the loss (the document and its conversation reopened from the store), said once."""
    from studio import Studio
    from studio.qa import QATab

    cluster, worker_node, docs, store = nodes
    tab = QATab(Studio(None, None, SessionPool(max_bytes=2**20, idle_s=None), documents=docs))
    ann, bob = user("ann"), user("bob")
    assert load(tab, ann, LONG).startswith("Loaded **") and load(tab, bob).startswith("Loaded **")
    assert docs.replica_of("ann") != docs.replica_of("bob")
    expected = {"ann": engine_turns(model_dir, LONG), "bob": engine_turns(model_dir, SHORT)}
    for name, who in (("ann", ann), ("bob", bob)):
        assert ask(tab, who)[0].split("\n\n*")[0] == expected[name][0]  # turn 1, on each node
    assert len([p for p in store.iterdir() if not p.name.startswith(".")]) == 2  # each replica saved its document
    pids = {r.index: r.call("hello")["node"] for r in docs.replicas}
    on_worker = [i for i, node in pids.items() if node == worker_node.node_id]
    assert len(on_worker) == 1, pids  # one replica on each node
    lost, kept = ("ann", "bob") if docs.replica_of("ann") == on_worker[0] else ("bob", "ann")
    cluster.remove_node(worker_node)  # the node goes, with its replica and the document and conversation it held
    who_lost, who_kept = user(lost), user(kept)
    answer, status = ask(tab, who_lost)  # the follow-up: reopened on the live replica, then answered
    assert status.startswith("pqcache: ") and answer.split("\n\n*")[0] == expected[lost][1]
    assert "conversation: " in status and "(turns 1-2;" in status  # 0 turns lost
    assert docs.replica_of(lost) not in (None, on_worker[0])
    notice = wait_for(lambda: told(tab.server_notice(who_lost)))
    assert "stopped; it was reopened on replica" in notice and "read from the document store, no prefill" in notice
    assert "your conversation came back with it (1 question(s))" in notice
    assert "Read from the document store in **" in notice  # then the status line of the reopened document
    assert told(tab.server_notice(who_lost)) is None  # said once
    assert ask(tab, who_kept)[0].split("\n\n*")[0] == expected[kept][1] and told(tab.server_notice(who_kept)) is None
    for name in ("ann", "bob"):
        tab.end_user(user(name))
