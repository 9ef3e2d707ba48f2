"""The golden wire contract: one fixed scenario, and the exact Kafka messages it must become.

Every path that relays the outbox (``stream`` decoding pgoutput or wal2json, events written
as logical decoding messages with ``outbox_emit()``, and ``poll``) writes the scenario into a
fresh database, relays it, and must put on Kafka exactly the messages in ``tests/golden/``:
topic, partition, key, headers (in order) and value, byte for byte. A refactor that changes
one byte fails here; a deliberate format change re-records the files (tests/golden/README.md)
in the same commit.

The scenario is split into golden files because not every path can express every case; each
file names the paths that must reproduce it, and ``ABSENT`` says why the others cannot.

CDC_RELAY_RECORD_GOLDEN=1 records instead of comparing: the first path of each file writes
it (after checking every message against what PostgreSQL stored), the other paths then
compare against the new file as usual. CDC_RELAY_RECORD_GOLDEN=name[,name...] records only
those files (a new one), and compares the others.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import re
import signal
import time
from collections import Counter, defaultdict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest
from confluent_kafka import (
    OFFSET_BEGINNING,
    Consumer,
    KafkaError,
    KafkaException,
    TopicPartition,
)
from confluent_kafka.admin import AdminClient, NewTopic
from psycopg import sql
from relaytools import RelayProcess, install_poller, relay_env, writers_only

from cdc_relay.postgres.slot import SlotSpec, setup

pytestmark = pytest.mark.integration

GOLDEN_DIR = Path(__file__).parents[1] / "golden"
RECORD = os.environ.get("CDC_RELAY_RECORD_GOLDEN", "")  # "1": every file; or names, comma-separated

# The default template, behind a prefix of the test's own: the golden files hold the topic
# without the prefix.
TOPIC_TEMPLATE = "outbox.event.{aggregate_type}"
PARTITIONS = 3  # the golden partitions are murmur2 of the key modulo 3
BIG_VALUE = 4096  # bytes; a longer value is kept in the files as its size and SHA-256
HEADER_COLUMNS = "region tenant"  # as --header-column region --header-column tenant
ANY_PARTITION = None  # a NULL key goes to a random partition (murmur2_random)
CONTENT_TYPES = {  # --cloudevents: the content-type of each payload column type
    "jsonb": b"application/json",
    "text": b"text/plain; charset=utf-8",
    "bytea": b"application/octet-stream",
}


# -- the scenario -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Event:
    """One outbox row (or outbox_emit() call). ``payload`` is what the application writes:
    JSON text for jsonb, text for text, bytes for bytea, None for NULL."""

    n: int
    aggregate_type: str
    aggregate_id: str | None
    event_type: str
    payload: str | bytes | None
    tenant: str | None = None
    region: str | None = None
    created_at: str | None = "now"  # timestamptz input ('now': the transaction's start)
    trace: str | None = None  # the --trace-column's value (tracingspancontext)
    # What the trace column must become: the traceparent and tracestate headers (written out
    # here, not derived by the code under test), and whether the traceparent is a valid one
    # (with --cloudevents: ce_traceparent and ce_tracestate then carry the same values).
    trace_headers: tuple[tuple[str, str], ...] = ()
    trace_valid: bool = True

    @property
    def id(self) -> str:
        return f"5eed0000-0000-4000-8000-{self.n:012d}"


def _big_json() -> str:
    """A JSON document of about 400 KB, the same on every run."""
    chunks = [hashlib.sha256(str(i).encode()).hexdigest() for i in range(6000)]
    return json.dumps({"blob": "".join(chunks), "parts": chunks[:500], "note": "groß ✓"})


@dataclass(frozen=True)
class GoldenFile:
    name: str
    table: str  # the outbox table its events go to
    payload_type: str  # of that table's payload column
    transactions: tuple[tuple[Event, ...], ...]
    paths: tuple[str, ...]  # the paths that must reproduce it; the first one records it
    options: tuple[tuple[str, str], ...] = ()  # CDC_RELAY_* settings of its relays (lowercase)

    @property
    def recording(self) -> bool:
        return RECORD == "1" or self.name in RECORD.split(",")

    @property
    def cloudevents_source(self) -> str | None:
        return dict(self.options).get("cloudevents_source")

    @property
    def trace_column(self) -> str | None:
        return dict(self.options).get("trace_column")

    @property
    def file(self) -> Path:
        return GOLDEN_DIR / f"{self.name}.jsonl"

    def lines(self) -> list[str]:
        """The recorded lines: ASCII, each ended by a newline (and no other line break)."""
        text = self.file.read_bytes().decode("ascii")
        assert text.endswith("\n"), f"{self.file} is empty or lacks its final newline"
        return text[:-1].split("\n")

    @property
    def events(self) -> list[Event]:
        return [event for transaction in self.transactions for event in transaction]


STREAM_PATHS = ("pgoutput", "wal2json", "exactly-once")
"""``exactly-once`` is stream on pgoutput with --exactly-once, read read_committed."""
MESSAGE_PATHS = ("message-pgoutput", "message-wal2json")
PATHS = (*STREAM_PATHS, *MESSAGE_PATHS, "poll")

OUTBOX = GoldenFile(
    name="outbox",
    table="outbox_events",
    payload_type="jsonb",
    transactions=(
        (
            Event(
                1,
                "order",
                "o-1001",
                "order.created",
                '{"total": "12.50", "currency": "EUR", "lines": [{"sku": "A-1", "qty": 2}]}',
            ),
            Event(2, "order", "o-1001", "order.paid", '{"amount": 12.50, "at": "2026-01-05"}'),
            Event(
                3,
                "customer",
                "c-7",
                "customer.registered",
                '{"name": "Zoë Ångström", "tags": [], "vip": false}',
            ),
            Event(
                4,
                "order",
                "o-1002",
                "order.created",
                '{"zz": 1,   "a": 2, "aa": {"y": null, "b": true}, "a": 3}',
            ),
        ),
        (
            # Non-ASCII aggregate type: the header keeps it, the topic has "_" for each char.
            Event(
                5,
                "größe",
                "maß-1",
                "größe.geändert",
                '{"wert": "½ Liter", "emoji": "😀", "cjk": "注文", "ключ": 1}',
            ),
            # Characters Kafka refuses in a topic name ("/", " ", "#") become "_".
            Event(
                6,
                "billing/invoice v2#eu",
                "inv#42",
                "invoice:issued",
                '{"esc": "quote \\" backslash \\\\ nl \\n tab \\t ctl \\u0001 \\u001f'
                ' del \\u007f ls \\u2028", "slash": "a/b"}',
            ),
            # Dots and dashes are legal in a topic name and stay.
            Event(
                7,
                "acme.crm-lead",
                "L-1",
                "lead.created",
                '[1, 2.50, -0.0, 1e3, 1.5E-7, 12345678901234567890, "x", null]',
            ),
        ),
        (
            Event(8, "order", None, "order.broadcast", '{"notice": "prices change Monday"}'),
            Event(9, "order", "o-1001", "order.deleted", None),  # a tombstone
            Event(10, "customer", None, "customer.audited", '"just a string"'),
            Event(11, "customer", "c-7", "customer.scored", "42"),
            Event(12, "customer", "c-8", "customer.flagged", "true"),
            Event(13, "order", "o-1002", "order.noted", "{}"),
        ),
        (Event(14, "order", "o-1003", "order.attached", _big_json()),),
        (Event(15, "order", "o-1003", "order.archived", '{"after": "the big one"}'),),
    ),
    paths=PATHS,
)

HEADER_COLUMNS_FILE = GoldenFile(
    name="header_columns",
    table="outbox_events",
    payload_type="jsonb",
    transactions=(
        (
            Event(16, "invoice", "i-1", "invoice.issued", '{"amount": 3}', "acme", "eu"),
            Event(17, "invoice", "i-2", "invoice.issued", '{"amount": 4}', "zürich", None),
            Event(18, "invoice", "i-1", "invoice.voided", '{"amount": 3}', "", "eu"),
            Event(19, "invoice", "i-3", "invoice.issued", '{"amount": 5}', None, None),
        ),
    ),
    paths=STREAM_PATHS,
)

TEXT_PAYLOAD = GoldenFile(
    name="text_payload",
    table="outbox_text",
    payload_type="text",
    transactions=(
        (
            Event(20, "note", "n-1", "note.written", "plain text, not JSON: ½ \\x and \\\\"),
            Event(21, "note", "n-1", "note.cleared", ""),  # empty: a tombstone
            Event(22, "note", "n-2", "note.erased", None),  # NULL: a tombstone
            Event(23, "note", "n-2", "note.kept", '{"kept":  "as written" ,"a":1}'),
        ),
    ),
    paths=(*STREAM_PATHS, "poll"),
)

BYTEA_PAYLOAD = GoldenFile(
    name="bytea_payload",
    table="outbox_bytea",
    payload_type="bytea",
    transactions=(
        (
            Event(24, "blob", "b-1", "blob.stored", b"\x0a\x0b\x0c\x00\xff"),
            Event(25, "blob", "b-1", "blob.emptied", b""),  # empty: a tombstone
            Event(26, "blob", "b-2", "blob.stored", "héllo".encode()),  # raw, though UTF-8
            Event(27, "blob", "b-2", "blob.stored", b"\\x41"),  # raw, though it reads as hex
            Event(28, "blob", "b-3", "blob.erased", None),  # NULL: a tombstone
        ),
    ),
    paths=(*STREAM_PATHS, "poll"),
)

CLOUDEVENTS = GoldenFile(
    name="cloudevents",
    table="outbox_cloudevents",
    payload_type="jsonb",
    transactions=(
        (
            Event(
                29,
                "parcel",
                "p-1",
                "parcel.created",
                '{"weight": 2.5}',
                created_at="2026-01-05 10:00:00.123456+01",
            ),
            Event(
                30,
                "parcel",
                "p-1",
                "parcel.shipped",
                '{"by": "ACME"}',
                created_at="2026-01-05 09:00:00+00",
            ),
            # Non-ASCII type and subject: UTF-8, as in the relay's own headers.
            Event(
                31,
                "maße",
                "maß-1",
                "maße.geändert",
                '{"wert": "½"}',
                created_at="2026-07-01 12:00:00.5+05:30",
            ),
        ),
        (
            # No ce_subject for a NULL, an empty or a control-character aggregate_id.
            Event(
                32,
                "parcel",
                None,
                "parcel.broadcast",
                '{"notice": 1}',
                created_at="2026-01-05 10:00:00+00",
            ),
            Event(33, "parcel", "", "parcel.unkeyed", "{}", created_at="2026-01-05 10:00:01+00"),
            Event(
                34,
                "parcel",
                "line\nbreak",
                "parcel.odd",
                "{}",
                created_at="2026-01-05 10:00:02+00",
            ),
            # A tombstone keeps the CloudEvents headers.
            Event(35, "parcel", "p-2", "parcel.lost", None, created_at="2026-01-05 10:00:03+00"),
        ),
        (
            # No ce_time where RFC 3339 has no such time, or there is none.
            Event(36, "parcel", "p-3", "parcel.timeless", "{}", created_at="infinity"),
            Event(
                37, "parcel", "p-3", "parcel.ancient", "{}", created_at="0044-03-15 12:00:00+00 BC"
            ),
            Event(38, "parcel", "p-3", "parcel.future", "{}", created_at="10000-01-01 00:00:00+00"),
            Event(39, "parcel", "p-3", "parcel.undated", "{}", created_at=None),
            # Four digits of year, in UTC: 1000-01-01T01:00:00Z.
            Event(40, "parcel", "p-3", "parcel.early", "{}", created_at="0999-12-31 23:00:00-02"),
        ),
    ),
    paths=(*STREAM_PATHS, "poll"),
    options=(
        ("cloudevents", "true"),
        ("cloudevents_source", "/cdc-relay/shop/public.outbox_cloudevents"),
    ),
)

# --trace-column: the W3C trace context as applications store it. Debezium's outbox extension
# writes java.util.Properties.store's text (a date comment, "=" and ":" escaped in values).
PARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
STATE = "rojo=00f067aa0ba902b7,congo=t61rcWkgMzE"
DEBEZIUM = (
    f"#Tue Dec 02 15:16:00 UTC 2026\ntraceparent={PARENT}\n"
    "tracestate=rojo\\=00f067aa0ba902b7,congo\\=t61rcWkgMzE\n"
)
PLAIN = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
MALFORMED = "00-0AF7651916CD43DD8448EB211C80319C-x-01"  # uppercase, a short parent id
LATER = "01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-what-a-later-version-adds"
TRACES = (
    (
        ("plain", "p-1", "created", PLAIN, (("traceparent", PLAIN),), True),
        ("debezium", "p-1", "packed", DEBEZIUM, (("traceparent", PARENT), ("tracestate", STATE))),
        ("none", "p-2", "created", None, ()),
    ),
    (
        (
            "debezium, CRLF, no tracestate",
            "p-2",
            "sent",
            f"#Tue Dec 02 15:16:00 UTC 2026\r\ntraceparent={PARENT}\r\n",
            (("traceparent", PARENT),),
        ),
        # as stored: a receiver ignores it; with --cloudevents no ce_traceparent
        ("malformed", "p-3", "lost", MALFORMED, (("traceparent", MALFORMED),), False),
        ("empty", "p-3", "found", "", ()),
        # OpenTracing's Jaeger key, no traceparent: nothing to send (logged)
        ("no traceparent", "p-3", "returned", "#x\nuber-trace-id=a\\:b\\:0\\:1\n", (), False),
        ("later version", "p-4", "created", LATER, (("traceparent", LATER),)),
    ),
)


def _traced(first: int, aggregate_type: str) -> tuple[tuple[Event, ...], ...]:
    """The trace scenario as events of ``aggregate_type``, ids from ``first``; each created at
    a fixed moment (ce_time of --cloudevents)."""
    n = first
    transactions = []
    for transaction in TRACES:
        events = []
        for what, key, verb, stored, headers, *valid in transaction:
            events.append(
                Event(
                    n,
                    aggregate_type,
                    key,
                    f"{aggregate_type}.{verb}",
                    json.dumps({"trace": what}),
                    created_at=f"2026-12-02 15:16:{n % 60:02d}+00",
                    trace=stored,
                    trace_headers=headers,
                    trace_valid=valid[0] if valid else bool(headers),
                )
            )
            n += 1
        transactions.append(tuple(events))
    return tuple(transactions)


TRACE_CONTEXT = GoldenFile(
    name="trace_context",
    table="outbox_trace",
    payload_type="jsonb",
    transactions=_traced(41, "shipment"),
    paths=(*STREAM_PATHS, "poll"),
    options=(("trace_column", "tracingspancontext"),),
)

TRACE_CLOUDEVENTS = GoldenFile(
    name="trace_cloudevents",
    table="outbox_trace_cloudevents",
    payload_type="jsonb",
    transactions=_traced(51, "crate"),
    paths=(*STREAM_PATHS, "poll"),
    options=(
        ("trace_column", "tracingspancontext"),
        ("cloudevents", "true"),
        ("cloudevents_source", "/cdc-relay/shop/public.outbox_trace_cloudevents"),
    ),
)

GOLDEN_FILES = (
    OUTBOX,
    HEADER_COLUMNS_FILE,
    TEXT_PAYLOAD,
    BYTEA_PAYLOAD,
    CLOUDEVENTS,
    TRACE_CONTEXT,
    TRACE_CLOUDEVENTS,
)

# Why a path does not reproduce a golden file: it cannot write or relay those events.
ABSENT = {
    ("header_columns", "message-pgoutput"): "outbox_emit() carries no extra columns to send",
    ("header_columns", "message-wal2json"): "outbox_emit() carries no extra columns to send",
    ("header_columns", "poll"): "cdc-relay poll has no --header-column",
    ("text_payload", "message-pgoutput"): "outbox_emit() takes jsonb: no empty or non-JSON text",
    ("text_payload", "message-wal2json"): "outbox_emit() takes jsonb: no empty or non-JSON text",
    ("bytea_payload", "message-pgoutput"): "outbox_emit() takes jsonb: no raw bytes",
    ("bytea_payload", "message-wal2json"): "outbox_emit() takes jsonb: no raw bytes",
    ("cloudevents", "message-pgoutput"): "outbox_emit() carries no created_at: no ce_time",
    ("cloudevents", "message-wal2json"): "outbox_emit() carries no created_at: no ce_time",
    ("trace_context", "message-pgoutput"): "outbox_emit() carries no trace column",
    ("trace_context", "message-wal2json"): "outbox_emit() carries no trace column",
    ("trace_cloudevents", "message-pgoutput"): "outbox_emit() carries no trace column",
    ("trace_cloudevents", "message-wal2json"): "outbox_emit() carries no trace column",
}


def test_every_path_reproduces_or_is_excused_from_every_golden_file() -> None:
    """The scenario cannot shrink unnoticed: files, counts and paths are all accounted for."""
    ids = [event.id for golden in GOLDEN_FILES for event in golden.events]
    assert len(ids) == len(set(ids)), "two events share an id"
    assert {p.name for p in GOLDEN_DIR.glob("*.jsonl")} == {g.file.name for g in GOLDEN_FILES}
    for golden in GOLDEN_FILES:
        assert golden.events, golden.name
        assert set(golden.paths) <= set(PATHS), golden.name
        for path in PATHS:
            excused = (golden.name, path) in ABSENT
            assert (path in golden.paths) != excused, f"{golden.name}: {path} neither or both"
        if not golden.recording:
            lines = golden.lines()
            assert len(lines) == len(golden.events), f"{golden.file}: one line per event"


# -- encoding messages as golden lines --------------------------------------------------------


def encode_bytes(data: bytes | None) -> Any:
    """Bytes as JSON, unambiguously: null; a string (the bytes are its UTF-8); {"hex": ...}
    (not UTF-8); {"size": n, "sha256": ...} (over BIG_VALUE bytes)."""
    if data is None:
        return None
    if len(data) > BIG_VALUE:
        return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    try:
        return data.decode()
    except UnicodeDecodeError:
        return {"hex": data.hex()}


@dataclass(frozen=True)
class Received:
    topic: str  # without the test's prefix
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, bytes | None], ...]

    @property
    def id(self) -> str | None:
        for name, value in self.headers:
            if name == "id" and value is not None:
                return value.decode(errors="replace")
        return None

    def line(self) -> str:
        """The golden line: ASCII only, so no editor or encoding can change a byte unseen."""
        text = json.dumps(
            {
                "topic": self.topic,
                "partition": ANY_PARTITION if self.key is None else self.partition,
                "key": encode_bytes(self.key),
                "headers": [[name, encode_bytes(value)] for name, value in self.headers],
                "value": encode_bytes(self.value),
            }
        )
        return text.replace("\x7f", "\\u007f")  # the one ASCII control json.dumps keeps


def golden_lines(messages: Sequence[Received], golden: GoldenFile) -> list[str]:
    """The messages of one golden file as its lines: by topic, then partition and offset;
    messages with a NULL key (on a random partition) last in their topic, in scenario order."""
    rank = {event.id: i for i, event in enumerate(golden.events)}

    def order(m: Received) -> tuple[Any, ...]:
        if m.key is None:
            return (m.topic, 1, rank.get(m.id or "", len(rank)), m.line())
        return (m.topic, 0, m.partition, m.offset)

    return [m.line() for m in sorted(messages, key=order)]


def random_partition_order_problems(messages: Sequence[Received], golden: GoldenFile) -> list[str]:
    """Messages without a key land anywhere, but those in one partition keep commit order."""
    rank = {event.id: i for i, event in enumerate(golden.events)}
    per_partition: dict[tuple[str, int], list[int]] = defaultdict(list)
    for m in sorted(messages, key=lambda m: (m.topic, m.partition, m.offset)):
        if m.key is None and m.id in rank:
            per_partition[(m.topic, m.partition)].append(rank[m.id])
    return [
        f"{topic}[{partition}] holds unkeyed events out of commit order: {ranks}"
        for (topic, partition), ranks in per_partition.items()
        if ranks != sorted(ranks)
    ]


# -- the database -----------------------------------------------------------------------------


def prepare_tables(dsn: str, goldens: Sequence[GoldenFile]) -> None:
    """outbox_events with a nullable key and payload, two header columns and a trace column,
    and the tables of the other golden files, shaped like it."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "ALTER TABLE outbox_events ALTER COLUMN aggregate_id DROP NOT NULL,"
            " ALTER COLUMN payload DROP NOT NULL, ALTER COLUMN created_at DROP NOT NULL,"
            " ADD COLUMN tenant text, ADD COLUMN region text, ADD COLUMN tracingspancontext text"
        )
        for golden in goldens:
            if golden.table == "outbox_events":
                continue
            table = sql.Identifier(golden.table)
            conn.execute(
                sql.SQL("CREATE TABLE IF NOT EXISTS {} (LIKE outbox_events INCLUDING ALL)").format(
                    table
                )
            )
            if golden.payload_type == "jsonb":
                continue  # as in outbox_events
            conn.execute(
                sql.SQL("ALTER TABLE {} ALTER COLUMN payload TYPE {} USING {}").format(
                    table,
                    sql.SQL(golden.payload_type),
                    sql.SQL(
                        "convert_to(payload::text, 'UTF8')"
                        if golden.payload_type == "bytea"
                        else "payload::text"
                    ),
                )
            )


