"""End to end in a real browser: Debian's Chromium driven by Playwright (no browser download).
Opens the page, uploads a document, asks, sees the streamed answer and every panel render, runs the
teaching tab; screenshots go to out/screenshots/."""
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHOTS = Path(os.environ.get("PQCACHE_SCREENSHOTS", ROOT / "out" / "screenshots"))
CHROMIUM = "/usr/bin/chromium"
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
        "--disable-component-update", "--disable-sync"]
PANELS = ["panel-power", "panel-recall", "panel-hits", "panel-memory", "panel-timeline"]


@pytest.fixture(scope="module")
def page(app_url):
    from playwright.sync_api import sync_playwright

    assert Path(CHROMIUM).exists(), "install Debian's chromium (apt-get install chromium); see .ci/run"
    SHOTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        page = browser.new_page(viewport={"width": 1500, "height": 1100})
        page.goto(app_url)
        yield page
        browser.close()


def test_upload_ask_stream_and_panels(page):
    page.wait_for_selector("text=Load document")
    page.set_input_files("input[type=file]", str(ROOT / "assets" / "passkey_1k.txt"))
    page.get_by_role("button", name="Load document").click()
    page.wait_for_selector("#doc-status >> text=PQ on layers", timeout=180_000)
    page.locator("#question textarea").fill("What is the pass key? The pass key is")
    page.locator("#ask").click()
    page.wait_for_function(  # streaming: the answer grows before generation ends
        "() => document.querySelector('#chat') && document.querySelector('#chat').innerText.includes('684')",
        timeout=120_000)
    page.wait_for_selector("#gen-status >> text=tokens/s", timeout=180_000)
    assert "68422" in page.locator("#chat").inner_text()
    for panel in PANELS:
        plot = page.locator(f"#{panel} .js-plotly-plot")
        assert plot.count() == 1, panel
        assert plot.locator(".main-svg").count() >= 1, panel
    assert page.locator("#panel-power").get_by_text("no sampled step yet").count() == 0
    page.screenshot(path=str(SHOTS / "app.png"), full_page=True)


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
