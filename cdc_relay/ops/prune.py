"""Pruning the outbox: delete old rows whose events are on Kafka, in batches.

A row the poller published carries ``processed_at``. A row ``stream`` relayed carries
nothing: only its slot knows how far it has relayed, so ``--slot`` deletes the rows whose
transaction the slot has confirmed, by the rule of horizon.py. Deleting a row never takes its
event from the stream (the WAL holds it); a row kept until its event is on Kafka is what an
operator publishes again should the slot be lost.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import psycopg
from psycopg import sql

from cdc_relay.errors import PreflightError, RelayError
from cdc_relay.lsn import Lsn, format_lsn
from cdc_relay.postgres import gaps, horizon
from cdc_relay.postgres.connection import connect
from cdc_relay.postgres.coverage import relay_problem, slot_problem
from cdc_relay.postgres.store import Outbox, refused, resolve
from cdc_relay.postgres.tables import OutboxTable
from cdc_relay.queries import QUERIES

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Pruned:
    """What a prune did."""

    deleted: int
    cutoff: datetime  # rows older than this were deleted (processed, or created, before it)
    confirmed: Lsn | None = None  # with a slot: its confirmed position, past the horizon's W


def prune_processed(
    dsn: str, table: str, older_than: timedelta, batch_size: int = 10_000
) -> Pruned:
    """Delete rows processed more than ``older_than`` ago, oldest first, ``batch_size`` per
    transaction. Unprocessed rows and dead letters stay."""
    with connect(dsn) as conn:
        outbox = resolve(conn, table)
        with refused(outbox, "the prune"):
            cutoff = _cutoff(conn, older_than)
            deleted = _delete(conn, outbox.query("prune"), {"before": cutoff}, batch_size)
    return Pruned(deleted, cutoff)


def prune_confirmed(
    dsn: str,
    table: str,
    slot: str,
    publication: str,
    older_than: timedelta,
    batch_size: int = 10_000,
    wait: float = 30.0,
) -> Pruned:
    """Delete rows created more than ``older_than`` ago whose transaction ``slot`` has
    confirmed, ``batch_size`` per transaction (horizon.py).

    Waits up to ``wait`` seconds for the slot to confirm the WAL position of the start; if it
    does not, deletes nothing and raises RelayError.
    """
    with connect(dsn) as conn:
        outbox = resolve(conn, table)
        with refused(outbox, "the prune"):
            _check(conn, outbox, slot, publication)
            cutoff = _cutoff(conn, older_than)
            edge = horizon.take(conn)
            confirmed, active = horizon.wait_for(conn, slot, edge.wal, wait)
            if confirmed < edge.wal:
                raise RelayError(
                    f"slot {slot} has not confirmed {format_lsn(edge.wal)}, where the WAL was "
                    f"when the prune began, within {wait:g} s (it is at "
                    f"{format_lsn(confirmed) if confirmed else '-'}"
                    f"{'' if active else ', and no relay streams it'}); nothing was deleted: "
                    "start cdc-relay stream, or give it longer with --wait"
                )
            deleted = delete_confirmed(conn, outbox.table, edge, cutoff, batch_size)
    return Pruned(deleted, cutoff, confirmed)


def delete_confirmed(
    conn: psycopg.Connection[dict[str, Any]],
    table: OutboxTable,
    edge: horizon.Horizon,
    before: datetime,
    batch_size: int,
) -> int:
    """Delete the rows of ``table`` created before ``before`` whose transaction precedes the
    horizon's X, ``batch_size`` per transaction (``conn`` autocommits); how many.

    Only once the slot has confirmed the horizon's W (horizon.wait_for): it is the rule's
    third step, which this does not check.
    """
    statement = horizon.query("prune_confirmed", table)
    return _delete(conn, statement, {"before": before, **edge.params}, batch_size)


def _check(
    conn: psycopg.Connection[dict[str, Any]], outbox: Outbox, slot: str, publication: str
) -> None:
    """The slot relays the outbox's rows, and they have an age; PreflightError if not."""
    row = conn.execute(QUERIES["slot"], {"slot": slot}).fetchone()
    database = (conn.execute(QUERIES["server"]).fetchone() or {})["database"]
    problem = slot_problem(row, slot, database)
    if problem is None and row is not None:
        problem = relay_problem(conn, row["plugin"], slot, publication, outbox.table)
    if problem is None and row is not None:
        # The slot is trusted for what it confirmed only if its publication covered the table
        # all along: nothing changed it since its relay verified it (lineage.py).
        found = gaps.find(conn, slot, str(row["confirmed_flush_lsn"]), [outbox.table])
        problem = found.missing or found.changed
    if problem is not None:
        raise PreflightError(problem)
    present = conn.execute(QUERIES["created_at_column"], {"oid": outbox.table.oid}).fetchone()
    if not (present or {}).get("present"):
        raise PreflightError(
            f"table {outbox.qualified} has no column created_at, which prune --slot reads a "
            "row's age from; add it as cdc-relay schema show outbox has it (created_at "
            "timestamptz NOT "
            "NULL DEFAULT now())"
        )


def _cutoff(conn: psycopg.Connection[dict[str, Any]], older_than: timedelta) -> datetime:
    row = conn.execute(QUERIES["prune_before"], {"age": older_than}).fetchone() or {}
    before: datetime = row["before"]
    return before


def _delete(
    conn: psycopg.Connection[dict[str, Any]],
    statement: sql.Composed,
    params: dict[str, Any],
    batch_size: int,
) -> int:
    """Run the DELETE of up to ``batch_size`` rows, one transaction each (``conn``
    autocommits), until one deletes fewer; how many it deleted in all."""
    deleted = 0
    while True:
        count = conn.execute(statement, {**params, "limit": batch_size}).rowcount
        deleted += count
        if count < batch_size:
            return deleted
        log.info("pruned %d rows so far", deleted, extra={"action": "prune"})
