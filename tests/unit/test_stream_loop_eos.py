"""The CDC loop in exactly-once mode on in-memory stages: no database, no broker.

The source is test_stream_loop's replay of captured pgoutput. The broker is ``Kafka``: what a
read_committed consumer reads (the messages of committed transactions, in commit order) and
the last committed checkpoint; each relay writes to it through its own transactional
``Transactions`` sink, whose open transaction dies with the relay. A "kill" is the relay
process dying at an instruction (the test raises ``Killed`` there): nothing after it reaches
Kafka or the slot, as with SIGKILL. What these prove is the loop's side of exactly once
(ARCHITECTURE.md, "Exactly once"): the slot is confirmed only behind committed checkpoints,
and a replay skips exactly what the checkpoint says Kafka has; the integration suite proves
the same against PostgreSQL and Kafka.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from capture import messages
from confluent_kafka import KafkaError
from memory_producer import Coordinator, producers
from test_stream_loop import WATCHDOG, Wal, backlog, event_id

from cdc_relay.errors import RelayError
from cdc_relay.events import Begin
from cdc_relay.kafka import sink as kafka_sink
from cdc_relay.kafka.checkpoints import MESSAGE, TRANSACTION, Checkpoint, Unit
from cdc_relay.kafka.exactly_once import ExactlyOnce
from cdc_relay.kafka.routing import Message
from cdc_relay.kafka.transactional import TransactionAborted, TransactionalSink
from cdc_relay.lsn import Lsn
from cdc_relay.postgres.connection import timeline_of
from cdc_relay.postgres.messages import Messages
from cdc_relay.relay import stream
from cdc_relay.relay.stages import ReadTimeline
from cdc_relay.relay.stream import StreamRelay
from cdc_relay.relay.stream_settings import StreamSettings


@pytest.fixture(autouse=True)
def look_after_every_message(monkeypatch: pytest.MonkeyPatch) -> None:
    """The loop looks at its timers (and commits when due) after every message instead of
    every 5 ms: a Kafka transaction then holds ``max_events`` events, not what 5 ms read."""
    monkeypatch.setattr(stream, "_TICK", 0.0)


class Killed(BaseException):
    """The relay's process dies here (BaseException: no ``except Exception`` catches it)."""


class Kafka:
    """The broker, as exactly once sees it (cdc_relay.relay.stages.CheckpointStore too)."""

    def __init__(self) -> None:
        self.visible: list[Message] = []  # what read_committed consumers read
        self.checkpoint = Checkpoint()
        self.epoch = 0  # the transactional id's: a producer of an older one is fenced
        self.transactions: list[int] = []  # events per committed transaction

    def prepare(self, timeout: float) -> None:
        pass

    def read(self, timeout: float) -> Checkpoint:
        return self.checkpoint

    def ids(self) -> list[str]:
        return [event_id(m) for m in self.visible]


