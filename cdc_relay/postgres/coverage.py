"""What a publication publishes of an outbox table, and so what a slot relays of it.

Every insert, every column and every row of the table (``coverage_problem``; a shard's
publication: exactly the shard's rows), no table beside those a wal2json slot selects by name
(``besides_problem``), no table inheriting from an outbox table whose rows would pass unseen
(``inheritors_problem``); a slot the relay reads (``slot_problem``) that relays the table
(``relay_problem``). Set-up, ``stream``, the watcher, ``status`` and ``prune --slot`` ask
these; each problem comes with its remedy.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import psycopg

from cdc_relay.postgres.connection import one_row
from cdc_relay.postgres.shards import Shard
from cdc_relay.postgres.tables import OutboxTable
from cdc_relay.queries import QUERIES

PLUGINS = ("pgoutput", "wal2json")
MIN_SHARDS_VERSION_NUM = 150000  # publication row filters


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
    part = one_row(conn, "published_part", publication=publication, oid=table.oid)
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
    row = one_row(conn, "published_besides", publication=publication, oids=[t.oid for t in tables])
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
    row = one_row(conn, "coverage", publication=publication, oid=table.oid)
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
    row = one_row(conn, "coverage", publication=publication, oid=table.oid)
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
