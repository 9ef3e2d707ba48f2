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

On a standby (decoding there, PostgreSQL 16+) nothing is kept: the table is the primary's,
and read-only there.
"""

from __future__ import annotations

import bisect
import logging
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg
from psycopg import sql
from psycopg.types.json import Jsonb

from cdc_relay import queries, schema
from cdc_relay.errors import PreflightError
from cdc_relay.lsn import Lsn, format_lsn, parse
from cdc_relay.postgres.tables import OutboxTable, untrusted_message, untrusted_owner
from cdc_relay.queries import QUERIES

log = logging.getLogger(__name__)

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
_REMEDY = "cdc-relay setup-slot --republish-since TIME"
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


def _hint(at: datetime | None) -> str:
    """What TIME ``--republish-since`` needs, from a moment the WAL had not passed the span's
    start yet."""
    if at is None:
        return (
            "TIME: the time of the old relay's last progress line less its lag and your longest "
            "transaction"
        )
    return (
        f"TIME: {at.isoformat(timespec='seconds')}, when the WAL had not reached it, less your "
        "longest transaction"
    )


def unproven(publication: str, what: str, when: str, start: str, at: datetime | None) -> str:
    """The one line that stops a relay (and refuses prune) when a change of ``publication``
    leaves its coverage since ``start`` unproven."""
    return (
        f"publication {publication} changed {when}: {what}. Rows it kept out then were not "
        "decoded, and nothing shows there were none, so the slot is not confirmed past "
        f"{start}: republish what was committed since (cdc-relay drop-slot, then {_REMEDY}; "
        f"{_hint(at)}), or accept the gap with cdc-relay setup-slot --accept-gap; then start "
        "the relay again"
    )


def _from(record: Lineage, confirmed: str) -> datetime | None:
    """A moment the WAL had not passed ``confirmed`` yet, if the row knows one."""
    if record.confirmed_from is None or parse(record.confirmed_lsn) > parse(confirmed):
        return None
    return record.confirmed_from


@dataclass(frozen=True)
class Found:
    """What the row of a slot says against trusting it, for those who read it at start."""

    record: Lineage | None
    missing: str | None
    """Why there is no row to go by, with the remedy; None when there is one (or on a
    standby, where nothing is kept)."""
    changed: str | None
    """How the publication changed since its relay verified it, with the remedies."""
    now: dict[str, dict[str, Any]]
    """What makes the publication publish the tables now (empty without one)."""


def find(
    conn: Connection,
    slot: str,
    confirmed: str,
    tables: Sequence[OutboxTable],
    stream: bool = False,
    reads: str | None = None,
) -> Found:
    """Read the row of ``slot`` (confirmed up to ``confirmed``) and compare what it verified of
    its publication with what makes that publish ``tables`` now. ``stream``: for a relay that
    starts, reading publication ``reads`` (None with a wal2json slot, which reads none): it
    must be the recorded one, and the role must be able to move the slot's position."""
    if standby(conn):
        return Found(None, None, None, {})
    allowed = access(conn)
    if not allowed.get("present"):
        return Found(
            None,
            f"table {TABLE}, where setup-slot records what each slot was, is missing; run "
            f"cdc-relay setup-slot once, which makes it and records slot {slot} as it is",
            None,
            {},
        )
    if not allowed.get("readable") or (stream and not allowed.get("movable")):
        role = (conn.execute(QUERIES["server"]).fetchone() or {}).get("role")
        grant = MOVABLE if stream else "SELECT"
        return Found(
            None,
            f"role {role} may not {'read and move' if stream else 'read'} the lineage of slot "
            f"{slot} in {TABLE}; GRANT {grant} ON {TABLE} TO {role} (cdc-relay schema show "
            "roles grants it to the roles it makes)",
            None,
            {},
        )
    record = read(conn, slot)
    if record is None:
        return Found(
            None,
            f"slot {slot} has no lineage in {TABLE} (it was made by hand, or before cdc-relay "
            "kept them), so nothing shows what its publication covered; run cdc-relay "
            "setup-slot once, which records it as it is",
            None,
            {},
        )
    publication = reads if stream else record.publication
    if publication is None:
        return Found(record, None, None, {})
    now = published(conn, publication, tables)
    if record.publication is not None and record.publication != publication:
        what = f"slot {slot} was streamed through publication {record.publication} until now"
    else:
        what = change(record.published, now, publication) or ""
    if not what:
        return Found(record, None, None, now)
    since = record.verified_lsn or record.created_lsn
    return Found(
        record,
        None,
        unproven(
            publication,
            what,
            f"since the relay of slot {slot} last verified it at {since}",
            confirmed,
            _from(record, confirmed),
        ),
        now,
    )


