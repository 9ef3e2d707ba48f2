"""The database side of set-up: preflight checks, publication and slot, their status."""

from __future__ import annotations

import logging
import re
import threading
import uuid
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, replace
from typing import Any, Literal

import psycopg
from psycopg import sql

from cdc_relay import schema
from cdc_relay.errors import PreflightError
from cdc_relay.lsn import Lsn, format_lsn
from cdc_relay.lsn import parse as parse_lsn
from cdc_relay.postgres import failover, horizon, lineage, store
from cdc_relay.postgres.connection import check_encoding, connect
from cdc_relay.postgres.replication import ReplicationConnection
from cdc_relay.postgres.shards import (
    CUT_PREFIX,
    Cut,
    Shard,
    StartAfterCut,
    every_shard,
    shard_named,
)
from cdc_relay.postgres.tables import OutboxTable, find_table
from cdc_relay.queries import QUERIES

log = logging.getLogger(__name__)

PLUGINS = ("pgoutput", "wal2json")
MIN_VERSION_NUM = 140000
MIN_SHARDS_VERSION_NUM = 150000  # publication row filters


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


def coverage_problem(
    conn: psycopg.Connection[dict[str, Any]],
    publication: str,
    table: OutboxTable,
    shard: Shard | None = None,
    aggregate_column: str | None = "aggregate_id",
) -> str | None:
    """Why ``publication`` does not publish the inserts of ``table`` (every column, and every
    row of it; for a shard: exactly the shard's rows, by their ``aggregate_column``, or by a
    row filter of any column when it is None: status does not know it), with the remedy;
    None when it does."""
    problem = _coverage_problem(conn, publication, table)
    if problem:
        return problem
    if conn.info.server_version < MIN_SHARDS_VERSION_NUM:  # no row filters nor column lists
        return (
            None
            if shard is None
            else f"shard {shard}: a shard's publication keeps its rows by a row filter, which "
            "PostgreSQL 14 does not have; stream this outbox with one relay, or move it to "
            "PostgreSQL 15 or newer"
        )
    part = _one(conn, "published_part", publication=publication, oid=table.oid)
    found = part.get("filter")
    problem = _part_problem(publication, table, found, part.get("left_out") or [], shard)
    if problem or shard is None:
        return problem
    if found is not None and aggregate_column is None:
        return None  # a shard's filter, on a column status is not told
    expected = shard.row_filter(aggregate_column or "aggregate_id").as_string(conn)
    if _bare(found or "") != _bare(expected):
        return (
            f"publication {publication} does not publish the rows of shard {shard} of "
            f"{table.qualified} (its row filter is {found or 'none'}, not {expected}), so "
            "events would be lost or published twice; drop it and run cdc-relay setup-slot "
            f"--shards {shard.count} again"
        )
    return None


def _part_problem(
    publication: str,
    table: OutboxTable,
    found: str | None,
    left_out: Sequence[str],
    shard: Shard | None,
) -> str | None:
    """Why the publication publishes too little of ``table``: a column list (the walsender
    never sends the columns it leaves out, so events would lose a header or created_at, or
    stop the relay), or a row filter on a relay's that is not a shard's (the walsender never
    sends the rows it keeps out, so the slot would be confirmed past their events)."""
    remove = (
        f"(ALTER PUBLICATION {publication} SET TABLE {table.qualified}"
        f"{' WHERE (' + found + ')' if shard is not None and found else ''}, with the "
        "publication's other tables if it has any)"
    )
    if left_out:
        return (
            f"publication {publication} leaves column{'s' if len(left_out) > 1 else ''} "
            f"{', '.join(left_out)} of {table.qualified} out (a column list), so events would "
            "reach Kafka without what they hold or stop the relay; publish every column: "
            f"remove the column list {remove}"
        )
    if found is not None and shard is None:
        return (
            f"publication {publication} publishes only the rows of {table.qualified} where "
            f"{found}, so the events of its other rows are never decoded; remove the filter "
            f"{remove} and republish the rows it kept out, or stream a shard's publication "
            "with --shard K/N"
        )
    return None


