"""What each replication slot was and what its publication covered, kept in the database
(table ``cdc_relay_slots`` of schema outbox) so that it outlives every relay: ARCHITECTURE.md,
invariants 13 and 14.

- A slot's row is written by set-up when it makes the slot (the cluster, its timeline, where
  the slot starts) and moved by the relay's watcher every ten seconds or so (how far the slot
  is confirmed, and a moment the WAL had not passed that yet). A slot that is missing while
  its row is there existed and is gone: made anew at the WAL's position now, it would skip
  whatever was committed after the row's position, so set-up refuses unless it is told how to
  make it (``--republish-since`` publishes that first; ``--accept-gap`` skips it, saying so),
  and ``stream`` and ``status`` say the same.
- The row also holds what makes the slot's publication publish each outbox table, as the
  identities of the catalog rows that say so (``publication_identity`` in queries.sql): a
  change of membership, row filter, column list or publish options makes one of them anew (a
  new OID) or alters it (a new xmin), and no change ever brings an old identity back. The same
  identities at two looks therefore mean that nothing changed in between, whatever was done
  and undone. The watcher compares them at each look with the one before, and at its first
  with what the last relay verified; ``stream``, ``setup-slot``, ``status`` and ``prune
  --slot`` compare them at start. A change that cannot be shown harmless stops each in one
  line, naming the span and the remedies.

What a row says against trusting its slot (the slot gone, the publication changed unseen) is
gaps.py's.

On a standby (decoding there, PostgreSQL 16+) nothing is kept: the table is the primary's,
and read-only there.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg
from psycopg import sql
from psycopg.types.json import Jsonb

from cdc_relay import queries, schema
from cdc_relay.errors import PreflightError
from cdc_relay.postgres.tables import OutboxTable, untrusted_message, untrusted_owner
from cdc_relay.queries import QUERIES

TABLE = "cdc_relay_slots"
DDL = queries.parse(schema.text("outbox"))["slot_lineage"]
"""The table's statement, the last of schema outbox (one text for both)."""

Connection = psycopg.Connection[dict[str, Any]]

_IDENTITY = (
    "publication",
    "publication_xmin",
    "entry",
    "entry_xmin",
    "schema_entry",
    "schema_entry_xmin",
)
_NO_SCHEMAS = sql.SQL(
    "(SELECT NULL::oid AS oid, NULL::xid AS xmin, NULL::oid AS pnpubid, NULL::oid AS pnnspid "
    "WHERE false)"
)
MOVABLE = "SELECT, UPDATE (confirmed_lsn, confirmed_from, published, verified_lsn)"
"""What ``stream`` needs of the table (schema roles grants it to the stream role)."""


@dataclass(frozen=True)
class Lineage:
    """A slot's row."""

    slot: str
    plugin: str
    system_id: str | None
    timeline: int | None
    made: str
    created_lsn: str
    created_at: datetime
    confirmed_lsn: str
    confirmed_from: datetime | None
    publication: str | None
    published: dict[str, Any]
    verified_lsn: str | None

    def as_json(self) -> dict[str, Any]:
        """For ``status --json``."""
        return {
            "made": self.made,
            "created_lsn": self.created_lsn,
            "created_at": self.created_at.isoformat(),
            "system_id": self.system_id,
            "timeline": self.timeline,
            "confirmed_lsn": self.confirmed_lsn,
            "confirmed_from": self.confirmed_from.isoformat() if self.confirmed_from else None,
            "publication": self.publication,
            "published": self.published,
            "verified_lsn": self.verified_lsn,
        }


def standby(conn: Connection) -> bool:
    row = conn.execute(QUERIES["in_recovery"]).fetchone()
    return bool((row or {}).get("standby"))


def access(conn: Connection) -> dict[str, Any]:
    """Whether the table exists (``present``), and whether this role may read it
    (``readable``), move a slot's position there (``movable``), make rows (``writable``)."""
    return conn.execute(QUERIES["lineage_access"]).fetchone() or {}


def read(conn: Connection, slot: str) -> Lineage | None:
    """The row of ``slot``; None when it has none."""
    row = conn.execute(QUERIES["lineage"], {"slot": slot}).fetchone()
    return None if row is None else Lineage(**row)


def record(conn: Connection, slot: str) -> Lineage | None:
    """The row of ``slot`` where rows are kept and this role may read them; None otherwise."""
    if standby(conn) or not access(conn).get("readable"):
        return None
    return read(conn, slot)


def published(
    conn: Connection, publication: str, tables: Sequence[OutboxTable]
) -> dict[str, dict[str, Any]]:
    """What makes ``publication`` publish each of ``tables`` now, by table OID (as text, the
    way the row's JSON keeps it): the identities of the catalog rows, and what they say."""
    schemas = (
        sql.Identifier("pg_catalog", "pg_publication_namespace")
        if conn.info.server_version >= 150000
        else _NO_SCHEMAS
    )
    rows = conn.execute(
        sql.SQL(QUERIES["publication_identity"]).format(schemas=schemas),
        {"oids": [table.oid for table in tables], "publication": publication},
    ).fetchall()
    names = {table.oid: table.qualified for table in tables}
    return {
        str(row["oid"]): {
            "table": names[row["oid"]],
            "identity": [row[key] for key in _IDENTITY],
            "publish": row["publish"],
            "via_root": row["via_root"],
            "all_tables": row["all_tables"],
            "filtered": row["filtered"],
            "columns": row["columns"],
        }
        for row in rows
    }


