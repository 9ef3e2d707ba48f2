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

    assert linger.Pace(0, 0.0).quiet(len(wal.event_ids), linger.HOLD)
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


def verdicts(looks: list[tuple[int, float]], times: int = 50) -> list[bool]:
    """What a pace makes of ``looks`` (events sent, seconds since the last look), repeated
    ``times``: its verdict at each look of the last round, once it has settled."""
    pace = linger.Pace(0, 0.0)
    events, now = 0, 0.0
    said: list[bool] = []
    for _ in range(times):
        said = []
        for sent, seconds in looks:
            events, now = events + sent, now + seconds
            said.append(pace.quiet(events, now))
    return said


@pytest.mark.parametrize(
    ("per_look", "expected"),
    [
        (12, True),  # 3,000 events/s, a look every 4 ms
        (36, True),  # 9,000
        (44, False),  # 11,000
        (132, False),  # 33,000
    ],
)
def test_a_steady_stream_is_quiet_under_10000_events_a_second(
    per_look: int, expected: bool
) -> None:
    assert verdicts([(per_look, 0.004)]) == [expected]


def test_a_steady_5000_events_a_second_in_bursts_is_quiet_at_every_look() -> None:
    """A steady 5,000 events/s in bursts of 40, 8 ms apart: a look's window that holds a
    burst sees 13,333 events/s. Judged by that window, 7.5% of the looks at the bench's steady
    5,000 events/s (ten events a commit on four connections, commits bunching) took the stream
    for a busy one and left their events to linger.ms, which made the p99 (bench/README.md)."""
    assert not linger.QUIET * 0.003 > 40  # the window alone says busy
    assert verdicts([(40, 0.003), (0, 0.005)]) == [True, True]


def test_a_steady_20000_events_a_second_in_bursts_is_busy_at_every_look() -> None:
    assert verdicts([(160, 0.004), (0, 0.004)]) == [False, False]


def test_a_stream_is_judged_again_within_its_span() -> None:
    """Busy after a quiet moment within a few looks; quiet at the first look after a pause."""
    pace = linger.Pace(0, 0.0)
    assert pace.quiet(10, 1.0)
    busy = [pace.quiet(100 * k, 1.0 + 0.004 * k) for k in range(1, 11)]  # 25,000 events/s
    assert busy[0] and not busy[-1]
    assert busy.index(False) * 0.004 <= linger.SPAN
    assert pace.quiet(1_040, 2.0)  # 40 events after a pause of a second


def test_after_a_busy_stretch_a_pause_of_span_is_quiet_and_a_shorter_one_is_not() -> None:
    """The price of the average (a no-context review of the look): the rate remembers a busy
    stretch for about SPAN, so a transaction after a shorter pause waits out linger.ms."""
    busy = [(200 * k, 0.004 * k) for k in range(1, 26)]  # 100 ms at 50,000 events/s
    for pause, expected in ((linger.SPAN, True), (linger.SPAN / 2, False)):
        pace = linger.Pace(0, 0.0)
        assert not any([pace.quiet(events, now) for events, now in busy][1:])
        assert pace.quiet(5_010, 0.100 + pause + linger.HOLD) is expected


def test_a_look_at_the_same_instant_changes_nothing() -> None:
    pace = linger.Pace(0, 0.0)
    assert not pace.quiet(200, 0.004)  # 50,000 events/s, the whole span
    assert not pace.quiet(200, 0.004)
    assert pace.quiet(200, 1.0)


def test_a_burst_after_a_quiet_moment_is_sent_at_its_look() -> None:
    """Ten transactions at once, 3 ms or so after the last look: over that window alone over
    25,000 events/s, a busy stream's rate; over the stream's span, a burst in a quiet one."""
    first = transactions(1)
    wal = Wal(first)
    relay, sink = lingering_relay(wal)
    then = [transactions(11)[len(first) :]]
    idle = 0
    flushed: list[int] = []  # what the producer held at each look's flush, before the stop's

    def on_idle() -> None:
        nonlocal idle
        if sink.queue:
            idle += 1
            if idle < 500:  # half a second or more: the burst was left to linger.ms
                return
        elif then:
            wal.write(then.pop(0), end=wal.end)
            return
        flushed.extend(sink.settled)
        relay.request_stop()

    wal.on_idle = on_idle
    relay.stream(wal.tables)

    assert flushed == [10, 100], "the burst waited for linger.ms"
    assert acked_ids(sink) == wal.event_ids


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