def besides_problem(
    conn: psycopg.Connection[dict[str, Any]], publication: str, tables: Sequence[OutboxTable]
) -> str | None:
    """For a wal2json slot, which selects rows by the names of ``tables``: why the rows of
    a table ``publication`` publishes besides them (setup-slot lists a slot's outbox tables
    there) would be skipped, with the remedy; None when there is none (or no publication)."""
    row = _one(conn, "published_besides", publication=publication, oids=[t.oid for t in tables])
    others = row.get("tables")
    if not others:
        return None
    return (
        f"publication {publication} publishes {', '.join(others)} beside the outbox "
        f"table{'s' if len(tables) > 1 else ''} the wal2json slot selects by --table, so rows "
        f"of {others[0]} would be skipped: restart with --table {others[0]} added, or drop "
        f"it from the publication (ALTER PUBLICATION {publication} DROP TABLE {others[0]})"
    )


def inheritors_problem(
    conn: psycopg.Connection[dict[str, Any]],
    publication: str | None,
    tables: Sequence[OutboxTable],
) -> str | None:
    """Why the rows of a table that inherits from an outbox table would pass the stream
    unseen, with the remedy; None when there is none. ``publication``: the pgoutput slot's
    (which sends the rows of a table it publishes: a row that arrives from one stops the
    stream), None for a wal2json slot (which selects rows by the names of ``tables``)."""
    rows = conn.execute(
        QUERIES["inheritors"], {"oids": [t.oid for t in tables], "publication": publication}
    ).fetchall()
    missed = [row for row in rows if publication is None or not row["published"]]
    if not missed:
        return None
    child, outbox = missed[0]["name"], missed[0]["outbox"]
    if publication is None:
        unseen = "the wal2json slot selects rows by --table, so their events would be skipped"
        relay = ""
    else:
        unseen = f"publication {publication} does not publish it, so their events would be skipped"
        relay = f"ALTER PUBLICATION {publication} ADD TABLE {child}, then "
    return (
        f"table {child} inherits from the outbox table {outbox}: a SELECT of {outbox} shows "
        f"its rows, but {unseen}. Write the events into {outbox} itself, or relay {child} as "
        f"an outbox table too ({relay}restart with --table {child} added); rows written to it "
        "before then are not in the stream: republish them"
    )


def _bare(expression: str) -> str:
    """A row filter without what printing it adds or drops: quotes, parentheses, spaces,
    casts to text."""
    return re.sub(r'[()"\s]|::text', "", expression)


def _coverage_problem(
    conn: psycopg.Connection[dict[str, Any]], publication: str, table: OutboxTable
) -> str | None:
    row = _one(conn, "coverage", publication=publication, oid=table.oid)
    if not row:
        return f"publication {publication} does not exist; run cdc-relay setup-slot"
    if not row["covered"]:
        if table.partitioned and not row["via_root"]:
            return (
                f"publication {publication} publishes the partitions of {table.qualified} under "
                "their own names, not the table's; run ALTER PUBLICATION "
                f"{publication} SET (publish_via_partition_root = true)"
            )
        return (
            f"publication {publication} does not publish {table.qualified}, so its events "
            f"would not be relayed; run ALTER PUBLICATION {publication} ADD TABLE "
            f"{table.qualified}"
        )
    if not row["inserts"]:
        return (
            f"publication {publication} does not publish inserts; run ALTER PUBLICATION "
            f"{publication} SET (publish = 'insert')"
        )
    return None


@dataclass
class SetupReport:
    """What set-up found and did, in sentences for the user."""

    done: list[str]
    existing: list[str]
    statements: list[str]


def _one(conn: psycopg.Connection[dict[str, Any]], name: str, **params: Any) -> dict[str, Any]:
    row = conn.execute(QUERIES[name], params).fetchone()
    return row or {}


