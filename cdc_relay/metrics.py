"""Every Prometheus metric of cdc-relay, and the HTTP endpoint that serves them with health.

``/metrics`` (Prometheus text format), ``/healthz`` (the relay's loop is alive) and
``/readyz`` (connected to PostgreSQL and Kafka and moving: no event has waited for Kafka
``STALL_TIMEOUT`` seconds with none acknowledged meanwhile) share one port.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import REGISTRY, Counter, Gauge, Histogram, make_wsgi_app

# -- the usual outbox names (both relays) -----------------------------------------------------

EVENTS_PUBLISHED = Counter(
    "outbox_events_published",
    "Events Kafka acknowledged.",
    ["relay"],
)
EVENTS_FAILED = Counter(
    "outbox_events_failed",
    "Events Kafka refused (the stream relay stops; the poller retries, then dead-letters), by "
    "event_type: the first 100 types seen by the process, then '(other)'.",
    ["relay", "event_type"],
)
EVENT_TYPE_LABELS = 100
"""How many event types get a series of their own: the label is the application's data,
and a series per value would grow without bound."""
_event_types: set[str] = set()
_event_types_lock = threading.Lock()


def count_failed(relay: str, event_type: str) -> None:
    """One more event Kafka refused (EVENTS_FAILED), under its event type while fewer than
    EVENT_TYPE_LABELS types have been seen, under ``(other)`` after that."""
    with _event_types_lock:
        if event_type not in _event_types and len(_event_types) < EVENT_TYPE_LABELS:
            _event_types.add(event_type)
        label = event_type if event_type in _event_types else "(other)"
    EVENTS_FAILED.labels(relay=relay, event_type=label).inc()


EVENTS_PENDING = Gauge(
    "outbox_events_pending",
    "Events not yet acknowledged: the poller's unprocessed rows, the stream's events in flight.",
)
OUT_OF_SEQ_ORDER = Counter(
    "outbox_events_out_of_seq_order",
    "Events published after a later event (higher seq) of their aggregate: their transaction "
    "committed after that one went out.",
    ["relay"],
)
TRACE_CONTEXT_MALFORMED = Counter(
    "outbox_trace_context_malformed",
    "Events whose --trace-column held no W3C traceparent: sent as stored (a receiver ignores "
    "it), each logged with its event id.",
)
DEAD_LETTERS = Gauge(
    "outbox_dead_letters",
    "Rows the poller gave up on (attempts >= max attempts).",
)
BATCH_DURATION = Histogram(
    "outbox_batch_duration_seconds",
    "Time from claiming a poller batch to committing it.",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)

# -- the CDC relay ----------------------------------------------------------------------------

WAL_RETAINED = Gauge(
    "cdc_relay_slot_wal_retained_bytes",
    "WAL the replication slot holds back (pg_current_wal_lsn() - restart_lsn).",
)
SLOT_SAFE_WAL = Gauge(
    "cdc_relay_slot_safe_wal_bytes",
    "WAL that may still be written before PostgreSQL may invalidate the slot "
    "(pg_replication_slots.safe_wal_size; +Inf without max_slot_wal_keep_size, negative once "
    "past it).",
)
SLOT_SAFE_WAL.set(float("inf"))  # until a relay reads its slot: no limit known
SLOT_INVALIDATED = Gauge(
    "cdc_relay_slot_invalidated",
    "1 once PostgreSQL has invalidated the slot (max_slot_wal_keep_size, "
    "idle_replication_slot_timeout, a conflict on a standby): it can never be streamed again, "
    "and the relay stops.",
)
FAILOVER_READY = Gauge(
    "cdc_relay_slot_failover_ready",
    "1 while a standby among the hosts of --dsn holds a usable copy of the relay's failover "
    "slot (synchronised, persistent, not invalidated), 0 when none does: a failover now would "
    "lose the slot. Only for a failover slot; read every 10 s.",
    ["slot"],
)
FAILOVER_STANDBY_READY = Gauge(
    "cdc_relay_slot_failover_standby_ready",
    "1 while this standby (host:port of --dsn) holds a usable copy of the failover slot, 0 "
    "when it does not or does not answer.",
    ["slot", "standby"],
)
FAILOVER_LAG = Gauge(
    "cdc_relay_slot_failover_lag_bytes",
    "How far this standby's copy of the failover slot is behind the primary's slot "
    "(confirmed_flush_lsn, in bytes of WAL): after a promotion the relay resumes from the "
    "copy's position, and sends that stretch again. No series while it holds no copy.",
    ["slot", "standby"],
)
CONFIRMED_LSN = Gauge(
    "cdc_relay_confirmed_lsn",
    "The last position confirmed to PostgreSQL, as a number.",
)
LATENCY = Histogram(
    "cdc_relay_end_to_end_latency_seconds",
    "From a transaction's commit in PostgreSQL to Kafka's acknowledgement of its last event.",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
)
IN_FLIGHT = Gauge(
    "cdc_relay_events_in_flight",
    "Events handed to the producer and not yet acknowledged.",
)
SINCE_LAST_EVENT = Gauge(
    "cdc_relay_seconds_since_last_event",
    "Seconds since the relay last read an event.",
)
KAFKA_TRANSACTIONS = Counter(
    "cdc_relay_kafka_transactions",
    "Kafka transactions of stream --exactly-once, by outcome (committed, aborted).",
    ["outcome"],
)
KAFKA_TRANSACTION_SECONDS = Histogram(
    "cdc_relay_kafka_transaction_seconds",
    "From a Kafka transaction's first event to its commit (stream --exactly-once).",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
SHARD = Gauge(
    "cdc_relay_shard",
    "1, labelled with the shard this relay streams (stream --shard K/N): join it with the "
    "relay's other metrics on the instance to see them per shard.",
    ["shard", "shards"],
)
MESSAGES_IGNORED = Counter(
    "cdc_relay_messages_ignored",
    "Logical decoding messages of the outbox prefix passed over by stream --ignore-messages "
    "(without --messages a message is no event): each is logged with its event id.",
)
CONNECTED = Gauge(
    "cdc_relay_connected",
    "1 while connected to the service; a stream relay standing by (cdc_relay_standby) is "
    "connected to postgres while PostgreSQL answers its attempts to take the slot.",
    ["service"],
)
STANDBY = Gauge(
    "cdc_relay_standby",
    "1 while this relay stands by (stream --standby): another relay streams the slot, and "
    "this one waits to take it over; 0 while it streams.",
)


def observe_slot(row: Mapping[str, Any]) -> None:
    """The slot's gauges, from its row of the ``slot`` query (whoever reads it sets them)."""
    if row.get("retained_bytes") is not None:
        WAL_RETAINED.set(row["retained_bytes"])
    invalidated = bool(row.get("invalidated"))
    SLOT_INVALIDATED.set(1 if invalidated else 0)
    safe = row.get("safe_wal_bytes")
    SLOT_SAFE_WAL.set(0 if invalidated else float("inf") if safe is None else safe)