class Transactions:
    """One relay's transactional producer (cdc_relay.relay.stages.TransactionalSink): every
    message offered is appended at once, and acknowledged when its transaction commits."""

    def __init__(
        self, kafka: Kafka, on_ack: Callable[[Any], None], on_refused: Callable[..., None]
    ) -> None:
        self.kafka = kafka
        self.on_ack = on_ack
        self.on_refused = on_refused
        self.open: list[tuple[Message, Any]] = []
        self.opened = 0.0
        self.epoch = -1
        self.initialised = False
        self.commits = 0
        self.offers = 0
        self.on_offer: Callable[[], object] = lambda: None  # before each offer is taken
        self.on_commit: Callable[[], object] = lambda: None  # after each commit
        self.dead = False
        self.open_at_death: list[str] = []
        self.aborted: list[list[str]] = []  # the events of each transaction aborted
        self.connected = True
        self.broken = False
        # Kafka refuses the checkpoint record of the next transactions holding one of these
        # events alone: the commit fails and the transaction is aborted.
        self.abort_alone: list[str] = []
        self.born = time.monotonic()

    @property
    def events(self) -> int:
        return len(self.open)

    def initialise(self) -> None:
        self.kafka.epoch += 1
        self.epoch = self.kafka.epoch
        self.initialised = True

    def offer(self, message: Message, token: Any) -> bool:
        assert not self.dead
        assert self.epoch == self.kafka.epoch, "a fenced producer offered a message"
        self.offers += 1
        self.on_offer()
        if not self.open:
            self.opened = time.monotonic()
        self.open.append((message, token))
        return True

    def commit(self, checkpoint: Checkpoint) -> None:
        if self.dead:  # the process is gone: its open transaction is aborted by the next one
            raise TransactionAborted("the relay died")
        if not self.open:
            return
        if [event_id(message) for message, _ in self.open][:1] == self.abort_alone[:1]:
            self.abort_alone.pop(0)
            self.renew()
            raise TransactionAborted("Kafka refused the checkpoint record")
        kafka = self.kafka
        kafka.visible.extend(message for message, _ in self.open)
        kafka.transactions.append(len(self.open))
        kafka.checkpoint = checkpoint
        acked, self.open = self.open, []
        self.commits += 1
        for _, token in acked:
            self.on_ack(token)
        self.on_commit()

    def kill(self) -> None:
        self.dead = True
        self.open_at_death = [event_id(message) for message, _ in self.open]
        raise Killed

    def poll(self, timeout: float) -> None:
        assert time.monotonic() - self.born < WATCHDOG, "the loop waits for ever"

    def settle(self, timeout: float) -> None:
        assert time.monotonic() - self.born < WATCHDOG, "the loop waits for ever"

    def in_flight(self) -> int:
        return 0  # appended at once: what is open waits for its commit, not for Kafka

    def missing(self, topic: str, err: KafkaError) -> bool:
        return False  # no topic is made here (--create-topics): tests/integration has those

    def renew(self) -> None:
        if self.open:
            self.aborted.append([event_id(message) for message, _ in self.open])
        self.open = []  # aborted: never visible, reported by no one

    def check_reachable(self, timeout: float) -> None:
        pass

    def close(self) -> int:
        left, self.open = len(self.open), []
        return left


def eos_relay(
    wal: Wal,
    kafka: Kafka,
    max_events: int = 4,
    read_timeline: ReadTimeline | None = None,
    sink: Callable[..., Any] = Transactions,
    interval: float = 3600.0,
) -> tuple[StreamRelay, Any]:
    """A relay in exactly-once mode on ``wal`` and ``kafka``; a Kafka transaction holds
    ``max_events`` events, or those of the stream's last transaction read when it idles
    (``interval``: how long one stays open at most, a quarter of it on an idle stream).
    Its sink is ``sink(kafka, on_ack, on_refused)``: the stand-in ``Transactions`` by default,
    or ``real_sink``, the real one on the model of librdkafka's producer."""
    sinks: list[Any] = []

    def open_transactions(on_ack: Callable[[Any], None], on_refused: Callable[..., None]) -> Any:
        sinks.append(sink(kafka, on_ack, on_refused))
        return sinks[0]

    relay = StreamRelay(
        StreamSettings(
            dsn="test",
            slot="test",
            publication="test",
            tables=("public.outbox_events",),
            kafka_config={},
            topic_template="outbox.{aggregate_type}",
            status_interval=0.01,
            shutdown_timeout=0.05,
            progress_interval=3600.0,
            exactly_once=ExactlyOnce("test", interval=interval, max_events=max_events),
            # the captures hold outbox messages: relayed as with --messages (whose check of
            # who may emit them is the database's, not the loop's)
            messages=Messages(relay=True),
        ),
        open_source=wal.open,
        open_transactions=open_transactions,
        checkpoints=kafka,
        # The same server, reconnected.
        read_timeline=read_timeline or (lambda dsn, slot: (0, wal.confirmed)),
    )
    return relay, sinks[0]


CHECKPOINTS = "cdc_relay.checkpoints"


def real_sink(
    kafka: Kafka, on_ack: Callable[[Any], None], on_refused: Callable[..., None]
) -> TransactionalSink:
    """The real exactly-once sink, on the producers ``on_librdkafka`` patched in."""
    return TransactionalSink(
        {}, on_ack, on_refused, transactional_id="test", checkpoint_topic=CHECKPOINTS
    )


