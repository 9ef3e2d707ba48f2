"""The world test_simulation runs the relay in: a database that writes WAL shapes, Kafka,
relay processes that crash, lose connections, are fenced and taken over, and the oracle.

Everything is in memory and in one thread, on a virtual clock, so a run is a function of
its schedule: the same schedule gives the same run, and Hypothesis can shrink a failing one.

- The database (``Writer``) writes units of the stream through test_stream_loop's ``Wal``
  as pgoutput bytes (pgoutput_encoder, checked against captures): transactions of rows and
  transactional messages, non-transactional messages (prefix ``outbox``, the envelope of
  ``outbox_emit()``) at the end of their WAL record, so that one emitted last in a
  transaction, or by another connection right before its commit, has the LSN where the
  commit record starts (``Begin.final_lsn``), and keepalives.
- Kafka: at least once, what reached the broker (``World.log``: acknowledged or not, a
  crash may leave messages there unacknowledged); exactly once, test_stream_loop_eos's
  ``Kafka`` (committed transactions and the checkpoint).
- A relay process (``Process``) is a real ``StreamRelay`` run by ``stream(tables)`` on
  stages of its own (the Wal's connections, test_stream_loop's ``Sink`` or a transactional
  one, the dead-letter table); each call of a stage is a step, and the schedule acts at
  steps: a crash (SIGKILL: nothing of the process acts again), a lost connection, SIGTERM,
  a refusal, a stalled broker, an aborted Kafka transaction, fencing, a standby taking the
  slot over while the process is paused. A process ends drained (the stream read, nothing
  in flight: it is stopped as by SIGTERM), killed, or on an error the oracle expects
  (the culprit without a dead-letter topic, fencing).
- Resharding: slots of one WAL (``Slot``: the old one, the new shards with their row
  filters), the cut emitted and committed by ``Writer`` (``Reshard``), and what the relay
  asks the database besides the stream (``Database``: the publications' comments, the old
  slot's position), a new shard waiting at the cut running the old shard's relay.
- The oracle (``World.check_*``) holds the relay to its promises: the slot is never
  confirmed past an event Kafka does not hold (at each status update); Kafka holds the
  events of each key in stream order (every event after all the earlier ones of its key);
  exactly once, no event twice in committed transactions; at least once, an event no more
  often than streams handed it to a relay; once quiet, every event delivered, the slot
  confirmed to the end of the WAL, the last copy of each event in order.
"""

from __future__ import annotations

import contextlib
import json
import types
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import pgoutput_encoder as pg
import psycopg
from capture import pgoutput_messages
from confluent_kafka import KafkaError
from test_stream_loop import DEAD, Connection, Letters, Sink, Wal, event_id
from test_stream_loop_cut import Rows
from test_stream_loop_eos import Kafka, Transactions

from cdc_relay.errors import DeliveryError
from cdc_relay.events import Insert, LogicalMessage, Relation, jsonb_text
from cdc_relay.kafka.checkpoints import Checkpoint
from cdc_relay.kafka.exactly_once import ExactlyOnce
from cdc_relay.kafka.routing import Message
from cdc_relay.kafka.transactional import TransactionAborted, _fenced_error
from cdc_relay.lsn import Lsn, format_lsn
from cdc_relay.postgres import pgoutput
from cdc_relay.postgres.messages import Messages
from cdc_relay.postgres.replication import ConnectionLost, Keepalive, XLogData
from cdc_relay.postgres.shards import CUT_PREFIX, Cut, Shard, StartAfterCut, every_shard
from cdc_relay.postgres.tables import OutboxTable
from cdc_relay.queries import QUERIES
from cdc_relay.relay.pipeline import Rewind
from cdc_relay.relay.stream import StreamRelay
from cdc_relay.relay.stream_settings import StreamSettings

# Defects the simulation finds that are not fixed yet: a process that meets one ends there
# (as a crash would), so that the search goes on past it; each has its own test, expected to
# fail until it is fixed (test_simulation.py). Empty this when they are.
KNOWN_OPEN: set[str] = set()

PREFIX = "outbox"
TOO_LARGE = KafkaError.MSG_SIZE_TOO_LARGE  # the event's own: the culprit
TIMED_OUT = KafkaError._MSG_TIMED_OUT  # not about the event: a later try
STEP = 0.001  # virtual seconds each call of a stage takes
LINGER = 0.010  # virtual seconds librdkafka holds a batch open (linger.ms, sink.py)