STALL_TIMEOUT = 120.0
"""Seconds events may wait for Kafka with none acknowledged before the relay is not ready:
longer than the longest Kafka transaction of stream --exactly-once (--transaction-interval,
60 s at most), whose events are acknowledged only at its commit."""


class Health:
    """What the health endpoints report. The relay's loop calls ``beat`` as it turns (alive);
    ``readiness`` says whether it is connected, ``progress`` how many events wait for Kafka
    and how many it has delivered so far (ready: connected and moving).

    Not ready is not dead: Kubernetes takes a relay that is not ready out of its Services and
    rollouts wait for it, but only liveness restarts it, and a restart brings neither a broker
    nor a database back. So the relay is alive while it waits, and not ready while events
    wait ``stall_timeout`` seconds for Kafka with none acknowledged meanwhile."""

    def __init__(
        self,
        liveness_timeout: float = 60.0,
        stall_timeout: float = STALL_TIMEOUT,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._clock = clock
        self._beat = clock()
        self._liveness_timeout = liveness_timeout
        self._stall_timeout = stall_timeout
        self.readiness: Callable[[], tuple[bool, str]] = lambda: (False, "starting")
        self.progress: Callable[[], tuple[int, int]] = lambda: (0, 0)
        self._delivered = 0  # delivered when last looked at
        self._moved = self._beat  # when events last moved, or none waited

    def beat(self) -> None:
        self._beat = self._clock()

    def alive(self) -> tuple[bool, str]:
        stalled = self._clock() - self._beat
        if stalled > self._liveness_timeout:
            return False, f"loop stalled for {stalled:.0f}s"
        return True, "ok"

    def ready(self) -> tuple[bool, str]:
        alive, reason = self.alive()
        if not alive:
            return False, reason
        ready, reason = self.readiness()
        stuck = self._stuck()
        if ready and stuck:
            return False, stuck
        return ready, reason

    def _stuck(self) -> str | None:
        """Why the relay is not moving: events wait for Kafka and none was acknowledged for
        ``stall_timeout`` seconds; None while it moves (or nothing waits)."""
        waiting, delivered = self.progress()
        now = self._clock()
        if waiting <= 0 or delivered != self._delivered:
            self._delivered = delivered
            self._moved = now
            return None
        still = now - self._moved
        if still < self._stall_timeout:
            return None
        return f"{waiting} events waiting for Kafka, none acknowledged for {still:.0f}s"


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes and probes are not worth a log line each."""


def _app(health: Health) -> Callable[..., Iterable[bytes]]:
    metrics = make_wsgi_app(REGISTRY)

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path in ("/healthz", "/readyz"):
            ok, reason = health.alive() if path == "/healthz" else health.ready()
            status = "200 OK" if ok else "503 Service Unavailable"
            start_response(status, [("Content-Type", "text/plain; charset=utf-8")])
            return [reason.encode() + b"\n"]
        result: Iterable[bytes] = metrics(environ, start_response)
        return result

    return app


def serve(host: str, port: int, health: Health) -> WSGIServer:
    """Serve /metrics, /healthz and /readyz in a daemon thread; return the server."""
    server = make_server(host, port, _app(health), _Server, handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    return server
