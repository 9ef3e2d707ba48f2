"""A quiet stream's events go to Kafka without waiting out ``linger.ms`` (relay/linger.py).

The loop runs on test_stream_loop's in-memory stages, with a sink that behaves as librdkafka
does under a ``linger.ms`` longer than the test: a poll sends nothing (it only serves the
reports of what was sent), a flush sends everything. The integration suite shows the same
against a real broker (tests/integration/test_stream.py, a ``linger.ms`` of a minute).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
from confluent_kafka import KafkaError
from test_stream_loop import DEAD, Letters, Sink, Wal, acked_ids, backlog, first_seen, relay_on

from cdc_relay.errors import DeliveryError
from cdc_relay.kafka.routing import Message
from cdc_relay.relay import linger
from cdc_relay.relay.stream import StreamRelay


class Lingering(Sink):
    """librdkafka holding every batch open: a poll reports nothing; a flush (``settle``)
    sends and reports all it holds. ``settled`` is what the producer held at each flush."""

    def __init__(
        self, on_ack: Callable[[Any], None], on_refused: Callable[..., None], wal: Wal
    ) -> None:
        super().__init__(on_ack, on_refused)
        self.wal = wal
        self.settled: list[int] = []
        self.behind: list[bool] = []  # at each flush: the relay had not read all there was
        self.per_event = 0.0  # seconds each offer takes: the pace of a slower relay

    def offer(self, message: Message, token: Any) -> bool:
        if self.per_event:
            time.sleep(self.per_event)
        return super().offer(message, token)

    def poll(self, timeout: float) -> None:
        self.hold_all = True
        try:
            super().poll(timeout)
        finally:
            self.hold_all = False

    def settle(self, timeout: float) -> None:
        self.settled.append(len(self.queue))
        holder = self.wal.holder
        self.behind.append(holder is not None and not holder.caught_up)
        super().settle(timeout)


def transactions(count: int) -> list[bytes]:
    """The first ``count`` transactions of the captured backlog (10 events each)."""
    raw = backlog()
    commits = [i for i, data in enumerate(raw) if data[:1] == b"C"]
    return raw[: commits[count - 1] + 1]


def lingering_relay(wal: Wal, **settings: Any) -> tuple[StreamRelay, Lingering]:
    relay, _ = relay_on(wal, **settings)
    sink = Lingering(relay.pipeline._acked, relay.pipeline._refused, wal)
    relay.pipeline.sink = relay.sink = sink
    return relay, sink


def run_until_idle(relay: StreamRelay, sink: Lingering, wal: Wal, looks: int = 50) -> list[str]:
    """Stream until the source has been idle ``looks`` times (a millisecond or so each, well
    past linger.HOLD); the events acknowledged by then, before the graceful stop's flush."""
    before_stop: list[str] = []

    def on_idle() -> None:
        nonlocal looks
        looks -= 1
        if looks == 0:
            before_stop.extend(acked_ids(sink))
            relay.request_stop()

    wal.on_idle = on_idle
    relay.stream(wal.tables)
    return before_stop


def test_a_quiet_stream_is_sent_once_its_first_event_waited_hold() -> None:
    wal = Wal(transactions(1))
    relay, sink = lingering_relay(wal)

    sent = run_until_idle(relay, sink, wal)

    assert linger.quiet(len(wal.event_ids), linger.HOLD)
    assert sent == wal.event_ids, "the quiet stream's events waited for linger.ms"
    assert sink.settled[0] == len(wal.event_ids)


@pytest.mark.parametrize("per_event", [0.0, 0.0005])
def test_a_backlog_is_left_to_linger_ms_and_loses_nothing(per_event: float) -> None:
    """Whatever the relay's pace: one that sends 2,000 events/s (``per_event`` 0.5 ms) drains
    a backlog below linger.QUIET's rate, and a flush at each look would halve it."""
    wal = Wal(backlog())  # 500 events waiting at once
    relay, sink = lingering_relay(wal)
    sink.per_event = per_event

    run_until_idle(relay, sink, wal)

    assert not any(sink.behind), "a look flushed while the relay had not read all there was"
    assert acked_ids(sink) == wal.event_ids  # in order, each once


@pytest.mark.parametrize(
    ("sent", "seconds", "expected"),
    [
        (10, linger.HOLD, True),  # 3,333 events/s
        (29, linger.HOLD, True),  # 9,667
        (31, linger.HOLD, False),  # 10,333
        (100, linger.HOLD, False),  # 33,333
        (30, 0.1, True),  # a burst after a pause: 300 events/s
        (0, 0.0, False),
    ],
)
def test_a_stream_read_to_its_end_is_quiet_under_10000_events_a_second(
    sent: int, seconds: float, expected: bool
) -> None:
    assert linger.quiet(sent, seconds) is expected