def check_stream(
    conn: Connection,
    slot: str,
    slot_row: Mapping[str, Any],
    publication: str,
    tables: Sequence[OutboxTable],
) -> None:
    """At ``stream``'s start, of ``slot`` (its row of queries.sql's ``slot``) and
    ``publication`` (which a wal2json slot does not read): refuse a slot without a row, or one
    whose publication changed since its relay verified it; record the tables new to it (a
    table added to the publication and to ``--table``: its rows from before are the
    operator's, as the stop that asked for it said)."""
    read = publication if slot_row["plugin"] == "pgoutput" else None
    confirmed = str(slot_row["confirmed_flush_lsn"])
    found = find(conn, slot, confirmed, tables, stream=True, reads=read)
    problem = found.missing or found.changed
    if problem is not None:
        raise PreflightError(problem)
    record = found.record
    if record is not None and read is not None and found.now != record.published:
        _record_published(conn, slot, read, found.now)


def _record_published(
    conn: Connection, slot: str, publication: str, now: dict[str, dict[str, Any]]
) -> None:
    wal = (conn.execute(QUERIES["wal_lsn"]).fetchone() or {}).get("lsn", "0/0")
    conn.execute(
        QUERIES["lineage_published"],
        {"slot": slot, "publication": publication, "published": Jsonb(now), "lsn": wal},
    )


def gone(conn: Connection, slot: str) -> str | None:
    """Why ``slot``, missing, is not to be made anew without a remedy: it existed (its row is
    there); None when it has no row (it never existed, as far as anything shows)."""
    found = record(conn, slot)
    if found is None:
        return None
    server = conn.execute(QUERIES["lineage_server"]).fetchone() or {}
    timeline = (conn.execute(QUERIES["timeline"]).fetchone() or {}).get("timeline")
    if found.system_id and server.get("system_id") and found.system_id != server["system_id"]:
        why = (
            f"it was made on another server (system identifier {found.system_id}, this one's "
            f"is {server['system_id']}): the database was restored or copied here"
        )
    elif found.timeline and timeline and timeline != found.timeline:
        why = (
            f"the server was promoted since (timeline {found.timeline} then, {timeline} now) "
            "and the slot, no failover slot, stayed behind"
        )
    else:
        why = "it was dropped (drop-slot, or by hand, maybe once PostgreSQL invalidated it)"
    return (
        f"slot {slot} existed and is gone: made by {found.made} at {found.created_lsn} on "
        f"{found.created_at.isoformat(timespec='seconds')} and confirmed up to "
        f"{found.confirmed_lsn} at least; {why}. Made anew at the WAL's position now it would "
        f"skip every event committed since {found.confirmed_lsn}: make it with {_REMEDY}, which "
        f"publishes those first ({_hint(found.confirmed_from)}), or with cdc-relay setup-slot "
        "--accept-gap to skip them"
    )


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


def lost(conn: Connection, slot: str, accept_gap: bool) -> Lineage | None:
    """Set-up of ``slot``, which is missing: PreflightError when it existed, unless
    ``accept_gap``; its row, if any."""
    problem = gone(conn, slot)
    if problem is not None and not accept_gap:
        raise PreflightError(problem)
    return read(conn, slot) if problem is not None else None


def skipped(record: Lineage, lsn: str) -> str:
    """What ``--accept-gap`` skipped, for set-up's report."""
    since = (
        f", from {record.confirmed_from.isoformat(timespec='seconds')} on,"
        if record.confirmed_from
        else ""
    )
    return (
        f"skipped the WAL from {record.confirmed_lsn} to {lsn} (--accept-gap): events committed "
        f"there{since} are not relayed"
    )


