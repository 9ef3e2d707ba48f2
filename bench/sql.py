"""The benchmark's named queries, loaded from ``bench/queries.sql`` (the relay's format)."""

from __future__ import annotations

from pathlib import Path

from cdc_relay.queries import parse

QUERIES = parse((Path(__file__).parent / "queries.sql").read_text())
