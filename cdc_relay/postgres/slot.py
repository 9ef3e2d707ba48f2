"""The database side of set-up: what a slot is made of (``SlotSpec``), the preflight checks,
the publication and slot made (``setup``; with an exported snapshot for a handover), and both
dropped.

What a publication covers is coverage.py's; resharding, reshard.py's; ``status``, ops/status.py's.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, replace
from typing import Any, Literal

import psycopg
from psycopg import sql

from cdc_relay import schema
from cdc_relay.errors import PreflightError
from cdc_relay.postgres import failover, gaps, lineage
from cdc_relay.postgres.connection import check_encoding, connect, one_row
from cdc_relay.postgres.coverage import MIN_SHARDS_VERSION_NUM, coverage_problem
from cdc_relay.postgres.replication import ReplicationConnection
from cdc_relay.postgres.shards import Shard
from cdc_relay.postgres.tables import find_table
from cdc_relay.queries import QUERIES

log = logging.getLogger(__name__)

MIN_VERSION_NUM = 140000


@dataclass(frozen=True)
class SlotSpec:
    """What set-up creates: names and plugin; for a shard, the slot and publication are the
    shard's own (:meth:`sharded`), the publication filtered on ``aggregate_column``."""

    slot: str
    publication: str
    table: str
    plugin: str = "pgoutput"
    shard: Shard | None = None
    aggregate_column: str = "aggregate_id"
    comment: str | None = None  # put on the publication it creates (reshard's cut)
    failover: bool = False  # a failover slot, which standbys keep a copy of (PostgreSQL 17+)
    more_tables: tuple[str, ...] = ()  # further outbox tables in the same publication

    @property
    def tables(self) -> tuple[str, ...]:
        """Every outbox table of the publication: ``table`` first."""
        return (self.table, *self.more_tables)

    def sharded(self, shard: Shard) -> SlotSpec:
        """The spec of ``shard``: its slot and publication, named after these."""
        return replace(
            self, slot=shard.name(self.slot), publication=shard.name(self.publication), shard=shard
        )


@dataclass
class SetupReport:
    """What set-up found and did, in sentences for the user."""

    done: list[str]
    existing: list[str]
    statements: list[str]


def preflight(conn: psycopg.Connection[dict[str, Any]], spec: SlotSpec) -> str:
    """Check everything logical replication of the outbox needs; return the table's name.

    Raises PreflightError with a remedy for the first unmet condition.
    """
    server = one_row(conn, "server")
    if server["version_num"] < MIN_VERSION_NUM:
        raise PreflightError(
            f"PostgreSQL {server['version']} is too old; cdc-relay needs 14 or newer"
        )
    if spec.shard is not None and server["version_num"] < MIN_SHARDS_VERSION_NUM:
        raise PreflightError(
            f"PostgreSQL {server['version']} has no publication row filters, which shards "
            "need; upgrade to PostgreSQL 15 or newer, or stream without --shards"
        )
    if spec.failover and server["version_num"] < failover.MIN_VERSION_NUM:
        raise PreflightError(
            f"PostgreSQL {server['version']} has no failover slots (new in 17); upgrade, or "
            "run setup-slot without --failover and see docs/failover.md, "
            '"Hot standby and database failover"'
        )
    if spec.shard is not None and spec.plugin != "pgoutput":
        raise PreflightError(
            "shards need the pgoutput plugin (wal2json does not read publications and their "
            "row filters); pass --plugin pgoutput"
        )
    if server["wal_level"] != "logical":
        raise PreflightError(
            f"wal_level is '{server['wal_level']}'; set wal_level = logical in "
            "postgresql.conf (or ALTER SYSTEM SET wal_level = logical) and restart PostgreSQL"
        )
    check_encoding(server)
    role = one_row(conn, "role")
    if not role.get("can_replicate"):
        raise PreflightError(
            f"role {server['role']} lacks REPLICATION; run ALTER ROLE {server['role']} "
            "REPLICATION as a superuser (on managed services: grant the provider's "
            "replication role)"
        )
    table = one_row(conn, "table", table=spec.table)
    if not table:
        raise PreflightError(
            f"table {spec.table} does not exist in database {server['database']}; "
            "create it with cdc-relay schema apply outbox (or setup-slot --create-table), or "
            "name yours with --table"
        )
    _check_standby(conn, server, spec, str(table["name"]))
    slot = one_row(conn, "slot", slot=spec.slot)
    if not slot and server["slots_used"] >= server["max_slots"]:
        raise PreflightError(
            f"all {server['max_slots']} replication slots are in use; raise "
            "max_replication_slots in postgresql.conf and restart, or drop an unused slot"
        )
    if server["senders_used"] >= server["max_senders"]:
        raise PreflightError(
            f"all {server['max_senders']} WAL senders are busy; raise max_wal_senders in "
            "postgresql.conf and restart PostgreSQL"
        )
    publication = one_row(conn, "publication", publication=spec.publication)
    if not publication and not (table["owned"] and role["can_create"]):
        raise PreflightError(
            f"role {server['role']} cannot create a publication on {table['name']} (it must "
            "own the table and have CREATE on the database); run setup-slot as the table's "
            "owner, or have an administrator create the publication"
        )
    return str(table["name"])


