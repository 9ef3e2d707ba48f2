"""Which outbox rows a slot has confirmed: the rule ``prune --slot`` deletes by and ``status``
counts by (docs/operations.md, "Pruning a stream outbox", tells users).

``stream`` never marks a row. What reached Kafka is recorded only as the slot's confirmed
position, a WAL position, which no row carries; a row carries the id of the transaction that
inserted it (``xmin``). A horizon ties the two together, on PostgreSQL's own guarantees:

1. X, the xmin of a snapshot taken now: every transaction with a lower id has ended,
   committed or rolled back. So has every subtransaction with a lower id: a subtransaction
   gets its id after its parent has one (``AssignTransactionId``), so its parent's is lower.
2. W, the WAL insert position, read after X, in a later statement: a transaction inserts its
   commit record before it stops running (``RecordTransactionCommit``, then
   ``ProcArrayEndTransaction``), so each one that had ended by step 1 has its commit record
   before W, flushed or not (``synchronous_commit = off`` reports a commit before the flush).
3. Once the slot's confirmed position is at or past W, the relay has confirmed each such
   commit, which it does only after Kafka acknowledged its events and those of every earlier
   transaction (the LSN rule, ARCHITECTURE.md).

So a row whose xmin precedes X, seen by a later statement (so committed), is on Kafka. A
transaction running at step 1 has an id of X or more, and so have its subtransactions and
every transaction that gets an id later: none of their rows passes, whenever they commit.

The 32-bit xmin is compared with X as PostgreSQL compares ids (``TransactionIdPrecedes``,
queries.sql's ``confirmed_row``), which is exact for ids under 2^31 apart. Every id not
frozen is that close to the newest one (PostgreSQL stops assigning ids before the oldest
unfrozen one falls 2^31 behind), and X is a running transaction's id or the next one's; so a
row of a transaction at or after X never compares before X, short of 2^31 ids assigned while
one command runs. A frozen row keeps its old xmin, which may compare either way once 2^31 ids
have passed; it committed long before step 1, so deleting it is right and keeping it is
safe. (``xmin::text::xid8`` would put every row in epoch 0, and ``pg_visible_in_snapshot``
takes a subtransaction of a running transaction for an ended one: a snapshot lists top-level
transactions only.)
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql

from cdc_relay.lsn import Lsn, parse
from cdc_relay.postgres.tables import OutboxTable
from cdc_relay.queries import QUERIES

_LOOK_EVERY = 0.2  # seconds between looks at the slot while waiting for it
_ADVANCE_EVERY = 1.0  # seconds between empty transactions while waiting for it


@dataclass(frozen=True)
class Horizon:
    """X and W of the rule above."""

    xmin: int  # X, a 64-bit transaction id (xid8)
    wal: Lsn  # W

    @property
    def params(self) -> dict[str, int]:
        """The parameters of queries.sql's confirmed_row: the low 32 bits of X."""
        return {"xmin": self.xmin & 0xFFFFFFFF}


def take(conn: psycopg.Connection[dict[str, Any]]) -> Horizon:
    """X, then W, each in a statement and a transaction of its own (``conn`` autocommits)."""
    if not conn.autocommit:
        raise ValueError("a horizon is taken in autocommit: X and W in order, each on its own")
    xmin = _one(conn, QUERIES["snapshot_xmin"])["xmin"]
    wal = _one(conn, QUERIES["wal_insert_lsn"])["lsn"]
    return Horizon(xmin=int(xmin), wal=parse(wal))


def wait_for(
    conn: psycopg.Connection[dict[str, Any]], slot: str, lsn: Lsn, timeout: float
) -> tuple[Lsn, bool]:
    """Wait up to ``timeout`` seconds for ``slot`` to confirm ``lsn``, committing an empty
    transaction at once and every second until it has (``conn`` autocommits).

    A relay confirms only positions it has read or been told of by a keepalive, which the
    server sends once it has read further: it reads flushed WAL only, and on an idle database
    nothing may come after ``lsn``. The empty transaction is WAL after ``lsn`` that the WAL
    writer flushes soon. It is written again while the slot lags, since a relay that hears of
    a position while it awaits Kafka's acknowledgements does not confirm it later.

    Returns the slot's confirmed position when it is at or past ``lsn``, else the last one
    seen (0 when the slot has none, or is gone), and whether a relay was streaming the slot.
    """
    start = time.monotonic()
    advanced = -_ADVANCE_EVERY
    while True:
        row = conn.execute(QUERIES["slot"], {"slot": slot}).fetchone()
        if row is None:
            return 0, False
        confirmed = parse(row["confirmed_flush_lsn"]) if row["confirmed_flush_lsn"] else 0
        now = time.monotonic() - start
        if confirmed >= lsn or now >= timeout:
            return confirmed, bool(row["active"])
        if now - advanced >= _ADVANCE_EVERY:
            conn.execute(QUERIES["advance_wal"])
            advanced = now
        time.sleep(min(_LOOK_EVERY, timeout - now))


def query(name: str, table: OutboxTable) -> sql.Composed:
    """A named query on ``table`` whose ``{confirmed}`` is queries.sql's confirmed_row."""
    return sql.SQL(QUERIES[name]).format(
        table=table.identifier,
        confirmed=sql.SQL(QUERIES["confirmed_row"]),
    )


def counts(
    conn: psycopg.Connection[dict[str, Any]], table: OutboxTable, horizon: Horizon
) -> tuple[int, int]:
    """The rows of ``table`` the horizon shows on Kafka, and the others (inserted by a
    transaction at or after X, so not shown yet)."""
    row = _one(conn, query("confirmed_counts", table), horizon.params)
    return int(row["confirmed"]), int(row["unconfirmed"])


def _one(
    conn: psycopg.Connection[dict[str, Any]],
    statement: str | sql.Composed,
    params: dict[str, Any] | None = None,
) -> dict[str, Any]:
    row = conn.execute(statement, params).fetchone()
    if row is None:
        raise RuntimeError("a query of one row returned none")
    return row
