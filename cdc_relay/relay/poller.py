"""The polling relay: claim outbox rows, publish them through the same router and sink as
``stream``, mark them processed.

One cycle is one transaction: lock the aggregates of the next rows (transaction-level
advisory locks, skipping those another poller holds), claim those aggregates' rows, produce
them in ``seq`` order, wait for Kafka's delivery reports, mark the delivered rows processed in
one statement and the refused ones for a later try, commit. One transaction at a time holds an
aggregate, so any number of workers and processes keep each aggregate's order. Each worker is
a thread with its own connection and its own producer (librdkafka does its work outside the
GIL) and looks first at its share of the aggregates. A listener thread turns NOTIFY into
wake-ups.

Every command resolves ``--table`` once (store.resolve) and names the table by its schema and
name from then on. Every poller connection holds the table's advisory lock, shared, before
it claims; the handover to ``stream`` holds it exclusively, so the two never run together.

Each worker is the pipeline (pipeline.py) configured for claims: the worker is the feed
(claim, publish each row, mark, commit; what a database error does), its claimed batch the
checkpointer and the refusal policy (batch.py: a refused row is marked for a later try and
its aggregate held back, where ``stream`` rewinds).

The stages are injected (cdc_relay.relay.stages), the real ones by default: the outbox store
(store.py: every query on the table, a worker's claims and marks) and the sink (sink.py).
``poll`` runs the workers on them alone, for the loop's unit tests
(tests/unit/test_poll_loop.py). Beside it: deadletter.py lists and retries the rows given up
on, handover.py hands over to ``stream``, prune.py prunes.
"""

from __future__ import annotations

import contextlib
import logging
import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import psycopg
from psycopg.conninfo import make_conninfo

from cdc_relay.kafka.sink import kafka_sink
from cdc_relay.metrics import (
    BATCH_DURATION,
    CONNECTED,
    DEAD_LETTERS,
    EVENTS_PENDING,
    EVENTS_PUBLISHED,
    OUT_OF_SEQ_ORDER,
    Health,
    count_failed,
)
from cdc_relay.postgres.connection import connect
from cdc_relay.postgres.replication import ConnectionLost
from cdc_relay.postgres.store import (
    READ_ONLY,
    REFUSED,
    Outbox,
    OutboxRow,
    PgStore,
    check_columns,
    check_fence,
    check_lock_room,
    first_line,
    kind,
    refusal,
    resolve,
    take_poll_lock,
)
from cdc_relay.queries import QUERIES
from cdc_relay.relay.batch import open_batch, poll_router
from cdc_relay.relay.pipeline import WAIT
from cdc_relay.relay.settings import RelaySettings
from cdc_relay.relay.stages import Claims, OpenSink, OpenStore, OutboxStore

log = logging.getLogger(__name__)

APPLICATION_NAME = "cdc-relay poll"
"""The ``application_name`` of the poller's sessions, to tell them apart in pg_stat_activity."""

_RECONNECT_BASE = 0.5  # seconds before reconnecting to PostgreSQL, doubling up to the max
_RECONNECT_MAX = 10.0


@dataclass(frozen=True, kw_only=True)
class PollSettings(RelaySettings):
    table: str
    workers: int = 1
    batch_size: int = 500
    poll_interval: float = 5.0
    max_attempts: int = 10
    backoff_base: float = 1.0
    backoff_max: float = 300.0


def backoff(
    attempts: int, base: float, cap: float, jitter: Callable[[], float] = random.random
) -> float:
    """Seconds before a row that has failed ``attempts`` times is tried again.

    ``base * 2 ** (attempts - 1)``, at most ``cap``, times a random factor in [0.5, 1): rows that
    failed together come back apart, and no wait is shorter than half its step.
    """
    step = min(cap, base * 2.0 ** min(max(attempts - 1, 0), 64))
    return step * (0.5 + jitter() / 2)


