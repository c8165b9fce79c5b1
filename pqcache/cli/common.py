"""What the subcommands' handlers share: the engine settings from their flags, progress on stderr, a plain table."""

from __future__ import annotations

import sys
from dataclasses import fields

from pqcache.engine.config import PQCacheConfig


def config_of(args) -> PQCacheConfig:
    """The engine settings a subcommand has flags for; the others keep PQCacheConfig's defaults."""
    names = [f.name for f in fields(PQCacheConfig)]
    return PQCacheConfig(**{name: getattr(args, name) for name in names if hasattr(args, name)})


def stderr(msg):
    print(msg, file=sys.stderr)


def table(rows: list[dict]) -> str:
    cols = [c for c in rows[0] if not isinstance(rows[0][c], dict)]
    cells = [[str(r[c]) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(cols, widths))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)