def write_scenario(dsn: str, golden: GoldenFile, as_messages: bool) -> None:
    """The golden file's transactions, as an application writes them."""
    if as_messages:
        statement = sql.SQL(
            "SELECT outbox_emit(%(aggregate_type)s, %(aggregate_id)s, %(event_type)s,"
            " %(payload)s::jsonb, %(id)s::uuid)"
        )
    else:
        statement = sql.SQL(
            "INSERT INTO {} (id, aggregate_type, aggregate_id, event_type, payload, tenant,"
            " region, created_at, tracingspancontext) VALUES (%(id)s::uuid, %(aggregate_type)s,"
            " %(aggregate_id)s, %(event_type)s, %(payload)s::{}, %(tenant)s, %(region)s,"
            " %(created_at)s::timestamptz, %(trace)s)"
        ).format(sql.Identifier(golden.table), sql.SQL(golden.payload_type))
    with psycopg.connect(dsn) as conn:
        for transaction in golden.transactions:
            with conn.transaction():
                for event in transaction:
                    conn.execute(
                        statement,
                        {
                            "id": event.id,
                            "aggregate_type": event.aggregate_type,
                            "aggregate_id": event.aggregate_id,
                            "event_type": event.event_type,
                            "payload": event.payload,
                            "tenant": event.tenant,
                            "region": event.region,
                            "created_at": event.created_at,
                            "trace": event.trace,
                        },
                    )


