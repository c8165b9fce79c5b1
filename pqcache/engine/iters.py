"""K-Means iteration count: fixed, or "auto" from the adaptive rule of the paper.

T_max = (c2 s^2 + b2 s + a2 - a1) / (b1 s): the most iterations whose clustering time (a1 + b1 s T)
still hides behind the prefill compute time (a2 + b2 s + c2 s^2). The fit comes from
`python -m pqcache calibrate`; without one, DEFAULT_ITERS is used.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

ITERS_RANGE = (3, 300)  # the official code's clip
DEFAULT_ITERS = 20


def calibration_path() -> Path:
    return Path(os.environ.get("PQCACHE_HOME", Path.home() / ".cache" / "pqcache")) / "calibration.json"


def load_fit() -> dict | None:
    path = calibration_path()
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def t_max(s: int, fit: dict) -> int:
    a1, b1 = fit["cluster"]["a1"], fit["cluster"]["b1"]
    a2, b2, c2 = fit["prefill"]["a2"], fit["prefill"]["b2"], fit["prefill"]["c2"]
    t = (c2 * s * s + b2 * s + a2 - a1) / max(b1 * s, 1e-12)
    lo, hi = ITERS_RANGE
    return int(min(max(t, lo), hi))


def kmeans_iters_for(setting, s: int, fit: dict | None = None) -> int:
    """Iterations for s tokens: the fixed setting, or "auto" from a calibration fit (a cache reads
    the file once and passes it as `fit`; without one, DEFAULT_ITERS)."""
    if setting != "auto":
        return int(setting)
    return t_max(s, fit) if fit else DEFAULT_ITERS
