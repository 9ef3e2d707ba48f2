"""The services the integration tests run against are what those tests assume."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psycopg
import pytest
from confluent_kafka import Consumer, KafkaError, Message, Producer, TopicPartition

from cdc_relay.devstack import DevstackError, port_open
from cdc_relay.devstack.postgres import LocalPostgres, StopMode, find_bindir

if TYPE_CHECKING:
    from conftest import KafkaService, Names, PostgresService

pytestmark = pytest.mark.integration

INSERT_EVENT = (
    "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload)"
    " VALUES ('order', %s, 'order_created', '{}') RETURNING id"
)


def _insert_event(conn: psycopg.Connection[tuple[Any, ...]], aggregate_id: str) -> uuid.UUID:
    row = conn.execute(INSERT_EVENT, [aggregate_id]).fetchone()
    assert row is not None
    event_id: uuid.UUID = row[0]
    return event_id


def _event_ids(conn: psycopg.Connection[tuple[Any, ...]]) -> list[uuid.UUID]:
    return [row[0] for row in conn.execute("SELECT id FROM outbox_events ORDER BY seq")]


def test_postgres_decodes_with_pgoutput_and_wal2json(outbox_db: str, names: Names) -> None:
    with psycopg.connect(outbox_db, autocommit=True) as conn:
        assert conn.execute("SHOW wal_level").fetchone() == ("logical",)
        conn.execute(f"CREATE PUBLICATION {names.publication} FOR TABLE outbox_events")
        pgoutput, wal2json = f"{names.slot}_pgoutput", f"{names.slot}_wal2json"
        for slot, plugin in ((pgoutput, "pgoutput"), (wal2json, "wal2json")):
            conn.execute("SELECT pg_create_logical_replication_slot(%s, %s)", [slot, plugin])
        conn.execute(INSERT_EVENT, ["o-1"])

        messages = conn.execute(
            "SELECT data FROM pg_logical_slot_get_binary_changes(%s, NULL, NULL,"
            " 'proto_version', '1', 'publication_names', %s)",
            [pgoutput, names.publication],
        ).fetchall()
        assert [bytes(data[:1]) for (data,) in messages] == [b"B", b"R", b"I", b"C"]

        changes = conn.execute(
            "SELECT data FROM pg_logical_slot_get_changes(%s, NULL, NULL, 'format-version', '2')",
            [wal2json],
        ).fetchall()
        assert any('"action":"I"' in data and '"outbox_events"' in data for (data,) in changes)
    # outbox_db's teardown drops both slots, or dropping the database would fail


def _produce(bootstrap: str, topic: str, value: bytes) -> None:
    producer = Producer({"bootstrap.servers": bootstrap, "acks": "all", "enable.idempotence": True})
    errors: list[KafkaError] = []

    def on_delivery(err: KafkaError | None, _: Message) -> None:
        if err is not None:
            errors.append(err)

    producer.produce(topic, value, key=b"order-1", on_delivery=on_delivery)
    assert producer.flush(30) == 0
    assert errors == []


def _consume_all(bootstrap: str, topic: str, expected: int, timeout: float = 30) -> list[bytes]:
    """The values in ``topic`` from its beginning, read without a consumer group rebalance."""
    consumer = Consumer(
        {"bootstrap.servers": bootstrap, "group.id": f"{topic}.check", "enable.auto.commit": False}
    )
    try:
        partitions = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        consumer.assign([TopicPartition(topic, p, 0) for p in partitions])  # offset 0: beginning
        values: list[bytes] = []
        deadline = time.monotonic() + timeout
        while len(values) < expected and time.monotonic() < deadline:
            message: Message | None = consumer.poll(0.5)
            if message is not None and message.error() is None:
                value = message.value()
                assert value is not None
                values.append(value)
        return values
    finally:
        consumer.close()


def test_kafka_round_trip(kafka_service: KafkaService, names: Names) -> None:
    topic = f"{names.topic_prefix}.round_trip"
    _produce(kafka_service.bootstrap, topic, b"hello")
    assert _consume_all(kafka_service.bootstrap, topic, expected=1) == [b"hello"]


def test_kafka_stop_and_start_keep_topic_and_message(
    kafka_service: KafkaService, names: Names
) -> None:
    topic = f"{names.topic_prefix}.restart"
    bootstrap = kafka_service.bootstrap
    _produce(bootstrap, topic, b"before the stop")
    kafka_service.stop()
    assert not kafka_service.running()
    assert not port_open(int(bootstrap.rsplit(":", 1)[1]))
    kafka_service.start()
    assert kafka_service.bootstrap == bootstrap
    assert _consume_all(bootstrap, topic, expected=1) == [b"before the stop"]


@pytest.mark.parametrize("mode", ["fast", "immediate"])
def test_postgres_restart_keeps_data(
    postgres_service: PostgresService, outbox_db: str, mode: StopMode
) -> None:
    with psycopg.connect(outbox_db) as conn:
        event_id = _insert_event(conn, "o-2")
    dsn = postgres_service.dsn
    postgres_service.restart(mode)
    assert postgres_service.dsn == dsn
    with psycopg.connect(outbox_db) as conn:
        assert _event_ids(conn) == [event_id]


def test_postgres_recovers_from_kill(postgres_service: PostgresService, outbox_db: str) -> None:
    with psycopg.connect(outbox_db) as conn:
        event_id = _insert_event(conn, "o-3")
    postgres_service.kill()
    assert not postgres_service.running()
    postgres_service.start()
    with psycopg.connect(outbox_db) as conn:
        assert _event_ids(conn) == [event_id]


@pytest.fixture
def pg_binaries() -> Path:
    try:
        return find_bindir()
    except DevstackError as err:
        pytest.skip(str(err))


def test_local_postgres_with_wal_level_replica(tmp_path: Path, pg_binaries: Path) -> None:
    with LocalPostgres(tmp_path / "pg", wal_level="replica", bindir=pg_binaries) as server:
        with psycopg.connect(server.dsn, autocommit=True) as conn:
            assert conn.execute("SHOW wal_level").fetchone() == ("replica",)
            with pytest.raises(psycopg.errors.ObjectNotInPrerequisiteState):
                conn.execute("SELECT pg_create_logical_replication_slot('s', 'pgoutput')")
    assert not (tmp_path / "pg").exists()


def test_postgres_dies_with_the_process_that_started_it(tmp_path: Path, pg_binaries: Path) -> None:
    script = textwrap.dedent(
        f"""
        import time
        from cdc_relay.devstack.postgres import LocalPostgres
        server = LocalPostgres({str(tmp_path / "pg")!r}, bindir={str(pg_binaries)!r}).start()
        print(server.port, flush=True)
        time.sleep(60)
        """
    )
    with subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True
    ) as owner:
        try:
            assert owner.stdout is not None
            port = int(owner.stdout.readline())
            assert port_open(port)
        finally:
            os.kill(owner.pid, signal.SIGKILL)  # no cleanup, no atexit: only the watchdog is left
    deadline = time.monotonic() + 10
    while port_open(port) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not port_open(port)
