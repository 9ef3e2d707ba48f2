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

Every command resolves ``--table`` once (:func:`resolve`) and names the table by its schema and
name from then on. Every poller connection holds the table's advisory lock, shared, before
it claims; the handover to ``stream`` holds it exclusively, so the two never run together.

Beside it: publisher.py publishes a batch, deadletter.py lists and retries the rows given up on,
handover.py hands over to ``stream``, prune.py prunes.
"""

from __future__ import annotations

import contextlib
import logging
import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo
from psycopg.rows import class_row, dict_row

from cdc_relay.config import RelaySettings
from cdc_relay.errors import PreflightError, RelayError
from cdc_relay.events import TIMESTAMP_OIDS, OutboxEvent, PayloadKind, payload_kind
from cdc_relay.metrics import (
    BATCH_DURATION,
    CONNECTED,
    DEAD_LETTERS,
    EVENTS_PENDING,
    EVENTS_PUBLISHED,
    Health,
)
from cdc_relay.publisher import WAIT_SLICE, Publisher
from cdc_relay.queries import QUERIES
from cdc_relay.slot import OutboxTable, connect, find_table

log = logging.getLogger(__name__)

APPLICATION_NAME = "cdc-relay poll"
"""The ``application_name`` of the poller's sessions, to tell them apart in pg_stat_activity."""

LOCK_CLASS = 0x43444352  # "CDCR"
"""First key of the outbox's advisory lock (``pg_locks.classid``); the second is the table's
oid (``pg_locks.objid``)."""

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


@dataclass(frozen=True, slots=True)
class OutboxRow:
    """An unprocessed row, as the claim reads it."""

    id: str
    aggregate_type: str
    aggregate_id: str
    event_type: str
    payload: bytes | None
    payload_type: int  # pg_type oid of the payload column when the row was read
    attempts: int
    created_at: str | None = None  # ISO 8601 (to_jsonb), when the table has the column
    payload_kind: PayloadKind = "json"
    headers: tuple[tuple[str, bytes], ...] = ()  # --header-column values (a republish's)
    seq: int | None = None  # the claim's: the row's place in the queue
    key: int | None = None  # the claim's: its aggregate's lock key (claim_aggregates)

    @property
    def aggregate(self) -> tuple[str, str]:
        return self.aggregate_type, self.aggregate_id

    def event(self) -> OutboxEvent:
        return OutboxEvent(
            id=self.id,
            aggregate_type=self.aggregate_type,
            aggregate_id=self.aggregate_id,
            event_type=self.event_type,
            payload=self.payload,
            commit_lsn=0,
            xid=0,
            commit_time_us=0,
            headers=self.headers,
            created_at=None if self.created_at is None else self.created_at.encode(),
            payload_kind=self.payload_kind,
        )


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else "no message"


# -- the outbox table -----------------------------------------------------------------------


@dataclass(frozen=True)
class Outbox:
    """The outbox table of ``--table``, resolved once (``find_table``: quoting, case folding,
    ``search_path``); every query names it by its schema and name from then on."""

    table: OutboxTable
    payload_type: int | None  # pg_type oid of the payload column; None without one
    payload_bytea: bool  # bytea, or a domain over it
    created_at: bool = False  # a created_at column of a timestamp type

    @property
    def qualified(self) -> str:
        return self.table.qualified

    @property
    def channel(self) -> str:
        """The NOTIFY channel of the trigger of cdc-relay schema poller on this table."""
        return f"{self.table.schema}.{self.table.name}"

    @property
    def lock(self) -> dict[str, int]:
        """The parameters of the table's advisory lock (poll_lock, handover_lock, pollers)."""
        return {"lock_class": LOCK_CLASS, "table": self.table.oid}

    def query(self, name: str, **more: sql.Composable) -> sql.Composed:
        """A named query on this table (``more`` fills its other placeholders). The payload
        expression is chosen here, once: a bytea payload goes out as the bytes stored, any other
        type as its text (the bytes pgoutput sends, so both relays publish the same value)."""
        payload = QUERIES["payload_bytes" if self.payload_bytea else "payload_text"]
        return sql.SQL(QUERIES[name]).format(
            table=sql.Identifier(self.table.schema, self.table.name),
            payload=sql.SQL(payload),
            created_at=sql.SQL(QUERIES["created_at_text" if self.created_at else "no_created_at"]),
            payload_kind=sql.Literal(payload_kind(self.payload_type, self.payload_bytea)),
            **more,
        )

    def check_payload(self, rows: Sequence[OutboxRow]) -> None:
        """Refuse rows read after the payload column changed type: the expression chosen at
        start would send other bytes than stored (a bytea read as text is its hex form)."""
        if rows and rows[0].payload_type != self.payload_type:
            raise RelayError(
                f"the payload column of {self.qualified} changed type while the relay ran; "
                "nothing was published from it since: start the relay again, which reads the "
                "payload by the column's type"
            )