def on_librdkafka(monkeypatch: pytest.MonkeyPatch, kafka: Kafka) -> tuple[Coordinator, list[Any]]:
    """The sink's producers are the model of librdkafka's (memory_producer.py), on a
    transaction coordinator committing into ``kafka``; the coordinator and the producers."""
    coordinator = Coordinator(kafka, CHECKPOINTS)
    make, made = producers(coordinator)
    monkeypatch.setattr(kafka_sink, "Producer", make)
    return coordinator, made


def commit_positions(wal: Wal) -> dict[Lsn, Lsn]:
    """Each transaction's commit LSN (a checkpoint's unit) by its end (a slot's position)."""
    return {
        end: next(r.final_lsn for _, r in unit if isinstance(r, Begin)) for end, unit in wal.units
    }


def run_until_killed(relay: StreamRelay, wal: Wal) -> Lsn:
    """Run ``relay`` until the test kills it; the slot's position when it died."""
    with pytest.raises(Killed):
        relay.stream(wal.tables)
    return wal.confirmed


def run_to_the_end(wal: Wal, kafka: Kafka) -> None:
    """A relay that reads the stream to its end, then stops (committing what it holds)."""
    relay, _ = eos_relay(wal, kafka)
    wal.on_idle = relay.request_stop
    relay.stream(wal.tables)


def test_kills_after_commits_replay_to_every_event_once_in_order() -> None:
    wal = Wal(backlog())  # 50 transactions of 10 events: most Kafka transactions split one
    kafka = Kafka()
    killed_at: list[tuple[Checkpoint, Lsn]] = []
    for commits in (1, 3, 2, 5, 1, 8):
        relay, sink = eos_relay(wal, kafka)
        wal.on_idle = lambda: pytest.fail("drained before the kill")
        sink.on_commit = lambda s=sink, n=commits: s.commits == n and s.kill()
        confirmed = run_until_killed(relay, wal)
        killed_at.append((kafka.checkpoint, confirmed))
    run_to_the_end(wal, kafka)

    # Every event once, in commit order, though each relay died right after a commit that
    # the slot had not heard of: the next one skipped what the checkpoint said Kafka had.
    assert kafka.ids() == wal.event_ids
    # Kills inside a transaction of the stream: its first events were in Kafka, the next
    # relay skipped exactly those and sent the rest.
    assert any(checkpoint.partial_events for checkpoint, _ in killed_at)
    # The slot never passed what Kafka had committed: a transaction it confirmed was whole
    # in a committed Kafka transaction.
    commit_of = commit_positions(wal)
    for checkpoint, confirmed in killed_at:
        assert confirmed == 0 or commit_of[confirmed] <= checkpoint.position.lsn
    last = kafka.checkpoint
    whole = last.partial.lsn == commit_of[wal.units[-1][0]] and last.partial_events == 10
    assert last.position.lsn == commit_of[wal.units[-1][0]] or whole
    assert len(wal.starts) == 7


def test_a_kill_between_commits_leaves_the_open_transaction_to_the_replay() -> None:
    wal = Wal(backlog())
    kafka = Kafka()
    relay, sink = eos_relay(wal, kafka, max_events=25)
    wal.on_idle = lambda: pytest.fail("drained before the kill")
    # The 240th event is offered into an open transaction holding others: the relay dies.
    sink.on_offer = lambda: sink.offers == 240 and sink.kill()
    confirmed = run_until_killed(relay, wal)
    aborted = sink.open_at_death
    visible = kafka.ids()
    checkpoint_at_kill = kafka.checkpoint
    run_to_the_end(wal, kafka)

    # What the dead relay had open never became visible; the next one sent it, once.
    assert aborted
    assert not set(aborted) & set(visible)
    assert visible == wal.event_ids[: len(visible)]
    assert confirmed == 0 or commit_positions(wal)[confirmed] <= checkpoint_at_kill.position.lsn
    assert kafka.ids() == wal.event_ids