class VirtualClock:
    """``time`` for the relay and its stages: waiting advances it, nothing else does."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += max(seconds, 0.0)

    def time(self) -> float:
        return 1_700_000_000.0 + self.now

    def time_ns(self) -> int:
        return int(self.time() * 1e9)


CLOCK = VirtualClock()


class InlineThread:
    """``threading`` for kafka_transactions.py: exactly once's start-up runs at once, in the loop's
    thread, so that how long it takes cannot change the run."""

    class Thread:
        def __init__(self, target: Callable[[], None], **_: Any) -> None:
            self._target = target

        def start(self) -> None:
            self._target()

        def is_alive(self) -> bool:
            return False

        def join(self, timeout: float | None = None) -> None:
            pass


class Killed(BaseException):
    """The process dies here (SIGKILL); BaseException: no handler of the relay catches it."""


class Stuck(BaseException):
    """The process went on past its budget of steps: it loops or waits for ever."""


class Violation(BaseException):
    """The oracle caught the relay breaking a promise amid a process's run: the process ends
    there (no handler of the relay catches it), and ``Process.run`` fails with the finding."""


# -- what is written ---------------------------------------------------------------------------

RELATION = next(data for data in pgoutput_messages() if data[:1] == b"R")
_LAYOUT = pgoutput.decode(RELATION)
assert isinstance(_LAYOUT, Relation)
COLUMNS = [column.name for column in _LAYOUT.columns]


@dataclass(frozen=True)
class Written:
    """An event the database wrote: its id, its key, how (``row``, ``txmsg`` a transactional
    message, ``msg`` a non-transactional one) and the position its unit is confirmed at."""

    id: str
    key: str
    kind: str
    end: Lsn
    seq: int  # its place in the stream, among all events written


def envelope(event: str, key: str) -> bytes:
    """What ``outbox_emit()`` emits: the envelope as PostgreSQL prints jsonb."""
    return jsonb_text(
        {
            "v": 2,
            "id": event,
            "aggregate_type": "order",
            "aggregate_id": key,
            "event_type": "order.created",
            "payload": {"event": event},
        }
    ).encode()


def row(event: str, key: str) -> bytes:
    values: dict[str, bytes | None] = {
        "id": event.encode(),
        "seq": event[1:].encode(),
        "aggregate_type": b"order",
        "aggregate_id": key.encode(),
        "event_type": b"order.created",
        "payload": jsonb_text({"event": event}).encode(),
        "attempts": b"0",
        "created_at": b"2024-05-01 12:00:00+00",
    }
    return pg.insert(_LAYOUT.relid, [values.get(column) for column in COLUMNS])


@dataclass
class Slot:
    """A replication slot and its publication, on the same WAL as every other slot: all of
    it, or a shard's rows (its row filter; messages pass every publication). ``new``: a new
    shard of the resharding under way, which starts after its cut."""

    name: str
    shard: Shard | None = None
    new: bool = False
    wal: Wal = field(init=False)

    def __post_init__(self) -> None:
        self.wal = Wal(clock=CLOCK)
        self.wal.watchdog = float("inf")
        self.wal.tables = (OutboxTable(_LAYOUT.relid, _LAYOUT.namespace, _LAYOUT.name, False),)
        shard = self.shard
        if shard is not None:
            column = COLUMNS.index("aggregate_id")

            def keeps(row: Insert) -> bool:
                value = row.values[column]
                return shard.owns(value.decode() if isinstance(value, bytes) else None)

            self.wal.row_filter = keeps

    def owns(self, key: str) -> bool:
        return self.shard is None or self.shard.owns(key)


@dataclass
class Reshard:
    """A resharding cut (``reshard``): the new slots exist, their publications' comments
    say they start after the cut; one transaction emits the cut message, then (COMMENT
    statements, nothing decoded) commits. Transactions committed between the message and
    that commit are before the cut."""

    cut: Cut
    message: Lsn | None = None  # where the cut message ends, once emitted
    commit: Lsn | None = None  # where its transaction's commit record starts, once committed
    before: int = 0  # the events written before the cut, once committed

    def comment(self, shard: Shard) -> str:
        lsn = self.message if self.commit is not None else None
        return StartAfterCut(self.cut.cut, lsn).comment(shard)


class Writer:
    """The database: writes units at the end of the WAL, as PostgreSQL places them."""

    def __init__(self, wals: Sequence[Wal]) -> None:
        self.wals = wals
        self.written: list[Written] = []
        self.xid = 700
        self.relation_sent = False
        self.reshard: Reshard | None = None

    @property
    def end(self) -> Lsn:
        return self.wals[0].end

    def transaction(self, events: Sequence[tuple[str, str]]) -> list[Written]:
        """A transaction of ``events`` (kind, key) in this order. A non-transactional message
        among them is streamed at once, before the transaction: its LSN is the end of its
        record, so one written last has the LSN where the commit record starts."""
        pos = self.end
        body: list[bytes] = []
        alone: list[tuple[Lsn, bytes, str, str]] = []
        inside: list[tuple[str, str, str]] = []
        for kind, key in events:
            event = f"e{len(self.written) + len(alone) + len(inside) + 1}"
            if kind == "row":
                pos += 100
                body.append(row(event, key))
                inside.append((event, key, kind))
            elif kind == "txmsg":
                pos += 80
                body.append(pg.message(True, pos, PREFIX, envelope(event, key)))
                inside.append((event, key, kind))
            else:
                pos += 80
                data = pg.message(False, pos, PREFIX, envelope(event, key))
                alone.append((pos, data, event, key))
        written: list[Written] = []
        for lsn, data, event, key in alone:
            self._write([data], lsn)
            written.append(Written(event, key, "msg", lsn, len(self.written) + len(written)))
        if body:
            self.xid += 1
            ts = int(CLOCK.time() * 1e6)
            end = pos + 48  # the commit record
            relation = [] if self.relation_sent else [RELATION]
            self.relation_sent = True
            begin, commit = pg.begin(pos, ts, self.xid), pg.commit(pos, end, ts)
            self._write([begin, *relation, *body, commit], end)
            written += [
                Written(event, key, kind, end, len(self.written) + len(written) + i)
                for i, (event, key, kind) in enumerate(inside)
            ]
        self.written += written
        return written

    def keepalive(self, reply_requested: bool) -> None:
        for wal in self.wals:
            wal.keepalive(reply_requested)

    def emit_cut(self) -> None:
        """``reshard``'s transaction emits the cut message (decoded at its commit)."""
        reshard = self.reshard
        assert reshard is not None and reshard.message is None
        reshard.message = self.end + 80
        for wal in self.wals:
            wal.end = reshard.message  # the record is in the WAL, its transaction open

    def commit_cut(self) -> None:
        """``reshard``'s transaction commits: the cut, and the publications' comments."""
        reshard = self.reshard
        assert reshard is not None and reshard.message is not None and reshard.commit is None
        self.xid += 1
        ts = int(CLOCK.time() * 1e6)
        reshard.commit = self.end
        content = reshard.cut.content().encode()
        raw = [
            pg.begin(reshard.commit, ts, self.xid),
            pg.message(True, reshard.message, CUT_PREFIX, content),
            pg.commit(reshard.commit, reshard.commit + 48, ts),
        ]
        self._write(raw, reshard.commit + 48)
        reshard.before = len(self.written)

    def _write(self, raw: list[bytes], end: Lsn) -> None:
        for wal in self.wals:
            wal.write(raw, end)


