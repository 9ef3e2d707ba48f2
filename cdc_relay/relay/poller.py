"""The polling relay: claim outbox rows, publish them through the same router and sink as
``stream``, mark them processed.

The relay runs the workers (worker.py: one cycle, one transaction, claims, publishes and
marks a batch), each a thread with its own connection and its own producer (librdkafka does
its work outside the GIL) that looks first at its share of the aggregates, and a listener
thread that turns NOTIFY into wake-ups; it checks the database first and logs the progress.

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

import logging
import threading

import psycopg
from psycopg.conninfo import make_conninfo

from cdc_relay.kafka.sink import kafka_sink
from cdc_relay.metrics import (
    CONNECTED,
    DEAD_LETTERS,
    EVENTS_PENDING,
    Health,
)
from cdc_relay.postgres.connection import connect
from cdc_relay.postgres.store import (
    REFUSED,
    Outbox,
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
from cdc_relay.relay.backoff import reconnect_delay
from cdc_relay.relay.batch import poll_router
from cdc_relay.relay.pipeline import WAIT
from cdc_relay.relay.stages import OpenSink, OpenStore, OutboxStore
from cdc_relay.relay.worker import PollSettings, Wake, Worker

log = logging.getLogger(__name__)

APPLICATION_NAME = "cdc-relay poll"
"""The ``application_name`` of the poller's sessions, to tell them apart in pg_stat_activity."""


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
        self._open_sink = open_sink or kafka_sink(
            settings.kafka_config, relay="poll", creation=settings.topic_creation
        )
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
            outbox = resolve(conn, self.settings.table, trace_column=self.settings.trace_column)
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
            self.stopping.wait(reconnect_delay(failures))

    def _register_metrics(self) -> None:
        CONNECTED.labels(service="postgres").set_function(lambda: self._listening)
        CONNECTED.labels(service="kafka").set_function(
            lambda: any(w.batch.sink.connected for w in self._workers)
        )
        self.health.readiness = self._readiness
        # Moving: messages the workers' producers hold, and the rows they marked published.
        self.health.progress = lambda: (
            sum(w.batch.sink.in_flight() for w in self._workers),
            sum(w.counts.published for w in self._workers),
        )

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
