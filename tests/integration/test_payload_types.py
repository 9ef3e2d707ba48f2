"""Payloads reach Kafka as stored whatever their type and form: a domain over bytea, and the
JSON value null as a row and as an outbox_emit() message, on both plugins."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import psycopg
import pytest
from relaytools import RelayProcess, consume, relay_env, setup_slot, writers_only

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("plugin", ["pgoutput", "wal2json"])
def test_a_domain_over_bytea_and_json_null_go_out_as_stored(
    tmp_path: Path, outbox_db: str, kafka_service: Any, names: Any, plugin: str
) -> None:
    with psycopg.connect(outbox_db, autocommit=True) as conn:
        conn.execute("CREATE DOMAIN blob AS bytea")
        conn.execute("CREATE DOMAIN small_blob AS blob CHECK (length(VALUE) < 100)")
        conn.execute(
            "CREATE TABLE blob_outbox (id uuid PRIMARY KEY, aggregate_type text NOT NULL, "
            "aggregate_id text, event_type text NOT NULL, payload small_blob)"
        )
    setup_slot(outbox_db, names, plugin=plugin, table="blob_outbox")
    blob_relay = RelayProcess(
        tmp_path,
        relay_env(outbox_db, kafka_service.bootstrap, names, table="public.blob_outbox"),
        name="blob",
    ).start()
    try:
        with psycopg.connect(outbox_db, autocommit=True) as conn:
            conn.execute(
                "INSERT INTO blob_outbox VALUES ('00000000-0000-0000-0000-00000000000b', "
                "'blob', 'b', 'blob.stored', '\\x0a0b0c00ff')"
            )
        (received,) = consume(kafka_service.bootstrap, names.topic_prefix, 1, settle=1)
        assert received.value == b"\x0a\x0b\x0c\x00\xff"
        assert blob_relay.stop() == 0, blob_relay.log()
    finally:
        blob_relay.close()


def test_json_null_is_the_value_null_as_a_row_and_as_a_message(
    tmp_path: Path, outbox_db: str, kafka_service: Any, names: Any
) -> None:
    setup_slot(outbox_db, names)
    writers_only(outbox_db)
    env = relay_env(
        outbox_db, kafka_service.bootstrap, names, tombstone_on_empty_payload="true", messages="1"
    )
    relay = RelayProcess(tmp_path, env).start()
    try:
        with psycopg.connect(outbox_db, autocommit=True) as conn:
            conn.execute(
                "INSERT INTO outbox_events (id, aggregate_type, aggregate_id, event_type, "
                "payload) VALUES ('00000000-0000-0000-0000-000000000001', 'n', 'k', 'x', "
                "'null'::jsonb)"
            )
            conn.execute(
                "SELECT outbox_emit('n', 'k', 'x', 'null'::jsonb, "
                "'00000000-0000-0000-0000-000000000002')"
            )
            conn.execute(
                "SELECT outbox_emit('n', 'k', 'x', NULL, '00000000-0000-0000-0000-000000000003')"
            )
        received = consume(kafka_service.bootstrap, names.topic_prefix, 3, settle=1)
        assert relay.stop() == 0, relay.log()
    finally:
        relay.close()
    values = {r.id[-1]: r.value for r in received}
    assert values == {"1": b"null", "2": b"null", "3": None}


def test_transaction_shapes_savepoint_rolled_back_copy_and_upsert(
    tmp_path: Path, outbox_db: str, kafka_service: Any, names: Any
) -> None:
    """Only what commits is relayed: a savepoint rolled back takes its event with it; rows
    written by COPY and by an upsert are events like any other."""
    setup_slot(outbox_db, names)
    relay = RelayProcess(tmp_path, relay_env(outbox_db, kafka_service.bootstrap, names)).start()
    ids = [f"00000000-0000-0000-0000-00000000001{n}" for n in range(5)]
    insert = (
        "INSERT INTO outbox_events (id, aggregate_type, aggregate_id, event_type, payload) "
        "VALUES (%s, 'shape', 'k', 'x', '{}')"
    )
    try:
        with psycopg.connect(outbox_db) as conn:
            conn.execute(insert, (ids[0],))
            with conn.transaction():  # a savepoint inside the transaction, rolled back
                conn.execute(insert, (ids[1],))
                raise psycopg.Rollback
        with psycopg.connect(outbox_db) as conn:
            with conn.cursor().copy(
                "COPY outbox_events (id, aggregate_type, aggregate_id, event_type, payload) "
                "FROM STDIN"
            ) as copy:
                copy.write_row((ids[2], "shape", "k", "x", "{}"))
            conn.execute(insert.replace("'{}')", "'{}') ON CONFLICT (id) DO NOTHING"), (ids[3],))
            conn.execute(  # a conflict: nothing inserted, no event
                insert.replace("'{}')", "'{}') ON CONFLICT (id) DO NOTHING"), (ids[0],)
            )
            conn.execute(insert, (ids[4],))
        received = consume(kafka_service.bootstrap, names.topic_prefix, 4, settle=2)
        assert relay.stop() == 0, relay.log()
    finally:
        relay.close()
    assert [r.id for r in received] == [ids[0], ids[2], ids[3], ids[4]]