# Delivery reports served inside the look's flush, not in the loop's poll (a no-context review
# of the look): what the refusal policy, the LSN rule and the status updates make of them.


def run_quiet(relay: StreamRelay, sink: Lingering, wal: Wal, then: list[list[bytes]]) -> None:
    """Stream ``wal``, writing each of ``then`` once the producer is empty, and stop once it
    is empty after the last (or when the relay stops by itself)."""

    def on_idle() -> None:
        if sink.queue:
            return
        if then:
            wal.write(then.pop(0), end=wal.end)
        else:
            relay.request_stop()

    wal.on_idle = on_idle
    relay.stream(wal.tables)


def first_and_second() -> tuple[list[bytes], list[bytes]]:
    first = transactions(1)
    return first, transactions(2)[len(first) :]


def test_a_refusal_served_in_the_look_rewinds_and_the_culprit_alone_stops_the_relay() -> None:
    first, second = first_and_second()
    wal = Wal(first)
    relay, sink = lingering_relay(wal)
    culprit = Wal(first + second).event_ids[13]  # the fourth event of the second transaction
    sink.poison[culprit] = KafkaError.MSG_SIZE_TOO_LARGE

    with pytest.raises(DeliveryError) as failure:
        run_quiet(relay, sink, wal, [second])

    assert culprit in str(failure.value)
    sizes = [size for refused, _, size in sink.refused if refused == culprit]
    assert sizes[0] == 10  # refused in the look's batch: a suspect
    assert sizes[-1] == 1  # then alone: the culprit
    assert first_seen(acked_ids(sink)) == wal.event_ids[:13]
    assert max(wal.flushed()) < wal.end_of(culprit)


def test_a_culprit_refused_in_the_look_is_dead_lettered_and_the_stream_goes_on() -> None:
    first, second = first_and_second()
    wal = Wal(first)
    relay, sink = lingering_relay(wal, dead_letter_topic=DEAD)
    culprit = Wal(first + second).event_ids[13]
    sink.poison[culprit] = KafkaError.MSG_SIZE_TOO_LARGE

    run_quiet(relay, sink, wal, [second])

    assert isinstance(relay.dead_letters, Letters)
    assert relay.dead_letters.stored == [(culprit, KafkaError.MSG_SIZE_TOO_LARGE)]
    assert first_seen(acked_ids(sink)) == wal.event_ids
    assert wal.flushed()[-1] == wal.units[-1][0]


def test_with_the_broker_away_a_quiet_stream_is_looked_at_once_and_status_updates_go_on() -> None:
    wal = Wal(transactions(1))
    relay, sink = lingering_relay(wal)
    sink.hold.update(wal.event_ids)  # nothing answered
    looks = 0
    flushes: list[int] = []

    def on_idle() -> None:
        nonlocal looks
        looks += 1
        if looks == 200:
            flushes.append(len(sink.settled))
            relay.request_stop()

    wal.on_idle = on_idle
    began = time.monotonic()
    relay.stream(wal.tables)

    assert flushes == [1]  # one look per burst: none while nothing new is read
    assert len(wal.statuses) >= 5  # invariant 6
    assert max(wal.flushed(), default=0) == 0  # nothing confirmed
    assert time.monotonic() - began < 5


def test_a_connection_lost_while_a_look_is_due_replays_and_loses_nothing() -> None:
    wal = Wal(transactions(1))
    relay, sink = lingering_relay(wal)
    wal.lose_after = 7  # inside the transaction: events offered, the look due

    def on_idle() -> None:
        if not sink.queue and set(acked_ids(sink)) == set(wal.event_ids):
            relay.request_stop()

    wal.on_idle = on_idle
    relay.stream(wal.tables)

    assert len(wal.starts) == 2
    assert first_seen(acked_ids(sink)) == wal.event_ids
    assert wal.flushed()[-1] == wal.end


def test_each_quiet_transaction_is_sent_in_its_own_look() -> None:
    first, second = first_and_second()
    third = transactions(3)[len(first) + len(second) :]
    wal = Wal(first)
    relay, sink = lingering_relay(wal)

    run_quiet(relay, sink, wal, [second, third])  # each written once the last was sent

    assert acked_ids(sink) == wal.event_ids
    assert len(wal.event_ids) == 30
    assert sink.settled[:3] == [10, 10, 10]
    assert wal.flushed()[-1] == wal.units[-1][0]