def event_of(message: XLogData | Keepalive | None) -> str | None:
    """The id of the outbox event a message of the stream carries, if any."""
    if not isinstance(message, XLogData):
        return None
    record = pgoutput.decode(message.data)
    if isinstance(record, Insert) and isinstance(record.values[0], bytes):
        return record.values[0].decode()
    if isinstance(record, LogicalMessage) and record.prefix == PREFIX:
        return str(json.loads(record.content)["id"])
    return None


# -- the schedule ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Crash:
    """SIGKILL. At least once, the first ``reached`` messages the producer held had reached
    Kafka, their acknowledgements lost with the process."""

    reached: int = 0


@dataclass(frozen=True)
class LoseConnection:
    """The replication connection breaks."""


@dataclass(frozen=True)
class Stop:
    """SIGTERM: the graceful stop."""


@dataclass(frozen=True)
class Stall:
    """The broker answers nothing for ``steps`` steps (the producer's queue fills up)."""

    steps: int


@dataclass(frozen=True)
class Refuse:
    """Kafka refuses the event written ``event``-th (modulo the events written): ``culprit``
    for good (too large: stops the relay, or goes to the dead letters), ``client`` the same
    refused in the producer, ``transient`` once, for a reason not about it (timed out)."""

    event: int
    kind: str


@dataclass(frozen=True)
class Abort:
    """Exactly once: Kafka aborts the next Kafka transaction at its commit (a transaction
    timeout, a coordinator moved)."""


@dataclass(frozen=True)
class Fence:
    """Exactly once: another producer with the relay's transactional id initialises."""


@dataclass(frozen=True)
class Takeover:
    """The process is paused (SIGSTOP, a long GC): the server ends its connection, a standby
    takes the slot (after ``waits`` refused attempts) and relays until drained; then the
    process resumes, or is killed without resuming (``resume`` False). At least once, a
    process frozen whole delivers what its producer held when it resumes, before it can
    notice anything (docs/exactly-once.md, "Idempotent consumers", says so; exactly once fences
    it): there it resumes only if it was paused after it noticed that its connection was lost,
    and is killed otherwise."""

    waits: int = 0
    resume: bool = True


@dataclass(frozen=True)
class Write:
    """The database writes while the relay streams: a transaction of ``events``."""

    events: tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class KeepaliveSent:
    """The walsender sends a keepalive amid the stream."""

    reply_requested: bool = False


Fault = Crash | LoseConnection | Stop | Stall | Refuse | Abort | Fence | Takeover
Action = Fault | Write | KeepaliveSent  # what a schedule holds


# -- the stages of a process -----------------------------------------------------------------


