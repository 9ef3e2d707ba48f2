"""Named SQL queries, loaded from ``cdc_relay/sql/queries.sql``.

Each query starts with a ``-- name --`` line and a line of description. Queries that name
database objects hold ``{placeholders}`` filled with :func:`psycopg.sql.Identifier`.
"""

from __future__ import annotations

import re
from importlib.resources import files

_HEADER = re.compile(r"^-- (\w+) --$", re.MULTILINE)


def parse(text: str) -> dict[str, str]:
    """Named queries from the text of a ``.sql`` file laid out as above."""
    parts = _HEADER.split(text)
    queries = {}
    for name, body in zip(parts[1::2], parts[2::2], strict=True):
        lines = [line for line in body.strip().splitlines() if not line.startswith("--")]
        queries[name] = "\n".join(lines).strip()
    return queries


QUERIES = parse(files("cdc_relay").joinpath("sql/queries.sql").read_text())
