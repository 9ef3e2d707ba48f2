"""The CDC relay: the one place that wires replication -> decode -> route -> sink -> tracker.

Single-threaded on purpose: delivery reports are served by ``poll`` on this thread, so the
tracker needs no locks, and the order of events is the order of the stream.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from cdc_relay import pgoutput, wal2json
from cdc_relay.checkpoint import LsnTracker, Transaction
from cdc_relay.errors import DecodeError, PreflightError, RelayError, SlotInUseError
from cdc_relay.events import (
    Begin,
    Commit,
    Insert,
    LogicalMessage,
    OutboxLayout,
    Record,
    Relation,
    RowMapper,
    envelope_event,
)
from cdc_relay.lsn import Lsn, format_lsn
from cdc_relay.metrics import (
    CONFIRMED_LSN,
    CONNECTED,
    EVENTS_PENDING,
    EVENTS_PUBLISHED,
    IN_FLIGHT,
    LATENCY,
    SINCE_LAST_EVENT,
    Health,
)
from cdc_relay.queries import QUERIES
from cdc_relay.replication import ConnectionLost, Keepalive, ReplicationConnection
from cdc_relay.routing import Message, Router
from cdc_relay.sink import KafkaSink
from cdc_relay.slot import PLUGINS, SlotWatcher, connect
from cdc_relay.wal2json import Wal2JsonDecoder

log = logging.getLogger(__name__)

_READ_TIMEOUT = 0.1  # seconds without data before serving delivery reports and timers
_RECONNECT_MAX = 10.0
# A newly acknowledged position is confirmed this soon: after a crash, PostgreSQL replays
# what was not confirmed, so this interval bounds the duplicates (events/s x interval).
_CONFIRM_AFTER = 0.2
_STANDBY_RETRY = 1.0  # seconds between a standby's attempts to take the slot


@dataclass(frozen=True)
class StreamSettings:
    dsn: str
    slot: str
    publication: str
    table: str
    kafka_config: dict[str, str]
    topic_template: str
    status_interval: float = 10.0
    shutdown_timeout: float = 30.0
    kafka_timeout: float = 15.0
    progress_interval: float = 10.0
    layout: OutboxLayout = field(default_factory=OutboxLayout)
    message_prefix: str = "outbox"
    tombstone_on_empty: bool = False
    dead_letter_topic: str | None = None
    standby: bool = False  # wait while another relay holds the slot, then take over


@dataclass
class Progress:
    events: int = 0
    transactions: int = 0
    started: float = field(default_factory=time.monotonic)


def _pgoutput(data: bytes) -> Sequence[Record]:
    return (pgoutput.decode(data),)


class _Stopping(Exception):
    """A stop was requested while waiting on a full producer queue."""


class StreamRelay:
    """Streams one slot to Kafka until stopped; confirms only acknowledged positions."""

    def __init__(self, settings: StreamSettings, health: Health | None = None) -> None:
        self.settings = settings
        self.health = health or Health()
        self.tracker = LsnTracker()
        self.router = Router(settings.topic_template, settings.tombstone_on_empty)
        self.sink = KafkaSink(
            settings.kafka_config,
            on_ack=self._acked,
            relay="stream",
            dead_letter_topic=settings.dead_letter_topic,
        )
        self._plugin = "pgoutput"
        self._decode: Callable[[bytes], Sequence[Record]] = _pgoutput
        self.progress = Progress()
        self._published = EVENTS_PUBLISHED.labels(relay="stream")
        self._last_event = time.monotonic()
        self._table: tuple[str, str] = ("", "")
        self._stop = False
        self._conn: ReplicationConnection | None = None
        self._mappers: dict[int, RowMapper | None] = {}
        self._begin: Begin | None = None
        self._transaction: Transaction | None = None
        self._received: Lsn = 0
        self._last_status = 0.0
        self._last_progress = time.monotonic()
        self._sent_flush: Lsn = -1
        self._standing_by = False

    def _acked(self, transaction: Transaction) -> None:
        self.tracker.acked(transaction)
        self._published.inc()
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
        self._table, confirmed, self._plugin = self._check_database()
        self.sink.check_reachable(self.settings.kafka_timeout)
        self._conn = self._acquire()
        if self._conn is None:
            return  # stopped while waiting as a standby
        watcher = SlotWatcher(self.settings.dsn, self.settings.slot).start()
        log.info(
            "streaming slot %s from %s",
            self.settings.slot,
            confirmed,
            extra={"action": "start", "slot": self.settings.slot, "lsn": confirmed},
        )
        try:
            while not self._stop:
                try:
                    self._pump()
                except ConnectionLost as exc:
                    log.warning(str(exc), extra={"action": "disconnected"})
                    self._recover()
        except _Stopping:
            pass
        finally:
            watcher.stop()
            self._shutdown()

    # -- the loop -------------------------------------------------------------------------

    def _pump(self) -> None:
        conn = self._require_conn()
        tracker = self.tracker
        sink = self.sink
        while not self._stop:
            message = conn.read(_READ_TIMEOUT)
            if message is None:
                pass
            elif isinstance(message, Keepalive):
                self._received = max(self._received, message.wal_end)
                tracker.keepalive(message.wal_end)
                if message.reply_requested:
                    self._send_status(force=True)
            else:
                self._received = max(self._received, message.wal_end)
                try:
                    records = self._decode(message.data)
                except DecodeError as exc:
                    raise RelayError(
                        f"cannot decode {self._plugin} message at "
                        f"{format_lsn(message.wal_start)}: {exc}; this is a bug, please report "
                        "it with the PostgreSQL and plugin versions"
                    ) from None
                for record in records:
                    self._handle(record)
            sink.poll(0)
            self._send_status()

    def _handle(self, record: Record) -> None:
        if isinstance(record, Insert):
            if record.relid not in self._mappers or self._begin is None:
                raise RelayError(
                    f"insert into relation {record.relid} arrived before its Relation or Begin "
                    "message; this is a bug, please report it"
                )
            mapper = self._mappers[record.relid]
            if mapper is None or self._transaction is None:
                return  # a row of another table in the publication
            event = mapper.event(record, self._begin)
            self._send(self.router.route(event), self._transaction)
        elif isinstance(record, Begin):
            self._begin = record
            self._transaction = self.tracker.begin(record.commit_time_us)
        elif isinstance(record, Commit):
            if self._transaction is not None:
                self.tracker.commit(self._transaction, record.end_lsn)
                self.progress.transactions += 1
            self._begin = None
            self._transaction = None
        elif isinstance(record, Relation):
            ours = (record.namespace, record.name) == self._table
            self._mappers[record.relid] = (
                RowMapper.for_relation(record, self.settings.layout) if ours else None
            )
        elif isinstance(record, LogicalMessage):
            self._message(record)

    def _message(self, record: LogicalMessage) -> None:
        """A logical decoding message with our prefix is an event, routed like a row."""
        if record.prefix != self.settings.message_prefix:
            return  # another application's message
        if record.transactional:
            if self._transaction is None or self._begin is None:
                raise RelayError("transactional message outside a transaction; please report it")
            event = envelope_event(record, self._begin)
            self._send(self.router.route(event), self._transaction)
        else:
            # Sent at once, even if its transaction rolls back: its own unit in the tracker.
            event = envelope_event(record, None)
            transaction = self.tracker.begin(time.time_ns() // 1000)
            self._send(self.router.route(event), transaction)
            self.tracker.commit(transaction, record.lsn)

    def _send(self, message: Message, transaction: Transaction) -> None:
        self.tracker.sent(transaction)
        while not self.sink.offer(message, transaction):
            # Queue full: wait for acks, but keep the walsender's timeout from firing.
            self.sink.poll(0.05)
            self._send_status()
            if self._stop:
                raise _Stopping
        self.progress.events += 1
        self._last_event = time.monotonic()

    def _send_status(self, force: bool = False) -> None:
        self.health.beat()
        now = time.monotonic()
        since = now - self._last_status
        safe = self.tracker.safe_lsn
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

    def _check_database(self) -> tuple[tuple[str, str], str, str]:
        """Slot, publication and table exist as ``stream`` needs them.

        Returns the table's (schema, name), the slot's confirmed position and its plugin.
        """
        with connect(self.settings.dsn) as conn:
            slot = conn.execute(QUERIES["slot"], {"slot": self.settings.slot}).fetchone()
            if not slot:
                raise PreflightError(
                    f"replication slot {self.settings.slot!r} does not exist; "
                    "run cdc-relay setup-slot first"
                )
            if slot["plugin"] not in PLUGINS:
                raise PreflightError(
                    f"slot {self.settings.slot} uses {slot['plugin']}; stream decodes "
                    f"{' and '.join(PLUGINS)}: create such a slot with cdc-relay setup-slot"
                )
            publication = conn.execute(
                QUERIES["publication"], {"publication": self.settings.publication}
            ).fetchone()
            if not publication and slot["plugin"] == "pgoutput":
                raise PreflightError(
                    f"publication {self.settings.publication!r} does not exist; "
                    "run cdc-relay setup-slot first"
                )
            table = conn.execute(QUERIES["table_name"], {"table": self.settings.table}).fetchone()
            if not table:
                raise PreflightError(f"table {self.settings.table} does not exist; check --table")
            return (
                (str(table["schema"]), str(table["name"])),
                str(slot["confirmed_flush_lsn"]),
                str(slot["plugin"]),
            )

    def _open(self) -> ReplicationConnection:
        """Connect and start streaming; decoder state starts afresh with each connection."""
        if self._plugin == "wal2json":
            self._decode = Wal2JsonDecoder().decode
            options = {
                **wal2json.START_OPTIONS,
                "add-tables": wal2json.table_filter(*self._table),
                "add-msg-prefixes": self.settings.message_prefix,
            }
        else:
            self._decode = _pgoutput
            options = {
                "proto_version": "1",
                "publication_names": self.settings.publication,
                "messages": "true",
            }
        conn = ReplicationConnection(self.settings.dsn)
        try:
            conn.start(self.settings.slot, self.tracker.safe_lsn, options)
        except BaseException:
            conn.close()
            raise
        self._last_status = 0.0
        return conn

    def _acquire(self) -> ReplicationConnection | None:
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
            else:
                self._standing_by = False
                return conn
            deadline = time.monotonic() + _STANDBY_RETRY
            while not self._stop and time.monotonic() < deadline:
                self.health.beat()
                self.sink.poll(0.1)  # keeps broker statistics, hence readiness, current
        return None

    def _recover(self) -> None:
        """After a lost connection: settle what is in flight, forget the rest, reconnect."""
        self._close_conn()
        self._drain(self.settings.shutdown_timeout, confirm=False)
        self.tracker.reset()
        self._mappers.clear()
        self._begin = None
        self._transaction = None
        delay = 0.5
        while not self._stop:
            try:
                self._conn = self._open()
            except (ConnectionLost, RelayError) as exc:
                log.warning(
                    "reconnect failed, retrying in %.1fs: %s",
                    delay,
                    exc,
                    extra={"action": "reconnect_failed"},
                )
                time.sleep(delay)
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

    def _shutdown(self) -> None:
        try:
            if self._conn is not None:
                self._drain(self.settings.shutdown_timeout, confirm=True)
                self._send_status(force=True)
        except ConnectionLost as exc:
            log.warning("could not confirm the final position: %s", exc)
        finally:
            self._close_conn()
            left = self.sink.close()
            self._log_progress()
            log.info(
                "stopped; %d events not acknowledged will be sent again on restart",
                left,
                extra={"action": "stop", "lsn": format_lsn(self.tracker.safe_lsn)},
            )

    def _close_conn(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _require_conn(self) -> ReplicationConnection:
        if self._conn is None:
            raise ConnectionLost("not connected")
        return self._conn
