"""Plain (non-replication) connections to the server, the row of a named query through one,
and what a relay reads of the server first: its encoding, its timeline and a slot's position
there."""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg.rows import dict_row

from cdc_relay.errors import PreflightError
from cdc_relay.lsn import Lsn
from cdc_relay.lsn import parse as parse_lsn
from cdc_relay.queries import QUERIES


def check_encoding(server: dict[str, Any]) -> None:
    """The relay reads text as UTF-8: another database encoding would change bytes on the way."""
    if server["encoding"] != "UTF8":
        raise PreflightError(
            f"database {server['database']} is encoded in {server['encoding']}; cdc-relay "
            "relays UTF8 databases only, so that events reach Kafka with the bytes stored: "
            "move the outbox to a database created WITH ENCODING 'UTF8'"
        )


def connect(dsn: str) -> psycopg.Connection[dict[str, Any]]:
    """A plain (non-replication) connection, with a remedy when it fails."""
    try:
        return psycopg.connect(dsn, autocommit=True, row_factory=dict_row)
    except psycopg.OperationalError as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else "no message"
        raise PreflightError(f"cannot connect to PostgreSQL: {first_line}; check --dsn") from None


def reconnecting(dsn: str) -> psycopg.Connection[dict[str, Any]]:
    """A plain connection for a relay that holds (or held) its slot: not through ``connect``,
    so that a server refusing it now (a restart, a promotion) raises the OperationalError a
    reconnecting relay retries on, not a start-up's PreflightError."""
    return psycopg.connect(dsn, autocommit=True, row_factory=dict_row)


def one_row(conn: psycopg.Connection[dict[str, Any]], name: str, **params: Any) -> dict[str, Any]:
    """The row of the query ``name`` of queries.sql; {} when it returns none."""
    row = conn.execute(QUERIES[name], params).fetchone()
    return row or {}


def timeline_of(dsn: str, slot: str) -> tuple[int, Lsn | None]:
    """The server's timeline (0 on a standby) and ``slot``'s confirmed position there (None
    when the server has no such slot): a relay that reconnected may be on another server."""
    with reconnecting(dsn) as conn:
        row = conn.execute(QUERIES["timeline"]).fetchone() or {}
        found = conn.execute(QUERIES["slot"], {"slot": slot}).fetchone()
    confirmed = None if found is None else parse_lsn(str(found["confirmed_flush_lsn"]))
    return int(row.get("timeline") or 0), confirmed
