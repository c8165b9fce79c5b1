"""End to end in a real browser: Debian's Chromium driven by Playwright (no browser download).
Opens the page, uploads a document, asks, sees the streamed answer and every panel render, runs the
teaching tab; screenshots go to out/screenshots/."""

import os
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHOTS = Path(os.environ.get("PQCACHE_SCREENSHOTS", ROOT / "out" / "screenshots"))
CHROMIUM = "/usr/bin/chromium"
ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
PANELS = ["panel-power", "panel-recall", "panel-hits", "panel-memory", "panel-timeline"]


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    assert Path(CHROMIUM).exists(), "install Debian's chromium (apt-get install chromium); see .ci/run"
    SHOTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def page(browser, app_url):
    page = browser.new_page(viewport={"width": 1500, "height": 1100})
    page.goto(app_url)
    yield page
    page.close()


def test_upload_ask_stream_and_panels(page):
    page.wait_for_selector("text=Load document")
    page.set_input_files("input[type=file]", str(ROOT / "assets" / "passkey_1k.txt"))
    page.get_by_role("button", name="Load document").click()
    page.wait_for_selector("#doc-status >> text=PQ on layers", timeout=180_000)
    page.locator("#question textarea").fill("What is the pass key? The pass key is")
    page.locator("#ask").click()
    page.wait_for_function(  # streaming: the answer grows before generation ends
        "() => document.querySelector('#chat') && document.querySelector('#chat').innerText.includes('684')",
        timeout=120_000,
    )
    page.wait_for_selector("#gen-status >> text=tokens/s", timeout=180_000)
    assert "68422" in page.locator("#chat").inner_text()
    for panel in PANELS:
        plot = page.locator(f"#{panel} .js-plotly-plot")
        assert plot.count() == 1, panel
        assert plot.locator(".main-svg").count() >= 1, panel
    assert page.locator("#panel-power").get_by_text("no sampled step yet").count() == 0
    page.screenshot(path=str(SHOTS / "app.png"), full_page=True)


def test_bad_uploads_show_a_message_and_the_document_stays(page, tmp_path):
    """After the passkey document is loaded: a binary file and an oversized file, then a question."""
    (tmp_path / "photo.txt").write_bytes(bytes(range(256)) * 10)
    (tmp_path / "big.txt").write_bytes(b"word " * (2 * 2**20 + 1))  # over the 10 MiB limit
    page.get_by_role("button", name="Clear").first.click()
    page.set_input_files("input[type=file]", str(tmp_path / "photo.txt"))
    page.locator("#load").click()
    page.wait_for_selector("#doc-status >> text=photo.txt looks like a binary file", timeout=60_000)
    page.get_by_role("button", name="Clear").first.click()
    page.set_input_files("input[type=file]", str(tmp_path / "big.txt"))
    page.wait_for_selector("text=exceed the maximum allowed size of 10.0 Mb", timeout=30_000)
    page.locator("#question textarea").fill("What is the pass key? The pass key is")
    page.locator("#ask").click()
    page.wait_for_function(  # the status line still shows the first answer's tokens/s: wait for this answer
        "() => document.querySelector('#chat').innerText.split('68422').length > 2", timeout=180_000
    )
    page.wait_for_selector("#gen-status >> text=tokens/s", timeout=180_000)
    assert "Traceback" not in page.locator("body").inner_text()
    assert page.locator("#chat").inner_text().count("68422") >= 2  # the first answer and this one


def test_teaching_tab_side_by_side(page):
    page.get_by_role("tab", name="Teaching").click()
    for name in ("snapkv", "oracle"):  # keep two methods: pqcache and streaming
        page.get_by_label(name, exact=True).uncheck()
    page.get_by_role("button", name="Run side by side").click()
    page.wait_for_selector("text=Prefilled", timeout=300_000)
    table = page.locator("#teaching-table").inner_text()
    assert "pqcache" in table and "streaming" in table
    assert page.locator("#teaching-strip .js-plotly-plot").count() == 1
    page.screenshot(path=str(SHOTS / "teaching.png"), full_page=True)


def test_two_users_queue_eviction_notice_and_closed_tab(browser, small_app_url):
    """Two browser sessions on an app with one model slot and room for one document's cache."""
    from gradio_client import Client

    admin = Client(small_app_url, verbose=False)
    question = "What is the pass key? The pass key is"
    ann, bob = (browser.new_context(viewport={"width": 1400, "height": 1000}).new_page() for _ in range(2))
    for page in (ann, bob):
        page.goto(small_app_url)
        page.wait_for_selector("text=Load document")
    ann.set_input_files("input[type=file]", str(ROOT / "assets" / "passkey_1k.txt"))
    ann.locator("#load").click()
    ann.wait_for_selector("#doc-status >> text=PQ on layers", timeout=180_000)
    ann.locator("#question textarea").fill(question)
    ann.locator("#ask").click()
    ann.wait_for_function("() => document.querySelector('#chat').innerText.includes('684')", timeout=120_000)
    bob.locator("#question textarea").fill(question)
    bob.locator("#ask").click()  # the only model slot is ann's: bob sees his place in the queue
    bob.wait_for_function("() => /queue: 1\\/\\d+/.test(document.body.innerText)", timeout=30_000)
    bob.screenshot(path=str(SHOTS / "queue.png"))
    ann.locator("#stop").click()
    bob.wait_for_selector("#chat >> text=Load a document first", timeout=120_000)
    bob.set_input_files("input[type=file]", str(ROOT / "assets" / "passkey_1k.txt"))
    bob.locator("#load").click()  # ann is idle now: her cache makes room, and her page says so
    bob.wait_for_selector("#doc-status >> text=PQ on layers", timeout=180_000)
    ann.wait_for_selector("#doc-status >> text=unloaded to make room for another user", timeout=30_000)
    assert admin.predict(api_name="/server_status")["users"] == 1
    bob.context.close()  # bob closes his tab: the server frees his cache
    deadline = time.time() + 60
    while admin.predict(api_name="/server_status")["cache_bytes"] > 0:
        assert time.time() < deadline, "the closed tab's cache was not freed"
        time.sleep(0.5)
    ann.context.close()
