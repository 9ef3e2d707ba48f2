"""Whether the relay's failover slot would survive a promotion now, read from the standbys.

Only a standby shows its copy of a slot (its own ``pg_replication_slots``): the primary's
``pg_stat_replication`` names the standbys it streams to, by address and application name,
but not what they hold, and no query of the primary reaches them. So each host of the
(multi-host) ``--dsn`` is asked, those that are standbys answer with their copy
(``Standbys``), and failover.py judges each copy and the whole (``failover.Readiness``). The
hosts of ``--dsn`` are also the ones the relay follows a promotion to, so they are the standbys
that count. ``status`` reads it once; the stream relay's watcher hands ``FailoverWatch`` the
slot's row when it samples the slot (every 10 s), and the watch asks the standbys on a thread
of its own (a standby that does not answer must not hold up the watcher), sets the gauges and
logs a line when the verdict changes, not at every sample.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Mapping
from typing import Any

import psycopg
from prometheus_client import Gauge
from psycopg.rows import dict_row

from cdc_relay.metrics import FAILOVER_LAG, FAILOVER_READY, FAILOVER_STANDBY_READY
from cdc_relay.postgres import failover
from cdc_relay.postgres.connection import connect, one_row
from cdc_relay.queries import QUERIES

log = logging.getLogger(__name__)


class Standbys:
    """The hosts of ``dsn``, each on a connection of its own kept between reads; the roles
    are asked at every read (a promotion swaps them)."""

    def __init__(self, dsn: str) -> None:
        self._hosts = failover.hosts(dsn)
        self._conns: dict[str, psycopg.Connection[dict[str, Any]]] = {}

    def readiness(self, slot: str, primary: Mapping[str, Any]) -> failover.Readiness:
        """Whether ``slot`` would survive a failover now; ``primary``: its row of the ``slot``
        query on the primary (its position, and whether it is a failover slot)."""
        if not primary.get("failover"):
            return failover.Readiness(slot, failover=False)
        copies = []
        for label, dsn in self._hosts:
            try:
                conn = self._conns.get(label)
                if conn is None or conn.closed:
                    conn = psycopg.connect(dsn, autocommit=True, row_factory=dict_row)
                    self._conns[label] = conn
                role = conn.execute(QUERIES["in_recovery"]).fetchone() or {}
                if not role.get("standby"):
                    continue  # the primary, or another one: no copy to look at
                row = conn.execute(QUERIES["slot"], {"slot": slot}).fetchone()
            except psycopg.Error as exc:
                self._close(label)
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else "no answer"
                copies.append(failover.Copy(label, f"no answer ({first})"))
                continue
            copies.append(failover.copy_of(slot, label, primary, row))
        return failover.Readiness(slot, failover=True, copies=tuple(copies))

    def _close(self, label: str) -> None:
        conn = self._conns.pop(label, None)
        if conn is not None:
            conn.close()

    def close(self) -> None:
        for label in list(self._conns):
            self._close(label)


def readiness(dsn: str, slot: str, primary: Mapping[str, Any]) -> failover.Readiness:
    """``Standbys.readiness`` once, for ``status``."""
    standbys = Standbys(dsn)
    try:
        return standbys.readiness(slot, primary)
    finally:
        standbys.close()


def wait_ready(dsn: str, slot: str, timeout: float, every: float = 1.0) -> failover.Readiness:
    """Read until ``slot`` is failover-ready or ``timeout`` seconds have passed; the last
    verdict (for ``setup-slot --wait-failover-ready``)."""
    deadline = time.monotonic() + timeout
    standbys = Standbys(dsn)
    try:
        while True:
            with connect(dsn) as conn:
                row = one_row(conn, "slot", slot=slot)
            found = standbys.readiness(slot, row)
            left = deadline - time.monotonic()
            if found.ready or not found.failover or left <= 0:
                return found
            time.sleep(min(every, left))
    finally:
        standbys.close()


class FailoverWatch:
    """The stream relay's view of its slot's readiness: the gauges, and one log line each time
    it becomes failover-ready or stops being so (and at the first look when it is not)."""

    def __init__(self, dsn: str, slot: str) -> None:
        self._slot = slot
        self._standbys = Standbys(dsn)
        self._row: Mapping[str, Any] | None = None
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="failover", daemon=True)
        self.ready: bool | None = None
        """The verdict last logged; None before the first look, or for no failover slot."""
        self._labels: set[str] = set()  # the standbys with series now

    def start(self) -> FailoverWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    def sample(self, row: Mapping[str, Any]) -> None:
        """The slot's row on the primary, as the watcher just read it: the standbys are asked
        on the watch's thread."""
        with self._lock:
            self._row = row
        self._wake.set()

    def _run(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            if self._stop.is_set():
                break
            with self._lock:
                row, self._row = self._row, None
            if row is not None:
                self.observe(row)
        self._standbys.close()

    def observe(self, row: Mapping[str, Any]) -> failover.Readiness:
        """Read the standbys against the slot's ``row``; gauges and the log line on a change."""
        found = self._standbys.readiness(self._slot, row)
        if not found.failover:
            self._forget()
            return found
        FAILOVER_READY.labels(slot=self._slot).set(1 if found.ready else 0)
        labels = set()
        for copy in found.copies:
            labels.add(copy.standby)
            ready = FAILOVER_STANDBY_READY.labels(slot=self._slot, standby=copy.standby)
            ready.set(1 if copy.usable else 0)
            if copy.confirmed_lag is None:
                _remove(FAILOVER_LAG, self._slot, copy.standby)
            else:
                FAILOVER_LAG.labels(slot=self._slot, standby=copy.standby).set(copy.confirmed_lag)
        for gone in self._labels - labels:
            _remove(FAILOVER_STANDBY_READY, self._slot, gone)
            _remove(FAILOVER_LAG, self._slot, gone)
        self._labels = labels
        if found.ready != self.ready:
            self._log(found)
        self.ready = found.ready
        return found

    def _log(self, found: failover.Readiness) -> None:
        if found.ready:
            usable = [copy for copy in found.copies if copy.usable]
            log.info(
                "slot %s is failover-ready: %s",
                self._slot,
                ", ".join(
                    f"standby {copy.standby} holds a usable copy, {copy.confirmed_lag} bytes behind"
                    for copy in usable
                ),
                extra={
                    "action": "failover_ready",
                    "slot": self._slot,
                    "standby": ",".join(copy.standby for copy in usable),
                },
            )
        else:
            log.warning(
                "slot %s is not failover-ready: %s; a failover now would lose the slot "
                "(the relay stops, and the events it had not confirmed wait for a republish)",
                self._slot,
                found.reason,
                extra={"action": "failover_not_ready", "slot": self._slot},
            )

    def _forget(self) -> None:
        """No failover slot (any more): no series, and nothing to log."""
        _remove(FAILOVER_READY, self._slot)
        for label in self._labels:
            _remove(FAILOVER_STANDBY_READY, self._slot, label)
            _remove(FAILOVER_LAG, self._slot, label)
        self._labels = set()
        self.ready = None


def _remove(gauge: Gauge, *labels: str) -> None:
    with contextlib.suppress(KeyError):  # no such series
        gauge.remove(*labels)