class SimConnection(Connection):
    """A process's replication connection: each call a step; what it hands over counted."""

    flowed = 0  # messages handed over without a wait (read_now), every connection's

    def __init__(self, wal: Wal, process: Process) -> None:
        super().__init__(wal)
        self.process = process
        self.started = False

    def start(self, slot: str, start_lsn: Lsn, options: Any) -> None:
        process = self.process
        process.step("start")
        if process.release is not None:  # a standby taking over a paused relay's slot
            if process.refused_starts:  # the old holder's connection lasts a while
                process.refused_starts -= 1
            else:  # then its wal_sender_timeout ends it
                process.release()
        super().start(slot, start_lsn, options)
        self.started = True

    def read(self, timeout: float) -> XLogData | Keepalive | None:
        process = self.process
        process.step("read")
        if not self.queue and not self.closed and not self.terminated:
            self._fill()
            if not self.queue:
                process.idle()
        return self._counted(super().read(timeout))

    def read_now(self) -> XLogData | Keepalive | None:
        self.process.step("read")
        message = super().read_now()
        if isinstance(message, XLogData):
            SimConnection.flowed += 1
        return self._counted(message)

    def _counted(self, message: XLogData | Keepalive | None) -> XLogData | Keepalive | None:
        event = event_of(message)
        if event is not None:
            self.process.world.reads[event] += 1
        return message

    def send_status(self, written: Lsn, flushed: Lsn) -> None:
        process = self.process
        if process.dead:
            raise ConnectionLost("the process is gone")
        process.step("status")
        super().send_status(written, flushed)
        process.world.check_confirmed(process.slot, f"{process.name} confirmed")


class SimSink(Sink):
    """At least once: test_stream_loop's sink, whose every acknowledged message is in the
    world's log; each call a step. While the world lingers, as librdkafka under
    ``linger.ms``, a poll reports nothing until the oldest message held has waited
    ``LINGER``; a flush (``settle``) sends at once, so reports also come inside the stream
    loop's look at a quiet stream (linger.py)."""

    first_held = 0.0  # when the oldest message held was offered

    def __init__(self, process: Process, on_ack: Any, on_refused: Any) -> None:
        super().__init__(on_ack, on_refused, CLOCK)
        world = process.world
        self.process = process
        self.acked = world.log
        self.poison = world.poison
        self.refuse_once = world.refuse_once
        self.capacity = world.capacity
        self.watchdog = float("inf")

    def offer(self, message: Message, token: Any) -> bool:
        if self.process.dead:
            return True
        self.process.step("offer")
        if message.topic != DEAD and self.process.world.client_refuses.get(event_id(message)):
            self.on_refused(token, KafkaError(TOO_LARGE))  # larger than message.max.bytes
            return True
        if not self.queue:
            self.first_held = CLOCK.monotonic()
        return super().offer(message, token)

    def poll(self, timeout: float) -> None:
        if self.process.dead:
            return
        self.process.step("poll")
        lingering = (
            self.process.world.linger
            and bool(self.queue)
            and CLOCK.monotonic() - self.first_held < LINGER
        )
        self.hold_all = self.process.stalled() or lingering
        super().poll(timeout)

    def settle(self, timeout: float) -> None:
        if self.process.dead:
            return
        self.process.step("settle")
        self.hold_all = self.process.stalled()
        super().settle(timeout)

    def in_flight(self) -> int:
        return 0 if self.process.dead else len(self.queue)

    def renew(self) -> None:
        if self.process.dead:
            self.queue = []
            return
        super().renew()