def change(before: Mapping[str, Any], now: Mapping[str, Any], publication: str) -> str | None:
    """What changed in ``publication`` between two looks (``published``'s), for the tables
    seen at both, and a table that is another one under a name seen before; None when nothing
    did."""
    names = {was["table"]: oid for oid, was in before.items()}
    for oid, seen in now.items():
        was = before.get(oid)
        if was is None and names.get(seen["table"], oid) != oid:
            # Dropped and made again: the new table's rows from before it was published again
            # were never decoded.
            return (
                f"{seen['table']} is another table than the one it published (dropped and made "
                "again)"
            )
        if was is None or list(was["identity"]) == list(seen["identity"]):
            continue
        old, new = list(was["identity"]), list(seen["identity"])
        table = seen["table"]
        if old[0] != new[0]:
            return f"it was dropped and made again (publication {publication} is a new one)"
        if old[1] != new[1]:
            return (
                "ALTER PUBLICATION altered it (its publish options, publish_via_partition_root, "
                f"owner or name), and it publishes '{seen['publish']}' now"
            )
        if old[2:4] != new[2:4]:
            verb = "made again" if old[2] != new[2] else "altered"
            return (
                f"its entry for {table} was {verb}: {table} was dropped from it and added back, "
                "or a row filter or column list was put on it or taken off"
            )
        return f"its entry for the schema of {table} was made again or altered"
    return None


# -- set-up: slot.setup, and the jobs that make a slot where a backlog ends (handover.py) --


@dataclass(frozen=True)
class Before:
    """What set-up saw just before making a slot: the server, a WAL position the slot will
    start at or after and a moment the WAL had not passed it, and what makes the publication
    publish the tables (read before, so that a change made meanwhile is found later)."""

    system_id: str | None
    timeline: int | None
    lsn: str
    at: datetime
    publication: str | None
    published: dict[str, dict[str, Any]]


def prepare(conn: Connection, dry_run: bool) -> tuple[bool, str]:
    """Make the table when it is missing (set-up's), unless ``dry_run``. Whether rows can be
    read and written now (not on a standby, where nothing is kept, nor in a dry run before
    the table is made), and the statement for a dry run's list ("" when none is needed).
    PreflightError when the table is there and this role may not make rows in it."""
    if standby(conn):
        return False, ""
    allowed = access(conn)
    if not allowed.get("present"):
        if dry_run:
            return False, f"{DDL};"
        conn.execute(DDL)
        return True, f"{DDL};"
    owner = untrusted_owner(conn, TABLE)
    if owner is not None:
        raise PreflightError(
            untrusted_message(TABLE, owner, "setup-slot records what each slot was")
        )
    if not allowed.get("writable"):
        role = (conn.execute(QUERIES["server"]).fetchone() or {}).get("role")
        raise PreflightError(
            f"role {role} may not write {TABLE}, where setup-slot records what each slot was; "
            f"GRANT SELECT, INSERT, UPDATE ON {TABLE} TO {role}, or run setup-slot as its owner"
        )
    return True, ""


def look(conn: Connection, plugin: str, publication: str, tables: Sequence[OutboxTable]) -> Before:
    """What a slot's row says of its start: read just before the slot is made."""
    server = conn.execute(QUERIES["lineage_server"]).fetchone() or {}
    timeline = (conn.execute(QUERIES["timeline"]).fetchone() or {}).get("timeline")
    pgoutput = plugin == "pgoutput"
    return Before(
        system_id=server.get("system_id"),
        timeline=timeline,
        lsn=str(server["lsn"]),
        at=server["at"],
        publication=publication if pgoutput else None,
        published=published(conn, publication, tables) if pgoutput else {},
    )


def made(
    conn: Connection,
    slot: str,
    plugin: str,
    before: Before,
    how: str,
    lsn: str,
    at: datetime | None,
) -> None:
    """Record ``slot``, made by ``how`` and confirmed at ``lsn`` (where it starts, or where it
    was found), which the WAL had not passed yet at ``at`` (None: unknown)."""
    conn.execute(
        QUERIES["lineage_made"],
        {
            "slot": slot,
            "plugin": plugin,
            "system_id": before.system_id,
            "timeline": before.timeline,
            "made": how,
            "lsn": lsn,
            "at": at,
            "publication": before.publication,
            "published": Jsonb(before.published),
            "verified": before.lsn,
        },
    )


# -- moved since: the publication as a relay verified it, how far the slot is confirmed ----


def verified(
    conn: Connection, slot: str, publication: str, now: dict[str, dict[str, Any]], lsn: str
) -> None:
    """Record what the relay of ``slot`` (or setup-slot --accept-gap) verified of
    ``publication``: what makes it publish the tables (``published``'s), as of ``lsn``."""
    conn.execute(
        QUERIES["lineage_published"],
        {"slot": slot, "publication": publication, "published": Jsonb(now), "lsn": lsn},
    )


def confirmed(conn: Connection, slot: str, lsn: str, at: datetime, verified: str) -> None:
    """Move ``slot``'s row to ``lsn``, which the WAL had not passed yet at ``at`` (and its
    publication verified up to ``verified``); never back."""
    conn.execute(
        QUERIES["lineage_confirmed"],
        {"slot": slot, "lsn": lsn, "at": at, "verified": verified},
    )
