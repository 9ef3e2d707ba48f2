"""The writer helpers where Python services are: psycopg (a connection or a cursor, sync or
async) and SQLAlchemy (Session, Connection, AsyncSession, AsyncConnection). Against a real
PostgreSQL, a real ``stream`` relay and a real Kafka: an event reaches Kafka if, and only if,
the transaction that wrote it commits, as a row or as a message (outbox_emit)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa
from psycopg.conninfo import conninfo_to_dict
from relaytools import RelayProcess, consume, relay_env, setup_slot, writers_only
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import Session

from cdc_relay import outbox, schema
from cdc_relay import sqlalchemy as alchemy
from cdc_relay.consumer import first_time_async, handle_async

pytestmark = pytest.mark.integration


class Boom(Exception):
    """Raised inside a transaction block."""


class Writer:
    """One way of writing events in transactions; every method is awaited, so that one set
    of scenarios runs against sync and async APIs alike."""

    async def close(self) -> None:
        raise NotImplementedError

    def transaction(self) -> AbstractAsyncContextManager[None]:
        """A block that commits at its end and rolls back on an exception."""
        raise NotImplementedError

    def savepoint(self) -> AbstractAsyncContextManager[None]:
        """A block inside a transaction that rolls back to its start on an exception."""
        raise NotImplementedError

    async def write(self, **event: Any) -> uuid.UUID:
        """One event, in the transaction open now (one begins if none is)."""
        raise NotImplementedError

    async def rollback(self) -> None:
        raise NotImplementedError


class Psycopg(Writer):
    def __init__(self, dsn: str, cursor: bool) -> None:
        self.conn = psycopg.connect(dsn)
        self.target: Any = self.conn.cursor() if cursor else self.conn

    async def close(self) -> None:
        self.conn.close()

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[None]:
        with self.conn.transaction():  # nested: a savepoint
            yield

    savepoint = transaction

    async def write(self, **event: Any) -> uuid.UUID:
        return outbox.write_event(self.target, **event)

    async def rollback(self) -> None:
        self.conn.rollback()


class PsycopgAsync(Writer):
    def __init__(self, conn: psycopg.AsyncConnection[Any], cursor: bool) -> None:
        self.conn = conn
        self.target: Any = conn.cursor() if cursor else conn

    async def close(self) -> None:
        await self.conn.close()

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[None]:
        async with self.conn.transaction():
            yield

    savepoint = transaction

    async def write(self, **event: Any) -> uuid.UUID:
        return await outbox.write_event_async(self.target, **event)

    async def rollback(self) -> None:
        await self.conn.rollback()


def engine_url(dsn: str) -> sa.URL:
    """The SQLAlchemy URL of a libpq DSN, through psycopg (sync and async engines alike)."""
    params = conninfo_to_dict(dsn)
    return sa.URL.create(
        "postgresql+psycopg",
        username=params.pop("user", None),
        password=params.pop("password", None),
        host=params.pop("host", None),
        port=int(params.pop("port")) if "port" in params else None,
        database=params.pop("dbname", None),
        query={key: str(value) for key, value in params.items()},
    )


class Alchemy(Writer):
    """A Session, or a Connection, of a sync engine."""

    def __init__(self, dsn: str, session: bool) -> None:
        self.engine = sa.create_engine(engine_url(dsn))
        self.target: Any = Session(self.engine) if session else self.engine.connect()

    async def close(self) -> None:
        self.target.close()
        self.engine.dispose()

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[None]:
        with self.target.begin():
            yield

    @asynccontextmanager
    async def savepoint(self) -> AsyncIterator[None]:
        with self.target.begin_nested():
            yield

    async def write(self, **event: Any) -> uuid.UUID:
        return alchemy.write_event(self.target, **event)

    async def rollback(self) -> None:
        self.target.rollback()


class AlchemyAsync(Writer):
    """An AsyncSession, or an AsyncConnection, of an async engine."""

    def __init__(self, dsn: str, session: bool) -> None:
        self.engine = create_async_engine(engine_url(dsn))
        self.session = session
        self.target: Any = None

    async def open(self) -> AlchemyAsync:
        if self.session:
            self.target = AsyncSession(self.engine)
        else:
            self.target = await self.engine.connect()
        return self

    async def close(self) -> None:
        await self.target.close()
        await self.engine.dispose()

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[None]:
        async with self.target.begin():
            yield

    @asynccontextmanager
    async def savepoint(self) -> AsyncIterator[None]:
        async with self.target.begin_nested():
            yield

    async def write(self, **event: Any) -> uuid.UUID:
        return await alchemy.write_event_async(self.target, **event)

    async def rollback(self) -> None:
        await self.target.rollback()


async def open_writer(kind: str, dsn: str) -> Writer:
    if kind.startswith("psycopg-async"):
        conn = await psycopg.AsyncConnection.connect(dsn)
        return PsycopgAsync(conn, cursor=kind.endswith("cursor"))
    if kind.startswith("psycopg"):
        return Psycopg(dsn, cursor=kind.endswith("cursor"))
    if kind.startswith("sqlalchemy-async"):
        return await AlchemyAsync(dsn, session=kind.endswith("session")).open()
    return Alchemy(dsn, session=kind.endswith("session"))


KINDS = [
    "psycopg-connection",
    "psycopg-cursor",
    "psycopg-async-connection",
    "psycopg-async-cursor",
    "sqlalchemy-session",
    "sqlalchemy-connection",
    "sqlalchemy-async-session",
    "sqlalchemy-async-connection",
]


async def scenarios(writer: Writer, kind: str) -> list[tuple[uuid.UUID, bytes]]:
    """Commit, roll back, raise, roll a savepoint back; return what committed, in commit
    order, with the payload each must carry on Kafka."""
    committed: list[tuple[uuid.UUID, bytes]] = []
    n = 0

    async def write(as_message: bool, payload: Any = "default") -> tuple[uuid.UUID, bytes]:
        nonlocal n
        n += 1
        value = {"kind": kind, "n": n} if payload == "default" else payload
        event_id = await writer.write(
            aggregate_type="writer",
            aggregate_id=kind,  # one key: one partition, so Kafka holds them in commit order
            event_type="writer.tested",
            payload=value,
            as_message=as_message,
        )
        text = "null" if value is None else f'{{"n": {n}, "kind": "{kind}"}}'
        return event_id, text.encode()

    # Committed: a row, a message, and a JSON null payload (the value null, not a tombstone).
    async with writer.transaction():
        committed += [await write(False), await write(True), await write(False, None)]
    # Rolled back explicitly, after an implicit begin.
    await write(False)
    await write(True)
    await writer.rollback()
    # An exception inside the block.
    with pytest.raises(Boom):
        async with writer.transaction():
            await write(False)
            await write(True)
            raise Boom
    # A savepoint rolled back inside a transaction that commits.
    async with writer.transaction():
        committed.append(await write(False))
        with pytest.raises(Boom):
            async with writer.savepoint():
                await write(False)
                await write(True)
                raise Boom
        committed.append(await write(True))
    # The last one: once it is on Kafka, so is everything committed before it.
    async with writer.transaction():
        committed.append(await write(False))
    await writer.close()
    return committed


@pytest.mark.parametrize("kind", KINDS)
def test_an_event_reaches_kafka_if_and_only_if_its_transaction_commits(
    tmp_path: Path, outbox_db: str, kafka_service: Any, names: Any, kind: str
) -> None:
    setup_slot(outbox_db, names)
    writers_only(outbox_db)  # stream --messages, once only writers may emit messages
    env = relay_env(outbox_db, kafka_service.bootstrap, names, messages="true")
    relay = RelayProcess(tmp_path, env).start()
    try:

        async def run() -> list[tuple[uuid.UUID, bytes]]:
            return await scenarios(await open_writer(kind, outbox_db), kind)

        committed = asyncio.run(run())
        received = consume(
            kafka_service.bootstrap, names.topic_prefix, expected=len(committed), settle=2
        )
        assert relay.stop() == 0
    finally:
        relay.close()
    assert [(r.id, r.value) for r in received] == [(str(i), value) for i, value in committed]
    for r in received:
        assert r.topic == f"{names.topic_prefix}.writer"
        assert r.key == kind.encode()
        assert dict(r.headers)["event_type"] == b"writer.tested"
    with psycopg.connect(outbox_db) as conn:  # the rows that committed, and only those
        rows = conn.execute("SELECT count(*) FROM outbox_events").fetchone()
    assert rows == (4,)  # the rows among them: two of the first, the savepoint's outer, the last


def test_the_relay_never_imports_sqlalchemy() -> None:
    probe = (
        "import sys; import cdc_relay.commands.cli, cdc_relay.relay.stream, "
        "cdc_relay.relay.poller, "
        "cdc_relay.outbox, cdc_relay.consumer; print('sqlalchemy' in sys.modules)"
    )
    ran = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert ran.stdout.strip() == "False"


def test_the_async_consumer_handles_a_redelivered_event_once(outbox_db: str) -> None:
    class Message:
        def __init__(self, event: uuid.UUID) -> None:
            self.event = event

        def headers(self) -> list[tuple[str, bytes]]:
            return [("id", str(self.event).encode())]

    with psycopg.connect(outbox_db, autocommit=True) as conn:
        conn.execute(schema.text("consumer"))
        conn.execute("CREATE TABLE ledger (event_id uuid)")
    event = uuid.uuid4()

    async def book(conn: psycopg.AsyncConnection[Any], message: Any) -> None:
        await conn.execute("INSERT INTO ledger VALUES (%s)", [message.event])

    async def failing(conn: psycopg.AsyncConnection[Any], message: Any) -> None:
        await book(conn, message)
        raise Boom

    async def run() -> tuple[list[bool], bool]:
        async with await psycopg.AsyncConnection.connect(outbox_db) as conn:
            with pytest.raises(Boom):  # leaves no record: the event is handled again later
                await handle_async(conn, Message(event), failing, consumer="billing")
            ran = [await handle_async(conn, Message(event), book, consumer="billing")]
            ran.append(await handle_async(conn, Message(event), book, consumer="billing"))
            async with conn.transaction():
                again = await first_time_async(conn, event, "audit")
        return ran, again

    ran, other_consumer = asyncio.run(run())
    assert ran == [True, False]
    assert other_consumer
    with psycopg.connect(outbox_db) as conn:
        assert conn.execute("SELECT count(*) FROM ledger").fetchone() == (1,)


# -- the table named as the relays resolve it -------------------------------------------------

TABLE_NAMES = [
    "Tenant.Outbox_Events",  # unquoted: folded to lower case, as --table is
    '"Odd Schema".outbox_events',
    '"Odd Schema"."Mixed"',
    " tenant . outbox_events ",
    "OUTBOX_EVENTS",  # unqualified: through search_path, as --table is
]


@pytest.mark.parametrize("name", TABLE_NAMES)
def test_the_writers_name_the_table_as_the_relays_resolve_table(outbox_db: str, name: str) -> None:
    """``write_event(table=NAME)`` writes into the table ``--table NAME`` names: PostgreSQL's
    reading of a name (quotes, case folding, search_path), not a case-sensitive one."""
    with psycopg.connect(outbox_db, autocommit=True) as conn:
        conn.execute("CREATE SCHEMA tenant")
        conn.execute('CREATE SCHEMA "Odd Schema"')
        for table in ("tenant.outbox_events", '"Odd Schema".outbox_events', '"Odd Schema"."Mixed"'):
            conn.execute(f"CREATE TABLE {table} (LIKE public.outbox_events INCLUDING ALL)")
        (resolved,) = conn.execute("SELECT to_regclass(%s)::oid::bigint", [name]).fetchone() or ()
    assert resolved is not None

    engine = sa.create_engine(engine_url(outbox_db))
    try:
        with psycopg.connect(outbox_db) as conn, conn.transaction():
            written = [
                outbox.write_event(
                    conn,
                    aggregate_type="order",
                    aggregate_id="1",
                    event_type="e",
                    payload={},
                    table=name,
                )
            ]
        with Session(engine) as session, session.begin():
            written.append(
                alchemy.write_event(
                    session,
                    aggregate_type="order",
                    aggregate_id="1",
                    event_type="e",
                    payload={},
                    table=name,
                )
            )
    finally:
        engine.dispose()
    with psycopg.connect(outbox_db, autocommit=True) as conn:
        tables = {
            row[0]
            for row in conn.execute(
                "SELECT tableoid::bigint FROM public.outbox_events WHERE id = ANY(%(ids)s)"
                " UNION ALL SELECT tableoid::bigint FROM tenant.outbox_events"
                " WHERE id = ANY(%(ids)s) UNION ALL SELECT tableoid::bigint FROM"
                ' "Odd Schema".outbox_events WHERE id = ANY(%(ids)s) UNION ALL SELECT'
                ' tableoid::bigint FROM "Odd Schema"."Mixed" WHERE id = ANY(%(ids)s)',
                {"ids": written},
            )
        }
    assert tables == {resolved}
