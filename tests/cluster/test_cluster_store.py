"""A lost node on a real multi-node Ray cluster (ray.cluster_utils.Cluster: a head and a worker node on this
machine, one CPU each, so one replica lands on each) with a document store the replicas share: the users of the
removed node lose no document and no question; their next question is answered after a reopen from the store on the
live replica, with no prefill, and the page says so once; the other node's users are not affected."""

import pytest
import ray
from ray import serve

from pqcache.serving.pool import SessionPool
from tests.cluster.test_cluster import LONG, SHORT, ask, load, model_dir, told, user, wait_for  # noqa: F401  (model_dir: fixture)


@pytest.fixture(scope="module")
def nodes(model_dir, tmp_path_factory):  # noqa: F811
    """Two Ray nodes, a replica on each (each reserves the node's one CPU), one store folder both replicas use."""
    from ray.cluster_utils import Cluster

    from pqcache.cluster import launch

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    worker_node = cluster.add_node(num_cpus=1)
    store = tmp_path_factory.mktemp("store")
    try:
        launch.connect(cluster.address)
        docs = launch.start_workers(
            2, model=str(model_dir), replica_cpus=1, max_bytes=2**28, idle_s=None, concurrency=1, pq_timeout_s=60,
            store_dir=str(store),
        )  # fmt: skip
        yield cluster, worker_node, docs, store
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()


def test_a_removed_node_loses_no_document_and_no_question(nodes):
    from studio import Studio
    from studio.qa import QATab

    cluster, worker_node, docs, store = nodes
    tab = QATab(Studio(None, None, SessionPool(max_bytes=2**20, idle_s=None), documents=docs))
    ann, bob = user("ann"), user("bob")
    assert load(tab, ann, LONG).startswith("Loaded **") and load(tab, bob).startswith("Loaded **")
    assert docs.replica_of("ann") != docs.replica_of("bob")
    before = {name: ask(tab, who)[0].split("\n")[0] for name, who in (("ann", ann), ("bob", bob))}
    assert len(list(store.iterdir())) == 2  # each replica saved its user's document in the one store
    pids = {r.index: r.call("hello")["node"] for r in docs.replicas}
    on_worker = [i for i, node in pids.items() if node == worker_node.node_id]
    assert len(on_worker) == 1, pids  # one replica on each node
    lost, kept = ("ann", "bob") if docs.replica_of("ann") == on_worker[0] else ("bob", "ann")
    cluster.remove_node(worker_node)  # the node goes, with its replica and the document it held
    who_lost, who_kept = user(lost), user(kept)
    answer, status = ask(tab, who_lost)  # the next question: reopened on the live replica, then answered
    assert status.startswith("pqcache: ") and answer.split("\n")[0] == before[lost]
    assert docs.replica_of(lost) not in (None, on_worker[0])
    notice = wait_for(lambda: told(tab.pool_notice(who_lost)))
    assert "stopped; it was reopened on replica" in notice and "read from the document store, no prefill" in notice
    assert "Read from the document store in **" in notice  # then the status line of the reopened document
    assert told(tab.pool_notice(who_lost)) is None  # said once
    assert ask(tab, who_kept)[0].split("\n")[0] == before[kept] and told(tab.pool_notice(who_kept)) is None
    for name in ("ann", "bob"):
        tab.end_user(user(name))
