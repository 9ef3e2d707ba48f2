"""The CDC relay: the pipeline (pipeline.py) configured for a replication slot.

The slot's stream is the feed: read, decoded (pgoutput or wal2json), each outbox row and
message published through the pipeline; the LSN tracker is the checkpointer, fed by the
delivery reports; the refusal policy rewinds (``Rewinds``: replay from the confirmed
position, each suspect alone). A shard is the same feed on its own slot and publication
(shards.py); exactly once is the transactional sink with the Kafka checkpoint
(exactly_once.py); ``--dead-letter-topic`` wraps the policy (deadletter.DeadLetterRefusals).

Single-threaded on purpose: delivery reports are served by ``poll`` on this thread, so the
tracker needs no locks, and the order of events is the order of the stream.
"""

from __future__ import annotations

import contextlib
import logging
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg
from confluent_kafka import KafkaError

from cdc_relay.errors import (
    DecodeError,
    DeliveryError,
    PreflightError,
    RelayError,
    SlotInUseError,
)
from cdc_relay.events import (
    BYTEA_OID,
    Begin,
    Commit,
    Insert,
    LogicalMessage,
    OutboxEvent,
    OutboxLayout,
    Record,
    Relation,
    RowMapper,
    envelope_event,
)
from cdc_relay.kafka.checkpoints import MESSAGE, TRANSACTION, Checkpoint, KafkaCheckpoints, Unit
from cdc_relay.kafka.deadletter import DeadLetterRefusals, DeadLetters, DeadLetterStore
from cdc_relay.kafka.exactly_once import Committer, ExactlyOnce, check_interval
from cdc_relay.kafka.refusals import Fate, RefusalPolicy, fate, refusal_error
from cdc_relay.kafka.routing import Message, Router
from cdc_relay.kafka.sink import Acked, Refused, kafka_sink
from cdc_relay.kafka.transactional import TransactionAborted, TransactionalSink
from cdc_relay.lsn import Lsn, format_lsn
from cdc_relay.lsn import parse as parse_lsn
from cdc_relay.metrics import (
    CONFIRMED_LSN,
    CONNECTED,
    EVENTS_PENDING,
    EVENTS_PUBLISHED,
    IN_FLIGHT,
    LATENCY,
    SHARD,
    SINCE_LAST_EVENT,
    Health,
    observe_slot,
)
from cdc_relay.postgres import failover, gaps, pgoutput, wal2json
from cdc_relay.postgres.connection import check_encoding, connect, timeline_of
from cdc_relay.postgres.coverage import PLUGINS, besides_problem, coverage_problem
from cdc_relay.postgres.messages import Messages, check_writers, genuine_cut, unrelayed
from cdc_relay.postgres.replication import ConnectionLost, Keepalive, ReplicationConnection
from cdc_relay.postgres.shards import CUT_PREFIX, Cut, Shard, StartAfterCut
from cdc_relay.postgres.tables import OutboxTable, find_table
from cdc_relay.postgres.wal2json import Wal2JsonDecoder
from cdc_relay.postgres.watch import Watcher
from cdc_relay.queries import QUERIES
from cdc_relay.relay import stages
from cdc_relay.relay.checkpoint import LsnTracker, Transaction
from cdc_relay.relay.pipeline import Pipeline, Rewind, Stopping
from cdc_relay.relay.settings import RelaySettings
from cdc_relay.relay.stages import (
    CheckpointStore,
    OpenDeadLetters,
    OpenSink,
    OpenSource,
    OpenTransactions,
    ReadTimeline,
    Sink,
    Source,
)

log = logging.getLogger(__name__)

_READ_TIMEOUT = 0.1  # seconds without data before serving delivery reports and timers
_TICK = 0.005  # seconds between looks at delivery reports and timers while data flows
_RECONNECT_MAX = 10.0
# A newly acknowledged position is confirmed this soon: after a crash, PostgreSQL replays
# what was not confirmed, so this interval bounds the duplicates (events/s x interval).
_CONFIRM_AFTER = 0.2
_STANDBY_RETRY = 1.0  # seconds between a standby's attempts to take the slot
# The server ending the stream with one error this many times in a row, with no progress in
# between (about 25 s of backing off), stops the relay: the error is the user's to fix.
_SAME_ERROR_LIMIT = 8
_SAME_ERROR_WITHIN = 60.0  # seconds: a loss longer after the last one starts the count anew


@dataclass(frozen=True, kw_only=True)
class StreamSettings(RelaySettings):
    slot: str
    publication: str
    # The outbox tables, one or more, all in the slot's publication (or wal2json's add-tables).
    tables: tuple[str, ...]
    status_interval: float = 10.0
    layout: OutboxLayout = field(default_factory=OutboxLayout)
    message_prefix: str = "outbox"
    dead_letter_topic: str | None = None
    standby: bool = False  # wait while another relay holds the slot, then take over
    # Skip rows of other tables in the publication (logged) instead of stopping at the first.
    ignore_other_tables: bool = False
    shard: Shard | None = None  # slot and publication are then the shard's (shards.py)
    exactly_once: ExactlyOnce | None = None  # Kafka transactions with a checkpoint
    messages: Messages = field(default_factory=Messages)  # --messages and its writers


@dataclass
class Progress:
    events: int = 0
    transactions: int = 0
    started: float = field(default_factory=time.monotonic)


def _pgoutput(data: bytes) -> Sequence[Record]:
    return (pgoutput.decode(data),)


# A token of the sink: the event's transaction, and its id for the refusals.
Token = tuple[Transaction, str]