class Wake:
    """Counts notifications; a worker waits until the count moves past what it saw before its
    last claim, so a notification that came during the claim is not lost."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._count = 0

    def seen(self) -> int:
        with self._cond:
            return self._count

    def notify(self) -> None:
        with self._cond:
            self._count += 1
            self._cond.notify_all()

    def wait(self, seen: int, timeout: float) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._count != seen, timeout)


class _DatabaseLost(ConnectionLost):
    """A worker's query failed for a reason a new connection or a later try may not meet
    (store.kind); ``read_only``: the server does not take writes."""

    def __init__(self, exc: psycopg.DatabaseError, read_only: bool) -> None:
        super().__init__(first_line(exc))
        self.read_only = read_only


@dataclass
class Counts:
    """One worker's tally, read by the progress line."""

    published: int = 0
    failed: int = 0


class Worker:
    """Claims, publishes and marks batches of one shard of the aggregates until stopped: the
    feed of its own pipeline (pipeline.Feed), whose checkpointer and refusal policy are its
    batch."""

    def __init__(
        self,
        relay: PollRelay,
        shard: int,
        claims: Claims,
        outbox: Outbox,
        open_sink: OpenSink,
    ) -> None:
        self.relay = relay
        self.settings = relay.settings
        self.shard = shard
        self.batch = open_batch(
            relay.settings,
            open_sink,
            tick=self._tick,
            give_up=self._give_up,
            router=relay.router,
        )
        self.claims = claims
        self.outbox = outbox
        self.counts = Counts()
        self.released = 0  # messages whose reports had not come when the worker stopped
        # Keys of the aggregates the last claim found held up by a row another transaction
        # locks (a prepared transaction may hold it for ever): the next claim walks past them.
        self._skip: list[int] = []
        self._stopping_since: float | None = None
        self._failures = 0  # failed cycles in a row
        self._holding = False  # inside a claim's transaction
        self.thread = threading.Thread(target=self._run, name=f"poll-worker-{shard}")

    def _run(self) -> None:
        try:
            self.batch.pipeline.run(self)
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread, which raises it
            self.relay.fail(exc)

    # -- the feed (pipeline.Feed) ---------------------------------------------------------

    @property
    def stopped(self) -> bool:
        return self.relay.stopping.is_set()

    def pump(self) -> None:
        """One cycle, then a wait for new rows when the outbox had no more; a database error
        is a lost connection, or one line for the user (store.kind)."""
        relay = self.relay
        seen = relay.wake.seen()
        try:
            claimed = self._cycle()
        except psycopg.DatabaseError as exc:  # what each kind means: see store.kind
            meaning = kind(exc)
            if meaning == REFUSED:
                raise refusal(exc, self.outbox, "the poller's query") from None
            raise _DatabaseLost(exc, read_only=meaning == READ_ONLY) from exc
        self._failures = 0
        relay.health.beat()
        if claimed < self.settings.batch_size and not self._skip:
            relay.wake.wait(seen, self.settings.poll_interval)

    def recover(self, exc: ConnectionLost) -> None:
        """After a lost connection: PostgreSQL released the claim, so whatever the producer
        still holds may be claimed, and published, by another poller, with newer rows of the
        same aggregates; drop it rather than deliver it after those. Then back off."""
        self._failures += 1
        dropped = self.batch.abandon()
        if dropped:
            log.warning(
                "dropped %d messages Kafka had not acknowledged: PostgreSQL released their "
                "claim, so they are published again by whichever poller claims their rows",
                dropped,
                extra={"action": "claim_released"},
            )
        delay = backoff(self._failures, _RECONNECT_BASE, _RECONNECT_MAX)
        if isinstance(exc, _DatabaseLost) and exc.read_only:
            log.warning(
                "the database is read-only (%s); waiting for a writable primary, next "
                "try in %.1fs. After a failover this ends once --dsn reaches the new "
                "primary; a database made read-only (default_transaction_read_only) "
                "must be made writable again",
                exc,
                delay,
                extra={"action": "read_only"},
            )
        else:
            log.warning(
                "lost the database connection, reconnecting in %.1fs: %s",
                delay,
                exc,
                extra={"action": "disconnected"},
            )
        self.claims.close()
        self.relay.health.beat()  # waiting on purpose: a restart would not help
        self.relay.stopping.wait(delay)

    def rewind(self) -> None:
        """Never asked for: the batch's policy marks a refused row for a later try instead."""

    def shutdown(self) -> None:
        self.claims.close()
        self.released += self.batch.sink.close()

    def _tick(self) -> None:
        """What the worker does while it waits for Kafka: beat, and look whether PostgreSQL
        has ended the session holding the claim. Kafka may stay away for long, and a claim
        PostgreSQL released (the session terminated, idle_in_transaction_session_timeout)
        is then another poller's: the wait ends (recover drops what the producer holds)."""
        self.relay.health.beat()
        if self._holding and self.claims.lost():
            raise ConnectionLost(
                "PostgreSQL ended the session holding the claim while Kafka had not answered"
            )

    def _give_up(self) -> bool:
        """Whether to stop waiting for Kafka: a stop was requested and its grace has run out."""
        if not self.relay.stopping.is_set():
            return False
        if self._stopping_since is None:
            self._stopping_since = time.monotonic()
        return time.monotonic() - self._stopping_since >= self.settings.shutdown_timeout

    def _cycle(self) -> int:
        """One batch: claim, publish, mark, commit. Returns how many rows were claimed."""
        settings = self.settings
        claims = self.claims
        claims.open()  # a batch's duration does not count connecting
        started = time.monotonic()
        with claims.transaction(), self._claim_held():
            keys = claims.claim_aggregates(
                settings.batch_size, self.shard, settings.workers, self._skip
            )
            self._skip = []
            if not keys:
                return 0
            rows = self._held_back(keys, claims.claim(settings.batch_size, keys))
            if not rows:
                return 0
            self.outbox.check_payload(rows)
            late = claims.published_after([row.id for row in rows])
            complete = self.batch.publish(rows)
            self._mark(rows, late)
        BATCH_DURATION.observe(time.monotonic() - started)
        if not complete:
            # Stopping with reports outstanding: those rows stay unprocessed and unlocked, and
            # the producer's copies are purged when the worker closes its sink.
            batch = self.batch
            unreported = len(rows) - len(batch.delivered) - len(batch.failures) - len(batch.held)
            log.warning(
                "stopping before Kafka answered for %d rows; they stay unprocessed",
                unreported,
                extra={"action": "batch_released"},
            )
        return len(rows)

    @contextlib.contextmanager
    def _claim_held(self) -> Iterator[None]:
        self._holding = True
        try:
            yield
        finally:
            self._holding = False

    def _held_back(self, keys: list[int], rows: list[OutboxRow]) -> list[OutboxRow]:
        """The claimed rows that may go: claim skips a row another transaction locks (waiting
        could take for ever: a prepared transaction holds its locks until it is resolved), and
        its aggregate's rows behind it must wait for it. Their aggregates are walked past in the
        next claim, which then follows at once, so the others are not held up."""
        if rows:
            skipped = self.claims.claim_skipped(
                keys, max(row.seq or 0 for row in rows), [row.id for row in rows]
            )
            rows = [r for r in rows if r.key not in skipped or (r.seq or 0) < skipped[r.key]]
        self._skip = sorted(set(keys) - {row.key for row in rows if row.key is not None})
        return rows

    def _mark(self, rows: Sequence[OutboxRow], late: dict[str, int]) -> None:
        batch = self.batch
        settings = self.settings
        if batch.delivered:
            ids = [rows[i].id for i in batch.delivered]
            self.claims.mark_processed(ids)
            self.counts.published += len(ids)
            EVENTS_PUBLISHED.labels(relay="poll").inc(len(ids))
            for i in sorted(batch.delivered):
                if rows[i].id in late:
                    out_of_seq_order(rows[i], late[rows[i].id], "poll")
        if not batch.failures:
            return
        failed = [rows[i] for i in batch.failures]
        delays = [
            backoff(row.attempts + 1, settings.backoff_base, settings.backoff_max) for row in failed
        ]
        own = [index in batch.own for index in batch.failures]
        outcome = self.claims.mark_failed(
            [row.id for row in failed],
            list(batch.failures.values()),
            delays,
            own,
            settings.max_attempts,
        )
        self.counts.failed += len(failed)
        for row in failed:
            count_failed("poll", row.event_type)
        for row, delay, error, its_own in zip(
            failed, delays, batch.failures.values(), own, strict=True
        ):
            result = outcome.get(row.id, {"attempts": row.attempts + 1, "dead": False})
            fields = {
                "event_id": row.id,
                "event_type": row.event_type,
                "aggregate_id": row.aggregate_id,
                "attempt": result["attempts"],
                "error": error,
            }
            if result["dead"]:
                log.error(
                    "gave up on event %s after %d attempts: it is a dead letter now "
                    "(cdc-relay dead-letters list)",
                    row.id,
                    result["attempts"],
                    extra={"action": "dead_letter", **fields},
                )
            elif its_own:
                log.warning(
                    "publishing event %s failed (attempt %d of %d), next try in %.1fs",
                    row.id,
                    result["attempts"],
                    settings.max_attempts,
                    delay,
                    extra={"action": "retry_later", **fields},
                )
            else:  # refused with others: not known to be its own failure (batch.py)
                log.warning(
                    "publishing event %s failed with other rows (attempt %d), next try in "
                    "%.1fs, alone",
                    row.id,
                    result["attempts"],
                    delay,
                    extra={"action": "retry_later", **fields},
                )


