"""Where one event is: its row, the slot, the poller's marks, the dead letters, and Kafka.

Nothing here changes anything. Kafka is not scanned whole: the topic comes from the topic
template, the partition from the key (murmur2, as the relay's producer puts it), the first
offset from the event's time (``offsets_for_times``), then a bounded scan for the ``id``
header (cdc_relay.kafka.lookup does that part). The slot's unconfirmed changes are read
through a temporary copy of it, so a relay streaming the slot is not disturbed.

Here: what the database knows (the row, the slot, its unconfirmed changes, the dead letters),
where that says to look on Kafka, and the answer drawn from it all.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import psycopg
from psycopg import sql

from cdc_relay.errors import PreflightError, UsageError
from cdc_relay.events import (
    Begin,
    Insert,
    LogicalMessage,
    OutboxEvent,
    Record,
    Relation,
    RowMapper,
    SchemaError,
    envelope_event,
)
from cdc_relay.kafka.lookup import Search, find
from cdc_relay.kafka.routing import fill_table, legal_topic
from cdc_relay.lsn import format_lsn
from cdc_relay.postgres import pgoutput, wal2json
from cdc_relay.postgres.connection import connect
from cdc_relay.postgres.tables import OutboxTable, find_table
from cdc_relay.queries import QUERIES

# -- what the database knows -----------------------------------------------------------------


@dataclass
class Pending:
    """The event among the changes the slot has not confirmed yet."""

    form: str  # "row" or "message"
    commit_lsn: str
    commit_time: dt.datetime
    aggregate_type: str
    aggregate_id: str | None
    event_type: str


@dataclass
class Trace:
    """Everything known about one event, and the answer drawn from it."""

    event_id: str
    row: dict[str, Any] | None = None
    committed: bool | None = None
    commit_time: dt.datetime | None = None
    commit_time_source: str | None = None  # "commit" or "created_at"
    slot: dict[str, Any] | None = None
    pending: Pending | None = None
    pending_scan: str | None = None  # "complete", "cut" or why it was not done
    confirmed_past_commit: bool | None = None
    dead_letter: dict[str, Any] | None = None
    kafka: Search = field(default_factory=Search)
    latency_seconds: float | None = None
    on_kafka: bool = False
    answer: str = ""

    def as_json(self) -> dict[str, Any]:
        return dict(_jsonable(asdict(self)))


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _jsonable(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(item) for item in value]
    if isinstance(value, dt.datetime):
        return value.isoformat()
    if isinstance(value, uuid.UUID):
        return str(value)
    if isinstance(value, bytes | memoryview):  # a dead letter's key
        return bytes(value).decode(errors="backslashreplace")
    return value


@dataclass(frozen=True)
class TraceSettings:
    dsn: str
    slot: str
    publication: str
    table: str
    message_prefix: str
    kafka: Mapping[str, str]  # consumer settings: bootstrap.servers and the user's
    topic_template: str
    kafka_timeout: float
    max_changes: int  # unconfirmed changes of the slot to read at most
    max_wal_bytes: int  # WAL to decode at most, from the slot's restart position
    max_messages: int  # messages to scan at most per partition
    clock_skew: float  # seconds the clocks of PostgreSQL and Kafka may differ by


def trace(settings: TraceSettings, event_id: str) -> Trace:
    """Find ``event_id`` everywhere it can be, and say where it is."""
    try:
        event_id = str(uuid.UUID(event_id))
    except ValueError:
        raise UsageError(f"{event_id!r} is not an event id (a UUID)") from None
    result = Trace(event_id)
    with connect(settings.dsn) as conn:
        table = _database(conn, settings, result)
    # The topic template's {schema} and {table} name the outbox table (several on one slot).
    template = fill_table(settings.topic_template, table.schema, table.name)
    _kafka(replace(settings, topic_template=template), result)
    result.answer = answer(result)
    return result


def _database(
    conn: psycopg.Connection[dict[str, Any]], settings: TraceSettings, result: Trace
) -> OutboxTable:
    """What the database knows of the event; returns the outbox table."""
    table = find_table(conn, settings.table)
    if table is None:
        raise PreflightError(
            f"table {settings.table} does not exist; check --table (cdc-relay schema apply "
            "outbox makes it)"
        )
    query = sql.SQL(QUERIES["trace_row"]).format(table=table.identifier)
    row = conn.execute(query, {"id": result.event_id}).fetchone()
    if row is not None:
        result.row = dict(row["row"])
        result.committed = True  # another session sees only committed rows
        if row["commit_time"] is not None:
            result.commit_time, result.commit_time_source = row["commit_time"], "commit"
        elif row["created_at"] is not None:
            result.commit_time, result.commit_time_source = row["created_at"], "created_at"
    if (conn.execute(QUERIES["trace_dead_letters"]).fetchone() or {}).get("present"):
        letter = conn.execute(QUERIES["trace_dead_letter"], {"id": result.event_id}).fetchone()
        result.dead_letter = dict(letter) if letter else None
    slot = conn.execute(QUERIES["slot"], {"slot": settings.slot}).fetchone()
    result.slot = {"slot_name": settings.slot, **slot} if slot else None
    if slot is None:
        result.pending_scan = f"no slot {settings.slot}"
        return table
    try:
        result.pending, complete = _unconfirmed(conn, settings, slot["plugin"], table, result)
    except psycopg.DatabaseError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        result.pending_scan = f"the slot's unconfirmed changes could not be read: {first}"
        return table
    result.pending_scan = "complete" if complete else "cut"
    if result.pending is not None:
        result.committed = True
        result.confirmed_past_commit = False
        result.commit_time, result.commit_time_source = result.pending.commit_time, "commit"
    elif complete and result.committed:
        result.confirmed_past_commit = True
    return table


def _unconfirmed(
    conn: psycopg.Connection[dict[str, Any]],
    settings: TraceSettings,
    plugin: str,
    table: OutboxTable,
    result: Trace,
) -> tuple[Pending | None, bool]:
    """The event among the slot's unconfirmed changes, read from a temporary copy of the slot
    (a relay may be streaming the slot itself); and whether every such change was read."""
    copy = f"cdc_relay_trace_{uuid.uuid4().hex[:12]}"
    if plugin == "wal2json":
        options = {
            **wal2json.START_OPTIONS,
            "add-tables": wal2json.table_filter(table.schema, table.name),
            "add-msg-prefixes": settings.message_prefix,
        }
    else:
        options = {
            "proto_version": "1",
            "publication_names": pgoutput.publication_names(settings.publication),
            "messages": "true",
        }
    pairs = [item for pair in options.items() for item in pair]
    # The copy is temporary: PostgreSQL drops it when this session ends, however it ends.
    conn.execute(QUERIES["trace_copy_slot"], {"slot": settings.slot, "copy": copy})
    try:
        # Decoding reads all the WAL the slot holds back, other tables' too, on the server:
        # bounded in bytes, since the changes of other tables do not count in max_changes.
        bound = conn.execute(
            QUERIES["trace_peek_bound"], {"slot": copy, "bytes": settings.max_wal_bytes}
        ).fetchone()
        upto = (bound or {}).get("upto")
        rows = conn.execute(
            QUERIES["trace_peek"],
            {"slot": copy, "upto": upto, "limit": settings.max_changes, "options": pairs},
        ).fetchall()
    finally:
        conn.execute(QUERIES["drop_slot"], {"slot": copy})
    complete = len(rows) < settings.max_changes and upto is None
    records: Iterator[Record]
    if plugin == "wal2json":
        decoder = wal2json.Wal2JsonDecoder()
        records = (record for row in rows for record in decoder.decode(bytes(row["data"])))
    else:
        records = (pgoutput.decode(bytes(row["data"])) for row in rows)
    for form, event in _events(records, table, settings.message_prefix):
        if event.id == result.event_id:
            pending = Pending(
                form,
                format_lsn(event.commit_lsn),
                dt.datetime.fromtimestamp(event.commit_time_us / 1e6, dt.UTC),
                event.aggregate_type,
                event.aggregate_id,
                event.event_type,
            )
            return pending, complete
    return None, complete


def _events(
    records: Iterator[Record], table: OutboxTable, prefix: str
) -> Iterator[tuple[str, OutboxEvent]]:
    """The outbox events among decoded records: the table's rows and the prefix's messages.
    The table is known by its OID (pgoutput) or its name (wal2json, which sends no OID)."""
    begin: Begin | None = None
    mappers: dict[int, RowMapper] = {}
    for record in records:
        if isinstance(record, Begin):
            begin = record
        elif isinstance(record, Relation):
            mappers.pop(record.relid, None)
            if record.relid == table.oid or (record.namespace, record.name) == (
                table.schema,
                table.name,
            ):
                with contextlib.suppress(SchemaError):  # a column it needs is gone
                    mappers[record.relid] = RowMapper.for_relation(record)
        elif isinstance(record, Insert) and begin is not None and record.relid in mappers:
            try:
                yield "row", mappers[record.relid].event(record, begin)
            except SchemaError:
                continue
        elif isinstance(record, LogicalMessage) and record.prefix == prefix:
            try:
                event = envelope_event(record, begin if record.transactional else None)
            except SchemaError:
                continue
            yield "message", event


# -- what Kafka holds ------------------------------------------------------------------------


def _kafka(settings: TraceSettings, result: Trace) -> None:
    search = result.kafka
    where = _where(settings, result)
    if where is None:
        search.problem = (
            "nothing tells its topic and key: no row, no unconfirmed change and no dead letter "
            "names them"
        )
        return
    topic, key, since = where
    since -= dt.timedelta(seconds=settings.clock_skew)
    find(
        settings.kafka,
        search,
        topic,
        key,
        since,
        result.event_id,
        settings.kafka_timeout,
        settings.max_messages,
    )
    if search.found is not None:
        result.on_kafka = True
        if search.found.timestamp is not None and result.commit_time is not None:
            result.latency_seconds = round(
                (search.found.timestamp - result.commit_time).total_seconds(), 3
            )


def _where(settings: TraceSettings, result: Trace) -> tuple[str, bytes | None, dt.datetime] | None:
    """The event's topic, key and a time before it reached Kafka, from what the database knows."""
    if result.pending is not None:
        fields = result.pending
        return (
            _topic(settings.topic_template, fields.aggregate_type, fields.event_type),
            None if fields.aggregate_id is None else fields.aggregate_id.encode(),
            fields.commit_time,
        )
    if result.row is not None and result.commit_time is not None:
        row = result.row
        return (
            _topic(settings.topic_template, str(row["aggregate_type"]), str(row["event_type"])),
            None if row.get("aggregate_id") is None else str(row["aggregate_id"]).encode(),
            result.commit_time,
        )
    if result.dead_letter is not None:
        letter = result.dead_letter
        key = letter["key"]
        return str(letter["topic"]), None if key is None else bytes(key), letter["dead_at"]
    return None


