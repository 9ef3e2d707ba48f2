"""What the log says while Kafka is away: one line when it goes, a summary now and then while it
stays away, one line when it is back.

librdkafka reports every failed connection attempt of every producer (the poll relay has one
per worker, and a new one after each refused batch): 10 to 40 lines a second during an outage,
which bury the line that matters. The sinks report to the one ``Outage`` of the process
instead, which turns those reports into changes of state.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

SUMMARY_INTERVAL = 30.0  # seconds between summaries while the service stays away
_LATELY = 5.0  # seconds a connection failure's reason stays the news


class Outage:
    """The availability of one service as the log tells it; thread-safe (poll's workers each
    report from their own thread)."""

    def __init__(
        self,
        service: str,
        summary_interval: float = SUMMARY_INTERVAL,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.service = service
        self.summary_interval = summary_interval
        self._clock = clock
        self._lock = threading.Lock()
        self.since: float | None = None  # when it went away; None while it is there
        self._reason = ""
        self._noted_at = -_LATELY - 1.0
        self._failures = 0  # reports since it went away (or since the last summary)
        self._summarised = 0.0

    @property
    def down(self) -> bool:
        return self.since is not None

    def noted(self, reason: str) -> None:
        """A connection failed, which alone does not make the service unreachable (another
        may be up): while it is away, one more failed attempt; else the reason is kept for
        the line that says it went away."""
        with self._lock:
            self._reason, self._noted_at = reason, self._clock()
            if self.since is not None:
                self._failures += 1
                self._summarise_if_due()

    def failed(self, reason: str) -> None:
        """The service cannot be reached: a warning if it was there until now. A connection
        failure noted lately says more than ``reason`` (librdkafka's "1/1 brokers are down")
        and is the one told."""
        with self._lock:
            if self._clock() - self._noted_at > _LATELY:
                self._reason = reason
            self._failures += 1
            if self.since is not None:
                self._summarise_if_due()
                return
            self.since = self._summarised = self._clock()
            self._failures = 0
            reason = self._reason
        log.warning(
            "%s unreachable: %s; retrying until it is back (events wait, in order, and "
            "nothing after them is confirmed)",
            self.service,
            reason,
            extra={"action": "outage", "error": reason},
        )

    def waiting(self, events: int) -> None:
        """A periodic look while it may be away (the sinks' statistics, every few seconds):
        the summary, if one is due."""
        with self._lock:
            if self.since is not None:
                self._summarise_if_due(events)

    def back(self) -> None:
        """The service answered again: one line saying for how long it was away."""
        if self.since is None:  # read without the lock: this runs per acknowledged event
            return
        with self._lock:
            if self.since is None:
                return
            away = self._clock() - self.since
            self.since = None
        log.info(
            "%s reachable again after %.0f s",
            self.service,
            away,
            extra={"action": "outage_over"},
        )

    def _summarise_if_due(self, events: int | None = None) -> None:
        now = self._clock()
        if self.since is None or now - self._summarised < self.summary_interval:
            return
        self._summarised = now
        failures, self._failures = self._failures, 0
        log.warning(
            "%s still unreachable after %.0f s (%d failed attempts since the last line; "
            "the last: %s)%s",
            self.service,
            now - self.since,
            failures,
            self._reason,
            "" if events is None else f"; {events} events wait for it",
            extra={"action": "outage_summary", "error": self._reason},
        )


KAFKA = Outage("Kafka")
"""The process's Kafka, which every sink reports to."""