def stored_messages(dsn: str, golden: GoldenFile) -> dict[str, tuple[Any, ...]]:
    """What each event must become by the design (key = aggregate_id, value = the payload bytes
    as the table stores them, tombstone for NULL or empty), read back from the table: the check
    a recording must pass."""
    payload = sql.SQL(
        "payload" if golden.payload_type == "bytea" else "convert_to(payload::text, 'UTF8')"
    )
    # ce_time: created_at in UTC where RFC 3339 can write it, by PostgreSQL's own to_char
    utc = sql.SQL("(created_at AT TIME ZONE 'UTC')")
    time = sql.SQL(
        "CASE WHEN {utc} >= '0001-01-01' AND {utc} < '10000-01-01' AND isfinite(created_at)"
        ' THEN to_char({utc}, \'YYYY-MM-DD"T"HH24:MI:SS.US"Z"\') END'
    ).format(utc=utc)
    query = sql.SQL("SELECT {}, {} FROM {} WHERE id = %s::uuid").format(
        payload, time, sql.Identifier(golden.table)
    )
    expected = {}
    with psycopg.connect(dsn, autocommit=True) as conn:
        for event in golden.events:
            row = conn.execute(query, [event.id]).fetchone()
            assert row is not None, f"event {event.id} is not in {golden.table}"
            value = bytes(row[0]) if row[0] else None
            headers: list[tuple[str, bytes | None]] = [
                ("id", event.id.encode()),
                ("event_type", event.event_type.encode()),
                ("aggregate_type", event.aggregate_type.encode()),
            ]
            for column in HEADER_COLUMNS.split():
                extra = getattr(event, column)
                if extra is not None:
                    headers.append((column, extra.encode()))
            if golden.trace_column:
                headers += [(name, value.encode()) for name, value in event.trace_headers]
            if golden.cloudevents_source:
                headers += [
                    ("ce_specversion", b"1.0"),
                    ("ce_id", event.id.encode()),
                    ("ce_source", golden.cloudevents_source.encode()),
                    ("ce_type", event.event_type.encode()),
                ]
                if row[1] is not None:
                    headers.append(("ce_time", row[1].encode()))
                subject = event.aggregate_id
                if subject and not re.search("[\x00-\x1f\x7f-\x9f]", subject):
                    headers.append(("ce_subject", subject.encode()))
                if golden.trace_column and event.trace_valid:
                    headers += [(f"ce_{n}", v.encode()) for n, v in event.trace_headers]
                headers.append(("content-type", CONTENT_TYPES[golden.payload_type]))
            key = None if event.aggregate_id is None else event.aggregate_id.encode()
            expected[event.id] = (key, value, tuple(headers))
    return expected