def _topic(template: str, aggregate_type: str, event_type: str) -> str:
    return legal_topic(template.format(aggregate_type=aggregate_type, event_type=event_type))


# -- the answer ------------------------------------------------------------------------------


def answer(t: Trace) -> str:
    """One paragraph that says where the event is, or why it is not on Kafka yet."""
    row = t.row
    if t.on_kafka and t.kafka.found is not None:
        found = t.kafka.found
        text = f"on Kafka: {found.topic} partition {found.partition} offset {found.offset}"
        if t.latency_seconds is not None:
            since = "its commit" if t.commit_time_source == "commit" else "created_at"
            text += f", appended {t.latency_seconds:g} s after {since}"
        return text
    if t.dead_letter is not None:
        letter = t.dead_letter
        return (
            f"dead letter of stream since {letter['dead_at']}: Kafka refused it for "
            f"{letter['topic']} ({letter['error_code']}: {letter['error']}); its content is in "
            "table cdc_relay_dead_letters and was sent to the dead-letter topic"
        )
    if row is not None and row.get("retry_after") == "infinity" and not row.get("processed_at"):
        return (
            f"dead letter of poll: the poller gave up after {row.get('attempts')} attempts "
            f"({row.get('last_error')}); fix the cause, then cdc-relay dead-letters retry "
            f"--id {t.event_id}"
        )
    where = "not on Kafka yet" if t.committed else "not found"
    if t.kafka.problem and t.kafka.topic:
        where += f" ({t.kafka.problem})"
    if t.pending is not None:
        slot = t.slot or {}
        head = (
            f"{where}: committed at {t.pending.commit_lsn} (as a {t.pending.form}), after slot "
            f"{slot.get('slot_name', 'the slot')}'s confirmed position "
            f"{slot.get('confirmed_flush_lsn')}"
        )
        if not slot.get("active"):
            return head + "; no relay is streaming the slot (inactive): start cdc-relay stream"
        return (
            head + f"; the relay (pid {slot.get('active_pid')}) is behind, or waits for "
            "Kafka's acknowledgement"
        )
    if row is not None:
        if row.get("processed_at"):
            return (
                f"{where}: the poller marked it processed at {row['processed_at']}, but it is "
                f"not among the messages scanned on {t.kafka.topic} since {t.kafka.since}"
            )
        if row.get("attempts"):
            return (
                f"{where}: Kafka refused it {row['attempts']} times ({row.get('last_error')}); "
                f"the poller tries again after {row.get('retry_after')}"
            )
        if t.confirmed_past_commit:
            return (
                f"{where}: the slot is confirmed past its commit, but it is not among the "
                f"messages scanned on {t.kafka.topic} since {t.kafka.since} (was it committed "
                "before the slot was made, or has the topic's retention removed it?)"
            )
        if t.slot is None:
            return (
                f"{where}: the row is committed; no slot (stream not set up, or another "
                "--slot) and the poller has not processed it yet: is a relay running?"
            )
        if t.pending_scan == "cut":
            return (
                f"{where}: the row is committed; not among the unconfirmed changes of the slot "
                "read (at most --max-changes changes, decoded from at most --max-wal-bytes of "
                "WAL): the relay is far behind"
            )
        return f"{where}: the row is committed; {t.pending_scan}"
    return (
        f"{where}: no row with this id (never committed, rolled back, deleted or pruned, or "
        "sent as a message that the slot has passed), no unconfirmed change of the slot and "
        "no dead letter carries it"
    )


