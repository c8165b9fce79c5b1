"""What the tabs share: who the user is, messages for the page, the live panels (figures from viz/)."""

from __future__ import annotations

import traceback

from pqcache import Instrumentation, PQCacheError
from pqcache.serving.session import DocumentSession
from viz import figures


def describe(exc: Exception) -> str:
    """The message for the page: ours as written; anything unexpected logged with its traceback on the
    server, and named on the page without one."""
    if isinstance(exc, (PQCacheError, OSError)):
        return str(exc)
    traceback.print_exception(exc)
    return f"unexpected {type(exc).__name__} on the server ({exc}); the details are in the server log"


def sentence(message: str) -> str:
    """An engine message ("your document was unloaded ...") as a sentence for the page."""
    return message[:1].upper() + message[1:] + "."


def user_of(request) -> str:
    """The user of a request (a gr.Request): one per browser tab or gradio_client."""
    return getattr(request, "session_hash", None) or "local"


def notices(stats: dict | None) -> str:
    return "".join(f"\n\n**Notice:** {n}" for n in (stats or {}).get("notices", []))


def merged_data(session: DocumentSession | None, obs: Instrumentation | None) -> dict:
    """The prefill's recorded data followed by the question's, on one clock."""
    data = {"lanes": [], "events": [], "attention": [], "recall": [], "blocks": [], "selected": []}
    if session is not None and session.prefill_obs is not None:
        data.update({k: list(v) if isinstance(v, list) else v for k, v in session.prefill_obs.to_dict().items()})
    if obs is not None:
        d = obs.to_dict()
        shift = obs.t0 - session.prefill_obs.t0 if session is not None and session.prefill_obs else 0.0
        data["events"] = data["events"] + [
            {**e, "start": e["start"] + shift, "end": e["end"] + shift} for e in d["events"]
        ]
        for key in ("attention", "recall", "blocks", "selected"):
            data[key] = d[key]
    return data


def panels(session, obs, layer):
    """The five live panels: power law (of `layer`), recall, hit rate, timeline, memory."""
    data = merged_data(session, obs)
    stats = getattr(session, "last_stats", None) or (session.cache.stats() if session and session.cache else None)
    layer = int(layer) if layer not in (None, "") else None
    return (
        figures.power_law(data, layer),
        figures.recall(data),
        figures.hit_rate(data),
        figures.timeline(data),
        figures.memory(stats),
    )


def pq_layer_choices(session) -> list[str]:
    if session is None or session.cache is None:
        return []
    return [str(layer.layer_idx) for layer in session.cache.pq_layers]
