"""Background checks of what the stream depends on, on their own connection: each outbox table
(by identity) is still there and still published, and how much WAL the slot retains (and, for
a failover slot, whether a standby holds a usable copy: failover_ready.py).

A check reads the WAL insert position first and then the catalog: when every table is still
published in that later snapshot, every transaction that committed before the position was
decoded with the tables published. The stream confirms no position past the last such check
(``verified``), so a publication that stops covering any one table stops the relay before the
slot moves past an event that was never decoded.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

import psycopg
from psycopg.rows import dict_row

from cdc_relay.lsn import Lsn, parse
from cdc_relay.metrics import observe_slot
from cdc_relay.postgres import gaps
from cdc_relay.postgres.coverage import besides_problem, coverage_problem, inheritors_problem
from cdc_relay.postgres.failover_ready import FailoverWatch
from cdc_relay.postgres.shards import Shard
from cdc_relay.postgres.tables import OutboxTable, table_by_oid
from cdc_relay.queries import QUERIES

log = logging.getLogger(__name__)


class Watcher:
    """Checks every ``interval`` seconds in a thread; the stream reads ``verified`` and
    ``problem``."""

    def __init__(
        self,
        dsn: str,
        slot: str,
        tables: Sequence[OutboxTable],
        publication: str | None,
        interval: float = 1.0,
        wal_interval: float = 10.0,
        shard: Shard | None = None,
        aggregate_column: str = "aggregate_id",
        listing: str | None = None,
    ) -> None:
        self._dsn = dsn
        self._slot = slot
        self.tables = list(tables)  # as named now: renames are followed
        # None: the plugin selects rows by table name (wal2json), so the name must not change.
        self._publication = publication
        self._shard = shard  # whose row filter the publication must keep
        self._aggregate_column = aggregate_column
        # wal2json: the publication that lists the outbox tables; one more there is a table
        # whose rows the slot skips (it selects rows by the names of ours).
        self._listing = listing
        # What makes the publication publish each table, compared at each look with the look
        # before; the slot's position moved in its row now and then (gaps.py).
        self._lineage = gaps.Watch(slot, publication)
        # Handed the slot's row at each sample: a failover slot's standbys are asked then.
        self._failover = FailoverWatch(dsn, slot)
        self._interval = interval
        self._wal_every = max(1, round(wal_interval / interval))
        self.verified: Lsn = 0
        """A WAL position before which every commit was decoded with every table published."""
        self.problem: str | None = None
        """Why the stream must stop, with the remedy; set once."""
        self.shutting_down = False
        """The server refuses new connections because it is shutting down: it waits for the
        walsender to have every WAL position confirmed, and no transaction commits any more."""
        self._failing = False
        self._stop = threading.Event()
        self._wake = threading.Event()  # a check is wanted now
        self._done = threading.Condition()
        self._checks = 0  # checks begun
        self._checked = 0  # checks done
        self._conn: psycopg.Connection[dict[str, Any]] | None = None
        self._thread = threading.Thread(target=self._run, name="watcher", daemon=True)

    def start(self) -> Watcher:
        """Check once now (the stream confirms nothing before), then in the background."""
        self._failover.start()
        self._check_safely(0)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._failover.stop()

    def check_now(self, timeout: float = 5.0) -> None:
        """Have a check begin now and wait (bounded: the database may be unreachable) until
        it is done, so that ``verified`` reaches the WAL's position now: a relay's last
        confirmation then covers everything it delivered."""
        with self._done:
            wanted = self._checks + 1
        self._wake.set()
        with self._done:
            self._done.wait_for(lambda: self._checked >= wanted, timeout)

    def _run(self) -> None:
        rounds = 1
        while True:
            self._wake.wait(self._interval)
            self._wake.clear()
            if self._stop.is_set():
                break
            with self._done:
                self._checks += 1
                begun = self._checks
            self._check_safely(rounds)
            with self._done:
                self._checked = begun
                self._done.notify_all()
            rounds += 1
        if self._conn is not None:
            self._conn.close()

    def _check_safely(self, rounds: int) -> None:
        try:
            if self._conn is None or self._conn.closed:
                self._conn = self._connect()
            self._check(self._conn, wal=rounds % self._wal_every == 0)
        except psycopg.Error as exc:
            # Nothing is verified meanwhile, so nothing new is confirmed: unless the server is
            # shutting down, which waits for the walsender to have everything confirmed.
            session = self._conn is not None  # the check failed, not the connection attempt
            if self._conn is not None:
                self._conn.close()
            self._conn = None
            self.shutting_down = _shutting_down(exc)
            if session and not self.shutting_down:
                # Our session ended: a fast shutdown ends it with admin_shutdown (57P01), and
                # so does pg_terminate_backend, or a connection pooler or network may cut it.
                # Only a server shutting down refuses a new session, so one is asked for now.
                try:
                    self._conn = self._connect()
                except psycopg.Error as again:
                    self.shutting_down = _shutting_down(again)
            if not self._failing and not self.shutting_down:
                log.warning(
                    "cannot check the outbox table and its publication, so the slot is not "
                    "confirmed further until it can: %s",
                    str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__,
                    extra={"action": "watch_failed"},
                )
            self._failing = True
        else:
            self._failing = self.shutting_down = False

    def _connect(self) -> psycopg.Connection[dict[str, Any]]:
        return psycopg.connect(self._dsn, autocommit=True, row_factory=dict_row)

    def _check(self, conn: psycopg.Connection[dict[str, Any]], wal: bool) -> None:
        if self.problem is not None:
            return
        row = conn.execute(QUERIES["wal_lsn"]).fetchone() or {}
        lsn = parse(row["lsn"])
        self._lineage.passed(lsn, row["at"])
        for index, table in enumerate(self.tables):
            self.problem = self._table_problem(conn, table, index)
            if self.problem is not None:
                return  # the tables checked so far may be fine: verified stays where it was
        # Published whole now, and at the look before: and in between? Only if nothing that
        # makes the publication publish them was made again or altered meanwhile.
        self.problem = self._lineage.change(conn, self.tables, self.verified, lsn)
        if self.problem is not None:
            return
        # A table made to inherit from the outbox after the last check has no row committed
        # before the WAL position read above: it stops the stream before the slot passes one.
        self.problem = inheritors_problem(conn, self._publication, self.tables)
        if self.problem is not None:
            return
        if self._listing is not None:
            self.problem = besides_problem(conn, self._listing, self.tables)
            if self.problem is not None:
                self.problem = "while streaming, " + self.problem
                return
        self.verified = max(self.verified, lsn)
        if wal:
            slot = conn.execute(QUERIES["slot"], {"slot": self._slot}).fetchone()
            if slot:
                observe_slot(slot)
                self._failover.sample(slot)
                if not row["standby"]:  # a standby's lineage is not kept: it is read-only
                    self._lineage.confirmed(conn, slot, self.verified)

    def _table_problem(
        self, conn: psycopg.Connection[dict[str, Any]], table: OutboxTable, index: int
    ) -> str | None:
        """Why the stream must stop for ``table`` (the ``index``-th), or None; follows a
        rename (pgoutput)."""
        problem = None
        now = table_by_oid(conn, table.oid)
        if now is None:
            problem = (
                f"the outbox table {table.qualified} was dropped; events committed before "
                "that were relayed, nothing after was confirmed. Recreate it and add it to the "
                "publication (rows written to it before then are not in the stream: republish "
                "them), or point --table at the new outbox, then restart"
            )
        elif (now.schema, now.name) != (table.schema, table.name):
            if self._publication is None:
                problem = (
                    f"the outbox table {table.qualified} was renamed to {now.qualified}; "
                    "the wal2json slot selects rows by table name, so rows written under the "
                    "new name are not decoded. Rename it back (and republish the rows written "
                    "meanwhile), or use a pgoutput slot, which follows the table by identity"
                )
            else:
                log.warning(
                    "the outbox table %s is now %s; following it",
                    table.qualified,
                    now.qualified,
                    extra={"action": "table_renamed", "table": now.qualified},
                )
                self.tables[index] = table = now
        if problem is None and self._publication is not None:
            problem = coverage_problem(
                conn, self._publication, table, self._shard, self._aggregate_column
            )
            if problem is not None:
                problem += (
                    "; rows written since were not decoded: republish them after the fix, "
                    "then restart the relay"
                )
        return problem


def _shutting_down(exc: psycopg.Error) -> bool:
    """Whether ``exc`` is the refusal of a new session by a server that is shutting down
    (cannot_connect_now, which libpq reports without its SQLSTATE)."""
    return exc.sqlstate == "57P03" or "shutting down" in str(exc)