# -- Kafka ------------------------------------------------------------------------------------


def create_topics(bootstrap: str, topics: set[str]) -> None:
    """The topics with the partitions the golden files assume, whatever the broker's default."""
    if not topics:
        return
    admin = AdminClient({"bootstrap.servers": bootstrap})
    futures = admin.create_topics([NewTopic(t, num_partitions=PARTITIONS) for t in topics])
    for future in futures.values():
        future.result(30)


class Topics:
    """The topics of one prefix: how many messages they hold, and all of them."""

    def __init__(self, bootstrap: str, prefix: str) -> None:
        self.prefix = prefix + "."
        self.consumer = Consumer(
            {
                "bootstrap.servers": bootstrap,
                "group.id": f"golden-{prefix}",
                "enable.auto.commit": False,
                # The end of a partition of transactions is a commit marker, never delivered.
                "enable.partition.eof": True,
            }
        )

    def close(self) -> None:
        self.consumer.close()

    def partitions(self) -> list[TopicPartition]:
        topics = self.consumer.list_topics(timeout=10).topics
        return [
            TopicPartition(name, partition)
            for name, meta in sorted(topics.items())
            if name.startswith(self.prefix)
            for partition in sorted(meta.partitions)
        ]

    def ends(self) -> dict[tuple[str, int], int]:
        return {
            (tp.topic, tp.partition): self.consumer.get_watermark_offsets(tp, 10, cached=False)[1]
            for tp in self.partitions()
        }

    def count(self) -> int:
        """Messages on the topics, or -1 while a partition has no leader yet (just created)."""
        try:
            return sum(self.ends().values())
        except KafkaException:
            return -1

    def readable(self) -> int:
        """Messages a read_committed consumer reads now, or -1 as ``count``."""
        try:
            return len(self.read())
        except KafkaException:
            return -1

    def read(self, timeout: float = 60) -> list[Received]:
        """Every message, from the beginning to the end each partition has now."""
        ends = self.ends()
        todo = {tp for tp, end in ends.items() if end > 0}
        self.consumer.assign([TopicPartition(t, p, OFFSET_BEGINNING) for (t, p) in sorted(ends)])
        received: list[Received] = []
        deadline = time.monotonic() + timeout
        while todo:
            assert time.monotonic() < deadline, f"could not read to the end of {sorted(todo)}"
            msg = self.consumer.poll(0.5)
            if msg is None:
                continue
            if msg.error():
                assert msg.error().code() == KafkaError._PARTITION_EOF, msg.error()
                todo.discard((msg.topic(), msg.partition()))
                continue
            position = (msg.topic(), msg.partition())
            received.append(
                Received(
                    topic=msg.topic().removeprefix(self.prefix),
                    partition=msg.partition(),
                    offset=msg.offset(),
                    key=msg.key(),
                    value=msg.value(),
                    headers=tuple(msg.headers() or ()),
                )
            )
            if msg.offset() + 1 >= ends[position]:
                todo.discard(position)
        return received


