"""--cloudevents on a real PostgreSQL and Kafka: what ``stream`` and ``poll`` put on the wire
is read back with the CloudEvents SDK's Kafka binding (binary content mode), and both relays
send the same messages; an event without a type is refused by both, never sent without it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import psycopg
import pytest
from cloudevents.core.bindings.kafka import KafkaMessage, from_binary
from cloudevents.core.formats.json import JSONFormat
from psycopg import sql
from relaytools import (
    Received,
    RelayProcess,
    consume,
    install_poller,
    relay_env,
    setup_slot,
    wait_until,
)

pytestmark = pytest.mark.integration


@dataclass(frozen=True)
class Row:
    n: int
    aggregate_id: str | None
    event_type: str
    payload: str | bytes | None
    created_at: str = "now()"  # SQL

    @property
    def id(self) -> str:
        return f"ce000000-0000-4000-8000-{self.n:012d}"


ROWS = {
    "jsonb": [
        Row(
            1,
            "o-1",
            "order.created",
            '{"total": "12.50", "lines": [1, 2]}',
            "'2026-01-05 10:00:00.123456+01'",
        ),
        Row(2, "maß-1", "größe.geändert", '{"wert": "½ Liter", "emoji": "😀"}'),
        Row(3, None, "order.broadcast", '"just a string"'),  # no key, no subject
        Row(4, "o-1", "order.archived", "42", "'infinity'"),  # no time
        Row(5, "o-1", "order.deleted", None),  # a tombstone: no data
    ],
    "text": [Row(6, "n-1", "note.written", "plain text, not JSON: ½")],
    "bytea": [Row(7, "b-1", "blob.stored", b"\x0a\x00\xff\xfe")],
}
CONTENT_TYPES = {
    "jsonb": "application/json",
    "text": "text/plain; charset=utf-8",
    "bytea": "application/octet-stream",
}


def outbox_table(dsn: str, payload_type: str) -> str:
    """An outbox table whose payload column has ``payload_type``, key and payload nullable."""
    table = f"outbox_{payload_type}"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            sql.SQL("CREATE TABLE {} (LIKE outbox_events INCLUDING ALL)").format(
                sql.Identifier(table)
            )
        )
        conn.execute(
            sql.SQL(
                "ALTER TABLE {} ALTER COLUMN aggregate_id DROP NOT NULL,"
                " ALTER COLUMN payload DROP NOT NULL,"
                " ALTER COLUMN payload TYPE {} USING NULL"
            ).format(sql.Identifier(table), sql.SQL(payload_type))
        )
    return table


def write(dsn: str, table: str, payload_type: str, rows: list[Row]) -> None:
    with psycopg.connect(dsn) as conn, conn.transaction():
        for row in rows:
            conn.execute(
                sql.SQL(
                    "INSERT INTO {} (id, aggregate_type, aggregate_id, event_type, payload,"
                    " created_at) VALUES (%s, 'ce', %s, %s, %s::{}, {})"
                ).format(sql.Identifier(table), sql.SQL(payload_type), sql.SQL(row.created_at)),
                (row.id, row.aggregate_id, row.event_type, row.payload),
            )


def start(
    command: str, dsn: str, bootstrap: str, names: Any, log_dir: Path, **env: str
) -> RelayProcess:
    prefix = f"{names.topic_prefix}_{command}"
    settings = relay_env(
        dsn,
        bootstrap,
        names,
        topic_template=prefix + ".{aggregate_type}",
        tombstone_on_empty_payload="true",
        cloudevents="true",
        poll_interval="0.5",
        **env,
    )
    return RelayProcess(log_dir, settings, name=command, command=command).start()


def cloudevent(message: Received) -> Any:
    headers = dict(message.headers)
    assert len(headers) == len(message.headers), "a header twice"
    kafka_message = KafkaMessage(headers=headers, key=message.key, value=message.value or b"")
    return from_binary(kafka_message, JSONFormat())


@pytest.mark.parametrize("payload_type", ["jsonb", "text", "bytea"])
def test_stream_and_poll_send_the_same_cloudevents_the_sdk_reads(
    tmp_path: Path, outbox_db: str, kafka_service: Any, names: Any, payload_type: str
) -> None:
    table = outbox_table(outbox_db, payload_type)
    rows = ROWS[payload_type]
    setup_slot(outbox_db, names, table=table)
    install_poller(outbox_db)
    bootstrap = kafka_service.bootstrap
    # --table as written here; the default source names the table as PostgreSQL resolves it
    relays = [
        start("stream", outbox_db, bootstrap, names, tmp_path, table=table),
        start("poll", outbox_db, bootstrap, names, tmp_path, table=f"public.{table}"),
    ]
    try:
        write(outbox_db, table, payload_type, rows)
        received = {
            relay.command: consume(
                bootstrap, f"{names.topic_prefix}_{relay.command}", len(rows), settle=1
            )
            for relay in relays
        }
        for relay in relays:
            assert relay.stop() == 0, relay.log()
    finally:
        for relay in relays:
            relay.close()

    stream, poll = wire(received["stream"]), wire(received["poll"])
    assert len(stream) == len(received["stream"]) == len(rows)
    assert stream == poll, "stream and poll sent different messages"
    check_cloudevents(received["stream"], rows, outbox_db, table, payload_type)


def wire(messages: list[Received]) -> dict[str, tuple[Any, ...]]:
    """The messages by event id, as the relay made them (without the topic's test prefix)."""
    return {
        # a message without a key goes to a random partition
        m.id: (m.topic.split(".", 1)[1], m.key and m.partition, m.key, m.value, m.headers)
        for m in messages
    }


def check_cloudevents(
    messages: list[Received], rows: list[Row], dsn: str, table: str, payload_type: str
) -> None:
    """The SDK reads each message as the CloudEvent of its row."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        database = conn.info.dbname
        created = dict(
            conn.execute(
                sql.SQL(
                    "SELECT id::text, CASE WHEN isfinite(created_at) THEN created_at END FROM {}"
                ).format(sql.Identifier(table))
            ).fetchall()
        )
    for message in messages:
        row = next(r for r in rows if r.id == message.id)
        event = cloudevent(message)
        assert event.get_specversion() == "1.0"
        assert event.get_id() == row.id
        assert event.get_source() == f"/cdc-relay/{database}/public.{table}"
        assert event.get_type() == row.event_type
        assert event.get_subject() == row.aggregate_id
        assert event.get_datacontenttype() == CONTENT_TYPES[payload_type]
        if created[row.id] is None:
            assert "ce_time" not in dict(message.headers)
        else:
            assert isinstance(event.get_time(), datetime)
            assert event.get_time() == created[row.id]
        if row.payload is None:
            assert message.value is None
        elif payload_type == "jsonb":
            assert event.get_data() == json.loads(str(row.payload))
        else:
            assert event.get_data() == row.payload
        # the message itself: as without --cloudevents, the CloudEvents headers after the rest
        assert message.key == (None if row.aggregate_id is None else row.aggregate_id.encode())
        assert [name for name, _ in message.headers[:3]] == ["id", "event_type", "aggregate_type"]
        assert message.headers[3][0] == "ce_specversion"


def test_an_event_without_a_type_is_refused_by_both_relays(
    tmp_path: Path, outbox_db: str, kafka_service: Any, names: Any
) -> None:
    """Stream stops at it, naming it; poll keeps the row, with the reason, and tries it again,
    while other aggregates flow on. Neither sends it without ce_type."""
    setup_slot(outbox_db, names)
    install_poller(outbox_db)
    bootstrap = kafka_service.bootstrap
    rows = [
        Row(11, "a-1", "thing.done", "{}"),
        Row(12, "a-2", "", "{}"),
        Row(13, "a-3", "thing.done", "{}"),
    ]
    stream = start("stream", outbox_db, bootstrap, names, tmp_path)
    poll = start("poll", outbox_db, bootstrap, names, tmp_path, backoff_base="60")
    try:
        write(outbox_db, "outbox_events", "jsonb", rows)
        assert stream.wait(60) == 1, stream.log()
        wait_until(lambda: attempts(outbox_db, rows[1].id) >= 1, 60, "poll to try the row")
        sent = consume(bootstrap, f"{names.topic_prefix}_poll", 2, settle=1)
        assert poll.stop() == 0, poll.log()
    finally:
        stream.close()
        poll.close()
    assert f"event {rows[1].id}" in stream.log()
    assert "its event_type is empty, and CloudEvents requires it as ce_type" in stream.log()
    streamed = consume(bootstrap, f"{names.topic_prefix}_stream", 1, timeout=10, settle=1)
    assert [m.id for m in streamed] == [rows[0].id]  # before it, and nothing from it on
    assert sorted(m.id for m in sent) == [rows[0].id, rows[2].id]
    with psycopg.connect(outbox_db, autocommit=True) as conn:
        error = conn.execute(
            "SELECT last_error FROM outbox_events WHERE id = %s AND processed_at IS NULL",
            [rows[1].id],
        ).fetchone()
    assert error is not None and "CloudEvents requires it as ce_type" in error[0]


def attempts(dsn: str, event_id: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT attempts FROM outbox_events WHERE id = %s", [event_id]
        ).fetchone()
    return int(row[0]) if row else 0


def test_the_switch_from_poll_to_stream_publishes_the_same_cloudevents(
    tmp_path: Path, outbox_db: str, kafka_service: Any, names: Any
) -> None:
    """setup-slot --from-poller --cloudevents publishes the rows the poller left as poll and
    stream would."""
    install_poller(outbox_db)  # where the handover fences the pollers off the table
    table = outbox_table(outbox_db, "jsonb")
    rows = ROWS["jsonb"]
    bootstrap = kafka_service.bootstrap
    slot = f"{names.slot}_before"  # the handover makes names.slot
    setup_slot(outbox_db, names, slot=slot, table=table)
    stream = start("stream", outbox_db, bootstrap, names, tmp_path, table=table, slot=slot)
    try:
        write(outbox_db, table, "jsonb", rows)
        streamed = consume(bootstrap, f"{names.topic_prefix}_stream", len(rows), settle=1)
        assert stream.stop() == 0, stream.log()
    finally:
        stream.close()
    env = relay_env(
        outbox_db,
        bootstrap,
        names,
        table=table,
        topic_template=f"{names.topic_prefix}_handover.{{aggregate_type}}",
        tombstone_on_empty_payload="true",
        cloudevents="true",
    )
    switched = subprocess.run(
        [sys.executable, "-m", "cdc_relay", "setup-slot", "--from-poller"],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert switched.returncode == 0, switched.stderr
    assert f"published {len(rows)} events" in switched.stdout
    handed_over = consume(bootstrap, f"{names.topic_prefix}_handover", len(rows), settle=1)
    assert wire(handed_over) == wire(streamed)
    check_cloudevents(handed_over, rows, outbox_db, table, "jsonb")