MIN_STANDBY_VERSION_NUM = 160000  # logical decoding on a standby
STANDBY_HINT_AFTER = 5.0  # seconds a slot's creation on a standby waits before the hint


def _check_standby(
    conn: psycopg.Connection[dict[str, Any]], server: dict[str, Any], spec: SlotSpec, table: str
) -> None:
    """On a standby, what decoding there needs: PostgreSQL 16+, hot_standby_feedback, and the
    publication made on the primary (a standby creates nothing)."""
    node = one_row(conn, "standby")
    if not node["standby"]:
        return
    if server["version_num"] < MIN_STANDBY_VERSION_NUM:
        raise PreflightError(
            f"this server is a standby, and PostgreSQL {server['version']} decodes on a "
            "standby only from 16 on; run setup-slot and stream against the primary, or upgrade"
        )
    if not node["hot_standby_feedback"]:
        raise PreflightError(
            "this server is a standby with hot_standby_feedback off, so the primary may remove "
            "catalog rows the slot needs and PostgreSQL would invalidate it; ALTER SYSTEM SET "
            "hot_standby_feedback = on; SELECT pg_reload_conf() on the standby (with a "
            "primary_slot_name, so that the primary keeps them across disconnections)"
        )
    if spec.failover:
        raise PreflightError(
            "this server is a standby, where a slot cannot fail over (its own standbys do not "
            "copy it); drop --failover, or run setup-slot --failover against the primary"
        )
    if not one_row(conn, "publication", publication=spec.publication):
        statement = _publication_statement(spec, [table])
        raise PreflightError(
            f"this server is a standby, where publication {spec.publication} cannot be created; "
            f"create it on the primary ({' '.join(statement.as_string(conn).split())}), "
            "then run setup-slot here again"
        )


def _publication_statement(spec: SlotSpec, tables: Sequence[str]) -> sql.Composed:
    """CREATE PUBLICATION of ``spec`` on ``tables`` (each quoted by the table query's
    format('%I.%I')); a shard's publication filters the rows of each the same way."""
    shard = spec.shard
    return sql.SQL(
        QUERIES["create_publication" if shard is None else "create_shard_publication"]
    ).format(
        publication=sql.Identifier(spec.publication),
        tables=sql.SQL(", ").join(
            sql.SQL(table)
            if shard is None
            else sql.SQL("{} WHERE ({})").format(
                sql.SQL(table), shard.row_filter(spec.aggregate_column)
            )
            for table in tables
        ),
    )


def comment_statement(publication: str, text: str) -> sql.Composed:
    """COMMENT ON PUBLICATION: where a shard's publication keeps its resharding cut."""
    return sql.SQL("COMMENT ON PUBLICATION {} IS {}").format(
        sql.Identifier(publication), sql.Literal(text)
    )