# -- the paths --------------------------------------------------------------------------------


def start_relays(
    path: str, dsn: str, bootstrap: str, names: Any, log_dir: Path, goldens: Sequence[GoldenFile]
) -> list[RelayProcess]:
    """Slots (before anything is written) and one relay process per outbox table; not started."""
    common = {
        "topic_template": f"{names.topic_prefix}.{TOPIC_TEMPLATE}",
        "tombstone_on_empty_payload": "true",
    }
    options = {g.table: dict(g.options) for g in goldens}  # of the golden file of each table
    if path == "poll":
        install_poller(dsn)
        tables = list(dict.fromkeys(g.table for g in goldens))
        return [
            RelayProcess(
                log_dir,
                relay_env(
                    dsn,
                    bootstrap,
                    names,
                    table=table,
                    poll_interval="0.5",
                    **common,
                    **options.get(table, {}),
                ),
                name=f"poll-{table}",
                command="poll",
            )
            for table in tables
        ]
    plugin = "pgoutput" if path == "exactly-once" else path.removeprefix("message-")
    if path == "exactly-once":
        common |= {"exactly_once": "1", "checkpoint_topic": f"{names.topic_prefix}_checkpoints"}
    if path in MESSAGE_PATHS:  # stream --messages, once only writers may emit messages
        writers_only(dsn)
        common |= {"messages": "true"}
    # The message form needs no table of its own, but stream follows one: outbox_events.
    tables = ["outbox_events"] if path in MESSAGE_PATHS else [g.table for g in goldens]
    relays = []
    for n, table in enumerate(dict.fromkeys(tables)):
        slot, publication = f"{names.slot}_{n}", f"{names.publication}_{n}"
        setup(dsn, SlotSpec(slot=slot, publication=publication, table=table, plugin=plugin))
        env = relay_env(
            dsn,
            bootstrap,
            names,
            slot=slot,
            publication=publication,
            table=table,
            header_column=HEADER_COLUMNS,
            **common,
            **options.get(table, {}),
        )
        relays.append(RelayProcess(log_dir, env, name=f"{path}-{table}"))
    return relays


