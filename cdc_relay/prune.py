"""Pruning the outbox: delete old rows whose events are on Kafka, in batches."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import psycopg
from psycopg import sql

from cdc_relay.poller import refused, resolve
from cdc_relay.queries import QUERIES
from cdc_relay.slot import connect

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Pruned:
    """What a prune did."""

    deleted: int
    cutoff: datetime  # rows processed before this were deleted


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
