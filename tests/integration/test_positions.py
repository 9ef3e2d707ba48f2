"""Two units of the stream at one position (ARCHITECTURE.md, invariant 11), against a real
PostgreSQL and Kafka: a non-transactional logical message ends where the next WAL record
starts, and when that record is a transaction's commit, the message and the transaction share
one LSN. Exactly once names each unit by its LSN and its kind; named by the LSN alone, a kill
inside such a transaction made the replay skip the rest of it (261,014 of 300,001 events lost
in the reproduction)."""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest
from relaytools import (
    RelayProcess,
    Written,
    check,
    consume,
    relay_env,
    setup_slot,
    wait_slot,
    writers_only,
)

from cdc_relay.events import Begin, LogicalMessage
from cdc_relay.kafka.checkpoints import MESSAGE, read_checkpoint
from cdc_relay.lsn import parse as parse_lsn
from cdc_relay.postgres import pgoutput
from cdc_relay.postgres.replication import ReplicationConnection, XLogData

pytestmark = pytest.mark.integration

ROWS = 200_000


def envelope(event_id: str) -> str:
    return json.dumps(
        {
            "v": 2,
            "id": event_id,
            "aggregate_type": "notes",
            "aggregate_id": "n-1",
            "event_type": "notes.changed",
            "payload": {"note": 1},
        }
    )


def write(dsn: str, emitter: str) -> list[Written]:
    """One transaction of ROWS events whose last WAL record before its commit is a
    non-transactional message: emitted by the transaction itself (``same``), or by another
    connection while the transaction waits to commit (``other``)."""
    message_id = str(uuid.uuid4())
    with psycopg.connect(dsn) as conn, psycopg.connect(dsn, autocommit=True) as other:
        conn.execute(
            "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload) "
            "SELECT 'orders', 'o-' || (i %% 13), 'orders.changed', jsonb_build_object('i', i) "
            "FROM generate_series(1, %s) i",
            (ROWS,),
        )
        emit = conn if emitter == "same" else other
        emit.execute("SELECT pg_logical_emit_message(false, 'outbox', %s)", (envelope(message_id),))
        conn.commit()
        after = parse_lsn(
            str(conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()[0])  # type: ignore[index]
        )
        rows = conn.execute(
            "SELECT id::text, aggregate_id, payload::text FROM outbox_events ORDER BY seq"
        ).fetchall()
    now = time.monotonic()
    written = [
        Written(i, "orders", a, "orders.changed", p.encode(), after, now) for i, a, p in rows
    ]
    message = Written(message_id, "notes", "n-1", "notes.changed", b'{"note": 1}', after, now)
    return [message, *written]


def shape(dsn: str, slot: str, publication: str) -> tuple[int, int]:
    """The non-transactional message's LSN and the next transaction's commit LSN, as the
    slot ``slot`` (made before the workload) streams them."""
    stream = ReplicationConnection(dsn)
    options = {"proto_version": "1", "publication_names": publication, "messages": "true"}
    try:
        stream.start(slot, 0, options)
        message_lsn = None
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            data = stream.read(0.5)
            if not isinstance(data, XLogData):
                continue
            record = pgoutput.decode(data.data)
            if isinstance(record, LogicalMessage) and not record.transactional:
                message_lsn = record.lsn
            elif isinstance(record, Begin) and message_lsn is not None:
                return message_lsn, record.final_lsn
        raise AssertionError("the message and the transaction after it did not come")
    finally:
        stream.close()


@pytest.mark.slow
@pytest.mark.parametrize("emitter", ["same", "other"])
def test_a_kill_inside_a_transaction_sharing_its_position_with_a_message_loses_nothing(
    tmp_path: Path, outbox_db: str, kafka_service: Any, names: Any, emitter: str
) -> None:
    setup_slot(outbox_db, names)
    inspect = f"{names.slot}_shape"
    with psycopg.connect(outbox_db, autocommit=True) as conn:
        conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (inspect,))
    written = write(outbox_db, emitter)
    message_lsn, commit_lsn = shape(outbox_db, inspect, names.publication)
    wait_slot(outbox_db, inspect, active=False)  # its walsender may outlive the close a moment
    with psycopg.connect(outbox_db, autocommit=True) as conn:
        conn.execute("SELECT pg_drop_replication_slot(%s)", (inspect,))
    assert message_lsn == commit_lsn, "the workload did not make the shape it tests"

    topic = f"{names.topic_prefix}_checkpoints"
    config = {"bootstrap.servers": kafka_service.bootstrap}
    env = relay_env(outbox_db, kafka_service.bootstrap, names, exactly_once="1")
    env["CDC_RELAY_CHECKPOINT_TOPIC"] = topic
    env["CDC_RELAY_MESSAGES"] = "1"
    writers_only(outbox_db)  # stream --messages, once only writers may emit messages
    relay = RelayProcess(tmp_path, env)
    try:
        relay.start()
        # Killed once Kafka holds the message and part of the transaction at its LSN.
        deadline = time.monotonic() + 120
        while True:
            assert time.monotonic() < deadline, relay.log()[-3000:]
            checkpoint = read_checkpoint(config, topic, f"cdc-relay-{names.slot}", 10)
            if checkpoint.partial_events and checkpoint.partial.lsn == commit_lsn:
                break
            assert checkpoint.position.lsn < commit_lsn or checkpoint.position.kind == MESSAGE, (
                "the relay got past the transaction before the kill"
            )
            time.sleep(0.05)
        relay.kill()
        wait_slot(outbox_db, names.slot, active=False)
        relay.start()
        received = consume(kafka_service.bootstrap, names.topic_prefix, len(written), 180)
        assert relay.stop() == 0
    finally:
        relay.close()
    verdict = check(written, received, names.topic_prefix)
    print(checkpoint, verdict)
    assert verdict.lost == []
    assert verdict.duplicates == 0
    assert verdict.out_of_order == []
    assert verdict.mismatched == []
