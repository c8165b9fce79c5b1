"""The app tier: `python app.py` started as a user starts it, shared by this folder's tests and stopped after them
(an idle server still takes a share of the two cores from the tiers that run next)."""

import pytest


def launch_app(*flags):
    """`python app.py` launched as a user launches it, on a free localhost port; yields its URL."""
    from pqcache.bench.app_process import running_app

    store = [] if "--store" in flags else ["--no-store"]  # the pages' tests read each document from its text
    with running_app(*store, *flags) as (url, _):
        yield url


@pytest.fixture(scope="package")
def app_url():
    yield from launch_app()


@pytest.fixture(scope="package")
def small_app_url():
    """An app sized to make limits reachable: one request at a time, 18.4 MiB of caches (one ~1K-token
    document of the bundled model reserves about 12 MiB and holds 10.7: float16 keys, values and windows), documents
    up to 1200 tokens, 8 s K-Means timeout."""
    yield from launch_app(
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
