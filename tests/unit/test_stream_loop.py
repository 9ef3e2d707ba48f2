"""The CDC loop (``StreamRelay``) on in-memory stages: no database, no broker.

The source replays real pgoutput messages captured from PostgreSQL (tests/unit/data and the
backlog of bench/data) the way a walsender streams them: from a start position, each
relation's schema again before its first row on a new connection, a keepalive when idle. The
sink holds what it is offered until the loop polls, then acknowledges each message or refuses
it with a real KafkaError, as the test says. What these prove is the loop's own logic
(ARCHITECTURE.md: the LSN rule and invariants 2, 4, 6, 7, 8); the integration suite proves
the same against PostgreSQL and Kafka.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import socket
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import psycopg
import pytest
from capture import pgoutput_messages
from confluent_kafka import KafkaError

from cdc_relay.errors import DeliveryError, RelayError, SlotInUseError
from cdc_relay.events import (
    Begin,
    Commit,
    Insert,
    LogicalMessage,
    OutboxEvent,
    Record,
    Relation,
    SchemaError,
)
from cdc_relay.kafka.deadletter import DeadLetterRefusals, DeadLetters
from cdc_relay.kafka.routing import Message, Router, TopicTaken
from cdc_relay.kafka.topics import MISSING
from cdc_relay.lsn import Lsn
from cdc_relay.postgres import pgoutput
from cdc_relay.postgres.replication import ConnectionLost, Keepalive, XLogData
from cdc_relay.postgres.tables import OutboxTable
from cdc_relay.relay.lsn_tracker import Transaction
from cdc_relay.relay.rewinds import Rewinds
from cdc_relay.relay.stream import StreamRelay
from cdc_relay.relay.stream_settings import StreamSettings

BACKLOG = Path(__file__).parents[2] / "bench" / "data" / "pgoutput-backlog.jsonl"
DEAD = "outbox.dead"  # the dead-letter topic
WATCHDOG = 10.0  # seconds: a loop that never ends fails its test instead of hanging it


def backlog() -> list[bytes]:
    """50 transactions of 10 inserts, captured from PostgreSQL 15."""
    return [bytes.fromhex(json.loads(line)["hex"]) for line in BACKLOG.read_text().splitlines()]


def event_id(message: Message) -> str:
    return dict(message.headers)["id"].decode()


def record_id(record: Record) -> str | None:
    """The id of the event an insert (the first column, ``id``) or an outbox envelope in a
    message carries."""
    if isinstance(record, Insert) and isinstance(record.values[0], bytes):
        return record.values[0].decode()
    if isinstance(record, LogicalMessage):
        envelope = json.loads(record.content)
        return str(envelope["id"]) if "aggregate_type" in envelope else None
    return None


def first_seen(ids: Sequence[str]) -> list[str]:
    """``ids`` without the repeats, each where it first came."""
    return list(dict.fromkeys(ids))


class Hurried:
    """Real time, with every wait cut to a millisecond: the loop's timeouts are upper bounds,
    and nothing in memory comes sooner for waiting longer. (test_simulation gives the stages
    a virtual clock instead.)"""

    monotonic = staticmethod(time.monotonic)

    def sleep(self, seconds: float) -> None:
        time.sleep(min(seconds, 0.001))


HURRIED = Hurried()


class Wal:
    """The server's side of one slot: messages in units of the stream (a transaction, Begin
    to Commit, at its commit; a non-transactional logical message, at its own position), and
    what the relay asked of it and told it. ``write`` adds units while relays stream: a
    connection streams what is written, as a walsender does."""

    def __init__(self, raw: Sequence[bytes] = (), clock: Any = HURRIED) -> None:
        self.clock = clock
        self.units: list[tuple[Lsn, list[tuple[bytes, Record]]]] = []  # (end, messages)
        self.end: Lsn = 100  # the keepalives' position: nothing written after
        self.tables: tuple[OutboxTable, ...] = ()
        self.event_ids: list[str] = []  # the events of rows and messages, in stream order
        # Keepalives the walsender sends amid the stream: (before unit, its position, reply).
        self.keepalives: list[tuple[int, Lsn, bool]] = []
        # The publication's row filter: a row it keeps out is not sent (nor its transaction,
        # if nothing of it is left: PostgreSQL 15 skips empty transactions).
        self.row_filter: Callable[[Insert], bool] = lambda row: True
        self.starts: list[Lsn] = []  # START_REPLICATION's positions
        self.statuses: list[tuple[Lsn, Lsn]] = []  # (written, flushed), every connection's
        self.confirmed: Lsn = 0  # the slot's
        self.holder: Connection | None = None  # the connection streaming the slot
        self.lose_after: int | None = None  # the next connection is lost after so many reads
        self.lost_after_commit: Lsn | None = None  # the end of the last Commit read before
        self.on_idle: Callable[[], object] = lambda: None  # the test's look, at each keepalive
        self.pauses: set[Lsn] = set()  # the transactions ending there come after a pause
        self.connections: list[Connection] = []
        self.watchdog = WATCHDOG
        self.born = time.monotonic()
        self.timeline = 0  # the server's, as a reconnecting relay reads it (0: not known)
        self.error: str | None = None  # the server ends every stream with it, at the first read
        self.taken = 0  # another relay holds the slot for so many attempts to start
        self.refuse_start: str | None = None  # the server refuses every start after the first
        self.unreachable = 0  # attempts to start refused for want of a server, once not taken
        self.on_taken: Callable[[], object] = lambda: None  # at each of them
        self.on_lost: Callable[[], object] = lambda: None  # when the test cuts a connection
        self.write(raw)

    def write(self, raw: Sequence[bytes], end: Lsn | None = None) -> None:
        """Append messages to the stream, whole units; the WAL then ends at ``end`` (the
        keepalives' position), by default a little after the last unit."""
        unit: list[tuple[bytes, Record]] = []
        for data in raw:
            record = pgoutput.decode(data)
            if id_ := record_id(record):
                self.event_ids.append(id_)
            if isinstance(record, LogicalMessage) and not record.transactional:
                assert not unit
                self.units.append((record.lsn, [(data, record)]))
                continue
            unit.append((data, record))
            if isinstance(record, Commit):
                self.units.append((record.end_lsn, unit))
                unit = []
            elif isinstance(record, Relation) and not self.tables:
                table = OutboxTable(record.relid, record.namespace, record.name, False)
                self.tables = (table,)
        assert not unit
        if end is not None:
            self.end = end
        elif self.units:
            self.end = max(self.end, self.units[-1][0] + 100)

    def keepalive(self, reply_requested: bool = False) -> None:
        """The walsender's keepalive after what is written so far, at the end of the WAL."""
        self.keepalives.append((len(self.units), self.end, reply_requested))

    def open(self, dsn: str) -> Connection:
        connection = Connection(self)
        self.connections.append(connection)
        return connection

    def end_of(self, event: str) -> Lsn:
        """The end of the transaction of ``event``."""
        return next(end for end, u in self.units if any(record_id(r) == event for _, r in u))

    def before(self, event: str) -> Lsn:
        """The end of the transaction before that of ``event``."""
        return max((end for end, _ in self.units if end < self.end_of(event)), default=0)

    def flushed(self) -> list[Lsn]:
        return [flushed for _, flushed in self.statuses]


def streamed_from(unit: list[tuple[bytes, Record]], start: Lsn) -> bool:
    """Whether a stream started at ``start`` holds ``unit``, as PostgreSQL decides: a
    transaction whose commit record starts at or after it (Begin.final_lsn), a
    non-transactional message whose record ends after it (its LSN is the record's end)."""
    first = unit[0][1]
    if isinstance(first, LogicalMessage):
        return first.lsn > start
    assert isinstance(first, Begin)
    return first.final_lsn >= start


class Connection:
    """One replication connection to the ``Wal`` (cdc_relay.relay.stages.Source)."""

    def __init__(self, wal: Wal) -> None:
        self.wal = wal
        self.queue: deque[XLogData | Keepalive | None] = deque()  # None: nothing for a moment
        self.caught_up = False  # nothing waited behind what the last read returned
        self.queue_had = False  # the last read took something from the queue (None: a pause)
        self.closed = False
        self.terminated = False  # the server ended it (another relay took the slot over)
        self.lose_after: int | None = None
        self.last_commit: Lsn | None = None
        self.start_lsn: Lsn = 0
        self.units = 0  # units of the WAL looked at
        self.keepalives = 0  # keepalives of the WAL looked at
        self.relations: dict[int, bytes] = {}  # each relation's newest schema
        self.sent: set[int] = set()  # relations whose schema this connection sent

    def start(self, slot: str, start_lsn: Lsn, options: Mapping[str, str]) -> None:
        wal = self.wal
        if wal.refuse_start is not None and wal.starts:
            raise ConnectionLost(f"START_REPLICATION failed: {wal.refuse_start}", True)
        if wal.unreachable and not wal.taken:
            wal.unreachable -= 1
            raise ConnectionLost("cannot connect to PostgreSQL: connection refused; check --dsn")
        if wal.taken:
            wal.taken -= 1
            wal.on_taken()
            raise SlotInUseError("replication slot 'test' is in use by another process")
        holder = wal.holder
        if holder is not None and not (holder.closed or holder.terminated):
            raise SlotInUseError(f'replication slot "{slot}" is active for another process')
        wal.holder = self
        wal.starts.append(start_lsn)
        self.start_lsn = max(start_lsn, wal.confirmed)
        self.lose_after, wal.lose_after = wal.lose_after, None

    def _fill(self) -> None:
        """Queue what was written since the last look: the units the stream holds, each
        relation's schema before its first row on this connection, the keepalives."""
        wal = self.wal
        while self.units < len(wal.units) or self.keepalives < len(wal.keepalives):
            if self.keepalives < len(wal.keepalives):
                before, position, reply = wal.keepalives[self.keepalives]
                if before <= self.units:
                    self.keepalives += 1
                    self.queue.append(Keepalive(position, reply))
                    continue
            end, unit = wal.units[self.units]
            self.units += 1
            for data, record in unit:
                if isinstance(record, Relation):
                    self.relations[record.relid] = data
            if not streamed_from(unit, self.start_lsn):
                continue  # confirmed: the walsender sends what comes after it
            kept = [
                (data, record)
                for data, record in unit
                if not isinstance(record, Insert) or wal.row_filter(record)
            ]
            if not any(isinstance(r, Insert | LogicalMessage) for _, r in kept) and any(
                isinstance(r, Insert) for _, r in unit
            ):
                continue  # every row filtered out: an empty transaction, not sent
            if end in wal.pauses:
                self.queue.append(None)
            for data, record in kept:
                if isinstance(record, Relation):
                    self.sent.add(record.relid)
                elif isinstance(record, Insert) and record.relid not in self.sent:
                    self.sent.add(record.relid)
                    self.queue.append(XLogData(end, end, self.relations[record.relid]))
                self.queue.append(XLogData(end, end, data))

    def read(self, timeout: float) -> XLogData | Keepalive | None:
        message = self._take()
        if message is not None or self.queue_had:
            return message
        wal = self.wal
        wal.on_idle()
        wal.clock.sleep(timeout)
        return Keepalive(wal.end, reply_requested=False)

    def read_now(self) -> XLogData | Keepalive | None:
        if self.queue and self.queue[0] is None:
            self.caught_up = True
            return None  # a pause: the next read waits it out
        return self._take()

    def _take(self) -> XLogData | Keepalive | None:
        """The next message, or None: a pause the test wrote (``queue_had``), or nothing yet."""
        wal = self.wal
        assert time.monotonic() - wal.born < wal.watchdog, "the loop did not end"
        assert not self.closed
        if self.terminated:
            raise ConnectionLost("replication connection ended by the server")
        if wal.error is not None:
            raise ConnectionLost(f"replication stream ended: {wal.error}", server_error=True)
        if self.lose_after is not None:
            if self.lose_after == 0:
                wal.lost_after_commit = self.last_commit
                wal.on_lost()
                raise ConnectionLost("replication connection lost: the test cut it")
            self.lose_after -= 1
        if not self.queue:
            self._fill()
        self.caught_up = len(self.queue) <= 1  # nothing waits behind what this read returns
        self.queue_had = bool(self.queue)
        if self.queue:
            message = self.queue.popleft()
            if isinstance(message, XLogData) and message.data[:1] == b"C":
                self.last_commit = message.wal_end
            return message
        return None

    def send_status(self, written: Lsn, flushed: Lsn) -> None:
        assert not self.closed
        if self.terminated:
            raise ConnectionLost("replication connection ended by the server")
        assert flushed <= written
        self.wal.statuses.append((written, flushed))
        self.wal.confirmed = max(self.wal.confirmed, flushed)

    def close(self) -> None:
        self.closed = True
        if self.wal.holder is self:
            self.wal.holder = None


class Sink:
    """In memory (cdc_relay.relay.stages.Sink): holds what it is offered until ``poll`` or
    ``settle``, then acknowledges each message, or refuses it as the test says."""

    def __init__(
        self,
        on_ack: Callable[[Any], None],
        on_refused: Callable[..., None],
        clock: Any = HURRIED,
    ) -> None:
        self.on_ack = on_ack
        self.on_refused = on_refused
        self.clock = clock
        self.capacity = 1_000_000
        self.queue: list[tuple[Message, Any]] = []
        self.offered: list[tuple[str, int]] = []  # (event id, messages in flight beside it)
        self.acked: list[Message] = []
        self.refused: list[tuple[str, int, int]] = []  # (event id, error code, batch size)
        self.full = 0  # offers turned away: the queue was full
        self.hold: set[str] = set()  # event ids not reported while here
        self.hold_all = False
        # Kafka refuses a batch holding one of these events (not their dead letters): event
        # id -> error code; those of ``refuse_once`` the next time only.
        self.poison: dict[str, int] = {}
        self.refuse_once: dict[str, int] = {}
        self.on_poll: Callable[[], object] = lambda: None
        self.makes_topics = False
        self.broken = False
        self.connected = True
        self.watchdog = WATCHDOG
        self.born = time.monotonic()

    def offer(self, message: Message, token: Any) -> bool:
        if self.broken and not self.queue:
            self.broken = False  # as KafkaSink: a new producer once the old one is empty
        if len(self.queue) >= self.capacity:
            self.full += 1
            return False
        self.offered.append((event_id(message), len(self.queue)))
        self.queue.append((message, token))
        return True

    def poll(self, timeout: float) -> None:
        assert time.monotonic() - self.born < self.watchdog, "the loop did not end"
        self.on_poll()
        if not self._report() and timeout:
            self.clock.sleep(timeout)

    def settle(self, timeout: float) -> None:
        self._report()
        if self.queue:
            self.clock.sleep(timeout)

    def in_flight(self) -> int:
        return len(self.queue)

    def missing(self, topic: str, err: KafkaError) -> bool:
        # As KafkaSink with --create-topics (``makes_topics``): the topic is made again.
        return self.makes_topics and err.code() in MISSING

    def in_queue(self) -> set[str]:
        return {event_id(message) for message, _ in self.queue}

    def renew(self) -> None:
        purged, self.queue = self.queue, []
        for _, token in purged:
            self.on_refused(token, KafkaError(KafkaError._PURGE_QUEUE))
        self.broken = False

    def check_reachable(self, timeout: float) -> None:
        pass

    def close(self) -> int:
        left = len(self.queue)
        self.renew()
        return left

    def _report(self) -> int:
        """Report what is not held: refused, all of it, if a poisoned message is in it (Kafka
        refuses the whole batch for one bad record, and the gapless guarantee stops the
        producer); acknowledged otherwise. How many were reported."""
        batch: list[tuple[Message, Any]] = []
        held: list[tuple[Message, Any]] = []
        for entry in self.queue:
            (held if self.hold_all or event_id(entry[0]) in self.hold else batch).append(entry)
        if not batch:
            return 0
        self.queue = held
        code = next(
            (
                self.poison.get(event_id(m)) or self.refuse_once.pop(event_id(m))
                for m, _ in batch
                if m.topic != DEAD
                and (event_id(m) in self.poison or event_id(m) in self.refuse_once)
            ),
            None,
        )
        for message, token in batch:
            if code is None:
                self.acked.append(message)
                self.on_ack(token)
            else:
                self.refused.append((event_id(message), code, len(batch)))
                self.on_refused(token, KafkaError(code))
        self.broken = code is not None
        return len(batch)


class Letters(DeadLetters):
    """The dead-letter store with its table in memory; its messages are the real ones."""

    def __init__(self, dsn: str, slot: str, topic: str) -> None:
        super().__init__(dsn, slot, topic)
        self.stored: list[tuple[str, int]] = []  # (event id, error code)

    def store(self, message: Message, err: KafkaError) -> None:
        self.stored.append((event_id(message), err.code()))

    def close(self) -> None:
        pass


def relay_on(wal: Wal, **settings: Any) -> tuple[StreamRelay, Sink]:
    """A relay streaming ``wal`` into an in-memory sink; status updates every 10 ms."""
    sinks: list[Sink] = []

    def open_sink(on_ack: Callable[[Any], None], on_refused: Callable[..., None]) -> Sink:
        sinks.append(Sink(on_ack, on_refused))
        return sinks[0]

    relay = StreamRelay(
        StreamSettings(
            **{
                "dsn": "test",
                "slot": "test",
                "publication": "test",
                "tables": ("public.outbox_events",),
                "kafka_config": {},
                "topic_template": "outbox.{aggregate_type}",
                "status_interval": 0.01,
                "shutdown_timeout": 0.05,
                "progress_interval": 3600.0,
                **settings,
            }
        ),
        open_source=wal.open,
        open_sink=open_sink,
        open_dead_letters=Letters,
        read_timeline=lambda dsn, slot: (wal.timeline, wal.confirmed),
    )
    return relay, sinks[0]


def drained(relay: StreamRelay, sink: Sink) -> None:
    """Stop once the stream is read (the source is idle) and the sink holds nothing."""
    if not sink.queue and not sink.hold_all:
        relay.request_stop()


def acked_ids(sink: Sink) -> list[str]:
    return [event_id(m) for m in sink.acked]


@pytest.mark.parametrize("capture", ["pgoutput", "backlog"])
def test_events_reach_the_sink_in_commit_order_and_idle_confirms_the_keepalive(
    capture: str,
) -> None:
    wal = Wal(pgoutput_messages() if capture == "pgoutput" else backlog())
    # The capture's logical message is no outbox envelope: with another prefix, another
    # application's message, passed over.
    relay, sink = relay_on(wal, message_prefix="another")
    wal.on_idle = lambda: drained(relay, sink)

    relay.stream(wal.tables)

    # Commit order, insert order within a transaction (two inserts in one, ten in each of
    # the backlog's); the pgoutput capture's updates, deletes, truncate and message are no
    # events, its insert after a schema change is one.
    assert len(wal.event_ids) == (7 if capture == "pgoutput" else 500)
    assert acked_ids(sink) == wal.event_ids
    assert any(others for _, others in sink.offered), "the sink never held a batch"
    assert wal.starts == [0]
    flushed = wal.flushed()
    assert flushed == sorted(flushed)
    # Nothing in flight: the keepalive's position is confirmed, past the last commit.
    assert flushed[-1] == wal.end
    assert wal.connections[-1].closed


def test_the_flush_position_never_passes_a_transaction_with_an_unacknowledged_event() -> None:
    wal = Wal(backlog())
    relay, sink = relay_on(wal)
    held = wal.event_ids[102]  # the third of the eleventh transaction
    sink.hold.add(held)
    looks = 0
    while_held: list[Lsn] = []

    def on_idle() -> None:
        nonlocal looks
        if sink.hold:
            if len(sink.acked) == len(wal.event_ids) - 1:
                looks += 1
            if looks == 100:  # a while, with keepalives and status updates
                while_held.extend(wal.flushed())
                sink.hold.clear()
        elif len(sink.acked) == len(wal.event_ids):
            relay.request_stop()

    wal.on_idle = on_idle
    relay.stream(wal.tables)

    # Every later transaction was acknowledged; the one with the held event was not, so the
    # slot stays before it: not its end, not a later one's, not the keepalive's.
    assert while_held
    assert max(while_held) == wal.before(held)
    assert wal.end_of(held) > wal.before(held)
    # Acknowledged at last: everything is confirmed, up to the keepalive.
    assert wal.flushed()[-1] == wal.end
    assert acked_ids(sink) == wal.event_ids[:102] + wal.event_ids[103:] + [held]


def test_back_pressure_loses_and_reorders_nothing_and_status_updates_go_on() -> None:
    wal = Wal(backlog())
    relay, sink = relay_on(wal)
    sink.capacity = 4
    sink.hold_all = True  # the broker is away: the queue fills up
    statuses_when_full: int | None = None

    def on_poll() -> None:
        nonlocal statuses_when_full
        if sink.full and statuses_when_full is None:
            statuses_when_full = len(wal.statuses)
        if sink.hold_all and sink.full >= 50 and len(wal.statuses) >= (statuses_when_full or 0) + 3:
            sink.hold_all = False  # the broker is back

    sink.on_poll = on_poll
    wal.on_idle = lambda: drained(relay, sink)
    relay.stream(wal.tables)

    assert sink.full >= 50
    assert not sink.hold_all, "no status update was sent while the sink was full"
    assert max(others for _, others in sink.offered) < sink.capacity
    assert acked_ids(sink) == wal.event_ids  # each once, in order
    assert wal.flushed()[-1] == wal.end


POISON = 233  # the fourth event of the 24th transaction


def test_a_refused_batch_rewinds_and_the_culprit_alone_stops_the_relay() -> None:
    wal = Wal(backlog())
    relay, sink = relay_on(wal)
    culprit = wal.event_ids[POISON]
    sink.poison[culprit] = KafkaError.MSG_SIZE_TOO_LARGE
    # The stream pauses before its transaction, so what came before is acknowledged; the
    # transaction's first events wait for it: one batch holds them, it and what follows.
    wal.pauses.add(wal.end_of(culprit))
    before = wal.event_ids[POISON - 3 : POISON]
    sink.hold.update(before)
    sink.on_poll = lambda: culprit in sink.in_queue() and sink.hold.clear()

    with pytest.raises(DeliveryError) as failure:
        relay.stream(wal.tables)

    message = str(failure.value)
    assert "\n" not in message
    assert culprit in message
    assert "Broker: Message size too large" in message
    # Refused in a batch first (a suspect among others), then alone: the culprit.
    refusals = [size for refused, _, size in sink.refused if refused == culprit]
    assert refusals[0] > 4
    assert refusals[-1] == 1
    assert (culprit, 0) in sink.offered  # sent with nothing else in flight
    # The replay starts at the confirmed position: the end of the transaction before.
    assert wal.starts == [0, wal.before(culprit)]
    # Its neighbours in the refused batch were sent alone too, and delivered; everything
    # before it is delivered, in order, and nothing after it.
    assert {refused for refused, _, _ in sink.refused} > {culprit, *before}
    assert all((neighbour, 0) in sink.offered for neighbour in before)
    assert first_seen(acked_ids(sink)) == wal.event_ids[:POISON]
    # The slot never passes it; the stop confirms what was acknowledged.
    assert max(wal.flushed()) == wal.flushed()[-1] == wal.before(culprit)


def test_a_culprit_goes_to_the_dead_letters_and_the_stream_goes_on() -> None:
    wal = Wal(backlog())
    relay, sink = relay_on(wal, dead_letter_topic=DEAD)
    culprit = wal.event_ids[POISON]
    sink.poison[culprit] = KafkaError.MSG_SIZE_TOO_LARGE
    wal.on_idle = lambda: len(set(acked_ids(sink))) == len(wal.event_ids) and relay.request_stop()

    relay.stream(wal.tables)

    letters = relay.dead_letters
    assert isinstance(letters, Letters)
    assert letters.stored == [(culprit, KafkaError.MSG_SIZE_TOO_LARGE)]
    (letter,) = [m for m in sink.acked if event_id(m) == culprit]
    assert letter.topic == DEAD
    assert dict(letter.headers)["error_code"] == b"MSG_SIZE_TOO_LARGE"
    assert first_seen(acked_ids(sink)) == wal.event_ids  # the letter where the event was
    assert wal.flushed()[-1] == wal.end


def test_an_event_of_a_deleted_topic_waits_for_the_topic_made_again_and_is_no_dead_letter() -> None:
    """With --create-topics a topic deleted under the relay is made again: its events, refused
    as unknown in a batch and then alone (the producer's metadata still says missing), are
    retried until it is there, never dead-lettered nor a stop."""
    wal = Wal(backlog())
    relay, sink = relay_on(wal, dead_letter_topic=DEAD)
    sink.makes_topics = True
    culprit = wal.event_ids[POISON]
    sink.poison[culprit] = KafkaError._UNKNOWN_PARTITION

    def on_poll() -> None:
        if sum(1 for refused, _, size in sink.refused if refused == culprit and size == 1) >= 2:
            sink.poison.clear()  # the topic is there again

    sink.on_poll = on_poll
    wal.on_idle = lambda: len(set(acked_ids(sink))) == len(wal.event_ids) and relay.request_stop()

    relay.stream(wal.tables)

    letters = relay.dead_letters
    assert isinstance(letters, Letters)
    assert letters.stored == []
    assert [size for refused, _, size in sink.refused if refused == culprit][-2:] == [1, 1]
    assert not [m for m in sink.acked if m.topic == DEAD]
    assert first_seen(acked_ids(sink)) == wal.event_ids
    assert wal.flushed()[-1] == wal.end


def test_the_stop_line_counts_an_event_kafka_refused_as_the_relay_stopped(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Refused while stopping, an event is no longer in the producer: the stop line counts
    what Kafka did not acknowledge, not what the producer holds."""
    wal = Wal(backlog())
    relay, sink = relay_on(wal, status_interval=3600.0)
    last = wal.event_ids[-1]
    sink.hold.add(last)
    sink.poison[last] = KafkaError.UNKNOWN_TOPIC_OR_PART

    def on_idle() -> None:
        if len(sink.acked) == len(wal.event_ids) - 1:
            relay.request_stop()
            sink.hold.clear()  # Kafka's answer comes now: a refusal

    wal.on_idle = on_idle
    with caplog.at_level(logging.INFO, logger="cdc_relay.relay.stream"):
        relay.stream(wal.tables)

    assert [refused for refused, _, _ in sink.refused] == [last]
    assert max(wal.flushed()) <= wal.before(last)
    assert "stopped; 1 event not acknowledged will be sent again on restart" in caplog.text


def test_an_event_whose_topic_another_aggregate_type_has_is_dead_lettered_with_why() -> None:
    def typed(aggregate_type: str, number: int) -> OutboxEvent:
        return OutboxEvent(
            id=f"e{number}",
            aggregate_type=aggregate_type,
            aggregate_id=f"a{number}",
            event_type="changed",
            payload=b"{}",
            commit_lsn=100 + number,
            xid=1,
            commit_time_us=0,
        )

    router = Router()
    router.route(typed("order/line", 1))
    with pytest.raises(TopicTaken) as taken:
        router.route(typed("order_line", 2))
    letters = Letters("test", "test", DEAD)
    delivered: list[Message] = []
    refusals = DeadLetterRefusals(Rewinds(), letters, lambda message, _: delivered.append(message))

    refusals.unroutable((Transaction(), "e2"), taken.value)

    assert letters.stored == [("e2", KafkaError.TOPIC_EXCEPTION)]
    (letter,) = delivered
    headers = dict(letter.headers)
    assert letter.topic == DEAD
    assert headers["original_topic"] == b"outbox.event.order_line"
    assert b"'order_line' and 'order/line' both make topic" in headers["error"]
    # An event with nothing to set aside (no payload) still stops the stream.
    with pytest.raises(SchemaError, match="NULL payload"):
        try:
            router.route(OutboxEvent("e3", "order", "a3", "changed", None, 103, 1, 0))
        except SchemaError as exc:
            refusals.unroutable((Transaction(), "e3"), exc)
    assert len(delivered) == 1


def test_a_lost_connection_reconnects_at_the_safe_position_and_replays() -> None:
    wal = Wal(backlog())
    relay, sink = relay_on(wal)
    wal.lose_after = 255  # reads: inside the 24th transaction
    wal.on_idle = lambda: set(acked_ids(sink)) == set(wal.event_ids) and relay.request_stop()

    relay.stream(wal.tables)

    assert wal.connections[0].closed
    assert len(wal.starts) == 2
    # What was in flight was acknowledged before reconnecting: the safe position is the end
    # of the last transaction read whole.
    resumed = wal.starts[1]
    assert resumed == wal.lost_after_commit
    assert resumed > 0
    # Replayed from there, decoded from scratch (the relation's schema came again): every
    # event once in order, and again only those of the transaction read in part.
    ids = acked_ids(sink)
    assert first_seen(ids) == wal.event_ids
    again = {i for i in ids if ids.count(i) > 1}
    assert again
    assert all(wal.end_of(i) > resumed for i in again)
    assert len({wal.end_of(i) for i in again}) == 1
    assert wal.flushed()[-1] == wal.end


def test_the_server_lost_just_after_the_slot_was_taken_is_a_lost_connection(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A promotion between taking the slot and reading its position (standby.held, on a
    connection of its own, refused by the server that went away): the relay reads again,
    backing off, where it used to die with psycopg's traceback, or stop with a start-up's
    "check --dsn". The stream is kept: a read on it finds it lost."""
    wal = Wal(backlog())
    relay, _ = relay_on(wal)
    pauses: list[float] = []
    relay._connection.pause = pauses.append  # type: ignore[method-assign]
    reads: list[int] = []
    held = relay._standby.held

    def read_slot(timeline: Any, after_cut: Any) -> Lsn | None:
        reads.append(len(wal.starts))
        if len(reads) < 3:  # a real connection to a server that is not there
            return held(timeline, after_cut)
        return 0

    relay.settings = dataclasses.replace(relay.settings, dsn=f"host=127.0.0.1 port={closed_port()}")
    relay._standby._settings = relay.settings
    relay._standby.held = read_slot  # type: ignore[method-assign]
    with caplog.at_level(logging.WARNING, logger="cdc_relay.relay.stream"):
        assert relay._take_slot()

    assert reads == [1, 1, 1]
    assert wal.starts == [0]  # the slot was not let go
    assert len(pauses) == 2 and 0 < pauses[0] and pauses[0] <= pauses[1] * 2
    assert "reading slot test just taken failed: connection" in caplog.text


def test_a_server_error_reading_the_slot_just_taken_again_and_again_stops_in_one_line() -> None:
    """The server answering the read with an error of its own each time (a statement timeout):
    counted as lost connections are, backing off, and a stop with one line, not a loop."""
    wal = Wal(backlog())
    relay, _ = relay_on(wal)
    pauses: list[float] = []
    relay._connection.pause = pauses.append  # type: ignore[method-assign]

    def read_slot(timeline: Any, after_cut: Any) -> Lsn | None:
        raise psycopg.errors.QueryCanceled("canceling statement due to statement timeout")

    relay._standby.held = read_slot  # type: ignore[method-assign]
    with pytest.raises(RelayError) as stop:
        relay._take_slot()

    assert "\n" not in str(stop.value)
    assert "times in a row" in str(stop.value)
    assert "statement timeout" in str(stop.value)
    assert 5 <= len(pauses) < 10 and pauses[-1] > pauses[0]
    assert wal.starts == [0]


def closed_port() -> int:
    """A loopback port nothing listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_shutdown_confirms_what_was_acknowledged_and_no_more(
    caplog: pytest.LogCaptureFixture,
) -> None:
    wal = Wal(backlog())
    # Status updates only when forced, or 0.2 s after a change: the stop's is the last word.
    relay, sink = relay_on(wal, status_interval=3600.0)
    last = wal.event_ids[-10:]  # the last transaction's, never acknowledged
    sink.hold.update(last)
    wal.on_idle = lambda: len(sink.acked) == len(wal.event_ids) - 10 and relay.request_stop()

    with caplog.at_level(logging.INFO, logger="cdc_relay.relay.stream"):
        relay.stream(wal.tables)

    assert wal.flushed()[-1] == wal.before(last[0]) == wal.units[-2][0]
    assert max(wal.flushed()) == wal.before(last[0])
    assert wal.connections[-1].closed
    assert "stopped; 10 events not acknowledged will be sent again on restart" in caplog.text


def test_an_error_the_server_ends_every_stream_with_backs_off_then_stops_in_one_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The walsender ends every stream with one ERROR (a publication it cannot find, say):
    the relay reconnected at once, for ever (1,572 times in 5 s). It backs off, then stops."""
    wal = Wal(backlog())
    relay, _ = relay_on(wal)
    pauses: list[float] = []
    monkeypatch.setattr(relay._connection, "pause", pauses.append)
    wal.error = 'ERROR:  publication "outboxpub" does not exist'

    with pytest.raises(RelayError) as failure:
        relay.stream(wal.tables)

    message = str(failure.value)
    assert "\n" not in message
    assert 'publication "outboxpub" does not exist' in message
    assert "8 times in a row" in message
    assert len(wal.starts) == 8
    assert pauses == sorted(pauses)
    assert pauses[0] > 0
    assert sum(pauses) > 20
    assert wal.flushed() == [0] * len(wal.flushed())


def test_a_relay_cut_off_from_kafka_and_its_slot_delivers_nothing_while_another_holds_it() -> None:
    """Kafka is away and the replication connection is lost; a standby takes the slot while
    this relay waits (now a standby itself). Its producer's queue, delivered whenever Kafka
    came back, would land after the new holder's newer events of the same aggregates (e1,
    e2, e1): it is dropped, and the replay sends it again once this relay holds the slot."""
    wal = Wal(backlog())
    relay, sink = relay_on(wal, standby=True)
    sink.hold_all = True  # Kafka away: nothing is acknowledged
    wal.lose_after = 200
    acked_at_loss: list[int] = []

    def lost() -> None:
        wal.taken = 3  # another relay holds the slot for a while
        acked_at_loss.append(len(sink.acked))

    def taken() -> None:
        sink.hold_all = False  # Kafka is back while the other relay holds the slot
        sink.poll(0)
        acked_while_taken.append(len(sink.acked))

    acked_while_taken: list[int] = []
    wal.on_lost = lost
    wal.on_taken = taken
    wal.on_idle = lambda: set(acked_ids(sink)) == set(wal.event_ids) and relay.request_stop()

    relay.stream(wal.tables)

    # Nothing of the old queue was delivered while the other relay held the slot: every
    # acknowledgement came from the replay, once this relay held the slot again.
    assert acked_at_loss == [0]
    assert acked_while_taken == [0, 0, 0]
    assert len(wal.starts) == 2
    assert acked_ids(sink) == wal.event_ids


def test_reconnected_to_a_promoted_server_the_stream_starts_from_the_slot_there() -> None:
    """The connection is lost and the relay reconnects to a standby promoted since (timeline
    2), whose copy of the failover slot lags: past it, the WAL is the new primary's own. The
    relay asked to start from its own position and the transactions in between were never
    sent; it starts from the slot's."""
    wal = Wal(backlog())
    relay, sink = relay_on(wal)
    wal.lose_after = 300
    lagging = wal.units[10][0]

    def promoted() -> None:
        wal.timeline = 2
        wal.confirmed = lagging

    wal.on_lost = promoted
    wal.on_idle = lambda: set(acked_ids(sink)) == set(wal.event_ids) and relay.request_stop()

    relay.stream(wal.tables)

    assert wal.starts[1] == lagging
    assert first_seen(acked_ids(sink)) == wal.event_ids


def test_a_start_the_server_refuses_the_same_way_every_time_stops_the_relay_in_one_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Reconnecting, START_REPLICATION is refused with one error each time (the role lost
    REPLICATION, say): retried with backoff, then a stop naming it, not warnings for ever."""
    wal = Wal(backlog())
    relay, _ = relay_on(wal)
    monkeypatch.setattr(relay._connection, "pause", lambda seconds: None)
    wal.lose_after = 50
    wal.refuse_start = "ERROR:  permission denied to start WAL sender"

    with pytest.raises(RelayError) as failure:
        relay.stream(wal.tables)

    assert "8 times in a row" in str(failure.value)
    assert "permission denied to start WAL sender" in str(failure.value)


def test_a_standby_waits_through_the_server_being_away_and_takes_over() -> None:
    """A standby waiting for the slot, when the primary goes away (a failover): it exited at
    the first connection refused; it waits on and takes over once the server is back."""
    wal = Wal(backlog())
    relay, sink = relay_on(wal, standby=True)
    wal.taken = 2
    wal.unreachable = 3
    wal.on_idle = lambda: set(acked_ids(sink)) == set(wal.event_ids) and relay.request_stop()

    relay.stream(wal.tables)

    assert wal.unreachable == 0
    assert first_seen(acked_ids(sink)) == wal.event_ids