def summary(t: Trace) -> Sequence[tuple[str, str]]:
    """The facts behind the answer, as lines for people."""
    lines: list[tuple[str, str]] = [("event", t.event_id)]
    row = t.row
    if row is None:
        lines.append(("row", "none"))
    else:
        lines.append(
            (
                "row",
                f"{row.get('aggregate_type')}/{row.get('aggregate_id')} {row.get('event_type')}, "
                f"created {row.get('created_at')}",
            )
        )
        if "processed_at" in row:
            lines.append(("processed_at", str(row.get("processed_at") or "-")))
    lines.append(("committed", {True: "yes", False: "no", None: "unknown"}[t.committed]))
    if t.slot is not None:
        slot = t.slot
        active = f"active (pid {slot['active_pid']})" if slot["active"] else "inactive"
        lines.append(
            (
                "slot",
                f"{slot['slot_name']}, {active}, confirmed up to {slot['confirmed_flush_lsn']}",
            )
        )
    if t.pending is not None:
        lines.append(
            (
                "commit",
                f"{t.pending.commit_lsn} at {t.pending.commit_time.isoformat()}, not confirmed yet",
            )
        )
    elif t.confirmed_past_commit:
        lines.append(("commit", "before the slot's confirmed position"))
    found = t.kafka.found
    if found is not None:
        when = found.timestamp.isoformat() if found.timestamp else "-"
        lines.append(
            (
                "kafka",
                f"{found.topic} [{found.partition}] @ {found.offset}, "
                f"{found.timestamp_type} {when}",
            )
        )
    elif t.kafka.topic is None:
        lines.append(("kafka", f"not looked: {t.kafka.problem}"))
    elif not t.kafka.partitions:
        lines.append(("kafka", f"not looked in {t.kafka.topic}: {t.kafka.problem}"))
    elif t.kafka.topic is not None:
        lines.append(
            (
                "kafka",
                f"looked in {t.kafka.topic} partitions {t.kafka.partitions} "
                f"since {t.kafka.since}: {t.kafka.scanned} messages, not there",
            )
        )
    return lines
