"""A poll worker's claimed batch: the checkpointer and the refusal policy of the poll loop.

The worker (worker.Worker) is the feed: it claims rows and publishes each through the
pipeline (pipeline.py: the same router and sink as ``stream``, so the wire is the same on
both paths). The batch collects each row's delivery report, which the worker marks in the
claim's transaction: the acknowledged rows processed, the refused ones for a later try.

Order per aggregate: rows are published in the order claimed, and once a row is known to
have failed, the later rows of its aggregate in the batch are held back (left for a later
claim, which waits for the failed row). A row that failed before is sent alone: Kafka
refuses a whole request for one oversized message, so a poison row must not share one with
healthy rows twice, and its fate is known before its aggregate's next row goes.

A failure is the row's ``own`` (cdc_relay.kafka.refusals: the culprit) when the client refused
it, the router could not route it, or Kafka refused it sent alone; a row refused among
others is only a suspect, and is never made a dead letter for it (worker.Worker).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from confluent_kafka import KafkaError

from cdc_relay.errors import RelayError
from cdc_relay.kafka.routing import Message, Router
from cdc_relay.kafka.sink import kafka_sink
from cdc_relay.postgres.store import OutboxRow
from cdc_relay.relay.pipeline import WAIT, Pipeline, Stopping
from cdc_relay.relay.settings import RelaySettings
from cdc_relay.relay.stages import OpenSink

# A token of the sink: the batch it belongs to, and the row's index in it. A report of an
# earlier batch, or of a producer dropped since (``_renew``), is stale and ignored.
Token = tuple[int, int]


def _failure(err: KafkaError) -> str:
    return f"{err.name()}: {err.str()}"


class Batch:
    """Publishes claimed rows through one pipeline and collects each one's report.

    After ``publish``: ``delivered`` (indexes of the rows Kafka acknowledged), ``failures``
    (by index, why), ``own`` (the refused rows whose failure is their own, for certain) and
    ``held`` (not sent: behind a failed row of their aggregate).
    """

    def __init__(
        self,
        router: Router,
        open_sink: OpenSink,
        *,
        tick: Callable[[], None],
        give_up: Callable[[], bool],
    ) -> None:
        self.delivered: set[int] = set()
        self.failures: dict[int, str] = {}
        self.own: set[int] = set()
        self.held: list[int] = []
        self._unreported: set[int] = set()  # published among others, no report yet
        self._batch = 0  # the current batch's number, in its tokens
        self._rows: Sequence[OutboxRow] = ()
        # the aggregates with a failed row (a type or an id may be NULL in a user's table)
        self._failed_aggregates: set[tuple[str | None, str | None]] = set()
        self.pipeline = Pipeline(router, open_sink, self, self, tick=tick, give_up=give_up)
        self.sink = self.pipeline.sink

    def publish(self, rows: Sequence[OutboxRow]) -> bool:
        """Publish ``rows`` and wait for their reports; False if a stop came first (the rows
        without a report are then neither acknowledged nor refused)."""
        pipeline = self.pipeline
        try:
            pipeline.settle()  # nothing of an earlier batch is still in flight
            self.delivered.clear()
            self.failures.clear()
            self.own.clear()
            self.held.clear()
            self._failed_aggregates.clear()
            self._unreported.clear()
            self._batch += 1
            self._rows = rows
            for index, row in enumerate(rows):
                if row.aggregate in self._failed_aggregates:
                    self.held.append(index)
                    continue
                alone = row.attempts > 0  # its report is the pipeline's, before it goes on
                if not alone:
                    self._unreported.add(index)
                try:
                    event = row.event()
                except RelayError as exc:  # no type to route it by: the row's own fault
                    self.unroutable((self._batch, index), exc)
                    continue
                pipeline.publish(event, (self._batch, index), alone)
            pipeline.settle()
        except Stopping:
            return False
        return True

    # -- the checkpointer and the refusal policy (cdc_relay.relay.stages) -----------------------

    def acked(self, token: Token) -> None:
        batch, index = token
        if batch == self._batch:
            self._unreported.discard(index)
            self.delivered.add(index)

    def refused(self, token: Token, err: KafkaError) -> None:
        self._fail(token, _failure(err), own=False)

    def served(self) -> None:
        """After a refused batch the producer stops (the gapless guarantee) and does not report
        what it still holds: a new one takes over, and the rows the old one held failed too."""
        if self.sink.broken and self._unreported:
            self.sink.settle(WAIT)  # the refused batch's reports, with Kafka's answer
            if self._unreported:
                self._renew()

    def culprit(self, message: Message, token: Token, err: KafkaError) -> None:
        self._fail(token, _failure(err), own=True)

    def retry(self, token: Token, err: KafkaError) -> None:
        self._fail(token, _failure(err), own=False)

    def cleared(self, token: Token) -> None:
        pass  # acknowledged alone: ``acked`` has it

    def unroutable(self, token: Token, exc: RelayError) -> None:
        self._fail(token, str(exc), own=True)  # no legal topic, no payload: the row's fault

    def _fail(self, token: Token, error: str, own: bool) -> None:
        batch, index = token
        if batch != self._batch:
            return
        self._unreported.discard(index)
        self.failures[index] = error
        if own:
            self.own.add(index)
        row = self._rows[index]
        if row.aggregate_type is not None:
            # A row without a type is of no aggregate (the claim does not hold rows back
            # behind it either): the rows behind it go, or fail on their own.
            self._failed_aggregates.add(row.aggregate)

    def abandon(self) -> int:
        """The claim is gone (PostgreSQL ended its session): what the producer still holds is
        no longer this worker's to deliver. Another poller may be publishing those rows, and
        newer ones of their aggregates, which the copies here must not follow: drop them, and
        their reports with them (a new batch number). How many were dropped."""
        dropped = self.sink.in_flight()
        if dropped:
            self._batch += 1
            self.sink.renew()
        return dropped

    def _renew(self) -> None:
        """A new producer; a report the old one still gives is stale (a new batch number),
        and the rows it held are failed, for a later try behind which their aggregates wait."""
        self.sink.renew()
        for index in sorted(self._unreported):
            self._fail(
                (self._batch, index),
                "no report: the producer stopped after Kafka refused a batch (if Kafka "
                "wrote it, it goes out twice)",
                own=False,
            )
        self._batch += 1


def _never() -> bool:
    return False


def _nothing() -> None:
    pass


def open_batch(
    settings: RelaySettings,
    open_sink: OpenSink | None = None,
    *,
    tick: Callable[[], None] = _nothing,
    give_up: Callable[[], bool] = _never,
    router: Router | None = None,
) -> Batch:
    """A batch on its own pipeline: the router of ``settings`` (or ``router``, which a poll
    relay's workers share: it tells which aggregate type a topic is of), and the sink of
    ``open_sink`` (the idempotent producer by default). A poll worker's; the handover's,
    which never gives up waiting."""
    if router is None:
        router = poll_router(settings)
    opener = open_sink or kafka_sink(
        settings.kafka_config, relay="poll", creation=settings.topic_creation
    )
    return Batch(router, opener, tick=tick, give_up=give_up)


def poll_router(settings: RelaySettings) -> Router:
    """The router of a relay of one outbox table (no ``{schema}`` or ``{table}``)."""
    return Router(settings.topic_template, settings.tombstone_on_empty, settings.cloudevents)
