"""What the tabs share: who the user is, messages for the page, where the bundled documents are."""

from __future__ import annotations

import os
import traceback

from pqcache import PQCacheError

ASSETS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets")


def describe(exc: Exception) -> str:
    """The message for the page: ours as written; anything unexpected logged with its traceback on the
    server, and named on the page without one."""
    if isinstance(exc, (PQCacheError, OSError)):
        return str(exc)
    traceback.print_exception(exc)
    return f"unexpected {type(exc).__name__} on the server ({exc}); the details are in the server log"


def sentence(message: str) -> str:
    """An engine message ("your document was unloaded ...") as a sentence for the page."""
    return message[:1].upper() + message[1:] + ("" if message.endswith(".") else ".")


def user_of(request) -> str:
    """The user of a request (a gr.Request): one per browser tab or gradio_client."""
    return getattr(request, "session_hash", None) or "local"


def notices(stats: dict | None) -> str:
    return "".join(f"\n\n**Notice:** {n}" for n in (stats or {}).get("notices", []))
