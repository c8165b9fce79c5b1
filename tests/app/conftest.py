"""The app tier: `python app.py` started as a user starts it, shared by this folder's tests and stopped after them
(an idle server still takes a share of the two cores from the tiers that run next).

The servers the collected tests ask for are started together, at the first one's request: a start is mostly each
process's own imports and model load, so three side by side on two cores take about 31 s where one after another
take 48 s (measured on this project's 2-core Xeon)."""

import contextlib
from concurrent.futures import ThreadPoolExecutor

import pytest

from pqcache.bench.app_process import running_app

# an app sized to make limits reachable: one request at a time, 18.4 MiB of caches (one ~1K-token document of the
# bundled model reserves about 12 MiB and holds 10.7: float16 keys, values and windows), documents up to 1200
# tokens, 8 s K-Means timeout
SMALL = (
    "--concurrency",
    "1",
    "--max-cache-gib",
    "0.018",
    "--max-document-tokens",
    "1200",
    "--idle-minutes",
    "10",
    "--pq-timeout",
    "8",
)


def launch_app(*flags):
    """`python app.py` launched as a user launches it, on a free localhost port; yields its URL."""
    store = [] if "--store" in flags else ["--no-store"]  # the pages' tests read each document from its text
    with running_app(*store, *flags) as (url, _):
        yield url


@pytest.fixture(scope="package")
def _servers(request, tmp_path_factory):
    """{fixture name: URL} of the app servers this run's tests use, started side by side."""
    wanted = {name for item in request.session.items for name in item.fixturenames}
    flags = {"app_url": (), "small_app_url": SMALL, "store_app_url": ("--store", str(tmp_path_factory.mktemp("store")))}
    flags = {name: f for name, f in flags.items() if name in wanted}
    with contextlib.ExitStack() as running:
        servers = {name: launch_app(*f) for name, f in flags.items()}
        for server in servers.values():
            running.callback(server.close)  # each stops its app (at the end, or when another failed to start)
        with ThreadPoolExecutor(max(1, len(servers))) as pool:
            urls = dict(zip(servers, pool.map(next, servers.values())))
        yield urls


@pytest.fixture(scope="package")
def app_url(_servers):
    return _servers["app_url"]


@pytest.fixture(scope="package")
def small_app_url(_servers):
    return _servers["small_app_url"]


@pytest.fixture(scope="package")
def store_app_url(_servers):
    """An app with a document store of its own."""
    return _servers["store_app_url"]
