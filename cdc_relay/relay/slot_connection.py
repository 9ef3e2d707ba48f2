"""The replication connection a stream relay holds to its slot: opened at the LSN tracker's
safe position with the plugin's options (records.Records), taken as a standby would take it
(standby.Standby), reconnected after a lost connection or a rewind (a jittered back-off, the
server's timeline followed first, a refusal of the start counted toward the stop:
losses.Losses), and closed. Every wait here ends with a stop."""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable

import psycopg

from cdc_relay.errors import PreflightError, RelayError
from cdc_relay.lsn import format_lsn
from cdc_relay.metrics import Health
from cdc_relay.postgres.replication import ConnectionLost
from cdc_relay.relay.backoff import RECONNECT_MAX
from cdc_relay.relay.losses import Losses
from cdc_relay.relay.lsn_tracker import LsnTracker
from cdc_relay.relay.records import Records
from cdc_relay.relay.stages import OpenSource, Source
from cdc_relay.relay.standby import Standby
from cdc_relay.relay.stream_settings import StreamSettings

# The stream relay's lines, under one logger whichever of its parts writes them.
log = logging.getLogger("cdc_relay.relay.stream")


class SlotConnection:
    """The open stream (``conn``, None while there is none) and when the last status update
    went out on it (``last_status``, 0.0 on a new one).

    ``follow_timeline`` is what the relay decides from the server's timeline before each
    reconnection (StreamRelay._follow_timeline); ``stopped`` ends every wait.
    """

    def __init__(
        self,
        settings: StreamSettings,
        open_source: OpenSource,
        records: Records,
        tracker: LsnTracker,
        *,
        standby: Standby,
        losses: Losses,
        health: Health,
        stopped: Callable[[], bool],
        follow_timeline: Callable[[], None],
    ) -> None:
        self._settings = settings
        self._open_source = open_source
        self._records = records
        self._tracker = tracker
        self._standby = standby
        self._losses = losses
        self._health = health
        self._stopped = stopped
        self._follow_timeline = follow_timeline
        self.conn: Source | None = None
        self.last_status = 0.0

    def open(self) -> Source:
        """Connect and start streaming; decoder state starts afresh with each connection."""
        options = self._records.start_options()
        conn = self._open_source(self._settings.dsn)
        try:
            conn.start(self._settings.slot, self._tracker.safe_lsn, options)
        except BaseException:
            conn.close()
            raise
        self.last_status = 0.0
        return conn

    def acquire(self) -> bool:
        """Open the stream, as a standby once the slot is free; False when stopped first."""
        self.conn = self._standby.acquire(self.open)
        return self.conn is not None

    def require(self) -> Source:
        if self.conn is None:
            raise ConnectionLost("not connected")
        return self.conn

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None

    def pause(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while not self._stopped() and time.monotonic() < deadline:
            self._health.beat()
            time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))

    def reconnect(self) -> None:
        delay = 0.5
        while not self._stopped():
            try:
                self._follow_timeline()  # before opening: where the stream starts depends on it
                self.conn = self.open()
            except PreflightError:
                raise  # the slot is gone or unusable: retrying would not bring it back
            except (ConnectionLost, RelayError, psycopg.OperationalError) as exc:
                self.close()
                if isinstance(exc, ConnectionLost):
                    self._losses.count(exc)  # START_REPLICATION refused the same way each time
                log.warning(
                    "reconnect failed, retrying in %.1fs: %s",
                    delay,
                    exc,
                    extra={"action": "reconnect_failed"},
                )
                self.pause(delay)
                delay = min(delay * 2, RECONNECT_MAX) * random.uniform(0.8, 1.2)  # noqa: S311
            else:
                log.info(
                    "reconnected",
                    extra={"action": "reconnected", "lsn": format_lsn(self._tracker.safe_lsn)},
                )
                return
