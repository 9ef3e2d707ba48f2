"""What a slot's lineage (lineage.py) says against trusting the slot, as the gaps it would
leave in the stream (ARCHITECTURE.md, invariants 13 and 14).

- A slot that existed and is gone (``gone``): made anew at the WAL's position now, it would
  skip whatever was committed after its row's position; set-up refuses unless told how to
  make it (``lost``), and says what ``--accept-gap`` skipped (``skipped``).
- A publication changed since its relay verified it: the rows it kept out meanwhile were not
  decoded, and nothing shows there were none. Found at start by ``status`` and ``prune
  --slot`` (``find``), ``stream`` (``check_stream``) and set-up (``existing``), and by the
  watcher at each look (``Watch``); each stops in one line, naming the span and the remedies
  (``unproven``).
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

from cdc_relay.errors import PreflightError
from cdc_relay.lsn import Lsn, format_lsn, parse
from cdc_relay.postgres import lineage
from cdc_relay.postgres.lineage import MOVABLE, TABLE, Before, Connection, Lineage
from cdc_relay.postgres.tables import OutboxTable
from cdc_relay.queries import QUERIES

log = logging.getLogger(__name__)

_REMEDY = "cdc-relay setup-slot --republish-since TIME"


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
    if lineage.standby(conn):
        return Found(None, None, None, {})
    allowed = lineage.access(conn)
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
    record = lineage.read(conn, slot)
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
    now = lineage.published(conn, publication, tables)
    if record.publication is not None and record.publication != publication:
        what = f"slot {slot} was streamed through publication {record.publication} until now"
    else:
        what = lineage.change(record.published, now, publication) or ""
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
        wal = (conn.execute(QUERIES["wal_lsn"]).fetchone() or {}).get("lsn", "0/0")
        lineage.verified(conn, slot, read, found.now, wal)


def gone(conn: Connection, slot: str) -> str | None:
    """Why ``slot``, missing, is not to be made anew without a remedy: it existed (its row is
    there); None when it has no row (it never existed, as far as anything shows)."""
    found = lineage.record(conn, slot)
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


# -- set-up: slot.setup --------------------------------------------------------------------


def lost(conn: Connection, slot: str, accept_gap: bool) -> Lineage | None:
    """Set-up of ``slot``, which is missing: PreflightError when it existed, unless
    ``accept_gap``; its row, if any."""
    problem = gone(conn, slot)
    if problem is not None and not accept_gap:
        raise PreflightError(problem)
    return lineage.read(conn, slot) if problem is not None else None


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
    record = lineage.read(conn, slot)
    if record is None:
        if not dry_run:
            how = "an earlier set-up (found by setup-slot)"
            lineage.made(conn, slot, str(slot_row["plugin"]), before, how, confirmed, None)
        return (
            f"recorded the lineage of slot {slot}, found confirmed up to {confirmed} (a change "
            "of its publication before now cannot be found)"
        )
    if before.publication is None:
        return None
    if record.publication is not None and record.publication != before.publication:
        what: str | None = f"slot {slot} was streamed through publication {record.publication}"
    else:
        what = lineage.change(record.published, before.published, before.publication)
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
        lineage.verified(conn, slot, before.publication, before.published, before.lsn)
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
        now = lineage.published(conn, publication, tables)
        if self._before is None:
            last = lineage.record(conn, self._slot)
            self._before = {}
            if last is not None and last.publication == publication:
                self._before = dict(last.published)
                self._since = last.verified_lsn or last.created_lsn
        what = lineage.change(self._before, now, publication)
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
            lineage.confirmed(conn, self._slot, format_lsn(confirmed), at, format_lsn(verified))
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
