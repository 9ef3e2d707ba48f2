"""Writing events: one INSERT into the outbox inside the caller's own transaction.

with psycopg.connect(dsn) as conn, conn.transaction():
    conn.execute("INSERT INTO orders ...")
    write_event(conn, aggregate_type="order", aggregate_id=order_id,
                event_type="order.created", payload={"total": 42})

``write_event_async`` is the same for an ``AsyncConnection`` or ``AsyncCursor`` (awaited);
``cdc_relay.sqlalchemy`` has both for SQLAlchemy sessions and connections.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from psycopg import AsyncConnection, AsyncCursor, Connection, Cursor, sql
from psycopg.types.json import Jsonb

from cdc_relay.queries import QUERIES

JsonValue = Mapping[str, Any] | Sequence[Any] | str | int | float | bool | None


def write_event(
    target: Connection[Any] | Cursor[Any],
    *,
    aggregate_type: str,
    aggregate_id: str | None,
    event_type: str,
    payload: JsonValue,
    event_id: uuid.UUID | None = None,
    table: str = "outbox_events",
    as_message: bool = False,
    prefix: str = "outbox",
) -> uuid.UUID:
    """Write one event; it reaches Kafka if, and only if, the caller's transaction commits.

    By default a row of ``table`` (which may be schema-qualified, and is read as ``--table``
    is: ``table_name``); with ``as_message`` a
    transactional logical decoding message with ``prefix`` (``outbox_emit()`` of
    cdc-relay schema outbox), which stores nothing. ``payload`` is any JSON-serialisable value.
    Returns the event id, the consumers' deduplication key.
    """
    event_id = event_id or uuid.uuid4()
    query, params = statement(
        event_id, aggregate_type, aggregate_id, event_type, payload, table, as_message, prefix
    )
    target.execute(query, params)
    return event_id


async def write_event_async(
    target: AsyncConnection[Any] | AsyncCursor[Any],
    *,
    aggregate_type: str,
    aggregate_id: str | None,
    event_type: str,
    payload: JsonValue,
    event_id: uuid.UUID | None = None,
    table: str = "outbox_events",
    as_message: bool = False,
    prefix: str = "outbox",
) -> uuid.UUID:
    """``write_event`` for psycopg's ``AsyncConnection`` and ``AsyncCursor``, in the caller's
    transaction; returns the event id."""
    event_id = event_id or uuid.uuid4()
    query, params = statement(
        event_id, aggregate_type, aggregate_id, event_type, payload, table, as_message, prefix
    )
    await target.execute(query, params)
    return event_id


def statement(
    event_id: uuid.UUID,
    aggregate_type: str,
    aggregate_id: str | None,
    event_type: str,
    payload: JsonValue,
    table: str,
    as_message: bool,
    prefix: str,
) -> tuple[sql.SQL | sql.Composed, dict[str, Any]]:
    """The query that writes one event, and its parameters."""
    params = {
        "id": event_id,
        "aggregate_type": aggregate_type,
        "aggregate_id": aggregate_id,
        "event_type": event_type,
        "payload": Jsonb(payload),
        "prefix": prefix,
    }
    if as_message:
        return sql.SQL(QUERIES["emit_event"]), params
    query = sql.SQL(QUERIES["insert_event"]).format(table=sql.Identifier(*table_name(table)))
    return query, params


_NAME_BYTES = 63  # PostgreSQL's NAMEDATALEN - 1: longer names are cut to it


def table_name(name: str) -> tuple[str, ...]:
    """The parts of a (schema-qualified) table name as PostgreSQL reads a name given as text,
    as ``--table`` is (to_regclass): separated by dots, blanks around each part ignored, a
    part in double quotes kept as it is (``""`` a quote), any other folded to lower case;
    each cut to 63 bytes. So a helper writes into the table the relays read. ValueError for
    a name PostgreSQL would refuse."""
    parts: list[str] = []
    i, end = 0, len(name)
    while True:
        while i < end and name[i].isspace():
            i += 1
        if i < end and name[i] == '"':
            part, i = _quoted(name, i + 1)
        else:
            start = i
            while i < end and name[i] != "." and not name[i].isspace():
                i += 1
            part = "".join(c.lower() if "A" <= c <= "Z" else c for c in name[start:i])
        if not part:
            raise ValueError(f"{name!r} is not a table name: an empty part")
        parts.append(part.encode()[:_NAME_BYTES].decode(errors="ignore"))
        while i < end and name[i].isspace():
            i += 1
        if i == end:
            return tuple(parts)
        if name[i] != ".":
            raise ValueError(f"{name!r} is not a table name: {name[i]!r} after a part")
        i += 1


def _quoted(name: str, i: int) -> tuple[str, int]:
    """A quoted part from after its opening quote; the part and where it ends."""
    part = []
    while True:
        close = name.find('"', i)
        if close < 0:
            raise ValueError(f"{name!r} is not a table name: a quote is not closed")
        part.append(name[i:close])
        if name[close + 1 : close + 2] != '"':
            return '"'.join(part), close + 1
        i = close + 2