class SimTransactions(Transactions):
    """Exactly once: a transactional producer on the world's Kafka. A message is in flight
    until a poll reports it (appended to the open transaction, or refused, which dooms the
    transaction); the commit reports what is left, then commits (the messages acknowledged,
    the checkpoint written) or, doomed, aborts. Fenced, every call raises what the real
    one raises."""

    def __init__(self, process: Process, on_ack: Any, on_refused: Any) -> None:
        super().__init__(process.world.kafka, on_ack, on_refused)
        self.process = process
        self.flying: list[tuple[Message, Any]] = []
        self.doomed = False
        self.abort_next = False

    @property
    def events(self) -> int:
        return len(self.open) + len(self.flying)

    @property
    def fenced(self) -> bool:
        return self.epoch < self.kafka.epoch

    def offer(self, message: Message, token: Any) -> bool:
        if self.process.dead:
            return True
        self.process.step("offer")
        if self.fenced:
            raise _fenced_error()
        if not self.events:
            self.opened = CLOCK.monotonic()
        if message.topic != DEAD and self.process.world.client_refuses.get(event_id(message)):
            self.on_refused(token, KafkaError(TOO_LARGE))
            return True
        self.flying.append((message, token))
        self.offers += 1
        return True

    def _report(self) -> int:
        world = self.process.world
        flying, self.flying = self.flying, []
        for message, token in flying:
            code = None
            if message.topic != DEAD:
                code = world.poison.get(event_id(message)) or world.refuse_once.pop(
                    event_id(message), None
                )
            if code is None:
                self.open.append((message, token))  # acknowledged at the commit
            else:
                self.doomed = True  # Kafka will not commit this transaction
                self.on_refused(token, KafkaError(code))
        return len(flying)

    def poll(self, timeout: float) -> None:
        if self.process.dead:
            return
        self.process.step("poll")
        if not self._report():
            CLOCK.sleep(timeout)

    def settle(self, timeout: float) -> None:
        if self.process.dead:
            return
        self.process.step("settle")
        self._report()

    def in_flight(self) -> int:
        return 0 if self.process.dead else len(self.flying)

    def commit(self, checkpoint: Checkpoint) -> None:
        if self.process.dead:
            raise TransactionAborted("the relay died")
        if not self.events:
            return
        self.process.step("commit")
        if self.fenced:
            raise _fenced_error()
        self._report()  # commit_transaction flushes first
        if self.doomed or self.abort_next:
            self.abort_next = False
            self.renew()
            raise TransactionAborted("Kafka aborted the transaction")
        super().commit(checkpoint)

    def renew(self) -> None:
        if self.process.dead:
            return
        if self.fenced and self.events:
            raise _fenced_error()  # the abort fails the same way
        if self.events:
            self.aborted.append([event_id(message) for message, _ in self.open + self.flying])
        flying, self.flying, self.open = self.flying, [], []
        self.doomed = False
        for _, token in flying:
            self.on_refused(token, KafkaError(KafkaError._PURGE_QUEUE))

    def close(self) -> int:
        left = self.events
        self.open, self.flying = [], []
        return left


class SimLetters(Letters):
    """The dead-letter table, the world's: it outlives the processes."""

    def __init__(self, process: Process, dsn: str, slot: str, topic: str) -> None:
        super().__init__(dsn, slot, topic)
        self.process = process
        self.stored = process.world.table

    def store(self, message: Message, err: KafkaError) -> None:
        self.process.step("store")
        super().store(message, err)


# -- the processes -----------------------------------------------------------------------------


