"""The benchmark's named queries, loaded from ``bench/queries.sql``."""

from __future__ import annotations

import re
from pathlib import Path

_HEADER = re.compile(r"^-- (\w+) --$", re.MULTILINE)


def _load() -> dict[str, str]:
    parts = _HEADER.split((Path(__file__).parent / "queries.sql").read_text())
    queries = {}
    for name, body in zip(parts[1::2], parts[2::2], strict=True):
        lines = [line for line in body.strip().splitlines() if not line.startswith("--")]
        queries[name] = "\n".join(lines).strip()
    return queries


QUERIES = _load()
