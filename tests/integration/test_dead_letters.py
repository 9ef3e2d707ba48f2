"""The stream's dead-letter table against a real PostgreSQL: each dead letter keeps its own
content, and storing one again (a replay) changes nothing but its reason."""

from __future__ import annotations

import psycopg
import pytest
from confluent_kafka import KafkaError
from psycopg.rows import dict_row

from cdc_relay import schema
from cdc_relay.errors import PreflightError
from cdc_relay.kafka.deadletter import DeadLetters
from cdc_relay.kafka.routing import Message

pytestmark = pytest.mark.integration


def letter(value: bytes, topic: str = "outbox.event.order") -> Message:
    return Message(
        topic=topic,
        key=b"42",
        value=value,
        headers=[("id", b"6f1c1b7e-2a51-4c43-9d0e-3f5d2b8a9c01"), ("event_type", b"e")],
        lsn=0x1000,
    )


def test_two_events_of_one_id_keep_each_its_content(outbox_db: str) -> None:
    """Ids are unique per table, and one slot may relay several outbox tables: two events
    may share an id. When both are dead letters, the table must hold both contents (the
    dead-letter topic has none when the payload is what Kafka refused), not the first one's
    twice; a replay of either stores it again without a second row."""
    store = DeadLetters(outbox_db, "slot", "dead")
    too_large = KafkaError(KafkaError.MSG_SIZE_TOO_LARGE)
    try:
        store.store(letter(b'{"table": "tenant_a"}'), too_large)
        store.store(letter(b'{"table": "tenant_b"}'), too_large)
        store.store(letter(b'{"table": "tenant_a"}'), KafkaError(KafkaError.INVALID_RECORD))
    finally:
        store.close()
    with psycopg.connect(outbox_db) as conn:
        kept = conn.execute(
            "SELECT value, error_code FROM cdc_relay_dead_letters ORDER BY value"
        ).fetchall()
    assert kept == [
        (b'{"table": "tenant_a"}', "INVALID_RECORD"),
        (b'{"table": "tenant_b"}', "MSG_SIZE_TOO_LARGE"),
    ]


def test_a_table_of_an_older_schema_is_refused_then_made_current_by_the_schema(
    outbox_db: str,
) -> None:
    with psycopg.connect(outbox_db, autocommit=True, row_factory=dict_row) as conn:
        conn.execute("DROP TABLE cdc_relay_dead_letters")
        conn.execute(
            "CREATE TABLE cdc_relay_dead_letters (event_id text PRIMARY KEY, topic text NOT NULL,"
            " key bytea, value bytea, headers jsonb NOT NULL, error_code text NOT NULL,"
            " error text NOT NULL, commit_lsn pg_lsn NOT NULL, slot text NOT NULL,"
            " dead_at timestamptz NOT NULL DEFAULT now())"
        )
        conn.execute(
            "INSERT INTO cdc_relay_dead_letters VALUES ('old', 't', NULL, 'v', '{}', 'E', 'e',"
            " '0/1', 's')"
        )
        store = DeadLetters(outbox_db, "slot", "dead")
        with pytest.raises(PreflightError, match="run cdc-relay schema apply outbox"):
            store.check(conn)
        for _ in range(2):  # idempotent
            schema.apply(conn, "outbox")
        store.check(conn)
        key = conn.execute(
            "SELECT array_agg(a.attname::text ORDER BY a.attname) AS key FROM pg_constraint c"
            " JOIN pg_attribute a ON a.attrelid = c.conrelid AND a.attnum = ANY(c.conkey)"
            " WHERE c.conrelid = 'cdc_relay_dead_letters'::regclass AND c.contype = 'p'"
        ).fetchone()
        assert key == {"key": ["content_sha256", "event_id"]}
        old = conn.execute("SELECT value FROM cdc_relay_dead_letters").fetchall()
        assert old == [{"value": b"v"}]
