"""Exactly once against a full producer queue: the broker stalls while the relay drains a
backlog, and the queue (queue.buffering.max.messages) fills with the open transaction's own
events; a commit due then must wait for room for its checkpoint record, as the relay's offers
do, and lose nothing (ARCHITECTURE.md, invariant 6: liveness under back-pressure).

The relay's loop and Kafka's sink run for real on memory_producer's model of librdkafka, with
librdkafka's bounded queue (produce raises BufferError when full) and a broker that answers
nothing for a while after the first event.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from confluent_kafka import KafkaError
from memory_producer import Coordinator, Producer
from simulation import Writer
from test_stream_loop import Wal, backlog
from test_stream_loop_eos import CHECKPOINTS, Kafka, eos_relay, real_sink

from cdc_relay.kafka import exactly_once, transactional
from cdc_relay.kafka import sink as kafka_sink
from cdc_relay.kafka.checkpoints import Checkpoint
from cdc_relay.kafka.exactly_once import ExactlyOnce
from cdc_relay.kafka.routing import Message
from cdc_relay.kafka.sink import DEFAULTS
from cdc_relay.kafka.transactional import TransactionAborted
from cdc_relay.relay import stream


class Broker:
    """Kafka answers nothing for ``stall`` seconds from the first event produced."""

    def __init__(self, stall: float) -> None:
        self.stall = stall
        self.until: float | None = None

    def start(self) -> None:
        if self.until is None:
            self.until = time.monotonic() + self.stall

    def left(self) -> float:
        return 0.0 if self.until is None else max(0.0, self.until - time.monotonic())


def stalling_producers(
    monkeypatch: pytest.MonkeyPatch, kafka: Kafka, capacity: int, stall: float
) -> None:
    """The sink's producers hold at most ``capacity`` messages, and the broker stalls."""
    coordinator = Coordinator(kafka, CHECKPOINTS)
    broker = Broker(stall)

    class Bounded(Producer):
        def produce(self, topic: str, *args: Any, **kwargs: Any) -> None:
            if len(self) >= capacity:
                raise BufferError("Local: Queue full")
            if topic != CHECKPOINTS:
                broker.start()
            super().produce(topic, *args, **kwargs)

        def _send(self) -> None:
            if not broker.left():  # while it stalls, nothing is sent and no report comes
                super()._send()

        def poll(self, timeout: float = -1) -> int:
            if timeout and broker.left():
                time.sleep(min(timeout, broker.left()))
            return super().poll(timeout)

        def flush(self, timeout: float = -1) -> int:
            if timeout and broker.left():
                time.sleep(min(timeout, broker.left()))
            return super().flush(timeout)

        def commit_transaction(self, timeout: float = -1) -> None:
            time.sleep(broker.left())  # librdkafka's commit flushes first: it waits
            super().commit_transaction(timeout)

    monkeypatch.setattr(kafka_sink, "Producer", lambda config: Bounded(coordinator, config))


@pytest.mark.parametrize("max_events", [10, 50])  # transactions below and above the queue
def test_a_commit_due_while_the_queue_is_full_waits_for_room(
    monkeypatch: pytest.MonkeyPatch, max_events: int
) -> None:
    monkeypatch.setattr(stream, "_TICK", 0.0)  # a look per message: a commit as soon as due
    kafka = Kafka()
    stalling_producers(monkeypatch, kafka, capacity=20, stall=1.0)
    wal = Wal(backlog())
    relay, _ = eos_relay(wal, kafka, max_events=max_events, sink=real_sink, interval=0.1)
    wal.on_idle = relay.request_stop

    relay.stream(wal.tables)

    assert kafka.ids() == wal.event_ids  # every event once, in order


class Slow:
    """``time`` for the commit's rules and the sink at a quarter of the speed: the loop here,
    pure Python, drains at about the compiled build's pace on that clock."""

    @staticmethod
    def monotonic() -> float:
        return time.monotonic() / 4


def test_with_the_defaults_a_broker_stall_while_draining_a_backlog_is_waited_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Unscaled: the sink's default queue, ExactlyOnce's defaults (a transaction of a backlog
    may hold more events than the queue), 25,000 events and a stall of a second on the
    relay's clock."""
    kafka = Kafka()
    stalling_producers(
        monkeypatch, kafka, capacity=int(DEFAULTS["queue.buffering.max.messages"]), stall=4.0
    )
    monkeypatch.setattr(exactly_once, "time", Slow)
    monkeypatch.setattr(transactional, "time", Slow)
    wal = Wal()
    wal.watchdog = 60.0
    writer = Writer([wal])
    for _ in range(2_500):
        writer.transaction([("row", "abc"[i % 3]) for i in range(10)])
    defaults = ExactlyOnce("test")
    assert defaults.max_events > int(DEFAULTS["queue.buffering.max.messages"])
    relay, _ = eos_relay(
        wal, kafka, max_events=defaults.max_events, sink=real_sink, interval=defaults.interval
    )
    wal.on_idle = relay.request_stop

    relay.stream(wal.tables)

    assert kafka.ids() == wal.event_ids  # every event once, in order
    assert len(wal.event_ids) == 25_000


def test_a_refusal_served_while_the_checkpoint_waits_for_room_aborts_the_commit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """librdkafka takes a transaction into its abortable state as soon as Kafka refuses one
    of its messages, and refuses every produce after (Local: Erroneous state). A refusal
    served while the checkpoint waits for room is such a case: the commit is aborted for the
    caller to replay (its refusal handled), and the relay is not stopped as if the
    transaction had failed for good."""
    kafka = Kafka()
    coordinator = Coordinator(kafka, CHECKPOINTS)
    refused: list[Any] = []

    class Refusing(Producer):
        def produce(self, topic: str, *args: Any, **kwargs: Any) -> None:
            if len(self) >= 2:
                raise BufferError("Local: Queue full")
            super().produce(topic, *args, **kwargs)

        refusing = False

        def _send(self) -> None:
            if not self.refusing:
                super()._send()
                return
            for queued in self.queue[:1]:  # Kafka refuses the first message it is sent
                self.queue.remove(queued)
                self.reports.append((queued, KafkaError(KafkaError.INVALID_RECORD)))

        def _serve(self) -> int:
            served = super()._serve()
            if self.dr_fails:
                self.state = "AbortableError"
            return served

    monkeypatch.setattr(kafka_sink, "Producer", lambda config: Refusing(coordinator, config))
    sink = real_sink(kafka, lambda token: None, lambda token, err: refused.append(token))
    sink.initialise()
    Refusing.refusing = True
    for n in range(2):
        assert sink.offer(Message("t", str(n).encode(), b"k", []), n)

    with pytest.raises(TransactionAborted):
        sink.commit(Checkpoint())

    assert refused[:1] == [0]  # Kafka's refusal, told; then the abort's purge
    assert kafka.ids() == []  # nothing of the transaction is visible
    assert sink.aborted == 1
