"""One poll worker: a thread that claims outbox rows of its share of the aggregates,
publishes them and marks them, until the relay that runs it (poller.PollRelay) stops it.

One cycle is one transaction: lock the aggregates of the next rows (transaction-level
advisory locks, skipping those another poller holds), claim those aggregates' rows, produce
them in ``seq`` order, wait for Kafka's delivery reports, mark the delivered rows processed in
one statement and the refused ones for a later try, commit. One transaction at a time holds an
aggregate, so any number of workers and processes keep each aggregate's order.

The worker is the feed of its own pipeline (pipeline.Feed), its claimed batch the
checkpointer and the refusal policy (batch.py). Beside it here: the settings of ``poll``, the
back-off of a refused row and of a reconnection, and the wake-ups a worker waits for.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import psycopg

from cdc_relay.kafka.routing import Router
from cdc_relay.metrics import (
    BATCH_DURATION,
    EVENTS_PUBLISHED,
    OUT_OF_SEQ_ORDER,
    Health,
    count_failed,
)
from cdc_relay.postgres.replication import ConnectionLost
from cdc_relay.postgres.store import (
    READ_ONLY,
    REFUSED,
    Outbox,
    OutboxRow,
    first_line,
    kind,
    refusal,
)
from cdc_relay.relay.backoff import backoff, reconnect_delay
from cdc_relay.relay.batch import open_batch
from cdc_relay.relay.settings import RelaySettings
from cdc_relay.relay.stages import Claims, OpenSink

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class PollSettings(RelaySettings):
    table: str
    workers: int = 1
    batch_size: int = 500
    poll_interval: float = 5.0
    max_attempts: int = 10
    backoff_base: float = 1.0
    backoff_max: float = 300.0
    trace_column: str | None = None  # --trace-column: the W3C trace context of each row


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


class Runner(Protocol):
    """What runs the workers (poller.PollRelay), as a worker sees it: the settings and the
    router they share, the health they beat, the stop they watch, the wake-ups they wait for,
    and where a worker's failure goes."""

    @property
    def settings(self) -> PollSettings:
        """The settings of ``poll``."""

    @property
    def router(self) -> Router:
        """One for all workers: which aggregate type each topic is of (routing.Router)."""

    @property
    def health(self) -> Health:
        """What a worker beats while it works, or waits on purpose."""

    @property
    def stopping(self) -> threading.Event:
        """Set when the workers are to stop."""

    @property
    def wake(self) -> Wake:
        """Notified when new rows may be due."""

    def fail(self, error: BaseException) -> None:
        """A worker stopped on ``error``: stop everything."""


class Worker:
    """Claims, publishes and marks batches of one shard of the aggregates until stopped: the
    feed of its own pipeline (pipeline.Feed), whose checkpointer and refusal policy are its
    batch."""

    def __init__(
        self,
        relay: Runner,
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
        delay = reconnect_delay(self._failures)
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
            count_failed("poll", "(other)" if row.event_type is None else row.event_type)
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
    (docs/how-it-works.md, "Order per aggregate on each path")."""
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