class Rewinds:
    """The stream's refusal policy (pipeline.RefusalPolicy; cdc_relay.kafka.refusals).

    A refusal among others makes its event a suspect and rewinds the stream: the relay
    replays from the confirmed position (nothing after a refused batch got through: the
    gapless guarantee) and sends each suspect alone. The culprit stops the relay, with one
    line; ``--dead-letter-topic`` wraps this policy (deadletter.DeadLetterRefusals) and
    dead-letters it instead.
    """

    def __init__(self) -> None:
        self.pending: list[tuple[Token, KafkaError]] = []  # reported since the last rewind
        self.suspects: set[str] = set()  # ids of the events to send alone
        self.rewinds = 0  # rewinds in a row that were retries, for the pause before the next
        self.pause_next = False  # a suspect sent alone met an error not about it: pause first

    def refused(self, token: Token, err: KafkaError) -> None:
        if not token[0].forgotten:
            self.pending.append((token, err))

    def served(self) -> None:
        if self.pending:
            raise Rewind

    def culprit(self, message: Message, token: Token, err: KafkaError) -> None:
        self.cleared(token)
        raise refusal_error(message, err, "stream")

    def retry(self, token: Token, err: KafkaError) -> None:
        self.pending.append((token, err))
        self.pause_next = True
        raise Rewind

    def cleared(self, token: Token) -> None:
        self.suspects.discard(token[1])
        self.rewinds = 0

    def unroutable(self, token: Token, exc: RelayError) -> None:
        raise exc  # a row or message of the outbox the relay cannot route: the user's to fix

    def note(self) -> bool:
        """Turn the refusals reported so far into suspects; True if one calls for a pause."""
        refusals, self.pending = self.pending, []
        retry = False
        for (_, event_id), err in refusals:
            kind = fate(err)
            if kind is Fate.STOP:
                raise DeliveryError(
                    f"Kafka refused the relay: {err.str()}; fix the cause and restart the relay: "
                    "it resumes after the last event Kafka acknowledged"
                )
            if kind is Fate.ISOLATE:
                self.suspects.add(event_id)
            else:
                retry = True
        return retry


def _find_tables(
    conn: psycopg.Connection[dict[str, Any]], names: Sequence[str]
) -> tuple[OutboxTable, ...]:
    """``--table`` (each) resolved as PostgreSQL resolves it; a PreflightError for a table
    that does not exist, or one named twice (``outbox_events`` and ``public.outbox_events``)."""
    if not names:
        raise PreflightError("no outbox table given; name one with --table")
    tables: dict[int, tuple[str, OutboxTable]] = {}
    for name in names:
        table = find_table(conn, name)
        if table is None:
            raise PreflightError(f"table {name} does not exist; check --table")
        if table.oid in tables:
            raise PreflightError(
                f"--table {tables[table.oid][0]} and --table {name} are the same table, "
                f"{table.qualified}; name each outbox table once"
            )
        tables[table.oid] = (name, table)
    return tuple(table for _, table in tables.values())


def _tables(tables: Sequence[OutboxTable]) -> str:
    """``table a`` or ``tables a, b``, for messages."""
    names = ", ".join(table.qualified for table in tables)
    return f"table{'s' if len(tables) > 1 else ''} {names}"