@contextmanager
def running(relays: Sequence[RelayProcess]) -> Iterator[None]:
    for relay in relays:
        relay.start()
    try:
        yield
        for relay in relays:
            relay.signal(signal.SIGTERM)
        for relay in relays:
            code = relay.wait(60)
            assert code == 0, f"{relay.name} exited with {code}:\n{relay.log()[-3000:]}"
    finally:
        for relay in relays:
            relay.close()


def relay(
    path: str, dsn: str, bootstrap: str, names: Any, log_dir: Path, goldens: Sequence[GoldenFile]
) -> list[Received]:
    """Write the golden files' scenario, relay it on ``path``, return what Kafka holds."""
    prepare_tables(dsn, goldens)
    create_topics(  # a recording's topics are created by the relay
        bootstrap,
        {
            f"{names.topic_prefix}.{json.loads(line)['topic']}"
            for golden in goldens
            if not golden.recording
            for line in golden.lines()
        },
    )
    relays = start_relays(path, dsn, bootstrap, names, log_dir, goldens)
    for golden in goldens:
        write_scenario(dsn, golden, as_messages=path in MESSAGE_PATHS)
    expected = sum(len(golden.events) for golden in goldens)
    topics = Topics(bootstrap, names.topic_prefix)
    try:
        with running(relays):
            deadline = time.monotonic() + 90
            # Offsets count a transaction's commit markers too: count what is readable.
            count = topics.readable if path == "exactly-once" else topics.count
            while count() < expected:
                for process in relays:
                    assert process.alive(), f"{process.name} stopped:\n{process.log()[-3000:]}"
                assert time.monotonic() < deadline, (
                    f"{path}: {topics.count()} of {expected} messages after 90 s"
                )
                time.sleep(0.2)
        received = topics.read()
        # A recording's topics are created by the relay, with the broker's default partitions.
        partitions = Counter(tp.topic for tp in topics.partitions())
        assert set(partitions.values()) == {PARTITIONS}, (
            f"not {PARTITIONS} partitions each: {partitions}"
        )
    finally:
        topics.close()
    return received