class Process:
    """One relay process: a StreamRelay on stages of its own, run by ``run`` until it ends;
    ``schedule`` says what happens at which of its steps."""

    BUDGET = 20_000  # steps: a process that takes more loops or waits for ever

    def __init__(
        self,
        world: World,
        name: str,
        schedule: Sequence[tuple[int, Action]] = (),
        standby: bool = False,
        slot: Slot | None = None,
    ) -> None:
        self.world = world
        self.name = name
        self.slot = slot or world.slot
        self.schedule = sorted(schedule, key=lambda entry: entry[0])
        self.steps = 0
        self.dead = False
        self.stall_until = -1
        self.refused_starts = 0  # a standby's: attempts that find the slot held
        self.release: Callable[[], None] | None = None  # ends the old holder's connection
        self.drained = False
        self.faulted = False  # a fault of the schedule acted
        self.sinks: list[SimSink | SimTransactions] = []
        self.connections: list[SimConnection] = []
        settings = world.settings
        self.relay = StreamRelay(
            StreamSettings(
                dsn="sim",
                slot=self.slot.name,
                publication=self.slot.name,
                shard=self.slot.shard,
                tables=("public.outbox_events",),
                kafka_config={},
                topic_template="outbox.{aggregate_type}",
                status_interval=0.01,
                shutdown_timeout=0.05,
                progress_interval=3600.0,
                dead_letter_topic=DEAD if settings.dead_letters else None,
                standby=standby,
                messages=Messages(relay=True),  # the outbox's messages are events too
                exactly_once=(
                    ExactlyOnce("sim", interval=0.05, max_events=settings.max_events)
                    if settings.exactly_once
                    else None
                ),
            ),
            open_source=self._connect,
            open_sink=self._sink,
            open_transactions=self._transactions,
            checkpoints=world.kafka,
            read_timeline=lambda dsn, slot: (0, self.slot.wal.confirmed),
            open_dead_letters=lambda dsn, slot, topic: SimLetters(self, dsn, slot, topic),
        )

    def _connect(self, dsn: str) -> SimConnection:
        connection = SimConnection(self.slot.wal, self)
        self.slot.wal.connections.append(connection)
        self.connections.append(connection)
        return connection

    def _sink(self, on_ack: Any, on_refused: Any) -> SimSink:
        sink = SimSink(self, on_ack, on_refused)
        self.sinks.append(sink)
        return sink

    def _transactions(self, on_ack: Any, on_refused: Any) -> SimTransactions:
        sink = SimTransactions(self, on_ack, on_refused)
        self.sinks.append(sink)
        return sink

    # -- running --------------------------------------------------------------------------

    def run(self) -> str:
        """Run until the process ends: ``drained``, ``stopped``, ``killed``, ``culprit`` (it
        stopped at an event Kafka refuses, as it must without dead letters) or ``fenced``.
        A promise broken fails here, whichever step broke it: one failure to shrink."""
        world = self.world
        try:
            outcome = self._run()
        except Violation:
            outcome = "broke a promise"
        except Stuck as exc:
            world.failure = world.failure or str(exc)
            outcome = "stuck"
        if world.failure:
            raise AssertionError(world.failure)
        return outcome

    def _run(self) -> str:
        world = self.world
        wal = self.slot.wal
        try:
            if self.slot.new and self.slot.shard is not None:
                # As _check_database finds it at start: before the cut reshard noted?
                confirmed = format_lsn(wal.confirmed)
                self.relay._start_after_cut(cast(Any, DATABASE), self.slot.shard, confirmed)
            self.relay.stream(wal.tables)
        except Killed:
            return "killed"
        except Rewind:
            if "rewind out of the stop" not in KNOWN_OPEN:
                raise
            return "ended by Rewind (a known defect)"
        except DeliveryError as exc:
            text = str(exc)
            if "another relay took over" in text and self.fenced_now():
                return "fenced"
            culprits = [e for e in world.poison if f"event {e} " in text]
            culprits += [e for e in world.client_refuses if f"event {e} " in text]
            if culprits and not world.settings.dead_letters:
                world.fix(culprits)
                return "culprit"
            raise
        return "drained" if self.drained else "stopped"

    def fenced_now(self) -> bool:
        return any(isinstance(sink, SimTransactions) and sink.fenced for sink in self.sinks)

    def step(self, what: str) -> None:
        """A call of one of the process's stages: time passes, the schedule acts."""
        if self.dead:
            raise Killed
        self.steps += 1
        CLOCK.sleep(STEP)
        if self.steps > self.BUDGET:
            raise Stuck(f"{self.name} still going after {self.BUDGET} steps (at {what})")
        while self.schedule and self.schedule[0][0] <= self.steps:
            _, action = self.schedule.pop(0)
            self.world.trace.append(f"{self.name} step {self.steps} ({what}): {action}")
            self.faulted = self.faulted or not isinstance(action, Write | KeepaliveSent)
            self.act(action)

    def act(self, action: Action) -> None:
        world = self.world
        if isinstance(action, Crash):
            self.kill(action.reached)
        elif isinstance(action, LoseConnection):
            for connection in self.connections:
                connection.terminated = True
        elif isinstance(action, Stop):
            self.relay.request_stop()
        elif isinstance(action, Stall):
            self.stall_until = self.steps + action.steps
        elif isinstance(action, Refuse):
            world.refuse(action)
        elif isinstance(action, Abort):
            for sink in self.sinks:
                if isinstance(sink, SimTransactions):
                    sink.abort_next = True
        elif isinstance(action, Fence):
            world.kafka.epoch += 1
        elif isinstance(action, Takeover):
            self.taken_over(action)
        elif isinstance(action, Write):
            world.writer.transaction(action.events)
        elif isinstance(action, KeepaliveSent):
            world.writer.keepalive(action.reply_requested)

    def stalled(self) -> bool:
        return self.steps < self.stall_until

    def idle(self) -> None:
        """The stream is read to its end: what the schedule writes comes now; with nothing
        left to write or in flight, the process is stopped (drained)."""
        writes = [entry for entry in self.schedule if isinstance(entry[1], Write | KeepaliveSent)]
        if writes:
            self.schedule.remove(writes[0])
            self.world.trace.append(f"{self.name} step {self.steps} (idle): {writes[0][1]}")
            self.act(writes[0][1])
            return
        if any(
            sink.in_flight() or (isinstance(sink, Sink) and sink.hold_all) for sink in self.sinks
        ):
            return  # Kafka has yet to answer
        self.drained = True
        self.relay.request_stop()

    def kill(self, reached: int = 0) -> None:
        """SIGKILL: the producer's queue is gone (its first ``reached`` messages had reached
        Kafka), the connections end, nothing of the process acts again."""
        for sink in self.sinks:
            if isinstance(sink, SimSink):
                self.world.log.extend(message for message, _ in sink.queue[:reached])
                sink.queue = []
            else:
                sink.dead = True
        for connection in self.connections:
            connection.terminated = True
        self.dead = True
        raise Killed

    def taken_over(self, action: Takeover) -> None:
        """Paused here while a standby takes the slot over and relays until drained."""
        world = self.world
        standby = Process(world, f"{self.name}'s standby", standby=True, slot=self.slot)
        standby.refused_starts = action.waits

        def release() -> None:
            for connection in self.connections:
                connection.terminated = True
            standby.release = None

        standby.release = release
        noticed = not any(c.started and not c.closed for c in self.connections)
        resumes = action.resume and (world.settings.exactly_once or noticed)
        outcome = standby.run()
        world.trace.append(
            f"{standby.name}: {outcome}; {self.name} {'resumes' if resumes else 'is killed'}"
        )
        if not resumes:
            self.kill()