def existing(
    conn: Connection,
    slot: str,
    slot_row: Mapping[str, Any],
    before: Before,
    accept_gap: bool,
    dry_run: bool,
) -> str | None:
    """Set-up of ``slot``, which exists: record it if it has no row; refuse (unless
    ``accept_gap``: then record the publication as it is) when its publication changed since
    its relay verified it. What was done, for set-up's report."""
    confirmed = str(slot_row["confirmed_flush_lsn"])
    record = read(conn, slot)
    if record is None:
        if not dry_run:
            how = "an earlier set-up (found by setup-slot)"
            made(conn, slot, str(slot_row["plugin"]), before, how, confirmed, None)
        return (
            f"recorded the lineage of slot {slot}, found confirmed up to {confirmed} (a change "
            "of its publication before now cannot be found)"
        )
    if before.publication is None:
        return None
    if record.publication is not None and record.publication != before.publication:
        what: str | None = f"slot {slot} was streamed through publication {record.publication}"
    else:
        what = change(record.published, before.published, before.publication)
    if what is None:
        return None
    since = record.verified_lsn or record.created_lsn
    if not accept_gap:
        raise PreflightError(
            unproven(
                before.publication,
                what,
                f"since the relay of slot {slot} last verified it at {since}",
                confirmed,
                _from(record, confirmed),
            )
        )
    if not dry_run:
        conn.execute(
            QUERIES["lineage_published"],
            {
                "slot": slot,
                "publication": before.publication,
                "published": Jsonb(before.published),
                "lsn": before.lsn,
            },
        )
    return (
        f"accepted (--accept-gap): publication {before.publication} changed since the relay of "
        f"slot {slot} last verified it at {since}; {what}. Rows it kept out of the WAL from "
        f"{confirmed} to {before.lsn} are not relayed; recorded the publication as it is now"
    )


# -- the watcher's side ----------------------------------------------------------------------


class Watch:
    """The watcher's share (watch.py): at each look, what makes the publication publish the
    tables is compared with the look before (at the first, with what the last relay verified);
    now and then, the slot's confirmed position goes into its row, with a moment the WAL had
    not passed it yet."""

    def __init__(self, slot: str, publication: str | None) -> None:
        self._slot = slot
        self._publication = publication
        self._before: dict[str, Any] | None = None  # None until the first look
        self._since: str | None = None  # where the last relay verified it, at the first look
        # (WAL position, a moment it had not been passed yet) of each look, oldest first: the
        # newest at or before the slot's position says when the WAL had not passed that yet.
        self._passed: deque[tuple[Lsn, datetime]] = deque(maxlen=3600)
        self._warned = False

    def passed(self, lsn: Lsn, at: datetime) -> None:
        """A look read the WAL at ``lsn``, which it had not passed yet at ``at``."""
        if not self._passed or lsn >= self._passed[-1][0]:
            self._passed.append((lsn, at))

    def change(
        self, conn: Connection, tables: Sequence[OutboxTable], verified: Lsn, lsn: Lsn
    ) -> str | None:
        """Why the stream must stop: the publication changed since the last look (which
        verified up to ``verified``; this one read the WAL at ``lsn``), with the remedies."""
        publication = self._publication
        if publication is None:
            return None
        now = published(conn, publication, tables)
        if self._before is None:
            last = record(conn, self._slot)
            self._before = {}
            if last is not None and last.publication == publication:
                self._before = dict(last.published)
                self._since = last.verified_lsn or last.created_lsn
        what = change(self._before, now, publication)
        if what is None:
            for oid, seen in now.items():
                self._before.setdefault(oid, seen)
            self._since = None
            return None
        if self._since is not None:
            when = f"since the relay of slot {self._slot} last verified it at {self._since}"
        else:
            when = (
                f"while the relay streamed, between two looks (at {format_lsn(verified)} and "
                f"{format_lsn(lsn)})"
            )
        start = format_lsn(verified) if verified else "its position at start"
        return unproven(publication, what, when, start, self._moment(verified))

    def _moment(self, lsn: Lsn) -> datetime | None:
        """The moment of the newest look whose WAL position is at or before ``lsn``."""
        index = bisect.bisect_right([each[0] for each in self._passed], lsn)
        return self._passed[index - 1][1] if index else None

    def confirmed(self, conn: Connection, slot_row: Mapping[str, Any], verified: Lsn) -> None:
        """Move the slot's row to its confirmed position (``slot_row``'s), if a look knows a
        moment the WAL had not passed it yet; never back."""
        confirmed = parse(str(slot_row["confirmed_flush_lsn"]))
        at = self._moment(confirmed)
        if at is None:
            return
        while len(self._passed) > 1 and self._passed[1][0] <= confirmed:
            self._passed.popleft()  # never needed again: the slot is not confirmed backwards
        try:
            conn.execute(
                QUERIES["lineage_confirmed"],
                {
                    "slot": self._slot,
                    "lsn": format_lsn(confirmed),
                    "at": at,
                    "verified": format_lsn(verified),
                },
            )
        except psycopg.OperationalError:
            raise
        except psycopg.DatabaseError as exc:
            if not self._warned:
                self._warned = True
                log.warning(
                    "cannot move the lineage of slot %s in %s, so a loss of the slot would be "
                    "said to skip more than it does: %s",
                    self._slot,
                    TABLE,
                    str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__,
                    extra={"action": "lineage_failed"},
                )
