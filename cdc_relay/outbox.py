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

    By default a row of ``table`` (which may be schema-qualified); with ``as_message`` a
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
    query = sql.SQL(QUERIES["insert_event"]).format(table=sql.Identifier(*table.split(".", 1)))
    return query, params
