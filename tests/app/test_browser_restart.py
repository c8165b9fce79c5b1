"""A browser whose document was loaded before its server restarted (Debian's Chromium, Playwright; the app on a
tiny random chat model, started, stopped and started again on the same port): the page says that the server
restarted and the document is gone from its memory, instead of a bare "No document loaded"; said once."""

from pqcache.bench.app_process import free_port, running_app
from tests.app.test_browser import ARGS, CHROMIUM, opened
from tests.tiny import SERVED, tiny_chat_model

KEY = "pqcache-server"  # the browser's localStorage key for the start of the server that holds its document
RESTARTED = "The server restarted since your document was loaded"


def test_a_page_open_across_a_restart_is_told_its_document_is_gone(tmp_path):
    from playwright.sync_api import sync_playwright

    model, tok = tiny_chat_model(**SERVED)
    model.save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    flags, port = ("--model", str(tmp_path / "model"), "--no-store"), free_port()
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        page = browser.new_page(viewport={"width": 1500, "height": 1100})
        try:
            with running_app(*flags, port=port) as (url, _):
                page.goto(url)
                page.locator("#pasted textarea").fill("w1 w2 w3 w4 " * 40)
                page.locator("#load").click()
                page.wait_for_selector("#doc-status >> text=the active document", timeout=120_000)
                page.wait_for_function(f"() => localStorage.getItem('{KEY}')")  # the browser keeps the start
                kept = page.evaluate(f"() => localStorage.getItem('{KEY}')")
                opened(page)  # a new page on the same server: nothing to say
                assert RESTARTED not in page.locator("#doc-status").inner_text()
            with running_app(*flags, port=port):  # the same address, a new server: nothing of the page's is there
                page.goto(url)  # the open page reconnects as a new one; a later visit is the same
                page.wait_for_selector(f"#doc-status >> text={RESTARTED}", timeout=60_000)
                assert "load it again" in page.locator("#doc-status").inner_text()
                page.wait_for_function(f"kept => localStorage.getItem('{KEY}') !== kept", arg=kept)  # forgotten
                opened(page)
                assert page.locator("#doc-status").inner_text().startswith("No document loaded")  # said once
        finally:
            browser.close()