def test_a_lost_connection_aborts_the_open_transaction_and_replays_it_once() -> None:
    wal = Wal(backlog())
    kafka = Kafka()
    relay, sink = eos_relay(wal, kafka, max_events=7)
    wal.lose_after = 255  # reads: inside the 24th transaction
    wal.on_idle = relay.request_stop

    relay.stream(wal.tables)

    assert len(wal.starts) == 2
    assert wal.connections[0].closed
    # The Kafka transaction open when the connection was lost was aborted; its events, and
    # the rest of the stream's transaction read in part, came again from the replay: each
    # event once, in order, in what read_committed consumers see.
    (aborted,) = sink.aborted
    assert aborted
    assert kafka.ids() == wal.event_ids
    flushed = wal.flushed()
    assert flushed == sorted(flushed)


def test_a_lost_connection_right_after_a_commit_renews_the_producer_kafka_failed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The real sink on librdkafka's state machine. Right after a commit, the coordinator is
    still writing its markers: the next transaction's AddPartitionsToTxn is answered
    CONCURRENT_TRANSACTIONS, and librdkafka will retry it. The connection is lost then; the
    abort sends EndTxn(abort), for the request it cannot be sure Kafka did not take, to a
    coordinator with no transaction open: INVALID_TXN_STATE, fatal. The relay stopped there
    for good ("Kafka transaction failed ... restart the relay"). Nothing of the transaction
    was on Kafka: a new producer takes over once the slot is held again (fencing only then),
    the checkpoint is read again, and the replay sends each event once."""
    wal = Wal(backlog())
    kafka = Kafka()
    coordinator, made = on_librdkafka(monkeypatch, kafka)
    inits: list[int] = []  # the stream's starts so far, at each init_transactions
    coordinator.on_init = lambda: inits.append(len(wal.starts))
    relay, _ = eos_relay(wal, kafka, max_events=7, sink=real_sink)
    wal.lose_after = 255  # reads: inside the 24th transaction, its Kafka transaction open
    wal.on_idle = relay.request_stop

    relay.stream(wal.tables)

    assert ("EndTxn(abort)", "INVALID_TXN_STATE") in coordinator.answers
    assert len(made) == 2  # the failed producer, and the one that took over
    assert inits == [1, 2]  # fenced at start, then again only with the slot held again
    assert len(wal.starts) == 2
    assert kafka.ids() == wal.event_ids  # each event once, in order
    flushed = wal.flushed()
    assert flushed == sorted(flushed)


def test_a_producer_renewed_while_another_relay_held_the_slot_skips_what_that_one_committed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As above, and while this relay is cut off, another one takes the slot, fences, commits
    and dies right after a commit the slot has not heard of. Its old producer fenced, this
    relay would have stopped; its new one is not, so the relay reads the checkpoint again
    once it holds the slot, and skips what the other committed. Started from its own older
    checkpoint, it would publish the other's last events again."""
    wal = Wal(backlog())
    kafka = Kafka()
    coordinator, made = on_librdkafka(monkeypatch, kafka)
    relay, _ = eos_relay(wal, kafka, max_events=7, sink=real_sink)
    wal.lose_after = 255
    ahead: list[str] = []

    def lost() -> None:
        wal.taken = 1  # the other relay takes the slot before this one reconnects

    def taken() -> None:
        other, sink = eos_relay(wal, kafka, max_events=7)
        sink.on_commit = lambda: sink.commits == 5 and sink.kill()
        with pytest.raises(Killed):
            other.stream(wal.tables)
        # what Kafka holds of transactions past the slot's position: replayed, not skipped
        ahead.extend(i for i in kafka.ids() if wal.end_of(i) > wal.confirmed)
        wal.connections[-1].close()  # its walsender ends with its process

    wal.on_lost = lost
    wal.on_taken = taken
    wal.on_idle = relay.request_stop

    relay.stream(wal.tables)

    assert ("EndTxn(abort)", "INVALID_TXN_STATE") in coordinator.answers
    assert len(made) == 2
    assert len(wal.starts) == 3  # this relay, the other, this relay again
    # The other committed past what it confirmed, and this relay skipped that all the same.
    assert ahead
    assert kafka.ids() == wal.event_ids