# -- the database's answers besides the stream -------------------------------------------------


class Database:
    """What the relay's plain connections read (its parts' connect, and messages.py's check of a
    cut): a new shard's publication comment (where reshard notes its cut, which also tells a
    genuine cut from a forged one) and how far the old slot is confirmed. A new shard asking
    while the old slot is before the cut runs the old shard's relay first
    (World.run_old_shards)."""

    world: World | None = None

    def execute(self, query: str, params: dict[str, Any] | None = None) -> Rows:
        world = self.world
        assert world is not None
        reshard = world.writer.reshard
        if query == QUERIES["publication_comment"]:
            assert params is not None
            slot = next(s for s in world.slots if s.name == params["publication"])
            if reshard is None or slot.shard is None or not slot.new:
                return Rows([])
            return Rows([{"comment": reshard.comment(slot.shard)}])
        if query == QUERIES["cut_comments"]:
            if reshard is None:
                return Rows([])
            return Rows([{"comment": reshard.comment(s.shard)} for s in world.slots if s.shard])
        if query == QUERIES["slots_confirmed"]:
            assert params is not None
            world.run_old_shards()
            return Rows(
                [
                    {"slot_name": s.name, "confirmed": format_lsn(s.wal.confirmed)}
                    for s in world.slots
                    if s.name in params["slots"]
                ]
            )
        raise AssertionError(f"unexpected query: {query}")

    @contextlib.contextmanager
    def connect(self, dsn: str, **options: Any) -> Iterator[Database]:
        yield self


DATABASE = Database()
# What the stream relay's parts and messages.py connect with (test_simulation installs them).
PSYCOPG = types.SimpleNamespace(connect=DATABASE.connect, OperationalError=psycopg.OperationalError)


# -- the world and its oracle ------------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    exactly_once: bool = False
    dead_letters: bool = False
    max_events: int = 2  # events in one Kafka transaction at most
    capacity: int = 1_000  # messages the producer holds at most
    shards: bool = False  # a resharding from one slot to two shards


