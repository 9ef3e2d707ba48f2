"""A quiet stream's events go to Kafka without waiting out ``linger.ms`` (relay/linger.py).

The loop runs on test_stream_loop's in-memory stages, with a sink that behaves as librdkafka
does under a ``linger.ms`` longer than the test: a poll sends nothing (it only serves the
reports of what was sent), a flush sends everything. The integration suite shows the same
against a real broker (tests/integration/test_stream.py, a ``linger.ms`` of a minute).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from test_stream_loop import Sink, Wal, acked_ids, backlog, relay_on

from cdc_relay.relay import linger
from cdc_relay.relay.stream import StreamRelay


class Lingering(Sink):
    """librdkafka holding every batch open: a poll reports nothing; a flush (``settle``)
    sends and reports all it holds. ``settled`` is what the producer held at each flush."""

    def __init__(self, on_ack: Callable[[Any], None], on_refused: Callable[..., None]) -> None:
        super().__init__(on_ack, on_refused)
        self.settled: list[int] = []

    def poll(self, timeout: float) -> None:
        self.hold_all = True
        try:
            super().poll(timeout)
        finally:
            self.hold_all = False

    def settle(self, timeout: float) -> None:
        self.settled.append(len(self.queue))
        super().settle(timeout)


def transactions(count: int) -> list[bytes]:
    """The first ``count`` transactions of the captured backlog (10 events each)."""
    raw = backlog()
    commits = [i for i, data in enumerate(raw) if data[:1] == b"C"]
    return raw[: commits[count - 1] + 1]


def lingering_relay(wal: Wal) -> tuple[StreamRelay, Lingering]:
    relay, _ = relay_on(wal)
    sink = Lingering(relay.pipeline._acked, relay.pipeline._refused)
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

    assert len(wal.event_ids) < linger.QUIET
    assert sent == wal.event_ids, "the quiet stream's events waited for linger.ms"
    assert sink.settled[0] == len(wal.event_ids)


def test_a_busy_stream_is_left_to_linger_ms_and_loses_nothing() -> None:
    wal = Wal(transactions(5))
    relay, sink = lingering_relay(wal)

    sent = run_until_idle(relay, sink, wal)

    assert len(wal.event_ids) >= linger.QUIET
    assert sent == [], "a busy stream's batches were sent before they filled"
    assert acked_ids(sink) == wal.event_ids  # the graceful stop's flush sent them, in order


def test_each_quiet_transaction_is_sent_in_its_own_look() -> None:
    first, *rest = (transactions(n)[len(transactions(n - 1)) if n > 1 else 0 :] for n in (1, 2, 3))
    wal = Wal(first)
    relay, sink = lingering_relay(wal)

    def on_idle() -> None:
        if sink.queue:
            return  # not sent yet: without the look, never (poll sends nothing here)
        if rest:
            wal.write(rest.pop(0))  # the next transaction commits once the last was sent
        else:
            relay.request_stop()

    wal.on_idle = on_idle
    relay.stream(wal.tables)

    assert acked_ids(sink) == wal.event_ids
    assert len(wal.event_ids) == 30
    assert sink.settled[:3] == [10, 10, 10]