def test_a_connection_lost_while_exactly_once_starts_is_reconnected() -> None:
    """The slot is taken, and while Kafka sets the transactions up (the relay tells the
    walsender it is there meanwhile), the server ends the connection: the relay reconnects
    as anywhere else in the stream. It stopped with "cannot send status"."""
    wal = Wal(backlog())
    kafka = Kafka()
    read = kafka.read

    def read_while_the_server_ends_the_stream(timeout: float) -> Checkpoint:
        assert wal.holder is not None
        wal.holder.terminated = True
        time.sleep(0.05)  # the start's wait for it ticks, and tells the walsender
        return read(timeout)

    kafka.read = read_while_the_server_ends_the_stream  # type: ignore[method-assign]
    relay, _ = eos_relay(wal, kafka)
    wal.on_idle = relay.request_stop

    relay.stream(wal.tables)

    assert len(wal.starts) == 2
    assert kafka.ids() == wal.event_ids


def test_a_server_that_refuses_the_timeline_query_on_reconnecting_is_retried() -> None:
    wal = Wal(backlog())
    kafka = Kafka()
    asked: list[str] = []

    def read_timeline(dsn: str, slot: str) -> tuple[int, Lsn | None]:
        asked.append(slot)
        if len(asked) == 1:  # the server is restarting: its first answer is a refusal
            raise psycopg.OperationalError("the database system is starting up")
        return 0, wal.confirmed

    relay, _ = eos_relay(wal, kafka, read_timeline=read_timeline)
    wal.lose_after = 120
    wal.on_idle = relay.request_stop

    relay.stream(wal.tables)

    # Retried, not stopped: asked again before the stream started again, and every event once.
    assert len(asked) == 2
    assert len(wal.starts) == 2
    assert kafka.ids() == wal.event_ids


def test_the_real_timeline_query_raises_what_the_reconnect_retries() -> None:
    # No server on this port: the OperationalError the loop retries on, not the
    # PreflightError with which a relay stops at start-up.
    with pytest.raises(psycopg.OperationalError):
        timeline_of("host=127.0.0.1 port=1 connect_timeout=2", "test")


def at_one_position() -> Wal:
    """Captured from PostgreSQL 15 (tests/tools/capture.py --positions): a transaction of six
    inserts that emits a non-transactional message last, then one more transaction. The
    message ends where the commit record starts: it and the transaction share one LSN, and
    the stream holds the message first."""
    wal = Wal(messages("pgoutput-positions"))
    (message_end, _), (_, unit), _ = wal.units
    assert next(r.final_lsn for _, r in unit if isinstance(r, Begin)) == message_end
    return wal


@pytest.mark.parametrize("commits", [1, 2])
def test_a_message_and_a_transaction_at_one_position_are_each_replayed_by_their_own_checkpoint(
    commits: int,
) -> None:
    """Kafka transactions of 4 events: the message and the first 3 inserts, then the other 3
    and the next transaction's. A kill after the first commit leaves the checkpoint "the
    message, and 3 events of the transaction at the same LSN"; after the second, "the
    transaction at that LSN". The replay must skip exactly that: named by its LSN alone, the
    first checkpoint made the transaction at the message's LSN look whole, and the replay
    skipped all of it (invariant 11)."""
    wal = at_one_position()
    kafka = Kafka()
    relay, sink = eos_relay(wal, kafka)
    sink.on_commit = lambda: sink.commits == commits and sink.kill()
    run_until_killed(relay, wal)
    at = wal.units[0][0]
    if commits == 1:
        assert kafka.checkpoint.position == Unit(at, MESSAGE)
        assert (kafka.checkpoint.partial, kafka.checkpoint.partial_events) == (Unit(at), 3)
    else:
        assert kafka.checkpoint.position == Unit(at, TRANSACTION)
    run_to_the_end(wal, kafka)
    assert kafka.ids() == wal.event_ids
    assert len(wal.event_ids) == 8


def test_a_checkpoint_that_reaches_only_the_message_at_a_commit_position_replays_the_commit() -> (
    None
):
    """A kill right after a Kafka transaction that held the message alone: the checkpoint
    reaches the message, at the LSN where the transaction's commit starts, and the whole
    transaction is replayed."""
    wal = at_one_position()
    kafka = Kafka()
    relay, sink = eos_relay(wal, kafka, max_events=1)
    sink.on_commit = lambda: sink.commits == 1 and sink.kill()
    run_until_killed(relay, wal)
    assert kafka.ids() == ["m-at-commit"]
    run_to_the_end(wal, kafka)
    assert kafka.ids() == wal.event_ids


