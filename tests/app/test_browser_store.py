"""The document store in a real browser (Debian's Chromium, Playwright): an app with a store of its own, the sample
loaded and asked about, the page reloaded (a new session, as a user's next visit), the document listed under *Your
documents* from the browser's storage and reopened with no prefill and with its conversation (the earlier turn back
in the chat, the next question a follow-up that sees it); then deleted from the store."""

from tests.app.test_browser import ARGS, CHROMIUM, EXAMPLE, answer_text, answered, ask


def test_a_document_reopens_from_the_store_after_a_page_reload(store_app_url):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        page = browser.new_page(viewport={"width": 1500, "height": 1100})
        try:
            page.goto(store_app_url)
            page.locator("#sample").click()
            page.wait_for_selector("#doc-status >> text=the active document", timeout=240_000)
            assert "Prefill" in page.locator("#doc-status").inner_text()
            ask(page, EXAMPLE["question"])
            first = answer_text(answered(page), EXAMPLE["question"])
            assert EXAMPLE["answer"] in first
            page.reload()  # a new session: the server has no document for it; the browser remembers its list
            page.wait_for_selector("#load")
            assert page.locator("#doc-status").inner_text().startswith("No document loaded")
            page.locator("#your-documents button.label-wrap").click()
            page.locator("#listed input").click()
            option = page.get_by_role("option", name="sample passkey_1k.txt")
            option.wait_for(timeout=30_000)
            option.click()
            page.locator("#reopen").click()
            page.wait_for_selector("#doc-status >> text=Read from the document store", timeout=120_000)
            line = page.locator("#doc-status").inner_text()
            assert "the active document" in line and "(no prefill)" in line and "Prefill" not in line
            status = "#gen-status >> text=Reopened the conversation kept with this document (1 question(s))"
            page.wait_for_selector(status, timeout=120_000)
            assert first in page.locator("#chat").inner_text()  # the visit before's turn, back in the chat
            ask(page, "Repeat that number.")  # a follow-up: it sees that turn
            assert EXAMPLE["answer"] in answer_text(answered(page), "Repeat that number.")
            assert "(turns 1-2;" in page.locator("#gen-status").inner_text()
            page.locator("#listed input").click()
            page.get_by_role("option", name="sample passkey_1k.txt").click()
            page.locator("#forget").click()
            page.wait_for_function(
                "() => !document.querySelector('#listed input').value", timeout=30_000
            )  # the list forgets it; the active document stays
            assert "the active document" in page.locator("#doc-status").inner_text()
        finally:
            page.close()
            browser.close()
