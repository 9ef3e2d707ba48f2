"""Exactly once against a full producer queue: the broker stalls while the relay drains a
backlog, and the queue (queue.buffering.max.messages) fills with the open transaction's own
events; a commit due then must wait for room for its checkpoint record (as commit_transaction
waits for the queue to flush), lose nothing, and meet a refusal served meanwhile as a commit
does: an abort and a replay, or, while stopping, the stop.

The relay's loop and Kafka's sink run for real on memory_producer's model of librdkafka, with
librdkafka's bounded queue (produce raises BufferError when full) and a broker that answers
nothing for a while after the first event.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException
from memory_producer import Coordinator, Producer
from simulation import Writer
from test_stream_loop import Wal, backlog
from test_stream_loop_eos import CHECKPOINTS, Kafka, eos_relay, real_sink

from cdc_relay.kafka import exactly_once, outage, transactional
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


class Stalled(Producer):
    """memory_producer's librdkafka with librdkafka's bounded queue (BufferError once it holds
    ``capacity`` messages), on a ``broker`` that answers nothing while it stalls."""

    capacity = 20
    broker = Broker(0.0)

    def produce(self, topic: str, *args: Any, **kwargs: Any) -> None:
        if self.state == "InTransaction" and len(self) >= self.capacity:
            raise BufferError("Local: Queue full")
        if topic != CHECKPOINTS:
            self.broker.start()
        super().produce(topic, *args, **kwargs)

    def _send(self) -> None:
        if not self.broker.left():  # while it stalls, nothing is sent and no report comes
            super()._send()

    def poll(self, timeout: float = -1) -> int:
        if timeout and self.broker.left():
            time.sleep(min(timeout, self.broker.left()))
        return super().poll(timeout)

    def flush(self, timeout: float = -1) -> int:
        if timeout and self.broker.left():
            time.sleep(min(timeout, self.broker.left()))
        return super().flush(timeout)

    def commit_transaction(self, timeout: float = -1) -> None:
        time.sleep(self.broker.left())  # librdkafka's commit flushes first: it waits
        super().commit_transaction(timeout)


def stalling_producers(
    monkeypatch: pytest.MonkeyPatch,
    kafka: Kafka,
    capacity: int,
    stall: float,
    kind: type[Stalled] = Stalled,
) -> None:
    """The sink's producers are ``kind``, holding at most ``capacity`` messages, on a broker
    that stalls for ``stall`` seconds from the first event."""
    coordinator = Coordinator(kafka, CHECKPOINTS)
    made = type("Made", (kind,), {"capacity": capacity, "broker": Broker(stall)})
    monkeypatch.setattr(kafka_sink, "Producer", lambda config: made(coordinator, config))


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


def unauthorised_topic(capacity: int) -> type[Producer]:
    class Unauthorised(Producer):
        """librdkafka with a queue of ``capacity``; Kafka answers the AddPartitionsToTxn of
        topic "x" late (a broker stall) with TOPIC_AUTHORIZATION_FAILED: librdkafka then takes
        the transaction into its abortable state with that error and purges its queue; its
        request stays counted (txn_req_cnt)."""

        stalled = 0
        txn_err: int | None = None

        def produce(self, topic: str, *args: Any, **kwargs: Any) -> None:
            if self.state == "InTransaction" and len(self) >= capacity:
                raise BufferError("Local: Queue full")
            super().produce(topic, *args, **kwargs)

        def _register(self) -> None:
            if any(t == "x" for t, _ in self.pending):
                if not self.stalled:
                    self.txn_req_cnt += 1  # sent, answered later
                self.stalled += 1
                return
            super()._register()

        def _wait(self) -> None:
            if self.stalled and self.state == "InTransaction":
                self.stalled += 1
                if self.stalled > 3:  # Kafka answers
                    self.txn_err = KafkaError.TOPIC_AUTHORIZATION_FAILED
                    self.state = "AbortableError"
                    self.pending = set()
                    self.purge()
                    return
            super()._wait()

        def begin_transaction(self) -> None:
            super().begin_transaction()
            self.stalled, self.txn_err = 0, None

        def commit_transaction(self, timeout: float = -1) -> None:
            if self.state == "InTransaction":
                self._wait()
                self._serve()
            if self.state == "AbortableError":  # begin_commit refuses with the reason
                raise KafkaException(
                    KafkaError(
                        self.txn_err,
                        "Failed to add partition(s) to transaction",
                        txn_requires_abort=True,
                    )
                )
            super().commit_transaction(timeout)

    return Unauthorised


@pytest.mark.parametrize("capacity", [100, 3])  # the checkpoint at once, or after a wait
def test_a_topic_refused_late_aborts_the_commit_for_a_replay_whether_the_queue_was_full(
    monkeypatch: pytest.MonkeyPatch, capacity: int
) -> None:
    """Kafka refuses to add a partition of a topic the relay may not write, late: the abort
    then meets a coordinator that holds no transaction open (INVALID_TXN_STATE), which is
    safe to go on from only when the commit failed on that refusal. A queue full when the
    refusal came must not hide it behind librdkafka's "Erroneous state"."""
    kafka = Kafka()
    coordinator = Coordinator(kafka, CHECKPOINTS)
    cls = unauthorised_topic(capacity)
    monkeypatch.setattr(kafka_sink, "Producer", lambda config: cls(coordinator, config))
    sink = real_sink(kafka, lambda token: None, lambda token, err: None)
    sink.initialise()
    assert sink.offer(Message("t", b"0", b"k", []), 0)
    sink.commit(Checkpoint())  # a first transaction commits
    for n in range(1, 4):  # the next one's events all go to "x"
        assert sink.offer(Message("x", str(n).encode(), b"k", []), n)

    with pytest.raises(TransactionAborted):  # a replay, not a stop
        sink.commit(Checkpoint())
    assert ("EndTxn(abort)", "INVALID_TXN_STATE") in coordinator.answers


