"""Writing events from SQLAlchemy, in the caller's transaction (``pip install
cdc-relay[sqlalchemy]``; the relay itself never imports SQLAlchemy).

with Session(engine) as session, session.begin():
    session.add(order)
    write_event(session, aggregate_type="order", aggregate_id=str(order.id),
                event_type="order.created", payload={"total": "42.00"})

``write_event`` takes a ``Session`` or a ``Connection``; ``write_event_async`` (awaited) an
``AsyncSession`` or an ``AsyncConnection``. The rows and messages are those of
``cdc_relay.outbox.write_event``: the same columns, the same ``outbox_emit()``.
"""

from __future__ import annotations

import uuid

try:
    import sqlalchemy as sa
except ImportError as exc:  # an optional extra
    raise ImportError(
        "cdc_relay.sqlalchemy needs SQLAlchemy 2: pip install 'cdc-relay[sqlalchemy]'"
    ) from exc
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession
from sqlalchemy.orm import Session
from sqlalchemy.sql.elements import quoted_name

from cdc_relay.outbox import JsonValue, table_name


def write_event(
    target: Session | Connection,
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
    transactional logical decoding message with ``prefix`` (``outbox_emit()``), which stores
    nothing. ``payload`` is any value the engine's JSON serializer takes. Returns the event
    id, the consumers' deduplication key.
    """
    event_id = event_id or uuid.uuid4()
    target.execute(
        statement(
            event_id, aggregate_type, aggregate_id, event_type, payload, table, as_message, prefix
        )
    )
    return event_id


async def write_event_async(
    target: AsyncSession | AsyncConnection,
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
    """``write_event`` for an ``AsyncSession`` or ``AsyncConnection``, in the caller's
    transaction; returns the event id."""
    event_id = event_id or uuid.uuid4()
    await target.execute(
        statement(
            event_id, aggregate_type, aggregate_id, event_type, payload, table, as_message, prefix
        )
    )
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
) -> sa.Executable:
    """The statement that writes one event, its values bound with their PostgreSQL types (so
    that any driver sends them as the columns and outbox_emit() take them)."""
    if as_message:
        return sa.select(
            sa.func.outbox_emit(
                sa.cast(aggregate_type, sa.Text),
                sa.cast(aggregate_id, sa.Text),
                sa.cast(event_type, sa.Text),
                sa.cast(sa.bindparam("payload", payload, type_=JSONB), JSONB),
                sa.cast(event_id, sa.Uuid),
                sa.cast(prefix, sa.Text),
            )
        )
    # Read as --table is; quoted as they are: the parts are the names in the catalog.
    *schema, name = (quoted_name(part, quote=True) for part in table_name(table))
    outbox = sa.table(
        name,
        sa.column("id", sa.Uuid),
        sa.column("aggregate_type", sa.Text),
        sa.column("aggregate_id", sa.Text),
        sa.column("event_type", sa.Text),
        sa.column("payload", JSONB),
        schema=schema[-1] if schema else None,  # a database before it must be this one
    )
    return sa.insert(outbox).values(
        id=event_id,
        aggregate_type=aggregate_type,
        aggregate_id=aggregate_id,
        event_type=event_type,
        payload=payload,
    )
