"""What `bench app` measured on this machine, kept for the page: its last rates, written by the benchmark and
quoted by the app's how-to line (a constant would be wrong on the next machine)."""

from __future__ import annotations

from pathlib import Path

from pqcache.serving.home import pqcache_home


def figures_path() -> Path:
    """Where `bench app` leaves its last figures for this machine (the app's how-to line quotes them)."""
    return pqcache_home() / "bench_app.json"


def save_figures(rows: list[dict]) -> None:
    """The session rows (the app's objects) of the last run, with the CPU they ran on."""
    import json
    import platform

    kept = [r for r in rows if r["runner"] == "session" and "load_tok_s" in r]
    if kept:
        path = figures_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"machine": platform.processor() or platform.machine(), "rows": kept}))
