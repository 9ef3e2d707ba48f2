"""Which event the log names when Kafka does not answer for it.

librdkafka retries what it cannot deliver yet, silently: a topic it waits for, a partition
without a leader, a broker that takes no more. The progress line counts the events awaiting
an answer but names none, and says no reason. So a sink watches, in each topic, one message
at a time: the next one it sends once Kafka answered for the last. Once a watched message has
waited longer than ``OVERDUE`` seconds, the sink names it in a warning, with the reason when
the topic's metadata tells it (sink.KafkaSink), and again every ``SUMMARY_INTERVAL`` seconds
while one waits that long. While Kafka is away, the outage's lines say it instead
(outage.py).

One message per topic, not every message: watching each would cost every event a clock read
and two dictionary updates, and one at a time is enough to see a topic, or a partition of it
within a few of its events, that Kafka does not answer for.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Generic, TypeVar

from cdc_relay.kafka.outage import SUMMARY_INTERVAL

OVERDUE = 5.0  # seconds an event may wait for Kafka's answer before the log names it

T = TypeVar("T")


class Overdue(Generic[T]):
    """The watched message of each topic: when it was sent, and what the warning needs
    (``T``). One sink's, on its loop's thread."""

    def __init__(
        self,
        after: float = OVERDUE,
        every: float = SUMMARY_INTERVAL,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.after = after
        self.every = every
        self._clock = clock
        # Read per event (is a message of this topic watched?): the sink looks in it itself.
        self.watched: dict[str, tuple[float, T]] = {}
        self._told = -float("inf")  # when the last warning was due

    def watch(self, topic: str, what: T) -> None:
        """A message of ``topic``, none of which is watched, was sent: it is, from now."""
        self.watched[topic] = (self._clock(), what)

    def answered(self, topic: str) -> None:
        """Kafka answered for the watched message of ``topic``: the next one is watched."""
        self.watched.pop(topic, None)

    def clear(self) -> None:
        """No report will come for what is watched: the producer holds nothing any more."""
        self.watched.clear()

    def due(self) -> tuple[float, str, T] | None:
        """The watched message that waited longest, how long, and its topic, when a warning
        about it is due."""
        if not self.watched:
            return None
        now = self._clock()
        if now - self._told < self.every:
            return None
        topic, (since, what) = min(self.watched.items(), key=lambda item: item[1][0])
        if now - since < self.after:
            return None
        self._told = now
        return now - since, topic, what
