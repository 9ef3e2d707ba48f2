"""What the poller publishes: a claimed batch through the router and one sink, with each row's
delivery report, in order per aggregate (a row after a failed one of its aggregate is held back).

The same router and sink as ``stream`` (routing.py, sink.py): the wire is the same on both paths.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from confluent_kafka import KafkaError

from cdc_relay.errors import RelayError
from cdc_relay.refusals import is_culprit
from cdc_relay.routing import Message, Router
from cdc_relay.sink import KafkaSink
from cdc_relay.store import OutboxRow

if TYPE_CHECKING:  # the poller imports this module
    from cdc_relay.poller import PollSettings
    from cdc_relay.stages import OpenSink, Sink

WAIT_SLICE = 0.2  # seconds between looks at the stop flag while waiting for Kafka


def _failure(err: KafkaError) -> str:
    return f"{err.name()}: {err.str()}"


class Publisher:
    """Produces rows through one sink and collects each one's delivery report.

    Order per aggregate: rows are produced in the order given, and once a row is known to have
    failed, the later rows of its aggregate in the batch are held back (left for a later
    claim, which waits for the failed row). A row that failed before is sent on its own,
    between waits: Kafka refuses a whole request for one oversized message, so a poison row
    must not share one with healthy rows twice, and its fate is known before its aggregate's
    next row goes.

    A failure is the row's ``own`` (cdc_relay.refusals: the culprit) when the client refused
    it, the router could not route it, or Kafka refused it sent alone; a row refused among
    others is only a suspect, and is never made a dead letter for it (poller.Worker).
    """

    def __init__(self, settings: PollSettings, open_sink: OpenSink | None = None) -> None:
        self.router = Router(
            settings.topic_template, settings.tombstone_on_empty, settings.cloudevents
        )
        self.sink: Sink = (
            open_sink(self._acked, self._refused)
            if open_sink is not None
            else KafkaSink(
                settings.kafka_config, on_ack=self._acked, relay="poll", on_refused=self._refused
            )
        )
        self.acked: set[int] = set()
        self.refused: dict[int, str] = {}
        self.own: set[int] = set()  # refused rows whose failure is their own, for certain
        self.held: list[int] = []
        self._unreported: set[int] = set()  # produced, no report yet
        self._offering: int | None = None  # the row inside sink.offer: a refusal now is its own
        self._producer = 0  # tokens are (producer, index): reports of a dropped one are stale
        self._rows: Sequence[OutboxRow] = ()
        self._failed: set[tuple[str, str]] = set()  # aggregates with a failed row

    @property
    def outstanding(self) -> int:
        """Rows produced whose delivery report has not come."""
        return len(self._unreported)

    def _acked(self, token: tuple[int, int]) -> None:
        producer, index = token
        if producer == self._producer:
            self._unreported.discard(index)
            self.acked.add(index)

    def _refused(self, token: tuple[int, int], err: KafkaError) -> None:
        producer, index = token
        if producer == self._producer:
            self._unreported.discard(index)
            # A row tried before goes alone (publish): Kafka's refusal of it is about it.
            alone = self._rows[index].attempts > 0
            own = index == self._offering or (alone and is_culprit(err))
            self._fail(index, _failure(err), own)

    def _fail(self, index: int, error: str, own: bool) -> None:
        self.refused[index] = error
        if own:
            self.own.add(index)
        self._failed.add(self._rows[index].aggregate)

    def publish(self, rows: Sequence[OutboxRow], give_up: Callable[[], bool]) -> bool:
        """Produce ``rows`` and wait for their reports; False if ``give_up`` said so first
        (the rows without a report are then neither acknowledged nor refused)."""
        # Tokens hold row indexes: no report of an earlier batch may still come.
        if not self.wait(give_up):
            return False
        self.acked.clear()
        self.refused.clear()
        self.own.clear()
        self.held.clear()
        self._failed.clear()
        self._rows = rows
        for index, row in enumerate(rows):
            if row.attempts and not self.wait(give_up):
                return False
            if row.aggregate in self._failed:
                self.held.append(index)
                continue
            try:
                message = self.router.route(row.event())
            except RelayError as exc:  # no legal topic, no payload: the row's fault
                self._fail(index, str(exc), own=True)
                continue
            if not self._offer(message, index, give_up):
                return False
            if row.attempts and not self.wait(give_up):
                return False
        return self.wait(give_up)

    def _offer(self, message: Message, index: int, give_up: Callable[[], bool]) -> bool:
        self._unreported.add(index)
        while True:
            self._offering = index
            try:
                accepted = self.sink.offer(message, (self._producer, index))
            finally:
                self._offering = None
            if accepted:
                return True
            self.sink.poll(WAIT_SLICE)  # the producer's queue is full: let it drain
            if give_up():
                self._unreported.discard(index)
                return False

    def wait(self, give_up: Callable[[], bool]) -> bool:
        """Serve delivery reports until none is outstanding; False if ``give_up`` came first.

        While the broker is down, this waits: the producer retries until it is back.
        """
        while self.outstanding:
            self.sink.settle(WAIT_SLICE)
            self.sink.poll(0)  # raises on a fatal producer error
            if self.sink.broken and self.outstanding:
                self.sink.settle(WAIT_SLICE)  # the refused batch's reports, with Kafka's answer
                if self.outstanding:
                    self._renew()
            if self.outstanding and give_up():
                return False
        return True

    def _renew(self) -> None:
        """After a refused batch the producer stops (the gapless guarantee) and does not report
        what it still holds: a new one takes over, and the rows the old one held failed too (a
        later try, behind which their aggregates wait). A report it still gives is ignored."""
        self.sink.renew()
        self._producer += 1
        for index in sorted(self._unreported):
            self._fail(
                index, "not sent: the producer stopped after Kafka refused a batch", own=False
            )
        self._unreported.clear()