def _create_slot(conn: psycopg.Connection[dict[str, Any]], spec: SlotSpec) -> dict[str, Any]:
    """Create the slot; on a standby, say after a few seconds what its creation waits for."""
    query = QUERIES["create_failover_slot" if spec.failover else "create_slot"]
    params = {"slot": spec.slot, "plugin": spec.plugin}
    hint = None
    if one_row(conn, "standby")["standby"]:
        hint = threading.Timer(
            STANDBY_HINT_AFTER,
            log.warning,
            [
                "creating slot %s on a standby waits for the transactions running on the "
                "primary to end and for the primary to log its running transactions, which it "
                "does every 15 s while busy and never while idle; run SELECT "
                "pg_log_standby_snapshot() on the primary to have it now",
                spec.slot,
            ],
        )
        hint.daemon = True
        hint.start()
    try:
        return conn.execute(query, params).fetchone() or {}
    finally:
        if hint is not None:
            hint.cancel()


Gap = Literal["refuse", "accept", "cut"]
"""What set-up does of a slot that existed and is gone: refuse to make it anew, make it
skipping what it had not confirmed (``--accept-gap``), or make it at a resharding cut (the old
shards relay what comes before it)."""

_MADE_BY: dict[str, str] = {
    "refuse": "setup-slot",
    "accept": "setup-slot --accept-gap",
    "cut": "reshard",
}


def setup(
    dsn: str,
    spec: SlotSpec,
    dry_run: bool = False,
    create_slot: bool = True,
    create_table: bool = False,
    gap: Gap = "refuse",
) -> SetupReport:
    """Idempotently create the publication and (unless ``create_slot`` is False) the slot,
    after preflight; with ``create_table``, the outbox table first when it is missing. A slot
    that existed and is gone is made anew as ``gap`` says (gaps.py)."""
    report = SetupReport(done=[], existing=[], statements=[])
    with connect(dsn) as conn, ExitStack() as dry:
        for name in spec.tables if create_table else ():
            if one_row(conn, "table", table=name):
                continue
            target = schema.outbox_target(conn, name)
            if dry_run and not report.statements:  # made for the checks, and rolled back
                dry.enter_context(conn.transaction(force_rollback=True))
            schema.apply(conn, "outbox", target)
            report.statements.append(f"-- cdc-relay schema apply outbox, in schema {target}")
            if not dry_run:
                report.done.append(f"created table {name} (cdc-relay schema outbox)")
        # Each name quoted by the table query's format('%I.%I').
        tables = [preflight(conn, replace(spec, table=name)) for name in spec.tables]
        for name, quoted in zip(spec.tables, tables, strict=True):
            if tables.count(quoted) > 1:
                raise PreflightError(
                    f"--table {name} names {quoted}, as another --table does; name each outbox "
                    "table once"
                )
        database = one_row(conn, "server")["database"]

        publication = one_row(conn, "publication", publication=spec.publication)
        if publication:
            for name in spec.tables:
                found = find_table(conn, name)
                problem = (
                    coverage_problem(
                        conn, spec.publication, found, spec.shard, spec.aggregate_column
                    )
                    if found
                    else None
                )
                if problem:
                    raise PreflightError(problem)
            report.existing.append(f"publication {spec.publication} on {', '.join(tables)}")
        else:
            statement = _publication_statement(spec, tables)
            report.statements.append(statement.as_string(conn) + ";")
            if not dry_run:
                conn.execute(statement)
                if spec.comment is not None:
                    conn.execute(comment_statement(spec.publication, spec.comment))
                report.done.append(f"created publication {spec.publication} on {', '.join(tables)}")

        if not create_slot:
            return report
        # What the slot was, kept in the database (lineage.py): a slot that existed and is
        # gone is not made anew without a remedy, nor one whose publication changed unseen.
        usable, ddl = lineage.prepare(conn, dry_run)
        if ddl:
            report.statements.append(ddl)
        outboxes = [found for name in spec.tables if (found := find_table(conn, name))]
        before = lineage.look(conn, spec.plugin, spec.publication, outboxes) if usable else None
        slot = one_row(conn, "slot", slot=spec.slot)
        if slot:
            _check_slot(spec, database, slot)
            report.existing.append(
                f"slot {spec.slot} ({slot['plugin']}), confirmed up to "
                f"{slot['confirmed_flush_lsn']}"
            )
            if before is not None:
                line = gaps.existing(conn, spec.slot, slot, before, gap == "accept", dry_run)
                if line and not dry_run:
                    report.done.append(line)
        else:
            record = gaps.lost(conn, spec.slot, gap != "refuse") if usable else None
            report.statements.append(
                f"SELECT pg_create_logical_replication_slot({sql.quote(spec.slot)}, "
                f"{sql.quote(spec.plugin)}" + (", failover => true);" if spec.failover else ");")
            )
            if not dry_run:
                lsn = str(_create_slot(conn, spec)["lsn"])
                if before is not None:
                    how = _MADE_BY[gap]
                    lineage.made(conn, spec.slot, spec.plugin, before, how, lsn, before.at)
                kind = f"{spec.plugin}, failover" if spec.failover else spec.plugin
                report.done.append(f"created slot {spec.slot} ({kind}) at {lsn}")
                if record is not None and gap == "accept":
                    report.done.append(gaps.skipped(record, lsn))
    return report


