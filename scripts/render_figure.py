"""Render a viz figure to PNG with Debian's chromium (no kaleido): python scripts/render_figure.py recall|fidelity
ROWS.json OUT.png. The rows are the `--json` output of the command that made them (`eval fidelity --out`'s too)."""

import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from viz import studies  # noqa: E402


def main():
    kind, rows_path, out = sys.argv[1], sys.argv[2], sys.argv[3]
    rows = json.loads(Path(rows_path).read_text())["rows"]
    fig = {"recall": studies.recall_grid, "fidelity": studies.fidelity_curve}[kind](rows)
    fig.update_layout(width=900, height=450)
    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory() as tmp:
        html = Path(tmp) / "figure.html"
        fig.write_html(html, include_plotlyjs=True, full_html=True)
        with sync_playwright() as p:
            browser = p.chromium.launch(
                executable_path="/usr/bin/chromium",
                args=["--no-sandbox", "--disable-gpu", "--disable-background-networking"],
            )
            page = browser.new_page(viewport={"width": 920, "height": 470})
            page.goto(html.as_uri())
            page.wait_for_selector(".main-svg")
            page.screenshot(path=out)
            browser.close()
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