def resolve(
    conn: psycopg.Connection[dict[str, Any]], table: str, payload_column: str = "payload"
) -> Outbox:
    """The outbox table ``table`` names, its payload in ``payload_column``; PreflightError if
    there is none."""
    try:
        found = find_table(conn, table)
    except psycopg.OperationalError:
        raise
    except psycopg.DatabaseError as exc:  # e.g. a name with too many dots
        raise PreflightError(
            f"--table {table!r} is not a table name PostgreSQL reads: {first_line(exc)}"
        ) from None
    if found is None:
        raise PreflightError(
            f"table {table} does not exist; create it with cdc-relay schema apply outbox, "
            "or name yours with --table"
        )
    payload = (
        conn.execute(
            QUERIES["poll_payload"], {"oid": found.oid, "payload": payload_column}
        ).fetchone()
        or {}
    )
    return Outbox(
        found,
        payload.get("payload_type"),
        bool(payload.get("payload_bytea")),
        payload.get("created_at_type") in TIMESTAMP_OIDS,
    )


def check_columns(conn: psycopg.Connection[dict[str, Any]], outbox: Outbox) -> None:
    missing = conn.execute(QUERIES["poll_columns"], {"oid": outbox.table.oid})
    columns = (missing.fetchone() or {}).get("missing")
    if columns:
        raise PreflightError(
            f"table {outbox.qualified} has no column {', '.join(columns)}, which the poller "
            "needs; add them as cdc-relay schema show outbox does"
        )


# -- what a database error means ------------------------------------------------------------
#
# Three kinds. The connection and the server's passing state (class 08 and the rest of
# psycopg's OperationalError: shutdown, too many connections, a cancelled query; 40:
# serialization failure, deadlock) are retried with backoff on a new connection.
#
# A read-only server (25006) is waited out the same way, with a warning that says so. After a
# failover the old primary comes back as a standby, or --dsn (a DNS name, a virtual IP, a
# multi-host DSN) reaches the new primary only after a reconnect; a database made read-only
# for maintenance becomes writable again. Waiting loses nothing: the claim is the first
# statement of its transaction and FOR UPDATE is refused before any row is read, so nothing
# was published, and a transaction that got past its claim is read-write to its end. Stopping
# would only need someone to start the relay again once the cluster has settled.
#
# Anything else the server refuses (a dropped column or table, a revoked privilege, a
# constraint) stays refused until someone changes the database: the relay stops with one line
# that says what to do. The refused transaction is rolled back, so nothing is marked that
# Kafka did not acknowledge; rows acknowledged but not marked are published again later.

_RETRY, _READ_ONLY, _REFUSED = "retry", "read-only", "refused"


def _kind(exc: psycopg.DatabaseError) -> str:
    if isinstance(exc, psycopg.errors.ReadOnlySqlTransaction):
        return _READ_ONLY
    if isinstance(exc, psycopg.OperationalError | psycopg.errors.TransactionRollback):
        return _RETRY
    return _REFUSED


def _refusal(exc: psycopg.DatabaseError, outbox: Outbox, doing: str) -> RelayError:
    """The one-line error for a database error the user must act on."""
    code = exc.sqlstate or ""
    if code == "42501":
        remedy = "grant the role of --dsn what cdc-relay schema show roles grants the poller"
    elif code[:2] in ("42", "0A"):
        remedy = f"make {outbox.qualified} as cdc-relay schema show outbox does"
    elif code == "25006":
        remedy = "run it against the primary"
    elif _kind(exc) == _RETRY:
        remedy = "check --dsn and the server"
    else:
        remedy = "fix the cause"
    sqlstate = f" (SQLSTATE {code})" if code else ""
    return RelayError(
        f"PostgreSQL refused {doing} on {outbox.qualified}: {first_line(exc)}{sqlstate}; "
        f"{remedy}, then run it again"
    )


@contextlib.contextmanager
def refused(outbox: Outbox, doing: str) -> Iterator[None]:
    """Database errors of a housekeeping command (dead letters, prune) as one line each."""
    try:
        yield
    except psycopg.DatabaseError as exc:
        raise _refusal(exc, outbox, doing) from None