@dataclass
class World:
    """The database, Kafka and what the relay processes did, with the oracle."""

    settings: Settings
    slots: list[Slot] = field(default_factory=lambda: [Slot("sim")])
    writer: Writer = field(init=False)
    kafka: Kafka = field(default_factory=Kafka)
    log: list[Message] = field(default_factory=list)  # at least once: what reached Kafka
    table: list[tuple[str, int]] = field(default_factory=list)  # the dead-letter table
    reads: Counter[str] = field(default_factory=Counter)  # times a stream handed an event
    poison: dict[str, int] = field(default_factory=dict)  # Kafka refuses them for good
    client_refuses: dict[str, int] = field(default_factory=dict)  # the producer refuses them
    refuse_once: dict[str, int] = field(default_factory=dict)
    trace: list[str] = field(default_factory=list)  # what happened, for a failure's report
    failure: str | None = None  # the first promise broken
    processes: int = 0
    linger: bool = False  # the producer holds its batches for LINGER (SimSink)

    def __post_init__(self) -> None:
        if self.settings.shards:
            self.slots = [
                Slot("old"),
                *(Slot(shard.name("new"), shard, new=True) for shard in every_shard(2)),
            ]
        self.writer = Writer([slot.wal for slot in self.slots])
        if self.settings.shards:
            self.writer.reshard = Reshard(Cut("0c0ffee0-0000-4000-8000-000000000001", ("old",)))
        self.schedules: dict[str, list[tuple[int, Action]]] = {}  # armed, by slot
        self.old_runs = 0  # the old shard's relays a new one waited for
        DATABASE.world = self

    def run_old_shards(self) -> None:
        """A new shard waits at the cut for the old slot: the old shard's relay runs (the
        operator starts it, or Kubernetes restarts it), with the faults armed for it; a few
        times at most."""
        reshard = self.writer.reshard
        assert reshard is not None and reshard.commit is not None
        old = self.slot
        if old.wal.confirmed >= reshard.commit or self.old_runs >= 3:
            return
        self.old_runs += 1
        process = self.process(self.schedules.pop(old.name, []), slot=old)
        outcome = process.run()
        self.trace.append(f"{process.name} (a new shard waits for it): {outcome}")

    @property
    def slot(self) -> Slot:
        """The first slot: the only one, or the old one of a resharding."""
        return self.slots[0]

    @property
    def wal(self) -> Wal:
        return self.slot.wal

    @property
    def capacity(self) -> int:
        return self.settings.capacity

    def process(
        self, schedule: Sequence[tuple[int, Action]] = (), slot: Slot | None = None
    ) -> Process:
        self.processes += 1
        slot = slot or self.slot
        name = f"relay {self.processes}" + ("" if len(self.slots) == 1 else f" of {slot.name}")
        return Process(self, name, schedule, slot=slot)

    def refuse(self, refusal: Refuse) -> None:
        written = self.writer.written
        if not written:
            return
        event = written[refusal.event % len(written)].id
        if refusal.kind == "culprit":
            self.poison[event] = TOO_LARGE
        elif refusal.kind == "client":
            self.client_refuses[event] = TOO_LARGE
        else:
            self.refuse_once[event] = TIMED_OUT

    def fix(self, events: Sequence[str]) -> None:
        """The operator's remedy for a culprit (a larger max.message.bytes)."""
        for event in events:
            self.poison.pop(event, None)
            self.client_refuses.pop(event, None)

    # -- what Kafka holds -------------------------------------------------------------------

    def delivered(self) -> list[Message]:
        """What consumers read (read_committed, exactly once), the dead letters among it."""
        return self.kafka.visible if self.settings.exactly_once else self.log

    def check_confirmed(self, slot: Slot, who: str) -> None:
        """The LSN rule (invariant 1): nothing of the slot's at or before its confirmed
        position is missing (a new shard's are its keys', before the cut as well: it confirms
        past them only once the old slots are past the cut; an old slot's are those before
        the cut)."""
        if self.failure:
            return  # the process is ending on the first
        confirmed = slot.wal.confirmed
        missing = [w for w in self.missing(confirmed) if self.owned(slot, w)]
        if missing:
            self.failure = (
                f"{who} slot {slot.name} up to {format_lsn(confirmed)} and Kafka lacks "
                f"{[w.id for w in missing]} (at {[format_lsn(w.end) for w in missing]})"
            )
            raise Violation

    def owned(self, slot: Slot, written: Written) -> bool:
        """Whether the slot's relays relay ``written``."""
        reshard = self.writer.reshard
        if reshard is None or not self.settings.shards:
            return True
        before = reshard.commit is not None and written.seq < reshard.before
        if slot.new:
            return slot.owns(written.key)
        return reshard.commit is None or before

    def missing(self, confirmed: Lsn) -> list[Written]:
        """The events at or before ``confirmed`` that Kafka does not hold."""
        have = {event_id(message) for message in self.delivered()}
        return [w for w in self.writer.written if w.end <= confirmed and w.id not in have]

    def check_kafka(self) -> None:
        """Order per key and duplicates, in what Kafka holds now."""
        order = {w.id: i for i, w in enumerate(self.writer.written)}
        key_of = {w.id: w.key for w in self.writer.written}
        earlier: dict[str, list[str]] = {}
        for w in self.writer.written:
            earlier.setdefault(w.key, []).append(w.id)
        seen: set[str] = set()
        counts: Counter[str] = Counter()
        for position, message in enumerate(self.delivered()):
            event = event_id(message)
            assert event in order, f"Kafka holds {event}, which nobody wrote"
            counts[event] += 1
            before = earlier[key_of[event]][: earlier[key_of[event]].index(event)]
            overtaken = [e for e in before if e not in seen]
            assert not overtaken, (
                f"{event} (key {key_of[event]}) reached Kafka at {position} before {overtaken}, "
                "written earlier with the same key"
            )
            seen.add(event)
        if self.settings.exactly_once:
            twice = sorted((e for e, n in counts.items() if n > 1), key=order.__getitem__)
            assert not twice, f"exactly once, and committed Kafka transactions hold {twice} twice"
        else:
            more = [e for e, n in counts.items() if n > self.reads[e]]
            assert not more, (
                f"{more} reached Kafka more often than streams handed them to a relay: "
                "a duplicate without a replay"
            )

    def check_quiet(self, slots: Sequence[Slot] = ()) -> None:
        """After a process drained with nothing refused: everything delivered, the slot (or
        ``slots``) confirmed to the end of the WAL, and the last copy of each event in order
        (what a compacted topic keeps)."""
        missing = [w.id for w in self.missing(self.writer.end)]
        assert not missing, f"at rest, Kafka lacks {missing}"
        for slot in slots or [self.slot]:
            assert slot.wal.confirmed >= self.writer.end, (
                f"at rest, slot {slot.name} is confirmed to {format_lsn(slot.wal.confirmed)}, "
                f"not to the end of the WAL, {format_lsn(self.writer.end)}"
            )
        last: dict[str, int] = {}
        for position, message in enumerate(self.delivered()):
            last[event_id(message)] = position
        for key in {w.key for w in self.writer.written}:
            events = [w.id for w in self.writer.written if w.key == key]
            positions = [last[e] for e in events]
            assert positions == sorted(positions), (
                f"at rest, the last copies of key {key}'s events are out of order: "
                f"{sorted(events, key=last.__getitem__)}"
            )