def check_recording(dsn: str, golden: GoldenFile, messages: Sequence[Received]) -> None:
    """Before a recording is written: one message per event, as PostgreSQL stored the event."""
    stored = stored_messages(dsn, golden)
    got = {m.id: (m.key, m.value, m.headers) for m in messages}
    assert len(messages) == len(got) == len(stored), "not one message per event"
    for event_id, expected in stored.items():
        assert got.get(event_id) == expected, f"event {event_id}: {got.get(event_id)} {expected}"


def golden_problems(path: str, dsn: str, golden: GoldenFile, messages: list[Received]) -> str:
    """How ``messages`` differ from the golden file (empty if they do not), or record it."""
    lines = golden_lines(messages, golden)
    if golden.recording and path == golden.paths[0]:
        check_recording(dsn, golden, messages)
        golden.file.write_text("".join(line + "\n" for line in lines))
    if not golden.file.exists():
        return f"{golden.file} is missing: record it (tests/golden/README.md)"
    expected = golden.lines()
    assert len(expected) == len(golden.events), f"{golden.file}: not one line per event"
    problems = random_partition_order_problems(messages, golden)
    if lines != expected:
        diff = [
            line.rstrip("\n")
            for line in difflib.ndiff(expected, lines)
            if line.startswith(("- ", "+ ", "? "))
        ]
        problems.append(
            f"{len(expected)} messages expected, {len(lines)} on Kafka; "
            "- golden line, + on Kafka, ? where they differ:\n" + "\n".join(diff)
        )
    if not problems:
        return ""
    return f"{path} does not reproduce tests/golden/{golden.file.name}:\n" + "\n".join(problems)


@pytest.mark.parametrize("path", PATHS)
def test_golden(path: str, tmp_path: Path, outbox_db: str, kafka_service: Any, names: Any) -> None:
    goldens = [golden for golden in GOLDEN_FILES if path in golden.paths]
    received = relay(path, outbox_db, kafka_service.bootstrap, names, tmp_path, goldens)

    owner = {event.id: golden.name for golden in goldens for event in golden.events}
    by_file: dict[str, list[Received]] = defaultdict(list)
    strays = []
    for message in received:
        if message.id in owner:
            by_file[owner[message.id]].append(message)
        else:
            strays.append(message.line())
    problems = [f"messages of no golden event on {path}:\n" + "\n".join(strays)] if strays else []
    for golden in goldens:
        problem = golden_problems(path, outbox_db, golden, by_file[golden.name])
        if problem:
            problems.append(problem)
    if problems:
        pytest.fail("\n\n".join(problems), pytrace=False)
    assert len(received) == sum(len(golden.events) for golden in goldens)