def out_of_seq_order(row: OutboxRow, after: int, relay: str) -> None:
    """Say and count that ``row`` went out after the event of seq ``after`` of its aggregate
    (README.md, "Order per aggregate on each path")."""
    OUT_OF_SEQ_ORDER.labels(relay=relay).inc()
    log.warning(
        "event %s went out after event seq %d of its aggregate, out of seq order (its seq is "
        "%s): its transaction committed after that one was published",
        row.id,
        after,
        row.seq,
        extra={
            "action": "out_of_seq_order",
            "event_id": row.id,
            "event_type": row.event_type,
            "aggregate_id": row.aggregate_id,
        },
    )


class PollRelay:
    """Runs the workers and the listener until stopped; raises what stopped a worker.

    The stages are injected (cdc_relay.relay.stages), the real ones by default: ``open_store``
    makes the outbox store (each worker's claims, the progress counts) from the connection
    string and the table, ``open_sink`` each worker's sink from its publisher's report
    callbacks.
    """

    def __init__(
        self,
        settings: PollSettings,
        health: Health | None = None,
        *,
        open_store: OpenStore = PgStore,
        open_sink: OpenSink | None = None,
    ) -> None:
        self.settings = settings
        self.health = health or Health()
        self.conninfo = make_conninfo(settings.dsn, application_name=APPLICATION_NAME)
        self.stopping = threading.Event()
        self.wake = Wake()
        self._open_store = open_store
        # One for all workers: what their sinks learn of Kafka's topics (sink.kafka_sink).
        self._open_sink = open_sink or kafka_sink(settings.kafka_config, relay="poll")
        # One for all workers: which aggregate type each topic is of (routing.Router).
        self.router = poll_router(settings)
        self._error: BaseException | None = None  # what stopped a worker
        self._error_lock = threading.Lock()
        self._listening = False
        self._workers: list[Worker] = []
        self.outbox: Outbox | None = None  # resolved by run()
        self._store: OutboxStore | None = None

    def request_stop(self) -> None:
        """Finish or release the current batches, then return from ``run``. Signal-safe."""
        self.stopping.set()

    def fail(self, error: BaseException) -> None:
        """A worker stopped on ``error``: stop everything, ``run`` raises it."""
        with self._error_lock:
            if self._error is None:
                self._error = error
        self.stopping.set()
        self.wake.notify()

    def run(self) -> None:
        """Poll until ``request_stop``; raise RelayError on a failure the user must fix."""
        outbox = self._check_database()
        self._poll(self._open_store(self.conninfo, outbox), listen=True)

    def poll(self, store: OutboxStore) -> None:
        """The workers alone, on ``store``, with the database's checks taken as passed and no
        listener (a test wakes them with ``wake.notify``). For the loop's unit tests, which
        inject in-memory stages (tests/unit/test_poll_loop.py)."""
        self._poll(store, listen=False)

    def _poll(self, store: OutboxStore, listen: bool) -> None:
        settings = self.settings
        outbox = self.outbox = store.outbox
        self._store = store
        workers = [
            Worker(self, n, store.claims(), outbox, self._open_sink)
            for n in range(settings.workers)
        ]
        try:
            workers[0].batch.sink.check_reachable(settings.kafka_timeout)
        except BaseException:
            for worker in workers:
                worker.batch.sink.close()
            raise
        self._workers = workers
        self._register_metrics()
        if listen:
            listener = threading.Thread(
                target=self._listen, args=(outbox,), name="poll-listener", daemon=True
            )
            listener.start()
        log.info(
            "polling %s with %d worker%s, batches of %d",
            outbox.qualified,
            settings.workers,
            "" if settings.workers == 1 else "s",
            settings.batch_size,
            extra={"action": "start"},
        )
        for worker in self._workers:
            worker.thread.start()
        try:
            while not self.stopping.wait(settings.progress_interval):
                self._log_progress()
        finally:
            self.stopping.set()
            self.wake.notify()
            for worker in self._workers:
                worker.thread.join()
            self._log_progress()
            released = sum(w.released for w in self._workers)
            log.info(
                "stopped; %d messages were still waiting for Kafka and may be published again",
                released,
                extra={"action": "stop"},
            )
        if self._error is not None:
            raise self._error

    def _check_database(self) -> Outbox:
        """The table has the poller's columns and no handover runs on it; returns it."""
        with connect(self.conninfo) as conn:
            outbox = resolve(conn, self.settings.table)
            check_columns(conn, outbox)
            trigger = conn.execute(QUERIES["poll_trigger"], {"oid": outbox.table.oid})
            found = trigger.fetchone() or {}
            if not found.get("current"):
                log.warning(
                    "%s notifies the pollers of new rows in %s; new events wait up to "
                    "--poll-interval (%gs): run cdc-relay schema apply poller",
                    "an older version of the trigger of schema poller, on another channel,"
                    if found.get("present")
                    else "no trigger",
                    outbox.qualified,
                    self.settings.poll_interval,
                    extra={"action": "no_trigger"},
                )
            if not outbox.published_index:
                log.warning(
                    "no index on (aggregate_type, aggregate_id, seq) of the processed rows of "
                    "%s: rows published after a later row of their aggregate are not counted "
                    "(outbox_events_out_of_seq_order_total); run cdc-relay schema apply poller",
                    outbox.qualified,
                    extra={"action": "no_order_index"},
                )
            check_lock_room(conn, self.settings.workers, self.settings.batch_size)
            take_poll_lock(conn, outbox)  # refused now rather than after connecting to Kafka
            check_fence(conn, outbox)
        return outbox

    def _listen(self, outbox: Outbox) -> None:
        """Turn notifications into wake-ups; reconnect when the connection drops."""
        failures = 0  # connection failures in a row
        while not self.stopping.is_set():
            try:
                with psycopg.connect(self.conninfo, autocommit=True) as conn:
                    conn.execute(outbox.listen)
                    self._listening = True
                    self.wake.notify()  # whatever was written while nobody listened
                    failures = 0
                    while not self.stopping.is_set():
                        for _ in conn.notifies(timeout=WAIT * 20):
                            self.wake.notify()
            except psycopg.DatabaseError as exc:
                # A standby refuses LISTEN (read-only): wait for the primary, as the workers do.
                if kind(exc) == REFUSED:
                    self.fail(refusal(exc, outbox, "LISTEN"))
                    return
                log.warning("listener: %s", first_line(exc), extra={"action": "disconnected"})
            self._listening = False
            failures += 1
            self.stopping.wait(backoff(failures, _RECONNECT_BASE, _RECONNECT_MAX))

    def _register_metrics(self) -> None:
        CONNECTED.labels(service="postgres").set_function(lambda: self._listening)
        CONNECTED.labels(service="kafka").set_function(
            lambda: any(w.batch.sink.connected for w in self._workers)
        )
        self.health.readiness = self._readiness

    def _readiness(self) -> tuple[bool, str]:
        if not self._listening:
            return False, "not connected to PostgreSQL"
        if not any(w.batch.sink.connected for w in self._workers):
            return False, "not connected to Kafka"
        return True, "ok"

    def _log_progress(self) -> None:
        published = sum(w.counts.published for w in self._workers)
        failed = sum(w.counts.failed for w in self._workers)
        pending = None if self._store is None else self._store.pending_counts()
        if pending is not None:
            EVENTS_PENDING.set(pending["unprocessed"])
            DEAD_LETTERS.set(pending["dead_letters"])
        log.info(
            "progress: %d events published, %d publish failures; %s unprocessed rows, "
            "%s dead letters",
            published,
            failed,
            "?" if pending is None else pending["unprocessed"],
            "?" if pending is None else pending["dead_letters"],
            extra={"action": "progress"},
        )
