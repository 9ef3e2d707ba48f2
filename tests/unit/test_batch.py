"""A poll worker's batch on the in-memory sink of test_stream_loop: no database, no broker.

What it proves is the per-batch refusal policy (cdc_relay.relay.batch): order per aggregate,
and which failures are a row's own (the culprit, which may become a dead letter) and which
only make it a suspect (refused among others, tried again alone). The integration suite
proves the same against Kafka (tests/integration/test_refusals.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from confluent_kafka import KafkaError
from test_stream_loop import Sink, event_id

from cdc_relay.kafka.routing import Message
from cdc_relay.postgres.store import OutboxRow
from cdc_relay.relay.batch import Batch, open_batch
from cdc_relay.relay.worker import PollSettings

SETTINGS = PollSettings(
    dsn="test", kafka_config={}, topic_template="outbox.{aggregate_type}", table="outbox"
)


def row(number: int, aggregate: str, attempts: int = 0, payload: bytes | None = b"{}") -> OutboxRow:
    return OutboxRow(
        id=f"00000000-0000-0000-0000-{number:012d}",
        aggregate_type="order",
        aggregate_id=aggregate,
        event_type="created",
        payload=payload,
        payload_type=3802,
        attempts=attempts,
    )


class ClientRefuses(Sink):
    """Refuses the events of ``refuse`` at once, in ``offer``, as the client does a message
    larger than its message.max.bytes."""

    refuse: frozenset[str] = frozenset()

    def offer(self, message: Message, token: Any) -> bool:
        if event_id(message) in self.refuse:
            self.on_refused(token, KafkaError(KafkaError.MSG_SIZE_TOO_LARGE))
            return True
        return super().offer(message, token)


def publisher(sink_class: type[Sink] = Sink) -> tuple[Batch, Sink]:
    sinks: list[Sink] = []

    def open_sink(on_ack: Any, on_refused: Any) -> Sink:
        sinks.append(sink_class(on_ack, on_refused))
        return sinks[0]

    batch = open_batch(SETTINGS, open_sink)
    return batch, sinks[0]


def test_a_refused_batch_makes_suspects_only_and_holds_their_aggregates() -> None:
    pub, sink = publisher()
    rows = [row(1, "a"), row(2, "b"), row(3, "a"), row(4, "c")]
    sink.poison[rows[1].id] = KafkaError.MSG_SIZE_TOO_LARGE
    sink.hold_all = True  # one batch: Kafka answers for all of them at once
    sink.on_poll = lambda: setattr(sink, "hold_all", False)

    assert pub.publish(rows)

    # Kafka refused the batch for one record: every row of it failed, none for certain.
    assert set(pub.failures) == {0, 1, 2, 3}
    assert not pub.own
    assert not pub.delivered


def test_rows_tried_again_go_alone_and_only_the_culprit_fails_as_its_own() -> None:
    pub, sink = publisher()
    # The batch above, claimed again: each row failed once, so each goes alone.
    rows = [row(1, "a", 1), row(2, "b", 1), row(3, "a", 1), row(4, "c", 1)]
    sink.poison[rows[1].id] = KafkaError.MSG_SIZE_TOO_LARGE

    assert pub.publish(rows)

    assert all(others == 0 for _, others in sink.offered)  # nothing else in flight
    assert pub.failures.keys() == pub.own == {1}
    assert pub.delivered == {0, 2, 3}
    assert [event_id(m) for m in sink.acked] == [rows[0].id, rows[2].id, rows[3].id]


def test_a_row_after_a_failed_one_of_its_aggregate_is_held_back() -> None:
    pub, sink = publisher()
    rows = [row(1, "a", 1), row(2, "a"), row(3, "b")]
    sink.poison[rows[0].id] = KafkaError.TOPIC_AUTHORIZATION_FAILED

    assert pub.publish(rows)

    assert pub.own == {0}  # refused alone: its own
    assert pub.held == [1]  # not sent: it must not overtake the failed row
    assert pub.delivered == {2}


def test_what_the_client_or_the_router_refuses_is_the_rows_own_even_among_others() -> None:
    pub, sink = publisher(ClientRefuses)
    rows = [row(1, "a"), row(2, "b"), row(3, "c", payload=None), row(4, "d")]
    assert isinstance(sink, ClientRefuses)
    sink.refuse = frozenset({rows[1].id})

    assert pub.publish(rows)

    # Too large for the client (refused in offer) and a NULL payload (the router refuses it
    # without --tombstone-on-empty-payload): both certain, though sent among others.
    assert pub.failures.keys() == pub.own == {1, 2}
    assert "MSG_SIZE_TOO_LARGE" in pub.failures[1]
    assert "NULL payload" in pub.failures[2]
    assert pub.delivered == {0, 3}


def test_rows_without_a_type_each_fail_on_their_own_and_hold_nothing_back() -> None:
    # A row whose aggregate_type is NULL is of no aggregate: the claim does not hold the
    # rows behind it back (SQL's NULL = NULL is not true), and neither does the batch, so a
    # run of them fails in one batch instead of one row a cycle, ahead of other aggregates.
    pub, _ = publisher()
    untyped = [dataclasses.replace(row(n, "x"), aggregate_type=None) for n in (1, 2, 3)]
    rows = [*untyped, row(4, "x")]

    assert pub.publish(rows)

    assert pub.own == set(pub.failures) == {0, 1, 2}
    assert all("aggregate_type is NULL" in pub.failures[i] for i in (0, 1, 2))
    assert pub.held == []
    assert pub.delivered == {3}
