"""The CDC relay: the pipeline (pipeline.py) configured for a replication slot, wired here.

The slot's stream is the feed: read, decoded (pgoutput or wal2json), each outbox row and
message published through the pipeline (records.py); the LSN tracker is the checkpointer, fed
by the delivery reports; the refusal policy rewinds (rewinds.Rewinds: replay from the
confirmed position, each suspect alone). A shard is the same feed on its own slot and
publication (shards.py), which starts or stops at a resharding cut (cut.py); exactly once is
the transactional sink with the Kafka checkpoint (kafka_transactions.py);
``--dead-letter-topic`` wraps the policy (deadletter.DeadLetterRefusals).

``StreamRelay`` runs the stream's life and wires its parts: the checks at start
(preflight.py), taking the slot (standby.py) and holding the connection to it
(slot_connection.py), the read loop and its tick, whose status updates confirm what Kafka
acknowledged (status.py), recovering from a lost connection (counted toward a stop: losses.py;
on the server's timeline: timeline.py) or a rewind, and the graceful stop.

Single-threaded on purpose: delivery reports are served by ``poll`` on this thread, so the
tracker needs no locks, and the order of events is the order of the stream.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence
from typing import Any

import psycopg

from cdc_relay.errors import RelayError
from cdc_relay.kafka.checkpoints import KafkaCheckpoints
from cdc_relay.kafka.deadletter import DeadLetterRefusals, DeadLetters, DeadLetterStore
from cdc_relay.kafka.exactly_once import Committer, fitted
from cdc_relay.kafka.refusals import RefusalPolicy
from cdc_relay.kafka.routing import Router
from cdc_relay.kafka.sink import Acked, Refused, kafka_sink
from cdc_relay.kafka.transactional import TransactionAborted
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
    STANDBY,
    Health,
)
from cdc_relay.postgres.connection import timeline_of
from cdc_relay.postgres.replication import ConnectionLost, ReplicationConnection, XLogData
from cdc_relay.postgres.shards import Shard
from cdc_relay.postgres.tables import OutboxTable
from cdc_relay.postgres.watch import Watcher
from cdc_relay.relay import stages
from cdc_relay.relay.backoff import RECONNECT_MAX, reconnect_delay
from cdc_relay.relay.cut import ShardCut
from cdc_relay.relay.kafka_transactions import KafkaTransactions, transactional_sink
from cdc_relay.relay.linger import HOLD, Pace, send_if_quiet
from cdc_relay.relay.losses import Losses
from cdc_relay.relay.lsn_tracker import Acknowledgements, LsnTracker
from cdc_relay.relay.pipeline import Pipeline
from cdc_relay.relay.preflight import check_database
from cdc_relay.relay.reading import Reading
from cdc_relay.relay.records import Progress, Records
from cdc_relay.relay.rewinds import Rewinds
from cdc_relay.relay.slot_connection import SlotConnection
from cdc_relay.relay.stages import (
    CheckpointStore,
    OpenDeadLetters,
    OpenSink,
    OpenSource,
    OpenTransactions,
    ReadTimeline,
    Sink,
)
from cdc_relay.relay.standby import Standby
from cdc_relay.relay.status import Status
from cdc_relay.relay.stream_settings import StreamSettings
from cdc_relay.relay.timeline import Timeline

log = logging.getLogger(__name__)

_READ_TIMEOUT = 0.1  # seconds without data before serving delivery reports and timers
_TICK = 0.005  # seconds between looks at delivery reports and timers while data flows


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
        # Exactly once: its sink, what it adds to the loop (exactly_once.Committer, and
        # kafka_transactions.KafkaTransactions with where the committed checkpoint is read
        # from at start).
        self._transactions: KafkaTransactions | None = None
        eos = settings.exactly_once
        if eos is not None:
            eos = fitted(eos, settings.kafka_config)
        made: list[stages.TransactionalSink] = []  # the Protocol: Kafka's, or one injected

        def open_kafka(acked: Acked, refused: Refused) -> Sink:
            if eos is None:
                opener = open_sink or kafka_sink(
                    settings.kafka_config, creation=settings.topic_creation
                )
                return opener(acked, refused)
            made.append(transactional_sink(settings, eos, open_transactions, acked, refused))
            return made[0]

        self._acks = Acknowledgements(self.tracker, LATENCY.observe, time.time)
        self.pipeline = Pipeline(
            router,
            open_kafka,
            self._acks,
            policy,
            tick=self._send_status,
            give_up=lambda: self.stopped,
            before_alone=self._commit_now,
            after_alone=self._commit_alone,
        )
        self.sink: Sink = self.pipeline.sink
        committer: Committer | None = None
        if eos is not None:
            committer = Committer(eos, made[0])
            self._transactions = KafkaTransactions(
                committer,
                checkpoints
                or KafkaCheckpoints(
                    settings.kafka_config,
                    eos.checkpoint_topic,
                    eos.transactional_id,
                    settings.topic_creation,
                ),
                self.pipeline,
                self.rewinds,
                self.health,
            )
        self.progress = Progress()
        self._published = EVENTS_PUBLISHED.labels(relay="stream")
        self._watcher: Watcher | None = None
        self._shutting_down = False  # in the graceful stop: a refusal no longer rewinds
        self._caught_up = False  # at the loop's last tick: the relay had read all that came
        self._slot_confirmed: Lsn = 0  # the slot's position at start
        # Its parts: where a shard stands to its resharding cut, what the records mean, the
        # server's timeline, the losses counted toward a stop, taking the slot and holding
        # the connection to it, the status updates sent on it.
        self._cut = ShardCut(
            settings, self.pipeline, commit=self._commit_now, stop=self.request_stop
        )
        self._records = Records(
            settings,
            self.tracker,
            self._cut,
            committer,
            self.rewinds,
            self.pipeline.publish,
            self.progress,
            self._acks.unacknowledged,
        )
        self._reading = Reading(self._records, time.monotonic)  # the loop's clock
        self._timeline = Timeline(settings, read_timeline, committer)
        self._losses = Losses(self.tracker)
        self._standby = Standby(
            settings, self.health, self.sink, self._losses, lambda: self.stopped
        )
        self._connection = SlotConnection(
            settings,
            open_source,
            self._records,
            self.tracker,
            standby=self._standby,
            losses=self._losses,
            health=self.health,
            stopped=lambda: self.stopped,
            follow_timeline=self._follow_timeline,
        )
        self._status = Status(settings, self.tracker, self._cut, self.progress, self._connection)

    @property
    def stopped(self) -> bool:
        return self._reading.stopping

    def _register_metrics(self) -> None:
        """Gauges read on scrape, from the relay's own state."""
        IN_FLIGHT.set_function(lambda: self.tracker.in_flight)
        EVENTS_PENDING.set_function(lambda: self.tracker.in_flight)
        CONFIRMED_LSN.set_function(lambda: max(self._status.sent_flush, 0))
        SINCE_LAST_EVENT.set_function(lambda: time.monotonic() - self._status.last_event)
        standby = self._standby
        CONNECTED.labels(service="postgres").set_function(
            lambda: self._connection.conn is not None or (standby.standing_by and standby.answered)
        )
        CONNECTED.labels(service="kafka").set_function(lambda: self.sink.connected)
        STANDBY.set_function(lambda: standby.standing_by)
        self.health.readiness = self._readiness
        # Moving: events in flight, and how many Kafka acknowledged (counted at each tick).
        self.health.progress = lambda: (self.tracker.in_flight, self.progress.acknowledged)

    def _readiness(self) -> tuple[bool, str]:
        if self._standby.standing_by:
            # Ready to take over: a rolling update may go on while this one waits; not while
            # PostgreSQL does not answer (it could not take over) or Kafka is away.
            if not self._standby.answered:
                return False, "standing by, PostgreSQL does not answer"
            if not self.sink.connected:
                return False, "standing by, not connected to Kafka"
            return True, f"standing by for slot {self.settings.slot}"
        if self._connection.conn is None:
            return False, "not connected to PostgreSQL"
        if not self.sink.connected:
            return False, "not connected to Kafka"
        return True, "ok"

    def request_stop(self) -> None:
        """Stop reading, wait (bounded) for acks, confirm, return from ``run``. Signal-safe."""
        self._reading.stopping = True

    def run(self) -> None:
        """Stream until ``request_stop``; raise RelayError on a failure the user must fix."""
        self._register_metrics()
        records = self._records
        records.tables, confirmed, records.plugin = self._check_database()
        self.sink.check_reachable(self.settings.kafka_timeout)
        if not self._take_slot():
            return  # stopped while waiting as a standby
        # Only with the slot in hand: a standby must not fence the relay it stands by for.
        self._start_transactions()
        publication = self.settings.publication if records.plugin == "pgoutput" else None
        watcher = Watcher(
            self.settings.dsn,
            self.settings.slot,
            records.tables,
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
        self._records.tables, self._records.plugin = tuple(tables), plugin
        if not self._connection.acquire():
            return
        self._start_transactions()
        self.pipeline.run(self)

    # -- the feed (pipeline.Feed) ---------------------------------------------------------

    def pump(self) -> None:
        """Read the open stream and publish its events until stopped."""
        conn = self._connection.require()
        tracker = self.tracker
        reading = self._reading
        flow = reading.flow
        serve = self.pipeline.serve
        # Delivery reports, status updates and the watcher's verdict are looked at every
        # _TICK seconds, or at once when the stream pauses: per message they cost more than
        # decoding it (bench/per_stage.py), and a few milliseconds change neither the LSN rule
        # nor the status interval. Without exactly once, the first tick linger.HOLD after the
        # first message since its last look (``due``), once read to its end, sends what the
        # producer holds if the stream is quiet (linger.py).
        next_tick = 0.0
        transactions = self._transactions
        lingers = transactions is None  # exactly once's commits send what it holds
        due = 0.0
        progress = self.progress
        pace = Pace(progress.events, time.monotonic())  # the stream's rate, at linger's looks
        timeout = _READ_TIMEOUT
        while not reading.stopping:
            if transactions is not None:  # exactly once: as long as a transaction may wait
                timeout = transactions.read_timeout(_READ_TIMEOUT)
            elif due:
                timeout = max(0.0, due - time.monotonic())
            else:
                timeout = _READ_TIMEOUT
            message = conn.read(timeout)
            if isinstance(message, XLogData):
                if lingers and not due:
                    due = time.monotonic() + HOLD
                # it and those after it the connection holds already, until the tick
                message = flow(conn, message, next_tick)
                if message is None and time.monotonic() < next_tick:
                    continue
            if message is not None:  # a keepalive
                reading.received = max(reading.received, message.wal_end)
                tracker.keepalive(message.wal_end)
                if message.reply_requested:
                    self._send_status(force=True)
            if due and conn.caught_up and (now := time.monotonic()) >= due:
                send_if_quiet(self.sink, pace, progress.events, now)
                due = 0.0
            serve(0)
            self._caught_up = conn.caught_up
            self._send_status()
            if self._watcher is not None and self._watcher.problem is not None:
                raise RelayError(self._watcher.problem)
            next_tick = time.monotonic() + _TICK

    def _maybe_commit(self) -> None:
        """Exactly once: commit when the transaction is old or large enough, or old enough
        and the relay has read all the server sent (kafka_transactions.py)."""
        if self._transactions is not None:
            self._transactions.commit(stopping=self._shutting_down, idle=self._caught_up)

    def _commit_now(self) -> None:
        """Exactly once: commit what was produced now: an event sent alone is alone in its
        Kafka transaction too, and an old shard at its cut has everything before it answered
        for first (cut.py). Nothing otherwise."""
        if self._transactions is not None:
            self._transactions.commit(force=True, stopping=self._shutting_down)

    def _commit_alone(self) -> None:
        """Exactly once: commit the event sent alone at once (kafka_transactions.py)."""
        if self._transactions is not None:
            self._transactions.commit_alone()

    def _send_status(self, force: bool = False) -> None:
        """The loop's tick: exactly once commits when due, the published counter catches up,
        and a status update goes out when one is due (status.py)."""
        self.health.beat()
        self._maybe_commit()
        acks = self._acks.take()
        if acks:
            self._published.inc(acks)
            self.progress.acknowledged += acks
        self._status.update(self._reading.received, self._watcher, force)

    # -- the start ------------------------------------------------------------------------

    def _check_database(self) -> tuple[tuple[OutboxTable, ...], str, str]:
        """Slot, publication and tables exist as ``stream`` needs them (preflight.py).

        Returns the outbox tables, the slot's confirmed position and the slot's plugin.
        """
        checked = check_database(
            self.settings, self._timeline, self._start_after_cut, self.dead_letters
        )
        self._slot_confirmed = parse_lsn(checked.confirmed)
        self._records.bytea_types = checked.bytea_types
        return checked.tables, checked.confirmed, checked.plugin

    def _start_after_cut(
        self, conn: psycopg.Connection[dict[str, Any]], shard: Shard, confirmed: str
    ) -> None:
        """A new shard whose slot has not passed its resharding cut waits for it (cut.py)."""
        if self._cut.start_after(conn, shard, confirmed):
            self._records.quiet = self._cut.waiting  # exactly once sets it again when it starts

    def _take_slot(self) -> bool:
        """Open the stream (standing by while another relay holds the slot); then, with the
        slot in hand, decide again what was decided from its position before it was held:
        a standby's relay may have moved the slot on (past a resharding cut, past the
        checkpoint's units) while this one waited (standby.py). Reading the slot fails when
        the server is lost meanwhile (a promotion): read again, backing off, the failures
        counted toward the stop as lost connections are (losses.py), and the stream kept (a
        read on it finds it lost, and the relay reconnects). False when stopped first."""
        if not self._connection.acquire():
            return False
        while True:
            try:
                confirmed = self._standby.held(self._timeline, self._start_after_cut)
            except psycopg.OperationalError as exc:
                lost = ConnectionLost(
                    f"reading slot {self.settings.slot} just taken failed: {exc}",
                    # an ERROR of the server's own (a statement timeout), not a lost server
                    server_error=not (exc.sqlstate or "08").startswith(("08", "57P")),
                )
                log.warning("%s; reading it again", lost, extra={"action": "disconnected"})
                self._losses.count(lost)
                self._connection.pause(reconnect_delay(self._losses.in_a_row))
                if self.stopped:
                    self._connection.close()
                    return False
                continue
            if confirmed is not None:
                self._slot_confirmed = confirmed
            return True

    def _start_transactions(self) -> None:
        """Exactly once: fence older relays of this transactional id, read how far they
        committed from the checkpoint store: the stream skips that. Nothing otherwise."""
        if self._transactions is None:
            return
        self._transactions.start(
            self.settings.kafka_timeout, self._slot_confirmed, self._keep_alive
        )
        self._records.quiet = True

    # -- recovering (pipeline.Feed) -------------------------------------------------------

    def _follow_timeline(self) -> None:
        """Reconnecting: the server may be another one, promoted since (a multi-host DSN, an
        address moved to the standby). On another timeline, the WAL past the slot's position
        there may be the new primary's own, which this relay never read: unless the old
        primary held WAL back for the standby (timeline.Timeline.guarded), the stream starts
        again from the slot's position, not from this relay's (duplicates, never a loss), and
        with exactly once the new timeline goes into the checkpoints and the checkpoint held
        is trusted on it as at start."""
        confirmed = self._timeline.moved()
        if confirmed is None:
            return  # the same server's history (a missing slot: the stream itself says so)
        # Guarded, the history this relay was sent is the new primary's too: nothing to rebase.
        if not self._timeline.guarded:
            self.tracker.rebase(confirmed)
            # A new shard whose slot there is before its cut: what precedes the cut is the
            # old shards' again (as on a restart, _start_after_cut).
            if self._cut.rebase(confirmed):
                self._records.quiet = True
        if self._transactions is not None:
            self._transactions.trust_again(confirmed)

    def recover(self, exc: ConnectionLost) -> None:
        """After a lost connection: settle what is in flight, forget the rest, reconnect. The
        same error again with no progress between backs off, and stops the relay after
        losses.py's limit of attempts when the server itself ended the stream with it."""
        log.warning(str(exc), extra={"action": "disconnected"})
        self._connection.close()
        self.sink.poll(0)  # reports already here count: fewer events to replay
        self.rewinds.note()
        self._losses.count(exc)
        self._restart_decoding()
        # What the producer holds is dropped, not drained: the slot may be another relay's by
        # now (a standby took it while this one was cut off), and a queue delivered whenever
        # Kafka comes back would land after that relay's newer events of the same aggregates
        # (e1, e2, e1). The replay sends it again while this relay holds the slot. Exactly
        # once: the open transaction is aborted.
        self.sink.renew()
        losses = self._losses.in_a_row
        if losses > 1:
            self._connection.pause(min(0.5 * 2 ** (losses - 2), RECONNECT_MAX))
        self._reconnect()

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
        self._connection.close()
        self._restart_decoding()
        self.sink.renew()  # the purged messages' reports come for forgotten transactions
        if retry:
            rewinds.rewinds += 1
            self._connection.pause(min(0.5 * 2**rewinds.rewinds, RECONNECT_MAX))
        self._reconnect()

    def _reconnect(self) -> None:
        """Take the slot again; exactly once, a producer the sink made anew meanwhile starts
        only now, with the checkpoint read again (KafkaTransactions.resume)."""
        self._connection.reconnect()
        if self._transactions is not None and self._connection.conn is not None:
            self._transactions.resume(self.settings.kafka_timeout, self._keep_alive)

    def _keep_alive(self) -> None:
        """The walsender hears from the relay while exactly once starts, confirming nothing;
        a connection lost meanwhile is the next read's to find."""
        with contextlib.suppress(ConnectionLost):
            self._connection.require().send_status(self._reading.received, 0)

    def _restart_decoding(self) -> None:
        """Forget open and unacknowledged transactions: the stream starts again from the
        confirmed position, decoded from scratch (invariant 7)."""
        self.tracker.reset()
        self._records.restart()

    # -- the stop -------------------------------------------------------------------------

    def _drain(self, timeout: float, confirm: bool) -> None:
        """Wait (bounded) for the acks of what the producer holds, confirming as they come."""
        deadline = time.monotonic() + timeout
        while self.sink.in_flight() and time.monotonic() < deadline:
            self.sink.settle(min(0.2, max(0.0, deadline - time.monotonic())))
            if confirm and self._connection.conn is not None:
                self._send_status()

    def shutdown(self) -> None:
        self._shutting_down = True
        try:
            if self.rewinds.pending or self.sink.broken:
                # Kafka refused events: what the producer holds is not delivered (a later
                # event of a refused one's key must not overtake it) and is replayed later.
                self.sink.renew()
            if self._connection.conn is not None:
                self._drain(self.settings.shutdown_timeout, confirm=True)
                transactions = self._transactions
                if (
                    transactions is not None
                    and not self.rewinds.pending
                    and not self.sink.in_flight()
                ):
                    with contextlib.suppress(TransactionAborted):
                        transactions.eos.commit()  # what was produced goes in, confirmed below
                if self._watcher is not None:
                    self._watcher.check_now()  # the last confirmation covers all delivered
                self._send_status(force=True)
        except ConnectionLost as exc:
            log.warning("could not confirm the final position: %s", exc)
        finally:
            self._connection.close()
            self.sink.close()
            self._status.log_progress()
            # Not what the producer still holds: a refused event is no longer there.
            left = len(self._acks.unacknowledged)
            log.info(
                "stopped; %d event%s not acknowledged will be sent again on restart",
                left,
                "" if left == 1 else "s",
                extra={"action": "stop", "lsn": format_lsn(self.tracker.safe_lsn)},
            )
