"""The server's timeline as a stream relay follows it: noted at start and once the slot is
held, read again on each reconnection (the server may be a standby promoted since, on another
timeline), and whether a promotion keeps the history this relay was sent (a failover slot whose
server held WAL back for the standby). Exactly once's checkpoints carry the timeline too; what
the relay does on a new one is StreamRelay._follow_timeline's."""

from __future__ import annotations

import logging
from typing import Any

import psycopg

from cdc_relay.kafka.exactly_once import Committer
from cdc_relay.lsn import Lsn, format_lsn
from cdc_relay.queries import QUERIES
from cdc_relay.relay.stages import ReadTimeline
from cdc_relay.relay.stream_settings import StreamSettings

# The stream relay's lines, under one logger whichever of its parts writes them.
log = logging.getLogger("cdc_relay.relay.stream")


class Timeline:
    """The server's timeline as the relay last read it, for the relay and exactly once's
    checkpoints alike; ``read`` is what the server says of it on reconnecting."""

    def __init__(self, settings: StreamSettings, read: ReadTimeline, eos: Committer | None) -> None:
        self._settings = settings
        self._read = read
        self._eos = eos
        self.current = 0  # the server's at start, or since it changed (0: not known)
        # A failover slot whose server holds back WAL for a standby (synchronized_standby_slots):
        # a promoted standby then has all this relay was sent.
        self.guarded = False

    def note(self, timeline: object) -> None:
        """The server's timeline as read (NULL on a standby: 0, not known), for the relay and
        exactly once's checkpoints alike."""
        self.current = int(str(timeline)) if timeline else 0
        if self._eos is not None:
            self._eos.timeline = self.current

    def guard(self, conn: psycopg.Connection[dict[str, Any]]) -> None:
        """Note whether a promoted standby has all this relay is sent (a failover slot, and
        the server's synchronized_standby_slots set); a failover slot without it is said."""
        self.guarded = self._failover_guarded(conn)

    def _failover_guarded(self, conn: psycopg.Connection[dict[str, Any]]) -> bool:
        row = conn.execute(QUERIES["failover_guarded"], {"slot": self._settings.slot}).fetchone()
        if not row or not row["failover"]:
            return False
        if not row["synchronized"]:
            log.warning(
                "slot %s fails over, but synchronized_standby_slots is empty: this relay may be "
                "sent changes no standby has yet, and after a promotion it streams again from "
                "the slot's copy, which may lag (duplicates); cdc-relay setup-slot --failover "
                "says what to set",
                self._settings.slot,
                extra={"action": "failover_unguarded", "slot": self._settings.slot},
            )
        return bool(row["synchronized"])

    def moved(self) -> Lsn | None:
        """Reconnecting: the server's timeline read again. On another one than noted (a
        standby promoted since), the slot's position there, the new timeline noted; None on
        the same server's history (a missing slot too: the stream itself says so)."""
        timeline, confirmed = self._read(self._settings.dsn, self._settings.slot)
        if not timeline or timeline == self.current or confirmed is None:
            return None
        log.info(
            "the server is on timeline %d now (was %d): streaming again from the slot's "
            "position there, %s",
            timeline,
            self.current,
            format_lsn(confirmed),
            extra={"action": "timeline", "timeline": timeline, "lsn": format_lsn(confirmed)},
        )
        self.note(timeline)
        return confirmed