class StreamRelay:
    """Streams one slot to Kafka until stopped; confirms only acknowledged positions.

    The stages are injected (cdc_relay.relay.stages), the real ones by default: ``open_source``
    makes the replication source from the DSN, ``open_sink`` the idempotent sink from the
    relay's report callbacks, ``open_dead_letters`` the store of ``--dead-letter-topic``; with
    exactly once, ``open_transactions`` makes its transactional sink instead of
    ``open_sink``'s, ``checkpoints`` is where the committed checkpoint is read at start, and
    ``read_timeline`` what the server says of its timeline on reconnecting.
    """

    def __init__(
        self,
        settings: StreamSettings,
        health: Health | None = None,
        *,
        open_source: OpenSource = ReplicationConnection,
        open_sink: OpenSink | None = None,
        open_dead_letters: OpenDeadLetters = DeadLetters,
        open_transactions: OpenTransactions | None = None,
        checkpoints: CheckpointStore | None = None,
        read_timeline: ReadTimeline = timeline_of,
    ) -> None:
        self.settings = settings
        self.health = health or Health()
        self.tracker = LsnTracker()
        router = Router(
            settings.topic_template,
            settings.tombstone_on_empty,
            settings.cloudevents,
            by_table=True,
        )
        self._open_source = open_source
        self._read_timeline = read_timeline
        self.dead_letters: DeadLetterStore | None = (
            open_dead_letters(settings.dsn, settings.slot, settings.dead_letter_topic)
            if settings.dead_letter_topic
            else None
        )
        self.rewinds = Rewinds()
        policy: RefusalPolicy = self.rewinds
        if self.dead_letters is not None:
            policy = DeadLetterRefusals(
                self.rewinds, self.dead_letters, lambda m, t: self.pipeline.deliver_alone(m, t)
            )
        # Exactly once: its sink, what it adds to the loop (exactly_once.Committer), and
        # where the committed checkpoint is read from at start.
        self._eos: Committer | None = None
        self._checkpoints: CheckpointStore | None = None
        eos = settings.exactly_once
        made: list[stages.TransactionalSink] = []  # the Protocol: Kafka's, or one injected

        def open_kafka(acked: Acked, refused: Refused) -> Sink:
            if eos is None:
                return (open_sink or kafka_sink(settings.kafka_config))(acked, refused)
            if open_transactions is not None:
                made.append(open_transactions(acked, refused))
            else:  # Kafka's, whose transactions time out
                check_interval(settings.kafka_config, eos.interval)
                made.append(
                    TransactionalSink(
                        settings.kafka_config,
                        on_ack=acked,
                        on_refused=refused,
                        transactional_id=eos.transactional_id,
                        checkpoint_topic=eos.checkpoint_topic,
                        start_timeout=settings.kafka_timeout,
                    )
                )
            return made[0]

        self.pipeline = Pipeline(
            router,
            open_kafka,
            self,
            policy,
            tick=self._send_status,
            give_up=lambda: self._stop,
            before_alone=self._commit_before_alone,
            after_alone=self._commit_alone,
        )
        self.sink: Sink = self.pipeline.sink
        self._publish = self.pipeline.publish
        if eos is not None:
            self._eos = Committer(eos, made[0])
            self._checkpoints = checkpoints or KafkaCheckpoints(
                settings.kafka_config, eos.checkpoint_topic, eos.transactional_id
            )
        self._plugin = "pgoutput"
        self._decode: Callable[[bytes], Sequence[Record]] = _pgoutput
        self.progress = Progress()
        self._published = EVENTS_PUBLISHED.labels(relay="stream")
        self._last_event = time.monotonic()
        # The outbox tables by identity, as named at start (the topics' {schema} and {table}).
        self._tables: tuple[OutboxTable, ...] = ()
        self._watcher: Watcher | None = None
        self._relations: dict[int, str] = {}  # relid -> name, for messages about other tables
        self._bytea_types: frozenset[int] = frozenset({BYTEA_OID})  # and its domains
        self._stop = False
        self._shutting_down = False  # in the graceful stop: a refusal no longer rewinds
        self._conn: Source | None = None
        self._mappers: dict[int, RowMapper | None] = {}
        self._begin: Begin | None = None
        self._transaction: Transaction | None = None
        self._received: Lsn = 0
        self._last_status = 0.0
        self._last_progress = time.monotonic()
        self._sent_flush: Lsn = -1
        self._standing_by = False
        self._acks = 0  # acknowledgements not yet added to the published counter
        # Ids of the events sent and not acknowledged, for the stop line: the tracker forgets
        # them on a rewind, and the producer once Kafka refused them.
        self._unacknowledged: set[str] = set()
        self._events_seen = 0  # events sent at the last tick, for SINCE_LAST_EVENT
        # A new shard after a resharding cut: what comes before the cut is the old shards',
        # skipped and never confirmed (shards.py); None for any other relay.
        self._after_cut: StartAfterCut | None = None
        self._waiting = False  # still before the cut
        self._slot_confirmed: Lsn = 0  # the slot's position at start
        self._timeline = 0  # the server's at start, or since it changed (0: not known)
        # A failover slot whose server holds back WAL for a standby (synchronized_standby_slots):
        # a promoted standby then has all this relay was sent.
        self._guarded = False
        # The last lost connection's error, where the stream was, and when.
        self._last_loss: tuple[str, Lsn, float] = ("", -1, 0.0)
        self._losses = 0  # connections lost in a row with that error at that position
        self._quiet = False  # events may be skipped: waiting for a cut, or replaying
        self._cut_transaction: Transaction | None = None  # the cut's, passed but not committed
        self._cut_at: Lsn | None = None  # an old shard's cut, reached: confirmed on stopping

    @property
    def stopped(self) -> bool:
        return self._stop

    def acked(self, token: Token) -> None:
        """The checkpointer's report (pipeline.Checkpointer): the LSN tracker's."""
        transaction = token[0]
        self.tracker.acked(transaction)
        self._unacknowledged.discard(token[1])
        # Counted here, added to the metric with the next status update: a Prometheus
        # counter's inc() takes a lock, per event.
        self._acks += 1
        if transaction.committed and not transaction.pending and not transaction.forgotten:
            # Commit to the ack of the transaction's last event, once per transaction.
            LATENCY.observe(max(0.0, time.time() - transaction.commit_time_us / 1e6))

    def _register_metrics(self) -> None:
        """Gauges read on scrape, from the relay's own state."""
        IN_FLIGHT.set_function(lambda: self.tracker.in_flight)
        EVENTS_PENDING.set_function(lambda: self.tracker.in_flight)
        CONFIRMED_LSN.set_function(lambda: max(self._sent_flush, 0))
        SINCE_LAST_EVENT.set_function(lambda: time.monotonic() - self._last_event)
        CONNECTED.labels(service="postgres").set_function(lambda: self._conn is not None)
        CONNECTED.labels(service="kafka").set_function(lambda: self.sink.connected)
        self.health.readiness = self._readiness

    def _readiness(self) -> tuple[bool, str]:
        if self._standing_by:
            # Ready to take over: a rolling update may go on while this one waits.
            if not self.sink.connected:
                return False, "standing by, not connected to Kafka"
            return True, f"standing by for slot {self.settings.slot}"
        if self._conn is None:
            return False, "not connected to PostgreSQL"
        if not self.sink.connected:
            return False, "not connected to Kafka"
        return True, "ok"

    def request_stop(self) -> None:
        """Stop reading, wait (bounded) for acks, confirm, return from ``run``. Signal-safe."""
        self._stop = True

    def run(self) -> None:
        """Stream until ``request_stop``; raise RelayError on a failure the user must fix."""
        self._register_metrics()
        self._tables, confirmed, self._plugin = self._check_database()
        self.sink.check_reachable(self.settings.kafka_timeout)
        self._conn = self._acquire()
        if self._conn is None:
            return  # stopped while waiting as a standby
        # Only with the slot in hand: a standby's relay may have moved the slot on (past a
        # resharding cut, past the checkpoint's units) while this one waited.
        self._held()
        # Only with the slot in hand: a standby must not fence the relay it stands by for.
        self._start_transactions()
        publication = self.settings.publication if self._plugin == "pgoutput" else None
        watcher = Watcher(
            self.settings.dsn,
            self.settings.slot,
            self._tables,
            publication,
            shard=self.settings.shard,
            aggregate_column=self.settings.layout.aggregate_id,
            listing=self.settings.publication if publication is None else None,
        )
        self._watcher = watcher.start()
        shard = self.settings.shard
        if shard is not None:
            SHARD.labels(shard=str(shard.index), shards=str(shard.count)).set(1)
        log.info(
            "streaming slot %s%s from %s",
            self.settings.slot,
            "" if shard is None else f" (shard {shard})",
            confirmed,
            extra={
                "action": "start",
                "slot": self.settings.slot,
                "lsn": confirmed,
                **({} if shard is None else {"shard": str(shard)}),
            },
        )
        try:
            self.pipeline.run(self)
        finally:
            watcher.stop()
            if self.dead_letters is not None:
                self.dead_letters.close()

    def stream(self, tables: Sequence[OutboxTable], plugin: str = "pgoutput") -> None:
        """The loop alone, with the database's checks taken as passed: ``tables`` as ``run``
        finds them, no watcher; exactly once starts as in ``run``. For the loop's unit tests,
        which inject in-memory stages (tests/unit/test_stream_loop.py)."""
        self._tables, self._plugin = tuple(tables), plugin
        self._conn = self._acquire()
        if self._conn is None:
            return
        self._start_transactions()
        self.pipeline.run(self)

    # -- the feed (pipeline.Feed) ---------------------------------------------------------

    def pump(self) -> None:
        """Read the open stream and publish its events until stopped."""
        conn = self._require_conn()
        tracker = self.tracker
        handle = self._handle
        decode = self._decode
        serve = self.pipeline.serve
        # Delivery reports, status updates and the watcher's verdict are looked at every
        # _TICK seconds, or at once when the stream pauses: per message they cost more than
        # decoding it (bench/per_stage.py), and a few milliseconds change neither the LSN rule
        # nor the status interval.
        next_tick = 0.0
        while not self._stop:
            message = conn.read(_READ_TIMEOUT)
            if message is None or isinstance(message, Keepalive):
                next_tick = 0.0
                if message is not None:
                    self._received = max(self._received, message.wal_end)
                    tracker.keepalive(message.wal_end)
                    if message.reply_requested:
                        self._send_status(force=True)
            else:
                if message.wal_end > self._received:
                    self._received = message.wal_end
                try:
                    records = decode(message.data)
                except DecodeError as exc:
                    raise RelayError(
                        f"cannot decode {self._plugin} message at "
                        f"{format_lsn(message.wal_start)}: {exc}; this is a bug, please report "
                        "it with the PostgreSQL and plugin versions"
                    ) from None
                for record in records:
                    handle(record)
                if time.monotonic() < next_tick:
                    continue
            serve(0)
            self._send_status()
            if self._watcher is not None and self._watcher.problem is not None:
                raise RelayError(self._watcher.problem)
            next_tick = time.monotonic() + _TICK

    def _handle(self, record: Record) -> None:
        if isinstance(record, Insert):
            if record.relid not in self._mappers or self._begin is None:
                raise RelayError(
                    f"insert into relation {record.relid} arrived before its Relation or Begin "
                    "message; this is a bug, please report it"
                )
            mapper = self._mappers[record.relid]
            if mapper is None:
                self._other_table(record.relid)
                return
            if self._transaction is None or (self._quiet and self._skip()):
                return
            self._send(mapper.event(record, self._begin), self._transaction)
        elif isinstance(record, Begin):
            self._begin = record
            self._transaction = self.tracker.begin(record.commit_time_us)
            if self._eos is not None:
                self._unit_begins(self._eos, Unit(record.final_lsn, TRANSACTION))
        elif isinstance(record, Commit):
            if self._transaction is not None:
                self.tracker.commit(self._transaction, record.end_lsn)
                self.progress.transactions += 1
                if self._transaction is self._cut_transaction:
                    self._cut_transaction = None  # past the cut for good: confirm again
                if self._eos is not None:
                    self._eos.unit_ends()
            self._begin = None
            self._transaction = None
        elif isinstance(record, Relation):
            self._relation(record)
        elif isinstance(record, LogicalMessage):
            self._message(record)

    def _relation(self, record: Relation) -> None:
        """Whether the rows of ``record`` are outbox events, and of which outbox table: a
        table is known by its OID (pgoutput), which follows renames and schema moves, or by
        its name (wal2json, and rows written before the table was dropped and made again).
        The OID decides first: two outbox tables that swapped names stay apart."""
        name = (record.namespace, record.name)
        table = next(
            (t for t in self._tables if self._plugin == "pgoutput" and record.relid == t.oid),
            None,
        ) or next((t for t in self._tables if (t.schema, t.name) == name), None)
        self._relations[record.relid] = record.qualified_name
        self._mappers[record.relid] = (
            None
            if table is None
            else RowMapper.for_relation(
                record, self.settings.layout, self._bytea_types, (table.schema, table.name)
            )
        )
        if table is not None and (table.schema, table.name) != name:
            log.info(
                "rows of the outbox table %s arrive as %s (renamed); following it by identity",
                table.qualified,
                record.qualified_name,
                extra={"action": "table_renamed", "table": record.qualified_name},
            )

    def _other_table(self, relid: int) -> None:
        name = self._relations.get(relid, str(relid))
        if not self.settings.ignore_other_tables:
            raise RelayError(
                f"a row of table {name} arrived: publication {self.settings.publication} "
                f"publishes it beside the outbox {_tables(self._tables)}, and cdc-relay "
                f"relays the outbox only. If it is an outbox too, restart with --table {name} "
                "added (nothing from its first row on was confirmed); if not, remove it (ALTER "
                f"PUBLICATION {self.settings.publication} DROP TABLE {name}) and restart with "
                "--ignore-other-tables to pass its rows already written, or give it its own "
                "publication"
            )
        log.warning(
            "skipped a row of table %s, which is not the outbox table",
            name,
            extra={"action": "other_table", "table": name},
        )

    def _message(self, record: LogicalMessage) -> None:
        """A logical decoding message with our prefix is an event, routed like a row; a shard
        keeps its own (publications do not filter messages). A cut message ends an old
        shard's stream and starts a new one's."""
        if record.prefix != self.settings.message_prefix:
            if record.prefix == CUT_PREFIX:
                self._cut(record)
            return  # another application's message
        if not self.settings.messages.relay:  # no event without --messages (messages.py)
            if not self._waiting:  # before a new shard's cut, the old shards' to act on
                unrelayed(record, self.settings.messages, self.settings.shard)
            return
        shard = self.settings.shard
        if record.transactional:
            if self._transaction is None or self._begin is None:
                raise RelayError("transactional message outside a transaction; please report it")
            event = envelope_event(record, self._begin)
            if shard is not None and not shard.owns(event.aggregate_id):
                return
            if self._quiet and self._skip():
                return
            self._send(event, self._transaction)
        else:
            # Sent at once, even if its transaction rolls back: its own unit in the tracker.
            event = envelope_event(record, None)
            if shard is not None and not shard.owns(event.aggregate_id):
                return
            if self._eos is not None:
                # Its own unit, at its LSN, before a transaction committing there (Unit).
                self._unit_begins(self._eos, Unit(record.lsn, MESSAGE))
            if self._quiet and self._skip():
                if self._eos is not None:
                    self._eos.unit_ends()
                return
            transaction = self.tracker.begin(time.time_ns() // 1000)
            self._send(event, transaction)
            self.tracker.commit(transaction, record.lsn)
            if self._eos is not None:
                self._eos.unit_ends()

    def _skip(self) -> bool:
        """Whether to skip an event: before a resharding cut, or in Kafka already (a replay in
        exactly-once mode)."""
        if self._waiting:
            return True
        return self._eos is not None and self._eos.skip()

    def _unit_begins(self, eos: Committer, unit: Unit) -> None:
        """Exactly once: a unit of the stream starts; the replay may be over."""
        eos.unit_begins(unit)
        if not eos.replaying:
            self._quiet = self._waiting

    def _maybe_commit(self, force: bool = False) -> None:
        """Exactly once: commit when the transaction is old or large enough (or ``force``)."""
        if self._eos is None or not self._eos.due(force):
            return
        if self._shutting_down:
            # No rewind while stopping: a refusal reported by now keeps the transaction from
            # committing, and the stop goes on (the replay after a restart meets it again).
            self.sink.poll(0)
            if self.rewinds.pending:
                return
        else:
            self.pipeline.serve(0)  # a refusal reported by now rewinds instead
        try:
            self._eos.commit()
        except TransactionAborted as exc:
            if self.rewinds.pending:
                raise Rewind from None
            raise ConnectionLost(f"Kafka aborted the transaction ({exc}); replaying") from None

    def _cut(self, record: LogicalMessage) -> None:
        """A resharding cut: a new shard waiting for it starts after it; an old shard stops
        at it, having delivered and confirmed everything before it."""
        cut = Cut.from_content(record.content)
        if cut is None:
            return
        if not record.transactional or self._begin is None:
            log.warning(
                "ignored a resharding cut at %s that is not in a transaction: reshard writes "
                "its cut in one",
                format_lsn(record.lsn),
                extra={"action": "cut_ignored", "lsn": format_lsn(record.lsn)},
            )
            return
        # The cut's place among the transactions is its transaction's commit: one committed
        # between the message and that commit is before the cut. Every transaction before
        # the cut ends at or before the commit record's start, so an old slot confirmed that
        # far has delivered all of them.
        commit = self._begin.final_lsn
        if not genuine_cut(self.settings, cut, record.lsn, self._tables, self._after_cut):
            return
        slot = self.settings.slot
        if self._waiting and self._after_cut is not None and cut.cut == self._after_cut.cut:
            # Nothing after the cut goes out before the old shards have delivered everything
            # before it: an aggregate's events must not overtake its earlier ones.
            self._wait_for_old_shards(cut, commit)
            self._waiting = False
            self._quiet = self._eos is not None and self._eos.replaying
            self._cut_transaction = self._transaction
            log.info(
                "passed resharding cut %s at %s: the old shards delivered what came before "
                "it; relaying from here",
                cut.cut,
                format_lsn(record.lsn),
                extra={"action": "cut_passed", "slot": slot, "lsn": format_lsn(record.lsn)},
            )
        elif not self._waiting and slot in cut.slots:
            # Everything before the cut answered first: a refusal among it rewinds (or stops
            # the relay with its one line) instead of a stop that says all went out.
            self._maybe_commit(force=True)
            self.pipeline.settle()
            log.info(
                "reached resharding cut %s at %s: every event of slot %s before it goes to "
                "Kafka and is confirmed, the new shards relay the rest; stopping (drop this "
                "slot once every old shard has stopped: cdc-relay drop-slot)",
                cut.cut,
                format_lsn(record.lsn),
                slot,
                extra={"action": "cut_reached", "slot": slot, "lsn": format_lsn(record.lsn)},
            )
            self._cut_at = commit
            self._stop = True
            raise Stopping

    def _wait_for_old_shards(self, cut: Cut, lsn: Lsn) -> None:
        """Wait until every slot of ``cut`` is confirmed up to ``lsn``, the start of the cut's
        commit record (its relay stopped at the cut, having delivered everything before it),
        or is gone (dropped: the user's call)."""
        logged = False
        with connect(self.settings.dsn) as conn:
            while True:
                rows = conn.execute(QUERIES["slots_confirmed"], {"slots": list(cut.slots)})
                behind = [
                    row["slot_name"]
                    for row in rows.fetchall()
                    if row["confirmed"] is None or parse_lsn(row["confirmed"]) < lsn
                ]
                if not behind:
                    return
                if not logged:
                    logged = True
                    log.info(
                        "at resharding cut %s: waiting for the relays of %s to deliver what "
                        "came before it (start them if they are not running)",
                        cut.cut,
                        ", ".join(behind),
                        extra={"action": "cut_waiting_for_old", "slot": self.settings.slot},
                    )
                for _ in range(10):
                    self.pipeline.wait_for_kafka()

    def _send(self, event: OutboxEvent, transaction: Transaction) -> None:
        self.tracker.sent(transaction)
        self._unacknowledged.add(event.id)
        suspects = self.rewinds.suspects
        self._publish(event, (transaction, event.id), bool(suspects) and event.id in suspects)
        if self._eos is not None:
            # Counted once produced (a checkpoint taken while it waited must not count it).
            self._eos.produced()
        self.progress.events += 1

    def _commit_before_alone(self) -> None:
        """Exactly once: an event sent alone is alone in its Kafka transaction too."""
        if self._eos is not None:
            self._maybe_commit(force=True)

    def _commit_alone(self) -> None:
        """Exactly once: commit the event sent alone at once. The checkpoint committed with it
        counts it (the event, or its dead letter standing for it): a replay after a crash must
        skip it, not publish it again. _send counts it for good once it returns; aborted, it
        is not counted."""
        if self._eos is None:
            return
        self._eos.produced()
        try:
            self._eos.commit()
        except TransactionAborted:
            pass  # its report came with Kafka's answer
        finally:
            self._eos.produced(-1)

    def _send_status(self, force: bool = False) -> None:
        self.health.beat()
        if self._eos is not None:
            self._maybe_commit()
        if self._acks:
            self._published.inc(self._acks)
            self._acks = 0
        now = time.monotonic()
        if self.progress.events != self._events_seen:
            self._events_seen = self.progress.events
            self._last_event = now
        since = now - self._last_status
        safe = self.tracker.safe_lsn
        if self._cut_at is not None and not self.tracker.in_flight:
            # An old shard at its cut, everything acknowledged: confirming the cut's position
            # tells the new shards so (they wait for it before relaying past the cut).
            safe = max(safe, self._cut_at)
        if self._waiting or self._cut_transaction is not None:
            safe = 0  # nothing before the cut is this shard's to confirm
        elif self._watcher is not None and not self._watcher.shutting_down:
            # Not past a position the table's publication was last seen to cover (watch.py).
            safe = min(safe, self._watcher.verified)
        if (
            force
            or since >= self.settings.status_interval
            or (safe != self._sent_flush and since >= _CONFIRM_AFTER)
        ):
            self._require_conn().send_status(max(self._received, safe), safe)
            self._last_status = now
            self._sent_flush = safe
        if now - self._last_progress >= self.settings.progress_interval:
            self._last_progress = now
            self._log_progress()

    def _log_progress(self) -> None:
        log.info(
            "progress: %d events relayed in %d transactions, %d awaiting Kafka's ack, "
            "slot confirmed up to %s",
            self.progress.events,
            self.progress.transactions,
            self.tracker.in_flight,
            format_lsn(self.tracker.safe_lsn),
            extra={"action": "progress", "lsn": format_lsn(self.tracker.safe_lsn)},
        )

    # -- connections ----------------------------------------------------------------------

    def _check_database(self) -> tuple[tuple[OutboxTable, ...], str, str]:
        """Slot, publication and tables exist as ``stream`` needs them.

        Returns the outbox tables, the slot's confirmed position and the slot's plugin.
        """
        settings = self.settings
        with connect(settings.dsn) as conn:
            check_encoding(conn.execute(QUERIES["server"]).fetchone() or {})
            check_writers(conn, settings.messages)
            slot = conn.execute(QUERIES["slot"], {"slot": settings.slot}).fetchone()
            # The server's timeline: what a missing slot means, and the exactly-once
            # checkpoints' (NULL on a standby).
            timeline = (conn.execute(QUERIES["timeline"]).fetchone() or {}).get("timeline")
            if not slot:
                raise PreflightError(
                    gaps.gone(conn, settings.slot)
                    or failover.slot_gone(settings.slot, timeline)
                    or f"replication slot {settings.slot!r} does not exist; "
                    "run cdc-relay setup-slot first"
                )
            observe_slot(slot)
            self._note_timeline(timeline)
            self._guarded = self._failover_guarded(conn)
            self._slot_confirmed = parse_lsn(str(slot["confirmed_flush_lsn"]))
            if invalidated := failover.slot_invalidated(settings.slot, slot):
                raise PreflightError(invalidated)
            if slot["plugin"] not in PLUGINS:
                raise PreflightError(
                    f"slot {settings.slot} uses {slot['plugin']}; stream decodes "
                    f"{' and '.join(PLUGINS)}: create such a slot with cdc-relay setup-slot"
                )
            tables = _find_tables(conn, settings.tables)
            if settings.shard is not None and slot["plugin"] != "pgoutput":
                raise PreflightError(
                    f"slot {settings.slot} uses {slot['plugin']}; a shard needs a pgoutput slot "
                    "(its publication's row filter sorts the rows out): cdc-relay setup-slot "
                    "--shards"
                )
            for table in tables:
                if slot["plugin"] == "pgoutput":
                    problem = coverage_problem(
                        conn,
                        settings.publication,
                        table,
                        settings.shard,
                        settings.layout.aggregate_id,
                    )
                    if problem:
                        raise PreflightError(problem)
                elif table.partitioned:
                    raise PreflightError(
                        f"{table.qualified} is partitioned, and wal2json names each row by its "
                        "partition; use a pgoutput slot (cdc-relay setup-slot --plugin pgoutput)"
                    )
            if slot["plugin"] == "wal2json":
                problem = besides_problem(conn, settings.publication, tables)
                if problem:
                    raise PreflightError(problem)
            if settings.shard is not None:
                self._start_after_cut(conn, settings.shard, str(slot["confirmed_flush_lsn"]))
            if self.dead_letters is not None:
                self.dead_letters.check(conn)
            gaps.check_stream(conn, settings.slot, slot, settings.publication, tables)
            row = conn.execute(QUERIES["bytea_types"]).fetchone()
            self._bytea_types = frozenset(row["oids"] if row else ()) | {BYTEA_OID}
            return tables, str(slot["confirmed_flush_lsn"]), str(slot["plugin"])

    def _start_transactions(self) -> None:
        """Exactly once: fence older relays of this transactional id, read how far they
        committed from the checkpoint store: the stream skips that. Nothing otherwise."""
        eos, checkpoints = self._eos, self._checkpoints
        if eos is None or checkpoints is None:
            return
        timeout = self.settings.kafka_timeout
        found: list[Checkpoint] = []
        failed: list[BaseException] = []

        def start() -> None:
            try:
                checkpoints.prepare(timeout)
                eos.sink.initialise()
                found.append(checkpoints.read(timeout))
            except BaseException as exc:  # noqa: BLE001 - raised below, in the relay's thread
                failed.append(exc)

        # Kafka may take seconds (the coordinator finishing the fenced relay's transaction);
        # meanwhile the walsender hears from us, confirming nothing.
        worker = threading.Thread(target=start, name="exactly-once-start", daemon=True)
        worker.start()
        while worker.is_alive():
            worker.join(0.2)
            self.health.beat()
            self._require_conn().send_status(self._received, 0)
        if failed:
            raise failed[0]
        self._trust(eos, found[0], self._slot_confirmed)
        self._quiet = True
        committed = eos.committed
        log.info(
            "exactly once: transactional id %s; Kafka holds the stream up to %s",
            eos.eos.transactional_id,
            committed.describe(),
            extra={"action": "checkpoint", "lsn": format_lsn(committed.position.lsn)},
        )

    def _trust(self, eos: Committer, checkpoint: Checkpoint, confirmed: Lsn) -> None:
        """Hold ``checkpoint`` as what Kafka has, as far as the server's timeline allows
        (Checkpoint.trusted_on): the replay skips that."""
        if not eos.trust(checkpoint, confirmed):
            log.warning(
                "exactly once: the checkpoint of %s was written on timeline %d and the server "
                "is on timeline %d (promoted since): past the slot's position %s it may name "
                "WAL the old primary had and this one never did, so nothing past it is skipped; "
                "events Kafka already had from there are published again",
                eos.eos.transactional_id,
                checkpoint.timeline,
                eos.timeline,
                format_lsn(confirmed),
                extra={"action": "checkpoint_other_timeline"},
            )

    def _follow_timeline(self) -> None:
        """Reconnecting: the server may be another one, promoted since (a multi-host DSN, an
        address moved to the standby). On another timeline, the WAL past the slot's position
        there may be the new primary's own, which this relay never read: unless the old
        primary held WAL back for the standby (``_guarded``), the stream starts again from the
        slot's position, not from this relay's (duplicates, never a loss), and
        with exactly once the new timeline goes into the checkpoints and the checkpoint held
        is trusted on it as at start."""
        timeline, confirmed = self._read_timeline(self.settings.dsn, self.settings.slot)
        if not timeline or timeline == self._timeline or confirmed is None:
            return  # the same server's history (a missing slot: the stream itself says so)
        log.info(
            "the server is on timeline %d now (was %d): streaming again from the slot's "
            "position there, %s",
            timeline,
            self._timeline,
            format_lsn(confirmed),
            extra={"action": "timeline", "timeline": timeline, "lsn": format_lsn(confirmed)},
        )
        self._timeline = timeline
        if self._guarded:  # the history this relay was sent is the new primary's too
            self._trust_again(confirmed)
            return
        self.tracker.rebase(confirmed)
        after = self._after_cut
        if after is not None and not self._waiting and (after.lsn is None or confirmed < after.lsn):
            # A new shard whose slot there is before its cut: what precedes the cut is the
            # old shards' again (as on a restart, _start_after_cut).
            self._waiting = self._quiet = True
            self._cut_transaction = None
        self._trust_again(confirmed)

    def _trust_again(self, confirmed: Lsn) -> None:
        """Exactly once, on a new timeline: its checkpoints carry it, and the checkpoint held
        is trusted on it as at start."""
        eos = self._eos
        if eos is not None:
            eos.timeline = self._timeline
            self._trust(eos, eos.committed, confirmed)

    def _failover_guarded(self, conn: psycopg.Connection[dict[str, Any]]) -> bool:
        """Whether a promoted standby has all this relay is sent (a failover slot, and the
        server's synchronized_standby_slots set); a failover slot without it is said."""
        row = conn.execute(QUERIES["failover_guarded"], {"slot": self.settings.slot}).fetchone()
        if not row or not row["failover"]:
            return False
        if not row["synchronized"]:
            log.warning(
                "slot %s fails over, but synchronized_standby_slots is empty: this relay may be "
                "sent changes no standby has yet, and after a promotion it streams again from "
                "the slot's copy, which may lag (duplicates); cdc-relay setup-slot --failover "
                "says what to set",
                self.settings.slot,
                extra={"action": "failover_unguarded", "slot": self.settings.slot},
            )
        return bool(row["synchronized"])

    def _note_timeline(self, timeline: object) -> None:
        """The server's timeline as read (NULL on a standby: 0, not known), for the relay and
        exactly once's checkpoints alike."""
        self._timeline = int(str(timeline)) if timeline else 0
        if self._eos is not None:
            self._eos.timeline = self._timeline

    def _held(self) -> None:
        """The slot is this relay's now: what was decided from its position before it was
        held (a standby waited meanwhile) is decided again from where it is."""
        with connect(self.settings.dsn) as conn:
            # The server may be another one by now, promoted while this relay stood by.
            self._note_timeline(
                (conn.execute(QUERIES["timeline"]).fetchone() or {}).get("timeline")
            )
            slot = conn.execute(QUERIES["slot"], {"slot": self.settings.slot}).fetchone()
            if not slot:
                return  # dropped meanwhile: the stream says so
            confirmed = str(slot["confirmed_flush_lsn"])
            self._slot_confirmed = parse_lsn(confirmed)
            if self.settings.shard is not None:
                self._start_after_cut(conn, self.settings.shard, confirmed)

    def _start_after_cut(
        self, conn: psycopg.Connection[dict[str, Any]], shard: Shard, confirmed: str
    ) -> None:
        """A new shard whose slot has not passed its resharding cut waits for it."""
        row = conn.execute(
            QUERIES["publication_comment"], {"publication": self.settings.publication}
        ).fetchone()
        after = StartAfterCut.from_comment((row or {}).get("comment"), shard)
        if after is None:
            return
        waited = self._waiting
        self._after_cut = after
        self._waiting = after.lsn is None or parse_lsn(confirmed) < after.lsn
        self._quiet = self._waiting  # exactly once sets it again when it starts
        if self._waiting and not waited:
            log.info(
                "shard %s starts after resharding cut %s: skipping what comes before it, which "
                "the old shards deliver",
                shard,
                after.cut,
                extra={"action": "cut_waiting", "slot": self.settings.slot},
            )

    def _open(self) -> Source:
        """Connect and start streaming; decoder state starts afresh with each connection."""
        if self._plugin == "wal2json":
            self._decode = Wal2JsonDecoder(self._bytea_types).decode
            options = {
                **wal2json.START_OPTIONS,
                "add-tables": ",".join(
                    wal2json.table_filter(table.schema, table.name) for table in self._tables
                ),
                "add-msg-prefixes": self.settings.message_prefix,
            }
        else:
            self._decode = _pgoutput
            options = {
                "proto_version": "1",
                "publication_names": pgoutput.publication_names(self.settings.publication),
                "messages": "true",
            }
        conn = self._open_source(self.settings.dsn)
        try:
            conn.start(self.settings.slot, self.tracker.safe_lsn, options)
        except BaseException:
            conn.close()
            raise
        self._last_status = 0.0
        return conn

    def _acquire(self) -> Source | None:
        """Open the stream. As a standby, wait while another relay holds the slot: PostgreSQL
        frees it as soon as that relay's connection ends, and this one takes over."""
        while not self._stop:
            try:
                conn = self._open()
            except SlotInUseError as exc:
                if not self.settings.standby:
                    raise
                if not self._standing_by:
                    self._standing_by = True
                    log.info(
                        "standing by: %s",
                        exc,
                        extra={"action": "standby", "slot": self.settings.slot},
                    )
            except ConnectionLost as exc:
                # Standing by through a failover: the server away for a moment is no reason
                # to give up (a refusal of its own counts toward the stop, as on reconnects).
                if not (self.settings.standby and self._standing_by):
                    raise
                self._count_loss(exc)
                log.warning(
                    "standing by: %s; trying again",
                    exc,
                    extra={"action": "standby_unreachable", "slot": self.settings.slot},
                )
            else:
                self._standing_by = False
                return conn
            deadline = time.monotonic() + _STANDBY_RETRY
            while not self._stop and time.monotonic() < deadline:
                self.health.beat()
                self.sink.poll(0.1)  # keeps broker statistics, hence readiness, current
        return None

    def recover(self, exc: ConnectionLost) -> None:
        """After a lost connection: settle what is in flight, forget the rest, reconnect. The
        same error again with no progress between backs off, and stops the relay after
        _SAME_ERROR_LIMIT attempts when the server itself ended the stream with it."""
        log.warning(str(exc), extra={"action": "disconnected"})
        self._close_conn()
        self.sink.poll(0)  # reports already here count: fewer events to replay
        self.rewinds.note()
        self._count_loss(exc)
        self._restart_decoding()
        # What the producer holds is dropped, not drained: the slot may be another relay's by
        # now (a standby took it while this one was cut off), and a queue delivered whenever
        # Kafka comes back would land after that relay's newer events of the same aggregates
        # (e1, e2, e1). The replay sends it again while this relay holds the slot. Exactly
        # once: the open transaction is aborted.
        self.sink.renew()
        if self._losses > 1:
            self._pause(min(0.5 * 2 ** (self._losses - 2), _RECONNECT_MAX))
        self._reconnect()

    def _count_loss(self, exc: ConnectionLost) -> None:
        """Count ``exc`` toward the stop: the same error again within _SAME_ERROR_WITHIN
        seconds, with no progress between; the relay stops after _SAME_ERROR_LIMIT of them
        when the server itself answered with the error (a connection that fails is waited
        out: a restart, a failover)."""
        now = time.monotonic()
        again = (str(exc), self.tracker.safe_lsn) == self._last_loss[:2] and (
            now - self._last_loss[2] < _SAME_ERROR_WITHIN
        )
        self._losses = self._losses + 1 if again else 1
        self._last_loss = (str(exc), self.tracker.safe_lsn, now)
        if exc.server_error and self._losses >= _SAME_ERROR_LIMIT:
            raise RelayError(
                f"the server ended the stream {self._losses} times in a row at "
                f"{format_lsn(self.tracker.safe_lsn)} with the same error, so retrying does not "
                f"help: {exc}; fix its cause and restart the relay: it resumes after the last "
                "event Kafka acknowledged"
            )

    def rewind(self) -> None:
        """Kafka refused events: drop what the producer holds (the gapless guarantee let
        nothing after a refused batch through) and replay from the confirmed position,
        sending each suspect alone (cdc_relay.kafka.refusals)."""
        rewinds = self.rewinds
        refusals = rewinds.pending
        retry = rewinds.note() or rewinds.pause_next
        rewinds.pause_next = False
        token, err = refusals[0]
        log.warning(
            "Kafka refused %d event%s (the first, %s: %s); replaying from %s and sending each "
            "of them alone to find the one it refuses",
            len(refusals),
            "" if len(refusals) == 1 else "s",
            token[1],
            err.str(),
            format_lsn(self.tracker.safe_lsn),
            extra={"action": "rewind", "event_id": token[1], "error": err.str()},
        )
        self._close_conn()
        self._restart_decoding()
        self.sink.renew()  # the purged messages' reports come for forgotten transactions
        if retry:
            rewinds.rewinds += 1
            self._pause(min(0.5 * 2**rewinds.rewinds, _RECONNECT_MAX))
        self._reconnect()

    def _restart_decoding(self) -> None:
        """Forget open and unacknowledged transactions: the stream starts again from the
        confirmed position, decoded from scratch (invariant 7)."""
        self.tracker.reset()
        self._mappers.clear()
        self._begin = None
        self._transaction = None
        if self._eos is not None:  # what the committed transactions hold is skipped
            self._eos.restart()
            self._quiet = True
        if self._cut_transaction is not None:  # the replay starts before the cut again
            self._cut_transaction = None
            self._waiting = self._quiet = True

    def _pause(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while not self._stop and time.monotonic() < deadline:
            self.health.beat()
            time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))

    def _reconnect(self) -> None:
        delay = 0.5
        while not self._stop:
            try:
                self._follow_timeline()  # before opening: where the stream starts depends on it
                self._conn = self._open()
            except PreflightError:
                raise  # the slot is gone or unusable: retrying would not bring it back
            except (ConnectionLost, RelayError, psycopg.OperationalError) as exc:
                self._close_conn()
                if isinstance(exc, ConnectionLost):
                    self._count_loss(exc)  # START_REPLICATION refused the same way each time
                log.warning(
                    "reconnect failed, retrying in %.1fs: %s",
                    delay,
                    exc,
                    extra={"action": "reconnect_failed"},
                )
                self._pause(delay)
                delay = min(delay * 2, _RECONNECT_MAX) * random.uniform(0.8, 1.2)  # noqa: S311
            else:
                log.info(
                    "reconnected",
                    extra={"action": "reconnected", "lsn": format_lsn(self.tracker.safe_lsn)},
                )
                return

    def _drain(self, timeout: float, confirm: bool) -> None:
        """Wait (bounded) for the acks of what the producer holds, confirming as they come."""
        deadline = time.monotonic() + timeout
        while self.sink.in_flight() and time.monotonic() < deadline:
            self.sink.settle(min(0.2, max(0.0, deadline - time.monotonic())))
            if confirm and self._conn is not None:
                self._send_status()

    def shutdown(self) -> None:
        self._shutting_down = True
        try:
            if self.rewinds.pending or self.sink.broken:
                # Kafka refused events: what the producer holds is not delivered (a later
                # event of a refused one's key must not overtake it) and is replayed later.
                self.sink.renew()
            if self._conn is not None:
                self._drain(self.settings.shutdown_timeout, confirm=True)
                if self._eos is not None and not self.rewinds.pending and not self.sink.in_flight():
                    with contextlib.suppress(TransactionAborted):
                        self._eos.commit()  # what was produced goes in, confirmed below
                if self._watcher is not None:
                    self._watcher.check_now()  # the last confirmation covers all delivered
                self._send_status(force=True)
        except ConnectionLost as exc:
            log.warning("could not confirm the final position: %s", exc)
        finally:
            self._close_conn()
            self.sink.close()
            self._log_progress()
            # Not what the producer still holds: a refused event is no longer there.
            left = len(self._unacknowledged)
            log.info(
                "stopped; %d event%s not acknowledged will be sent again on restart",
                left,
                "" if left == 1 else "s",
                extra={"action": "stop", "lsn": format_lsn(self.tracker.safe_lsn)},
            )

    def _close_conn(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _require_conn(self) -> Source:
        if self._conn is None:
            raise ConnectionLost("not connected")
        return self._conn