def _check_lock_room(conn: psycopg.Connection[dict[str, Any]], settings: PollSettings) -> None:
    """Each worker's claim locks up to --batch-size aggregates in PostgreSQL's shared lock
    table; refuse a configuration that would take over half of it."""
    room = int((conn.execute(QUERIES["lock_room"]).fetchone() or {})["room"])
    need = settings.workers * settings.batch_size
    if need > room // 2:
        raise PreflightError(
            f"--workers x --batch-size = {need} aggregate locks at once, over half of "
            f"PostgreSQL's lock table ({room}: max_locks_per_transaction x (max_connections + "
            "max_prepared_transactions)); "
            "lower --batch-size or --workers, or raise max_locks_per_transaction"
        )


def _take_poll_lock(conn: psycopg.Connection[Any], outbox: Outbox) -> None:
    """Take the outbox's advisory lock, shared, for as long as the session lasts; a
    PreflightError if a handover holds it.

    Session-level: behind a pooler in transaction mode it would not stay with the session, so
    pollers must connect to PostgreSQL directly (or through session pooling).
    """
    with conn.cursor(row_factory=dict_row) as cur:
        if (cur.execute(QUERIES["poll_lock"], outbox.lock).fetchone() or {}).get("locked"):
            return
        pids = [
            str(r["pid"]) for r in cur.execute(QUERIES["pollers"], outbox.lock) if r["handover"]
        ]
    by = f" (pid {', '.join(pids)})" if pids else ""
    raise PreflightError(
        f"a handover to stream (cdc-relay setup-slot --from-poller) is running on "
        f"{outbox.qualified}{by}; a poller must not run beside it: when the handover has "
        "finished, run cdc-relay stream; if it failed, start the poller again"
    )


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


@dataclass
class Counts:
    """One worker's tally, read by the progress line."""

    published: int = 0
    failed: int = 0