@contextmanager
def exported_snapshot(dsn: str, spec: SlotSpec) -> Iterator[tuple[str, str]]:
    """Create ``spec.slot`` as a temporary slot and yield its consistent point and the name of
    the snapshot it starts from; the snapshot can be imported (``SET TRANSACTION SNAPSHOT``)
    inside the block.

    The slot lives as long as the block, busy all along: a temporary slot belongs to the
    session that created it, so no relay can stream it, and PostgreSQL drops it when that
    session ends, however it ends (a killed process leaves no slot behind). To keep it, copy
    it inside the block (``pg_copy_logical_replication_slot``): the copy starts at the same
    position.
    """
    conn = ReplicationConnection(dsn)
    try:
        # The options as PostgreSQL 14 spells them, which later versions still read.
        command = (
            f"CREATE_REPLICATION_SLOT {sql.Identifier(spec.slot).as_string()} TEMPORARY "
            f"LOGICAL {sql.Identifier(spec.plugin).as_string()} EXPORT_SNAPSHOT"
        )
        ((_, consistent_point, snapshot, _),) = conn.query(command)
        if consistent_point is None or snapshot is None:
            raise PreflightError(f"creating slot {spec.slot} exported no snapshot")
        yield consistent_point, snapshot
    finally:
        conn.close()


def _check_slot(spec: SlotSpec, database: str, slot: dict[str, Any]) -> None:
    if slot["slot_type"] != "logical" or slot["database"] != database:
        raise PreflightError(
            f"slot {spec.slot} exists but is not a logical slot of database {database}; "
            "choose another --slot"
        )
    if slot["plugin"] != spec.plugin:
        raise PreflightError(
            f"slot {spec.slot} exists with plugin {slot['plugin']}, not {spec.plugin}; pass "
            f"--plugin {slot['plugin']}, or drop it with cdc-relay drop-slot"
        )


def drop(dsn: str, spec: SlotSpec) -> list[str]:
    """Drop the slot and the publication; return what was removed."""
    removed = []
    with connect(dsn) as conn:
        slot = one_row(conn, "slot", slot=spec.slot)
        if slot:
            if slot["active"]:
                raise PreflightError(
                    f"slot {spec.slot} is in use by process {slot['active_pid']}; "
                    "stop the relay first"
                )
            conn.execute(QUERIES["drop_slot"], {"slot": spec.slot})
            removed.append(f"slot {spec.slot}")
        if one_row(conn, "publication", publication=spec.publication):
            conn.execute(
                sql.SQL(QUERIES["drop_publication"]).format(
                    publication=sql.Identifier(spec.publication)
                )
            )
            removed.append(f"publication {spec.publication}")
    return removed