@pytest.mark.parametrize("capacity", [20, 1000])  # the stop's commit waits for room, or not
def test_a_refusal_during_the_stopping_commit_does_not_escape_the_stop(
    monkeypatch: pytest.MonkeyPatch, capacity: int
) -> None:
    """Kafka refuses an event while the graceful stop commits: the stop goes on (no rewind
    while stopping; the replay after a restart meets the refusal again), nothing is visible
    twice or out of order."""
    monkeypatch.setattr(stream, "_TICK", 0.0)
    kafka = Kafka()
    relays: list[Any] = []
    refused: list[bool] = []

    class StallThenRefuse(Stalled):
        def produce(self, topic: str, *args: Any, **kwargs: Any) -> None:
            if self.state == "InTransaction" and len(self) >= 20 and topic != CHECKPOINTS:
                relays[0].request_stop()
            super().produce(topic, *args, **kwargs)

        def _send(self) -> None:
            if self.broker.left():
                return
            if (
                not refused
                and self.state == "InTransaction"
                and any(q.message.topic != CHECKPOINTS for q in self.queue)
            ):
                refused.append(True)
                first, *rest = self.queue
                self.queue = []
                self.reports.append((first, KafkaError(KafkaError.INVALID_RECORD)))
                self.reports.extend((q, KafkaError(KafkaError._PURGE_QUEUE)) for q in rest)
                self.state = "AbortableError"  # librdkafka: abortable at once, queue purged
                return
            super()._send()

    stalling_producers(monkeypatch, kafka, capacity, stall=1.0, kind=StallThenRefuse)
    wal = Wal(backlog())
    relay, _ = eos_relay(wal, kafka, max_events=50, sink=real_sink, interval=0.1)
    relay.settings = dataclasses.replace(relay.settings, shutdown_timeout=5.0)
    relays.append(relay)

    relay.stream(wal.tables)  # a graceful stop: returns

    assert refused
    assert kafka.ids() == wal.event_ids[: len(kafka.ids())]


def test_an_append_kafka_takes_after_an_outage_says_it_is_back(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """As the at-least-once sink's acknowledgement does: the line that Kafka is back comes with
    the first append it takes, not with the next statistics (every 5 s), which a relay that
    stops first never reads (tests/integration/test_faults.py, the broker killed)."""
    caplog.set_level(logging.INFO, logger="cdc_relay.kafka.outage")
    kafka = Kafka()
    coordinator = Coordinator(kafka, CHECKPOINTS)
    monkeypatch.setattr(kafka_sink, "Producer", lambda config: Producer(coordinator, config))
    sink = real_sink(kafka, lambda token: None, lambda token, err: None)
    sink.initialise()
    monkeypatch.setattr(outage.KAFKA, "since", None)
    outage.KAFKA.failed("TxnCoordinator: Connect to ipv4#127.0.0.1:9092 failed")
    assert outage.KAFKA.down

    assert sink.offer(Message("t", b"0", b"k", []), 0)
    sink.poll(0.1)  # the partition added to the transaction, the append sent and reported

    assert not outage.KAFKA.down
    assert any("Kafka reachable again" in r.getMessage() for r in caplog.records)
