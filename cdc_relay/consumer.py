"""Idempotent consumers: handle each event once, although Kafka may deliver it twice.

The relay delivers at least once: after a crash, the events in flight are sent again. A
consumer that changes a PostgreSQL database records each event id it handles in
``processed_events`` (cdc-relay schema apply consumer) inside the same transaction as its
own changes, so a redelivered event finds its id there and is skipped::

    with psycopg.connect(dsn) as conn:
        for message in kafka_messages:
            handle(conn, message, apply_order, consumer="billing")

    def apply_order(conn, message):
        conn.execute("INSERT INTO invoices ...")   # committed with the event id, or not at all

``handle_async`` and ``first_time_async`` are the same for a psycopg ``AsyncConnection``.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import psycopg
from psycopg import AsyncConnection, Connection

from cdc_relay.queries import QUERIES


class KafkaMessage(Protocol):
    """What ``handle`` needs of a message (confluent_kafka.Message has it)."""

    def headers(self) -> list[tuple[str, bytes]] | None: ...


def event_id(message: KafkaMessage) -> str:
    """The event id a relay put in the ``id`` header, as it is: a UUID's text with the outbox
    of schema outbox, any text with ``--column id=COLUMN``."""
    for key, value in message.headers() or ():
        if key == "id":
            return value.decode()
    raise ValueError("message has no 'id' header: it was not published by cdc-relay")


_NOT_UUID = (
    "event id {event!r} is not a UUID, and processed_events.event_id is of type uuid (made by "
    "an older schema consumer): run ALTER TABLE processed_events ALTER COLUMN event_id TYPE "
    "text"
)


def first_time(conn: Connection[Any], event: uuid.UUID | str, consumer: str) -> bool:
    """Record ``event`` as handled by ``consumer`` in the caller's open transaction.

    True the first time; False when it was handled before (the caller skips it). A
    concurrent handler of the same event waits on the row and then sees False.
    """
    try:
        row = conn.execute(
            QUERIES["claim_event"], {"consumer": consumer, "event_id": str(event)}
        ).fetchone()
    except psycopg.errors.InvalidTextRepresentation:
        raise ValueError(_NOT_UUID.format(event=str(event))) from None
    return row is not None


def handle(
    conn: Connection[Any],
    message: KafkaMessage,
    apply: Callable[[Connection[Any], KafkaMessage], None],
    consumer: str,
) -> bool:
    """Run ``apply`` for ``message`` once per event id, in one transaction with the record
    of it; return whether it ran. An exception in ``apply`` rolls both back."""
    with conn.transaction():
        if not first_time(conn, event_id(message), consumer):
            return False
        apply(conn, message)
    return True


async def first_time_async(
    conn: AsyncConnection[Any], event: uuid.UUID | str, consumer: str
) -> bool:
    """``first_time`` for an ``AsyncConnection``, in the caller's open transaction."""
    try:
        cursor = await conn.execute(
            QUERIES["claim_event"], {"consumer": consumer, "event_id": str(event)}
        )
    except psycopg.errors.InvalidTextRepresentation:
        raise ValueError(_NOT_UUID.format(event=str(event))) from None
    return await cursor.fetchone() is not None


async def handle_async(
    conn: AsyncConnection[Any],
    message: KafkaMessage,
    apply: Callable[[AsyncConnection[Any], KafkaMessage], Awaitable[None]],
    consumer: str,
) -> bool:
    """``handle`` for an ``AsyncConnection``: await ``apply`` for ``message`` once per event
    id, in one transaction with the record of it; return whether it ran."""
    async with conn.transaction():
        if not await first_time_async(conn, event_id(message), consumer):
            return False
        await apply(conn, message)
    return True