def preflight(conn: psycopg.Connection[dict[str, Any]], spec: SlotSpec) -> str:
    """Check everything logical replication of the outbox needs; return the table's name.

    Raises PreflightError with a remedy for the first unmet condition.
    """
    server = _one(conn, "server")
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
            "run setup-slot without --failover and see README 'Hot standby and database failover'"
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
    role = _one(conn, "role")
    if not role.get("can_replicate"):
        raise PreflightError(
            f"role {server['role']} lacks REPLICATION; run ALTER ROLE {server['role']} "
            "REPLICATION as a superuser (on managed services: grant the provider's "
            "replication role)"
        )
    table = _one(conn, "table", table=spec.table)
    if not table:
        raise PreflightError(
            f"table {spec.table} does not exist in database {server['database']}; "
            "create it with cdc-relay schema apply outbox (or setup-slot --create-table), or "
            "name yours with --table"
        )
    _check_standby(conn, server, spec, str(table["name"]))
    slot = _one(conn, "slot", slot=spec.slot)
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
    publication = _one(conn, "publication", publication=spec.publication)
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
    node = _one(conn, "standby")
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
    if not _one(conn, "publication", publication=spec.publication):
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


def _create_slot(conn: psycopg.Connection[dict[str, Any]], spec: SlotSpec) -> dict[str, Any]:
    """Create the slot; on a standby, say after a few seconds what its creation waits for."""
    query = QUERIES["create_failover_slot" if spec.failover else "create_slot"]
    params = {"slot": spec.slot, "plugin": spec.plugin}
    hint = None
    if _one(conn, "standby")["standby"]:
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
    that existed and is gone is made anew as ``gap`` says (lineage.py)."""
    report = SetupReport(done=[], existing=[], statements=[])
    with connect(dsn) as conn, ExitStack() as dry:
        for name in spec.tables if create_table else ():
            if _one(conn, "table", table=name):
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
        database = _one(conn, "server")["database"]

        publication = _one(conn, "publication", publication=spec.publication)
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
                    conn.execute(_comment(spec.publication, spec.comment))
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
        slot = _one(conn, "slot", slot=spec.slot)
        if slot:
            _check_slot(spec, database, slot)
            report.existing.append(
                f"slot {spec.slot} ({slot['plugin']}), confirmed up to "
                f"{slot['confirmed_flush_lsn']}"
            )
            if before is not None:
                line = lineage.existing(conn, spec.slot, slot, before, gap == "accept", dry_run)
                if line and not dry_run:
                    report.done.append(line)
        else:
            record = lineage.lost(conn, spec.slot, gap != "refuse") if usable else None
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
                    report.done.append(lineage.skipped(record, lsn))
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


def slot_problem(slot: dict[str, Any] | None, name: str, database: str) -> str | None:
    """Why the slot ``name`` (its row of queries.sql's ``slot``, None when missing) cannot
    vouch for the rows of an outbox in ``database``, with the remedy; None when it can."""
    remedy = "pass --slot the slot that cdc-relay stream reads"
    if slot is None:
        return f"replication slot {name} does not exist; {remedy}"
    if slot["slot_type"] != "logical":
        return f"slot {name} is a {slot['slot_type']} slot, which relays no events; {remedy}"
    if slot["database"] != database:
        return (
            f"slot {name} belongs to database {slot['database']}, not {database}: it relays "
            f"that database's events; {remedy} in {database}, or connect to {slot['database']}"
        )
    if slot["plugin"] not in PLUGINS:
        return (
            f"slot {name} decodes with {slot['plugin']}, which cdc-relay stream does not "
            f"read; {remedy} ({' or '.join(PLUGINS)})"
        )
    return None


def relay_problem(
    conn: psycopg.Connection[dict[str, Any]],
    plugin: str,
    slot: str,
    publication: str,
    table: OutboxTable,
) -> str | None:
    """Why the slot ``slot``, of ``plugin`` (one the relay reads), relays no rows of ``table``
    (``stream`` refuses it so), with the remedy; None when it does."""
    if plugin == "pgoutput":
        problem = coverage_problem(conn, publication, table)
        if problem is None:
            return None
        return f"{problem} (--publication names the one cdc-relay stream reads)"
    if table.partitioned:
        return (
            f"{table.qualified} is partitioned, and wal2json names each row by its partition, "
            f"so slot {slot} relays none of them; use a pgoutput slot"
        )
    # wal2json selects rows by the tables stream is given; setup-slot lists them in the
    # publication, and stream refuses to run without one listed there.
    row = _one(conn, "coverage", publication=publication, oid=table.oid)
    if not row:
        return (
            f"publication {publication} does not exist, and with a wal2json slot it is what "
            f"shows which tables the relay of slot {slot} selects (cdc-relay setup-slot lists "
            f"them there): nothing shows that the slot relays {table.qualified}; name the "
            "slot's publication with --publication"
        )
    if not row["covered"]:
        return (
            f"publication {publication}, which lists the tables the relay of wal2json slot "
            f"{slot} selects, does not list {table.qualified}, so the slot relays none of its "
            f"rows; if it should, run ALTER PUBLICATION {publication} ADD TABLE "
            f"{table.qualified} and give stream --table {table.qualified} too"
        )
    return None


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
        slot = _one(conn, "slot", slot=slot_name)
        found = _one(conn, "table", table=table)
        outbox = find_table(conn, table)
        published = bool(_one(conn, "publication", publication=publication))
        # Only a pgoutput slot reads the publication; one that is not there is shown as such.
        publication_problem = (
            coverage_problem(conn, publication, outbox, shard, aggregate_column=None)
            if outbox is not None and published and slot.get("plugin") == "pgoutput"
            else None
        )
        database = _one(conn, "server")["database"]
        problem = (
            slot_problem(slot, slot_name, database) or failover.slot_invalidated(slot_name, slot)
            if slot
            else lineage.gone(conn, slot_name)
            or failover.slot_gone(slot_name, _one(conn, "timeline").get("timeline"))
        )
        # What the slot was, and whether its publication changed since its relay verified it.
        kept = (
            lineage.find(conn, slot_name, str(slot["confirmed_flush_lsn"]), [outbox])
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
        missing = _one(conn, "poll_columns", oid=outbox.oid).get("missing") if outbox else None
        if found and outbox is not None and "processed_at" not in (missing or ()):
            # The dead letters of this table: the view outbox_dead_letters shows those of
            # outbox_events only, whichever table --table names. A table without retry_after
            # has none: its unprocessed rows alone.
            dead_letters = "retry_after" not in (missing or ())
            counts.update(store.counts(conn, outbox, dead_letters=dead_letters))
        rows = _confirmed_rows(conn, slot_name, outbox, wait) if relays and outbox else {}
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


def reshard(dsn: str, spec: SlotSpec, before: int, after: int) -> list[str]:
    """Create the ``after`` new shards of ``spec``, then write the cut at which the ``before``
    old ones stop and the new ones start (shards.py); return what was done, and what to do."""
    plan = prepare_reshard(dsn, spec, before, after)
    with connect(dsn) as conn, conn.transaction():
        at = write_cut(conn, plan)
    old = plan.old
    return [
        *plan.done,
        f"wrote resharding cut {at.cut} at {format_lsn(at.lsn or 0)}: the relays of "
        f"{', '.join(each.slot for each in old)} stop at it once they have delivered "
        "everything before it",
        f"start one relay per new shard: cdc-relay stream --shard K/{after} (K from 0 to "
        f"{after - 1}); they relay what comes after the cut",
        "once every old relay has stopped (exit 0, 'reached resharding cut' in its log), drop "
        "the old shards: cdc-relay drop-slot"
        + (f" --shards {before}" if old[0].shard is not None else "")
        + " --yes",
    ]


@dataclass(frozen=True)
class ReshardPlan:
    """A reshard whose new shards exist, its cut not yet written."""

    cut: StartAfterCut
    old: list[SlotSpec]
    new: dict[Shard, SlotSpec]
    done: list[str]


def prepare_reshard(dsn: str, spec: SlotSpec, before: int, after: int) -> ReshardPlan:
    """Check that the ``before`` shards of ``spec`` can be resharded, and create the ``after``
    new ones; the cut is written next (:func:`write_cut`)."""
    new = {shard: spec.sharded(shard) for shard in every_shard(after)}
    lines = []
    with connect(dsn) as conn:
        old = _streamed(conn, spec, before, after)
        for each in old:
            slot = _one(conn, "slot", slot=each.slot)
            if not slot:
                raise PreflightError(
                    f"slot {each.slot} does not exist, so the relays do not stream {before} "
                    "shard(s) of it; check --from and --slot"
                )
            if slot["plugin"] != "pgoutput":
                raise PreflightError(
                    f"slot {each.slot} uses {slot['plugin']}; shards need pgoutput slots: "
                    "move to one first (setup-slot --plugin pgoutput, then stream it)"
                )
            # The new publications publish --table alone: another table's rows after the cut
            # would be in no slot's stream.
            table = _one(conn, "table", table=spec.table).get("name")
            published = _one(conn, "publication", publication=each.publication).get("tables")
            others = [name for name in published or () if name != table]
            if others:
                raise PreflightError(
                    f"publication {each.publication} publishes {', '.join(others)} beside "
                    f"{table or spec.table}; reshard moves one outbox table to new shards, so "
                    "the rows of the others would be in no shard's stream after the cut: "
                    "reshard a publication of one table only"
                )
        for shard, each in new.items():
            if not (
                _one(conn, "slot", slot=each.slot)
                or _one(conn, "publication", publication=each.publication)
            ):
                continue
            comment = _one(conn, "publication_comment", publication=each.publication)
            done = StartAfterCut.from_comment(comment.get("comment"), shard)
            if done is not None and done.lsn is not None:
                raise PreflightError(
                    f"the {after} shards exist and start after resharding cut {done.cut}, "
                    f"written at {format_lsn(done.lsn)}: this reshard is done. Run their relays "
                    f"(stream --shard K/{after}); do not drop them, they hold the events after "
                    "the cut"
                )
            raise PreflightError(
                f"{each.slot} or its publication exists already, from a reshard that stopped "
                f"before writing its cut (no relay uses them): drop them (cdc-relay drop-slot "
                f"--shards {after} --yes) and run reshard again"
            )
    cut = StartAfterCut(str(uuid.uuid4()), None)
    for shard, each in new.items():
        report = setup(dsn, replace(each, comment=cut.comment(shard)), gap="cut")
        lines += report.done
    return ReshardPlan(cut, old, new, lines)


def write_cut(conn: psycopg.Connection[dict[str, Any]], plan: ReshardPlan) -> StartAfterCut:
    """Write the cut of ``plan`` in the open transaction of ``conn``: the message, then its
    position in the new publications' comments. The cut's place among the transactions is
    this transaction's commit, not the message's LSN: transactions that commit between the
    two are before the cut (the relays wait for the cut's commit, ARCHITECTURE.md)."""
    # The new slots exist: every transaction that commits from now on is in their streams.
    message = Cut(plan.cut.cut, tuple(each.slot for each in plan.old))
    row = conn.execute(
        QUERIES["emit_cut"], {"prefix": CUT_PREFIX, "content": message.content()}
    ).fetchone()
    at = StartAfterCut(plan.cut.cut, parse_lsn(str((row or {})["lsn"])))
    for shard, each in plan.new.items():
        conn.execute(_comment(each.publication, at.comment(shard)))
    return at


@dataclass(frozen=True)
class _Generation:
    """The slots of one shard count of a base name (``count`` 0: the slot without shards), and
    the resharding cut they start after: its position once written (``since``), whether one is
    named (``pending``: a reshard that stopped before writing it; no relay streams them)."""

    count: int
    specs: list[SlotSpec]
    since: Lsn | None
    pending: bool

    def __str__(self) -> str:
        slots = ", ".join(each.slot for each in self.specs)
        return f"the slot without shards ({slots})" if not self.count else f"{slots}"


def _streamed(
    conn: psycopg.Connection[dict[str, Any]], spec: SlotSpec, before: int, after: int
) -> list[SlotSpec]:
    """The slots ``reshard --from before`` cuts: those of ``before`` shards (1: the slot
    without shards, or the one shard a reshard --to 1 made, whichever came later). PreflightError
    when the relays stream another generation of slots of this name, made by a later reshard
    (or when which one they stream cannot be told): a cut naming slots they left would stop no
    relay, and the new shards would relay what follows it too."""
    counts = {0, 1} if before == 1 else {before}
    for name in _rows(conn, "slots_named_after", base=spec.slot):
        shard = shard_named(name["slot_name"], spec.slot)
        if shard is not None:
            counts.add(shard.count)
    generations = []
    for count in sorted(counts - {after}):
        specs = [spec] if not count else [spec.sharded(s) for s in every_shard(count)]
        if not any(_one(conn, "slot", slot=each.slot) for each in specs):
            continue
        cuts = [
            StartAfterCut.from_comment(
                _one(conn, "publication_comment", publication=each.publication).get("comment"),
                each.shard,
            )
            for each in specs
            if each.shard is not None
        ]
        cut = next((c for c in cuts if c is not None), None)
        since = cut.lsn if cut is not None else None
        pending = cut is not None and since is None
        generations.append(_Generation(count, specs, since, pending))
    mine = [g for g in generations if g.count in ((0, 1) if before == 1 else (before,))]
    if not mine:
        return [spec] if before == 1 else [spec.sharded(s) for s in every_shard(before)]
    chosen = max(mine, key=lambda g: -1 if g.since is None else g.since)
    for other in generations:
        if other is chosen or other.pending:
            continue
        if other.since is not None and (chosen.since is None or other.since > chosen.since):
            raise PreflightError(
                f"the relays stream {other} now (they start after the resharding cut at "
                f"{format_lsn(other.since)}), not {chosen}: a cut naming those would stop none "
                "of the relays, and old and new shards would both relay what follows it; run "
                f"reshard --from {other.count} --to {after}, and drop {chosen} once its relays "
                "have stopped (cdc-relay drop-slot)"
            )
        if other.since is None and chosen.since is None:
            raise PreflightError(
                f"{chosen} and {other} both exist, neither made by a reshard, so which the "
                "relays stream cannot be told; drop the one no relay streams (cdc-relay "
                "drop-slot) and run reshard again"
            )
    return chosen.specs


def _rows(
    conn: psycopg.Connection[dict[str, Any]], name: str, **params: Any
) -> list[dict[str, Any]]:
    return conn.execute(QUERIES[name], params).fetchall()


def _comment(publication: str, text: str) -> sql.Composed:
    return sql.SQL("COMMENT ON PUBLICATION {} IS {}").format(
        sql.Identifier(publication), sql.Literal(text)
    )


def _confirmed_rows(
    conn: psycopg.Connection[dict[str, Any]], slot: str, table: OutboxTable, wait: float
) -> dict[str, Any]:
    """The rows of ``table`` the slot has confirmed and the others (horizon.py); or why it
    cannot tell, when the slot has not confirmed the start's WAL position within ``wait``."""
    if _one(conn, "in_recovery")["standby"]:
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


def drop(dsn: str, spec: SlotSpec) -> list[str]:
    """Drop the slot and the publication; return what was removed."""
    removed = []
    with connect(dsn) as conn:
        slot = _one(conn, "slot", slot=spec.slot)
        if slot:
            if slot["active"]:
                raise PreflightError(
                    f"slot {spec.slot} is in use by process {slot['active_pid']}; "
                    "stop the relay first"
                )
            conn.execute(QUERIES["drop_slot"], {"slot": spec.slot})
            removed.append(f"slot {spec.slot}")
        if _one(conn, "publication", publication=spec.publication):
            conn.execute(
                sql.SQL(QUERIES["drop_publication"]).format(
                    publication=sql.Identifier(spec.publication)
                )
            )
            removed.append(f"publication {spec.publication}")
    return removed
