"""Taking the slot: a stream relay opens its stream, and with ``--standby`` waits while another
relay holds the slot (ready meanwhile: a rolling update may go on), through the server being
away for a moment too (a failover), and takes over as soon as PostgreSQL frees it (that
relay's connection ended). Once the slot is held, by a standby or not, what the start decided
from the slot's position is decided again from where it is (``held``): the relay it stood by
for may have moved it on."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from cdc_relay.errors import SlotInUseError
from cdc_relay.lsn import Lsn
from cdc_relay.lsn import parse as parse_lsn
from cdc_relay.metrics import Health
from cdc_relay.postgres.connection import reconnecting
from cdc_relay.postgres.replication import ConnectionLost
from cdc_relay.queries import QUERIES
from cdc_relay.relay.cut import AfterCut
from cdc_relay.relay.losses import Losses
from cdc_relay.relay.stages import Sink, Source
from cdc_relay.relay.stream_settings import StreamSettings
from cdc_relay.relay.timeline import Timeline

# The stream relay's lines, under one logger whichever of its parts writes them.
log = logging.getLogger("cdc_relay.relay.stream")

_STANDBY_RETRY = 1.0  # seconds between a standby's attempts to take the slot


class Standby:
    """Opens the relay's stream, standing by while the slot is another relay's (``standing
    by``: readiness and cdc_relay_standby say so; ``answered``: whether PostgreSQL answered
    the last attempt to take it, so that the standby could take over); ``stopped`` ends the
    wait. Kafka's reports are served meanwhile (``sink``), and lost connections count toward
    the stop (``losses``)."""

    def __init__(
        self,
        settings: StreamSettings,
        health: Health,
        sink: Sink,
        losses: Losses,
        stopped: Callable[[], bool],
    ) -> None:
        self._settings = settings
        self._health = health
        self._sink = sink
        self._losses = losses
        self._stopped = stopped
        self.standing_by = False
        self.answered = False

    def acquire(self, open_stream: Callable[[], Source]) -> Source | None:
        """Open the stream. As a standby, wait while another relay holds the slot: PostgreSQL
        frees it as soon as that relay's connection ends, and this one takes over."""
        while not self._stopped():
            try:
                conn = open_stream()
            except SlotInUseError as exc:
                if not self._settings.standby:
                    raise
                self.answered = True
                if not self.standing_by:
                    self.standing_by = True
                    log.info(
                        "standing by: %s",
                        exc,
                        extra={"action": "standby", "slot": self._settings.slot},
                    )
            except ConnectionLost as exc:
                # Standing by through a failover: the server away for a moment is no reason
                # to give up (a refusal of its own counts toward the stop, as on reconnects).
                if not (self._settings.standby and self.standing_by):
                    raise
                self.answered = False
                self._losses.count(exc)
                log.warning(
                    "standing by: %s; trying again",
                    exc,
                    extra={"action": "standby_unreachable", "slot": self._settings.slot},
                )
            else:
                self.standing_by = False
                return conn
            deadline = time.monotonic() + _STANDBY_RETRY
            while not self._stopped() and time.monotonic() < deadline:
                self._health.beat()
                self._sink.poll(0.1)  # keeps broker statistics, hence readiness, current
        return None

    def held(self, timeline: Timeline, after_cut: AfterCut) -> Lsn | None:
        """The slot is this relay's now: what was decided from its position before it was
        held (a standby waited meanwhile) is decided again from where it is. The slot's
        confirmed position, None when it was dropped meanwhile (the stream says so). The
        server lost meanwhile raises psycopg.OperationalError (StreamRelay._take_slot)."""
        settings = self._settings
        with reconnecting(settings.dsn) as conn:
            # The server may be another one by now, promoted while this relay stood by.
            timeline.note((conn.execute(QUERIES["timeline"]).fetchone() or {}).get("timeline"))
            slot = conn.execute(QUERIES["slot"], {"slot": settings.slot}).fetchone()
            if not slot:
                return None
            confirmed = str(slot["confirmed_flush_lsn"])
            if settings.shard is not None:
                after_cut(conn, settings.shard, confirmed)
            return parse_lsn(confirmed)