class Worker:
    """Claims, publishes and marks batches of one shard of the aggregates until stopped."""

    def __init__(self, relay: PollRelay, shard: int, publisher: Publisher, outbox: Outbox) -> None:
        self.relay = relay
        self.settings = relay.settings
        self.shard = shard
        self.publisher = publisher
        self.outbox = outbox
        self.counts = Counts()
        self.released = 0  # messages whose reports had not come when the worker stopped
        self._conn: psycopg.Connection[Any] | None = None
        self._claim_aggregates = outbox.query("claim_aggregates")
        self._claim = outbox.query("claim")
        self._claim_skipped = outbox.query("claim_skipped")
        # Keys of the aggregates the last claim found held up by a row another transaction
        # locks (a prepared transaction may hold it for ever): the next claim walks past them.
        self._skip: list[int] = []
        self._mark_processed = outbox.query("mark_processed")
        self._mark_failed = outbox.query("mark_failed")
        self._stopping_since: float | None = None
        self.thread = threading.Thread(target=self._run, name=f"poll-worker-{shard}")

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread, which raises it
            self.relay.fail(exc)
        finally:
            if self._conn is not None:
                self._conn.close()
            self.released += self.publisher.outstanding
            self.publisher.sink.close()

    def _loop(self) -> None:
        relay = self.relay
        failures = 0  # failed cycles in a row
        while not relay.stopping.is_set():
            seen = relay.wake.seen()
            try:
                claimed = self._cycle()
            except psycopg.DatabaseError as exc:  # what each kind means: see _kind
                kind = _kind(exc)
                if kind == _REFUSED:
                    raise _refusal(exc, self.outbox, "the poller's query") from None
                failures += 1
                delay = backoff(failures, _RECONNECT_BASE, _RECONNECT_MAX)
                if kind == _READ_ONLY:
                    log.warning(
                        "the database is read-only (%s); waiting for a writable primary, next "
                        "try in %.1fs. After a failover this ends once --dsn reaches the new "
                        "primary; a database made read-only (default_transaction_read_only) "
                        "must be made writable again",
                        first_line(exc),
                        delay,
                        extra={"action": "read_only"},
                    )
                else:
                    log.warning(
                        "lost the database connection, reconnecting in %.1fs: %s",
                        delay,
                        first_line(exc),
                        extra={"action": "disconnected"},
                    )
                self._drop_connection()
                relay.health.beat()  # waiting on purpose: a restart would not help
                relay.stopping.wait(delay)
                continue
            failures = 0
            relay.health.beat()
            if claimed < self.settings.batch_size and not self._skip:
                relay.wake.wait(seen, self.settings.poll_interval)

    def _connection(self) -> psycopg.Connection[Any]:
        """The worker's connection; a new one takes the outbox's lock before its first claim."""
        if self._conn is None or self._conn.closed:
            conn = psycopg.connect(
                self.relay.conninfo, autocommit=True, row_factory=class_row(OutboxRow)
            )
            try:
                _take_poll_lock(conn, self.outbox)
            except BaseException:
                conn.close()
                raise
            self._conn = conn
        return self._conn

    def _drop_connection(self) -> None:
        """After a lost connection: PostgreSQL released the claim, so whatever the producer still
        holds may be claimed again; wait (bounded) for it to settle first."""
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        self.publisher.wait(self._give_up)

    def _give_up(self) -> bool:
        """Whether to stop waiting for Kafka: a stop was requested and its grace has run out."""
        self.relay.health.beat()
        if not self.relay.stopping.is_set():
            return False
        if self._stopping_since is None:
            self._stopping_since = time.monotonic()
        return time.monotonic() - self._stopping_since >= self.settings.shutdown_timeout

    def _cycle(self) -> int:
        """One batch: claim, publish, mark, commit. Returns how many rows were claimed."""
        settings = self.settings
        conn = self._connection()
        started = time.monotonic()
        with conn.transaction():
            # Two statements: the second's snapshot sees what the aggregates' last holders
            # committed before their locks came free (see claim_aggregates in queries.sql).
            with conn.cursor(row_factory=dict_row) as cur:
                locked = cur.execute(
                    self._claim_aggregates,
                    {
                        "limit": settings.batch_size,
                        "shard": self.shard,
                        "shards": settings.workers,
                        "table_oid": self.outbox.table.oid,
                        "skip": self._skip,
                    },
                ).fetchone()
            keys = locked["keys"] if locked else []
            self._skip = []
            if not keys:
                return 0
            rows = self._held_back(
                conn, keys, conn.execute(self._claim, {"limit": settings.batch_size, "keys": keys})
            )
            if not rows:
                return 0
            self.outbox.check_payload(rows)
            complete = self.publisher.publish(rows, self._give_up)
            self._mark(conn, rows)
        BATCH_DURATION.observe(time.monotonic() - started)
        if not complete:
            # Stopping with reports outstanding: those rows stay unprocessed and unlocked, and
            # the producer's copies are purged when the worker closes its sink.
            publisher = self.publisher
            unreported = (
                len(rows) - len(publisher.acked) - len(publisher.refused) - len(publisher.held)
            )
            log.warning(
                "stopping before Kafka answered for %d rows; they stay unprocessed",
                unreported,
                extra={"action": "batch_released"},
            )
        return len(rows)

    def _held_back(
        self, conn: psycopg.Connection[Any], keys: list[int], claimed: psycopg.Cursor[Any]
    ) -> list[OutboxRow]:
        """The claimed rows that may go: claim skips a row another transaction locks (waiting
        could take for ever: a prepared transaction holds its locks until it is resolved), and
        its aggregate's rows behind it must wait for it. Their aggregates are walked past in the
        next claim, which then follows at once, so the others are not held up."""
        rows: list[OutboxRow] = claimed.fetchall()
        if rows:
            with conn.cursor(row_factory=dict_row) as cur:
                skipped = {
                    row["key"]: row["seq"]
                    for row in cur.execute(
                        self._claim_skipped,
                        {
                            "keys": keys,
                            "last": max(row.seq or 0 for row in rows),
                            "ids": [row.id for row in rows],
                        },
                    )
                }
            rows = [r for r in rows if r.key not in skipped or (r.seq or 0) < skipped[r.key]]
        self._skip = sorted(set(keys) - {row.key for row in rows if row.key is not None})
        return rows

    def _mark(self, conn: psycopg.Connection[Any], rows: Sequence[OutboxRow]) -> None:
        publisher = self.publisher
        settings = self.settings
        if publisher.acked:
            ids = [rows[i].id for i in publisher.acked]
            conn.execute(self._mark_processed, {"ids": ids})
            self.counts.published += len(ids)
            EVENTS_PUBLISHED.labels(relay="poll").inc(len(ids))
        if not publisher.refused:
            return
        failed = [rows[i] for i in publisher.refused]
        delays = [
            backoff(row.attempts + 1, settings.backoff_base, settings.backoff_max) for row in failed
        ]
        own = [index in publisher.own for index in publisher.refused]
        params = {
            "ids": [row.id for row in failed],
            "errors": list(publisher.refused.values()),
            "delays": delays,
            "own": own,
            "max_attempts": settings.max_attempts,
        }
        with conn.cursor(row_factory=dict_row) as cur:
            outcome = {r["id"]: r for r in cur.execute(self._mark_failed, params).fetchall()}
        self.counts.failed += len(failed)
        for row, delay, error, its_own in zip(
            failed, delays, publisher.refused.values(), own, strict=True
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
            else:  # refused with others: not known to be its own failure (publisher.py)
                log.warning(
                    "publishing event %s failed with other rows (attempt %d), next try in "
                    "%.1fs, alone",
                    row.id,
                    result["attempts"],
                    delay,
                    extra={"action": "retry_later", **fields},
                )


class PollRelay:
    """Runs the workers and the listener until stopped; raises what stopped a worker."""

    def __init__(self, settings: PollSettings, health: Health | None = None) -> None:
        self.settings = settings
        self.health = health or Health()
        self.conninfo = make_conninfo(settings.dsn, application_name=APPLICATION_NAME)
        self.stopping = threading.Event()
        self.wake = Wake()
        self._error: BaseException | None = None  # what stopped a worker
        self._error_lock = threading.Lock()
        self._listening = False
        self._workers: list[Worker] = []
        self.outbox: Outbox | None = None  # resolved by run()

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
        settings = self.settings
        outbox = self.outbox = self._check_database()
        publishers = [Publisher(settings) for _ in range(settings.workers)]
        try:
            publishers[0].sink.check_reachable(settings.kafka_timeout)
        except BaseException:
            for publisher in publishers:
                publisher.sink.close()
            raise
        self._workers = [Worker(self, n, p, outbox) for n, p in enumerate(publishers)]
        self._register_metrics()
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
            if not (trigger.fetchone() or {}).get("present"):
                log.warning(
                    "no trigger notifies the pollers of new rows in %s; new events wait up to "
                    "--poll-interval (%gs): run cdc-relay schema apply poller",
                    outbox.qualified,
                    self.settings.poll_interval,
                    extra={"action": "no_trigger"},
                )
            _check_lock_room(conn, self.settings)
            _take_poll_lock(conn, outbox)  # refused now rather than after connecting to Kafka
        return outbox

    def _listen(self, outbox: Outbox) -> None:
        """Turn notifications into wake-ups; reconnect when the connection drops."""
        listen = sql.SQL(QUERIES["listen"]).format(channel=sql.Identifier(outbox.channel))
        failures = 0  # connection failures in a row
        while not self.stopping.is_set():
            try:
                with psycopg.connect(self.conninfo, autocommit=True) as conn:
                    conn.execute(listen)
                    self._listening = True
                    self.wake.notify()  # whatever was written while nobody listened
                    failures = 0
                    while not self.stopping.is_set():
                        for _ in conn.notifies(timeout=WAIT_SLICE * 5):
                            self.wake.notify()
            except psycopg.DatabaseError as exc:
                # A standby refuses LISTEN (read-only): wait for the primary, as the workers do.
                if _kind(exc) == _REFUSED:
                    self.fail(_refusal(exc, outbox, "LISTEN"))
                    return
                log.warning("listener: %s", first_line(exc), extra={"action": "disconnected"})
            self._listening = False
            failures += 1
            self.stopping.wait(backoff(failures, _RECONNECT_BASE, _RECONNECT_MAX))

    def _register_metrics(self) -> None:
        CONNECTED.labels(service="postgres").set_function(lambda: self._listening)
        CONNECTED.labels(service="kafka").set_function(
            lambda: any(w.publisher.sink.connected for w in self._workers)
        )
        self.health.readiness = self._readiness

    def _readiness(self) -> tuple[bool, str]:
        if not self._listening:
            return False, "not connected to PostgreSQL"
        if not any(w.publisher.sink.connected for w in self._workers):
            return False, "not connected to Kafka"
        return True, "ok"

    def _log_progress(self) -> None:
        published = sum(w.counts.published for w in self._workers)
        failed = sum(w.counts.failed for w in self._workers)
        pending = None if self.outbox is None else _pending_counts(self.conninfo, self.outbox)
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


def _pending_counts(conninfo: str, outbox: Outbox) -> dict[str, int] | None:
    """The outbox's unprocessed rows and dead letters; None when the database cannot say (the
    workers meet the same error and report it)."""
    try:
        with psycopg.connect(conninfo, autocommit=True, row_factory=dict_row) as conn:
            return conn.execute(outbox.query("pending_counts")).fetchone()
    except psycopg.DatabaseError:
        return None
