"""What a stream relay tells the walsender and the operator: the status updates that confirm
the slot up to the LSN tracker's safe position (none of it before a new shard's resharding
cut, an old shard's cut once everything before it is acknowledged, never past what the
watcher last verified of the publication), sent soon after the position moves and at least
every status interval; and the progress line."""

from __future__ import annotations

import logging
import time

from cdc_relay.lsn import Lsn, format_lsn
from cdc_relay.postgres.watch import Watcher
from cdc_relay.relay.cut import ShardCut
from cdc_relay.relay.lsn_tracker import LsnTracker
from cdc_relay.relay.records import Progress
from cdc_relay.relay.slot_connection import SlotConnection
from cdc_relay.relay.stream_settings import StreamSettings

# The stream relay's lines, under one logger whichever of its parts writes them.
log = logging.getLogger("cdc_relay.relay.stream")

# A newly acknowledged position is confirmed this soon: after a crash, PostgreSQL replays
# what was not confirmed, so this interval bounds the duplicates (events/s x interval).
_CONFIRM_AFTER = 0.2


class Status:
    """The status updates sent on the relay's ``connection``: ``sent_flush`` is the position
    last confirmed, ``last_event`` when the relay last sent an event (both for the gauges)."""

    def __init__(
        self,
        settings: StreamSettings,
        tracker: LsnTracker,
        cut: ShardCut,
        progress: Progress,
        connection: SlotConnection,
    ) -> None:
        self._settings = settings
        self._tracker = tracker
        self._cut = cut
        self._progress = progress
        self._connection = connection
        self.last_event = time.monotonic()
        self._last_progress = time.monotonic()
        self.sent_flush: Lsn = -1
        self._events_seen = 0  # events sent at the last tick, for SINCE_LAST_EVENT

    def update(self, received: Lsn, watcher: Watcher | None, force: bool = False) -> None:
        """A status update when one is due (``force``: now), confirming what is safe, the
        stream read up to ``received``; the progress line when it is due."""
        now = time.monotonic()
        if self._progress.events != self._events_seen:
            self._events_seen = self._progress.events
            self.last_event = now
        connection = self._connection
        since = now - connection.last_status
        safe = self._tracker.safe_lsn
        cut = self._cut
        if cut.at is not None and not self._tracker.in_flight:
            # An old shard at its cut, everything acknowledged: confirming the cut's position
            # tells the new shards so (they wait for it before relaying past the cut).
            safe = max(safe, cut.at)
        if cut.waiting or cut.transaction is not None:
            safe = 0  # nothing before the cut is this shard's to confirm
        elif watcher is not None and not watcher.shutting_down:
            # Not past a position the table's publication was last seen to cover (watch.py).
            safe = min(safe, watcher.verified)
        if (
            force
            or since >= self._settings.status_interval
            or (safe != self.sent_flush and since >= _CONFIRM_AFTER)
        ):
            connection.require().send_status(max(received, safe), safe)
            connection.last_status = now
            self.sent_flush = safe
        if now - self._last_progress >= self._settings.progress_interval:
            self._last_progress = now
            self.log_progress()

    def log_progress(self) -> None:
        log.info(
            "progress: %d events relayed in %d transactions, %d awaiting Kafka's ack, "
            "slot confirmed up to %s",
            self._progress.events,
            self._progress.transactions,
            self._tracker.in_flight,
            format_lsn(self._tracker.safe_lsn),
            extra={"action": "progress", "lsn": format_lsn(self._tracker.safe_lsn)},
        )
