"""The loop every relay runs: a source hands events in, Kafka's reports come out.

    source -> decode -> route -> sink -> checkpointer (fed by the delivery reports)

The source and its decoding are each relay's own: ``stream`` reads a replication slot
(stream.py), a ``poll`` worker claims rows (poller.py). Everything from an event on is this
module's, the same for both: the route, the sink with its back-pressure, each delivery report
handed to the relay's checkpointer, which of Kafka's refusals is whose (cdc_relay.kafka.refusals:
a refusal among others makes a suspect, which is sent alone; the client's refusal, or
Kafka's of a message alone, is the culprit's own), and the loop around the source: a lost
connection recovers, a refusal that calls for it rewinds, a stop ends with the graceful stop.

What differs between the relays is which stages they are given (cdc_relay.relay.stages):

- a ``Feed`` (the source, with what it does on a lost connection, a rewind, the stop): the
  slot's stream, or a worker's claims;
- a ``Checkpointer`` (what an acknowledgement moves): the LSN tracker, or a claimed batch;
- a ``RefusalPolicy`` (what a refusal does): the stream rewinds to its confirmed position
  (with the culprit stopping the relay, or dead-lettered by ``deadletter.DeadLetterRefusals``),
  a poll worker marks the row for a later try and holds its aggregate back;
- the sink: the idempotent producer, or for exactly once the transactional one (whose
  commit ``before_alone`` and ``after_alone`` place around an event sent alone).

Single-threaded on purpose: delivery reports are served by ``poll`` on the loop's thread, so
nothing the reports touch needs a lock.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from confluent_kafka import KafkaError

from cdc_relay.errors import RelayError
from cdc_relay.events import OutboxEvent
from cdc_relay.kafka.refusals import RefusalPolicy, is_culprit
from cdc_relay.kafka.routing import Message, Router
from cdc_relay.postgres.replication import ConnectionLost
from cdc_relay.relay.stages import Checkpointer, Feed, OpenSink, Sink

WAIT = 0.05  # seconds of each wait for delivery reports, between looks at the source and the stop


class Stopping(Exception):
    """A stop ends a wait for Kafka (raised by ``wait_for_kafka``, and by a feed)."""


class Rewind(Exception):
    """Kafka refused events: the feed starts again from its checkpoint (``Feed.rewind``)."""


_PENDING = object()  # no report yet for the message sent alone
_NONE = object()  # no message inside sink.offer


def _nothing() -> None:
    pass


class Pipeline:
    """Routes events and hands them to the sink; serves Kafka's reports to the stages.

    ``give_up`` says whether a wait for Kafka ends (a stop, after the feed's grace), ``tick``
    is what the feed does while the loop waits (the stream's status update to the walsender).
    """

    def __init__(
        self,
        router: Router,
        open_sink: OpenSink,
        checkpointer: Checkpointer,
        refusals: RefusalPolicy,
        *,
        tick: Callable[[], None],
        give_up: Callable[[], bool],
        before_alone: Callable[[], None] = _nothing,
        after_alone: Callable[[], None] = _nothing,
    ) -> None:
        self.router = router
        self.checkpointer = checkpointer
        self.refusals = refusals
        self._tick = tick
        self._give_up = give_up
        self._before_alone = before_alone
        self._after_alone = after_alone
        self._route = router.route
        self._ack = checkpointer.acked
        self._refuse = refusals.refused
        # The token of the message inside sink.offer: a refusal of it now is the client's.
        self._offering: Any = _NONE
        self._refused_now: KafkaError | None = None
        self._lone: Any = None  # the token of the message sent alone, waiting for its report
        self._lone_result: object = _PENDING
        self.sink: Sink = open_sink(self._acked, self._refused)

    # -- what the sink reports ----------------------------------------------------------------

    def _acked(self, token: Any) -> None:
        if token is self._lone:
            self._lone_result = None
        self._ack(token)

    def _refused(self, token: Any, err: KafkaError) -> None:
        if token is self._offering:
            self._refused_now = err
        elif token is self._lone:
            self._lone_result = err
        else:
            self._refuse(token, err)

    # -- the loop -----------------------------------------------------------------------------

    def run(self, feed: Feed) -> None:
        """Pump ``feed`` until it stops: a lost connection recovers, a refusal rewinds; then
        the feed's graceful stop (invariant 8), whatever ended the loop."""
        try:
            while not feed.stopped:
                try:
                    feed.pump()
                except ConnectionLost as exc:
                    feed.recover(exc)
                except Rewind:
                    feed.rewind()
        except Stopping:
            pass
        finally:
            feed.shutdown()

    # -- events in ----------------------------------------------------------------------------

    def publish(self, event: OutboxEvent, token: Any, alone: bool = False) -> None:
        """Route ``event`` and hand it to the sink (``alone``: with nothing else in flight, to
        learn whether Kafka refuses it). A refusal of it goes to the refusal policy: at once
        when it is certainly the event's own, with the reports otherwise."""
        try:
            message = self._route(event)
        except RelayError as exc:  # no legal topic, no payload: the event's own fault
            self.refusals.unroutable(token, exc)
            return
        if alone:
            err = self.deliver_alone(message, token)
            if err is None:
                self.refusals.cleared(token)
            elif is_culprit(err) and not self.sink.missing(message.topic, err):
                self.refusals.culprit(message, token, err)
            else:  # not about this message after all (nor a topic made anew): a later try
                self.refusals.retry(token, err)
            return
        err = self.offer(message, token)
        if err is not None:  # the client refused it: it is the culprit, for certain,
            self.settle()
            if self.sink.missing(message.topic, err):  # unless its topic is to be made again
                self.refusals.retry(token, err)
            else:
                self.refusals.culprit(message, token, err)

    def offer(self, message: Message, token: Any) -> KafkaError | None:
        """Hand ``message`` to the sink, waiting while its queue is full; the client's refusal
        of it, if any."""
        sink = self.sink
        while True:
            self._offering = token
            try:
                accepted = sink.offer(message, token)
            finally:
                self._offering = _NONE
            if self._refused_now is not None:
                err, self._refused_now = self._refused_now, None
                return err
            if accepted:
                return None
            self.wait_for_kafka()

    def deliver_alone(self, message: Message, token: Any) -> KafkaError | None:
        """Send ``message`` with nothing else in flight and wait for its report: whatever
        Kafka answers is about this message. None when it was acknowledged."""
        self.settle()
        self._before_alone()
        self._lone, self._lone_result = token, _PENDING
        try:
            err = self.offer(message, token)
            if err is not None:
                return err
            self._after_alone()
            while self._lone_result is _PENDING:
                if not self.sink.in_flight():
                    # Neither in flight nor answered: the Kafka transaction that held it was
                    # aborted after Kafka took it (exactly once: its checkpoint record was
                    # refused). No report will come; the stream replays it.
                    raise ConnectionLost(
                        "Kafka aborted the transaction of an event sent alone after taking "
                        "it; replaying from the last committed checkpoint"
                    )
                self._flush()  # nothing else is in flight: no refusal but its own
            return self._lone_result if isinstance(self._lone_result, KafkaError) else None
        finally:
            self._lone = None

    # -- waiting for Kafka --------------------------------------------------------------------

    def serve(self, timeout: float) -> None:
        """Serve delivery reports, then let the refusal policy act on the refusals among them
        (the stream's rewinds: it raises Rewind)."""
        self.sink.poll(timeout)
        self.refusals.served()

    def wait_for_kafka(self) -> None:
        """Wait a little for delivery reports, the feed ticking on (invariant 6); raise
        Stopping when the feed gives up waiting."""
        self.serve(WAIT)
        self._tick()
        if self._give_up():
            raise Stopping

    def settle(self) -> None:
        """Wait until Kafka answered for every message sent."""
        while self.sink.in_flight():
            self._flush()

    def _flush(self) -> None:
        """``wait_for_kafka`` for a wait on everything in flight: the sink's ``settle`` sends
        what it holds at once (librdkafka's flush does not wait out linger.ms, a poll does),
        so a poll worker's batch, or an event sent alone, is not held back by it."""
        self.sink.settle(WAIT)
        self.serve(0)  # the reports flush served; raises on a fatal producer error
        self._tick()
        if self._give_up():
            raise Stopping