def test_an_event_sent_alone_whose_kafka_transaction_aborts_is_replayed_not_waited_for() -> None:
    """A suspect is sent alone in a Kafka transaction of its own; Kafka acknowledged it, then
    refused the transaction's checkpoint record, and the commit aborted: no report will ever
    come for the event. The loop waited for one for ever, looking healthy; it replays."""
    wal = Wal(backlog())
    kafka = Kafka()
    relay, sink = eos_relay(wal, kafka)
    suspect = wal.event_ids[42]
    relay.rewinds.suspects.add(suspect)
    sink.abort_alone = [suspect]
    wal.on_idle = relay.request_stop

    relay.stream(wal.tables)

    assert sink.aborted == [[suspect]]
    assert kafka.ids() == wal.event_ids
    assert len(wal.starts) == 2


def test_a_commit_kafka_made_but_librdkafka_reports_abortable_is_not_published_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """librdkafka's own words (rdkafka_txnmgr.c, rd_kafka_txn_handle_EndTxn, state
    ABORTABLE_ERROR): "the transaction will have failed locally but the EndTxn(commit) may
    have succeeded"; EndTxn then answered with an error, commit_transaction returns the
    transaction's error as abortable. Here: the third commit's EndTxn(commit) reaches the
    coordinator, which decides it (read_committed consumers see it), and the call reports an
    abortable error. The abort's EndTxn(abort) meets a committed transaction:
    INVALID_TXN_STATE, fatal. The sink takes that for "nothing of it is on Kafka", renews the
    producer and replays the transaction from the checkpoint before it: every event of it
    visible twice. Before the renewal (398b33b) the relay stopped there and a restart read the
    checkpoint, which held the commit."""
    wal = Wal(backlog())
    kafka = Kafka()
    coordinator, _made = on_librdkafka(monkeypatch, kafka)
    relay, _ = eos_relay(wal, kafka, max_events=7, sink=real_sink)
    wal.on_idle = relay.request_stop
    commits = [0]
    from confluent_kafka import KafkaError, KafkaException
    from memory_producer import Producer

    commit = Producer.commit_transaction

    def commit_reported_failed(self: Producer, timeout: float = -1) -> None:
        commits[0] += 1
        if commits[0] != 3:
            return commit(self, timeout)
        self._wait()
        self._serve()
        assert coordinator.end_txn(self.epoch, commit=True) == KafkaError.NO_ERROR  # decided
        self.state = "AbortableError"
        raise KafkaException(
            KafkaError(
                KafkaError._TIMED_OUT,
                "EndTxn failed with REQUEST_TIMED_OUT but transaction had already failed due "
                "to: Transaction timed out",
                txn_requires_abort=True,
            )
        )

    monkeypatch.setattr(Producer, "commit_transaction", commit_reported_failed)

    # The relay stops (a restart reads the checkpoint that holds the commit): publishing the
    # transaction again would not be allowed.
    with pytest.raises(RelayError, match="restart the relay"):
        relay.stream(wal.tables)

    assert ("EndTxn(abort)", "INVALID_TXN_STATE") in coordinator.answers
    ids = kafka.ids()
    assert len(ids) == len(set(ids)), f"{len(ids) - len(set(ids))} events visible twice"
    assert ids == wal.event_ids[: len(ids)]


def test_an_idle_stream_commits_its_open_transaction_after_a_quarter_of_the_interval() -> None:
    wal = Wal(backlog())
    kafka = Kafka()
    relay, sink = eos_relay(wal, kafka, max_events=10_000, interval=4.0)
    opened: list[float] = []
    committed: list[float] = []
    sink.on_offer = lambda: opened or opened.append(time.monotonic())
    sink.on_commit = lambda: committed.append(time.monotonic())
    wal.on_idle = lambda: committed and relay.request_stop()
    relay.stream(wal.tables)

    assert kafka.ids() == wal.event_ids
    # The backlog read, the stream idle: its transaction commits after a quarter of the
    # interval (1 s), not the whole of it (4 s), which would only add to its latency.
    assert committed[0] - opened[0] < 3.0, committed[0] - opened[0]
