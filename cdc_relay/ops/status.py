"""``cdc-relay status``: a slot's state, whether it relays the outbox table and why not, what
its lineage says of it, whether a standby holds a usable copy of a failover slot
(failover_ready.py), and the outbox's counts (the rows the slot has confirmed and the others,
by horizon.py's rule; pending rows and dead letters through ``store.counts``)."""

from __future__ import annotations

from typing import Any

import psycopg

from cdc_relay.lsn import format_lsn
from cdc_relay.postgres import failover, failover_ready, gaps, horizon, lineage, store
from cdc_relay.postgres.connection import connect, one_row
from cdc_relay.postgres.coverage import coverage_problem, relay_problem, slot_problem
from cdc_relay.postgres.shards import Shard
from cdc_relay.postgres.tables import OutboxTable, find_table


def status(
    dsn: str,
    slot_name: str,
    table: str,
    publication: str,
    wait: float = 5.0,
    shard: Shard | None = None,
) -> dict[str, Any]:
    """The slot's state and the outbox's counts, for ``cdc-relay status``.

    When the slot relays the table, its rows are told apart by horizon.py's rule: confirmed
    (on Kafka) or not, once the slot has confirmed the WAL position of the start, which is
    waited for up to ``wait`` seconds. ``shard``: the slot's, whose publication keeps the
    shard's rows (so the slot confirms those only, and its rows are not told apart).
    """
    with connect(dsn) as conn:
        slot = one_row(conn, "slot", slot=slot_name)
        found = one_row(conn, "table", table=table)
        outbox = find_table(conn, table)
        published = bool(one_row(conn, "publication", publication=publication))
        # Only a pgoutput slot reads the publication; one that is not there is shown as such.
        publication_problem = (
            coverage_problem(conn, publication, outbox, shard, aggregate_column=None)
            if outbox is not None and published and slot.get("plugin") == "pgoutput"
            else None
        )
        database = one_row(conn, "server")["database"]
        problem = (
            slot_problem(slot, slot_name, database) or failover.slot_invalidated(slot_name, slot)
            if slot
            else gaps.gone(conn, slot_name)
            or failover.slot_gone(slot_name, one_row(conn, "timeline").get("timeline"))
        )
        # What the slot was, and whether its publication changed since its relay verified it.
        kept = (
            gaps.find(conn, slot_name, str(slot["confirmed_flush_lsn"]), [outbox])
            if slot and outbox is not None and problem is None
            else None
        )
        made = kept.record if kept else None if slot else lineage.record(conn, slot_name)
        relays = (
            outbox is not None
            and bool(slot)
            and problem is None
            and relay_problem(conn, slot["plugin"], slot_name, publication, outbox) is None
        )
        counts: dict[str, Any] = {"unprocessed": None, "dead_letters": None}
        missing = one_row(conn, "poll_columns", oid=outbox.oid).get("missing") if outbox else None
        if found and outbox is not None and "processed_at" not in (missing or ()):
            # The dead letters of this table: the view outbox_dead_letters shows those of
            # outbox_events only, whichever table --table names. A table without retry_after
            # has none: its unprocessed rows alone.
            dead_letters = "retry_after" not in (missing or ())
            counts.update(store.counts(conn, outbox, dead_letters=dead_letters))
        rows = _confirmed_rows(conn, slot_name, outbox, wait) if relays and outbox else {}
    # Only a standby shows its copy: each host of the DSN is asked (failover_ready.py).
    ready = failover_ready.readiness(dsn, slot_name, slot) if slot else None
    return {
        "slot": slot_name,
        "exists": bool(slot),
        "slot_problem": problem,
        "active": bool(slot.get("active")),
        "active_pid": slot.get("active_pid"),
        "plugin": slot.get("plugin"),
        "confirmed_flush_lsn": slot.get("confirmed_flush_lsn"),
        "wal_retained_bytes": slot.get("retained_bytes"),
        "wal_status": slot.get("wal_status"),
        "safe_wal_bytes": slot.get("safe_wal_bytes"),
        "invalidated": slot.get("invalidated"),
        "failover": ready.as_json() if ready else None,
        "table": found.get("name") if found else table,
        "slot_relays_table": relays,
        "publication": publication,
        "publication_exists": published,
        "publication_problem": publication_problem,
        "lineage": made.as_json() if made else None,
        "lineage_problem": kept.changed if kept else None,
        "confirmed_rows": rows.get("confirmed"),
        "unconfirmed_rows": rows.get("unconfirmed"),
        "confirmed_rows_unknown": rows.get("unknown"),
        "unprocessed_rows": counts.get("unprocessed"),
        "dead_letters": counts.get("dead_letters"),
    }


def _confirmed_rows(
    conn: psycopg.Connection[dict[str, Any]], slot: str, table: OutboxTable, wait: float
) -> dict[str, Any]:
    """The rows of ``table`` the slot has confirmed and the others (horizon.py); or why it
    cannot tell, when the slot has not confirmed the start's WAL position within ``wait``."""
    if one_row(conn, "in_recovery")["standby"]:
        return {"unknown": "the server is a standby; ask the primary"}
    edge = horizon.take(conn)
    confirmed, active = horizon.wait_for(conn, slot, edge.wal, wait)
    if confirmed < edge.wal:
        return {
            "unknown": f"slot {slot} has not confirmed {format_lsn(edge.wal)}, where the WAL "
            f"was when status began, within {wait:g} s"
            f"{'' if active else ', and no relay streams it'}"
        }
    done, left = horizon.counts(conn, table, edge)
    return {"confirmed": done, "unconfirmed": left}
