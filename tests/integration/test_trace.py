"""``cdc-relay trace`` against the real services: the partition the producer really chose,
an event before and after the stream relay, a message, the poller's marks and dead letters."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest
from confluent_kafka import Producer
from relaytools import (
    RelayProcess,
    consume,
    create_topics,
    install_poller,
    relay_env,
    setup_slot,
    wait_until,
    writers_only,
)

from cdc_relay.kafka.lookup import partition_of
from cdc_relay.kafka.sink import producer_config
from cdc_relay.outbox import write_event

pytestmark = pytest.mark.integration


def test_the_partition_computed_is_the_one_the_relays_producer_chooses(
    kafka_service: Any, names: Any
) -> None:
    topic = f"{names.topic_prefix}.keys"
    create_topics(kafka_service.bootstrap, {topic: {}}, partitions=7)
    producer = Producer(producer_config(kafka_service.bootstrap, {}))
    keys = [b"", b"a", b"42", "Zürich-ü".encode(), *(f"order-{n}".encode() for n in range(200))]
    keys.append(bytes(range(256)))
    chosen: dict[bytes, int] = {}

    def report(err: Any, message: Any) -> None:
        assert err is None, err
        chosen[message.key()] = message.partition()

    for key in keys:
        producer.produce(topic, key=key, value=b"v", on_delivery=report)
    assert producer.flush(60) == 0
    assert len(set(chosen.values())) == 7  # every partition was chosen for some key
    assert {key: partition_of(key, 7) for key in keys} == chosen


def trace(dsn: str, bootstrap: str, names: Any, event: str, *more: str) -> tuple[int, Any]:
    ran = subprocess.run(
        [sys.executable, "-m", "cdc_relay", "trace", event, "--json", *more],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **relay_env(dsn, bootstrap, names)},
    )
    assert ran.stderr == "", ran.stderr
    return ran.returncode, json.loads(ran.stdout)


def write(dsn: str, as_message: bool = False, key: str = "1") -> str:
    with psycopg.connect(dsn) as conn, conn.transaction():
        return str(
            write_event(
                conn,
                aggregate_type="order",
                aggregate_id=key,
                event_type="order.created",
                payload={"key": key},
                as_message=as_message,
            )
        )


def test_trace_follows_an_event_from_the_slot_to_kafka(
    tmp_path: Path, outbox_db: str, kafka_service: Any, names: Any
) -> None:
    bootstrap = kafka_service.bootstrap
    setup_slot(outbox_db, names)
    topic = f"{names.topic_prefix}.order"
    create_topics(bootstrap, {topic: {"message.timestamp.type": "LogAppendTime"}}, partitions=5)
    row, message = write(outbox_db, key="k-1"), write(outbox_db, as_message=True, key="k-2")

    # No relay yet: committed, after the slot's confirmed position, the slot inactive.
    code, found = trace(outbox_db, bootstrap, names, row)
    assert code == 3
    assert found["committed"] is True
    assert found["row"]["aggregate_id"] == "k-1"
    assert found["pending"]["form"] == "row"
    assert found["confirmed_past_commit"] is False
    assert found["answer"].startswith(
        f"not on Kafka yet: committed at {found['pending']['commit_lsn']}"
    )
    assert found["answer"].endswith(
        "no relay is streaming the slot (inactive): start cdc-relay stream"
    )
    code, found = trace(outbox_db, bootstrap, names, message)
    assert code == 3
    assert found["row"] is None
    assert found["pending"]["form"] == "message"
    assert found["pending"]["aggregate_id"] == "k-2"

    writers_only(outbox_db)  # stream --messages, once only writers may emit messages
    env = relay_env(outbox_db, bootstrap, names, messages="true")
    relay = RelayProcess(tmp_path, env).start()
    try:
        received = {r.id: r for r in consume(bootstrap, names.topic_prefix, 2, settle=0.5)}
        # While the relay streams the slot: read through a copy, the relay undisturbed.
        code, found = trace(outbox_db, bootstrap, names, row)
        assert code == 0, found
        assert relay.alive()
        assert relay.stop() == 0  # confirms everything
    finally:
        relay.close()
    landed = received[row]
    assert found["kafka"]["found"] == {
        "topic": topic,
        "partition": landed.partition,
        "offset": landed.offset,
        "timestamp": found["kafka"]["found"]["timestamp"],
        "timestamp_type": "LogAppendTime",
    }
    assert landed.partition == partition_of(b"k-1", 5)
    assert found["kafka"]["partitions"] == [landed.partition]  # one partition, not the topic
    assert 0 <= found["latency_seconds"] < 60
    assert found["answer"].startswith(
        f"on Kafka: {topic} partition {landed.partition} offset {landed.offset}, appended "
    )
    code, found = trace(outbox_db, bootstrap, names, row)
    assert code == 0
    assert found["confirmed_past_commit"] is True
    assert found["pending"] is None
    # A message the slot has passed leaves nothing in the database to find it by.
    code, found = trace(outbox_db, bootstrap, names, message)
    assert code == 3
    assert found["answer"].startswith("not found: no row with this id")
    # Lines for people, the same facts.
    text = subprocess.run(
        [sys.executable, "-m", "cdc_relay", "trace", row],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **relay_env(outbox_db, bootstrap, names)},
    )
    assert text.returncode == 0, text.stderr
    lines = text.stdout.splitlines()
    assert lines[0] == f"event         {row}"
    assert f"kafka         {topic} [{landed.partition}] @ {landed.offset}, LogAppendTime " in (
        text.stdout
    )
    assert lines[-1].startswith("on Kafka: ")


def test_trace_tells_what_the_poller_did(
    tmp_path: Path, outbox_db: str, kafka_service: Any, names: Any
) -> None:
    bootstrap = kafka_service.bootstrap
    install_poller(outbox_db)
    delivered = write(outbox_db)
    with psycopg.connect(outbox_db) as conn, conn.transaction():  # given up on before it ran
        dead = str(
            write_event(
                conn,
                aggregate_type="order",
                aggregate_id="9",
                event_type="order.created",
                payload={},
            )
        )
        conn.execute(
            "UPDATE outbox_events SET attempts = 10, last_error = 'MSG_SIZE_TOO_LARGE', "
            "retry_after = 'infinity' WHERE id = %s",
            [dead],
        )
    code, found = trace(outbox_db, bootstrap, names, delivered)
    assert code == 3
    assert found["slot"] is None
    assert found["answer"].startswith("not on Kafka yet")

    relay = RelayProcess(
        tmp_path, relay_env(outbox_db, bootstrap, names, poll_interval="0.2"), command="poll"
    ).start()
    try:
        wait_until(
            lambda: trace(outbox_db, bootstrap, names, delivered)[1]["row"]["processed_at"],
            60,
            "the poller to mark the row",
        )
        assert relay.stop() == 0
    finally:
        relay.close()
    code, found = trace(outbox_db, bootstrap, names, delivered)
    assert code == 0, found
    assert found["kafka"]["found"]["topic"] == f"{names.topic_prefix}.order"
    assert found["commit_time_source"] == "created_at"  # track_commit_timestamp is off
    code, found = trace(outbox_db, bootstrap, names, dead)
    assert code == 3
    assert found["answer"] == (
        "dead letter of poll: the poller gave up after 10 attempts (MSG_SIZE_TOO_LARGE); fix "
        f"the cause, then cdc-relay dead-letters retry --id {dead}"
    )
    code, found = trace(outbox_db, bootstrap, names, str(uuid.uuid4()))
    assert code == 3
    assert found["row"] is None


def test_trace_reads_a_wal2json_slot_and_the_streams_dead_letters(
    outbox_db: str, kafka_service: Any, names: Any
) -> None:
    bootstrap = kafka_service.bootstrap
    setup_slot(outbox_db, names, plugin="wal2json")
    row, message = write(outbox_db, key="w-1"), write(outbox_db, as_message=True, key="w-2")
    for event, form in ((row, "row"), (message, "message")):
        code, found = trace(outbox_db, bootstrap, names, event)
        assert code == 3
        assert found["pending"]["form"] == form
        assert found["slot"]["plugin"] == "wal2json"
    # What stream --dead-letter-topic keeps of an event Kafka refused for good.
    refused = str(uuid.uuid4())
    with psycopg.connect(outbox_db, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO cdc_relay_dead_letters (event_id, topic, key, value, headers, "
            "error_code, error, commit_lsn, slot) VALUES (%s, 'outbox.event.order', 'k', "
            "'{}', '{}', 'MSG_SIZE_TOO_LARGE', 'Broker: Message size too large', '0/1', %s)",
            [refused, names.slot],
        )
    code, found = trace(outbox_db, bootstrap, names, refused)
    assert code == 3
    assert found["dead_letter"]["key"] == "k"
    assert found["answer"].startswith("dead letter of stream since ")
    assert found["answer"].endswith(
        "Kafka refused it for outbox.event.order (MSG_SIZE_TOO_LARGE: Broker: Message size too "
        "large); its content is in table cdc_relay_dead_letters and was sent to the dead-letter "
        "topic"
    )


def test_trace_says_the_relay_is_behind_when_it_streams_the_slot_without_confirming(
    tmp_path: Path, outbox_db: str, kafka_service: Any, names: Any
) -> None:
    bootstrap = kafka_service.bootstrap
    setup_slot(outbox_db, names)
    relay = RelayProcess(tmp_path, relay_env(outbox_db, bootstrap, names)).start()
    try:
        first = write(outbox_db)
        wait_until(lambda: trace(outbox_db, bootstrap, names, first)[0] == 0, 60, "the relay")
        relay.signal(signal.SIGSTOP)  # a frozen relay: it holds the slot, confirms nothing
        try:
            event = write(outbox_db)
            code, found = trace(outbox_db, bootstrap, names, event)
        finally:
            relay.signal(signal.SIGCONT)
        assert relay.stop() == 0
    finally:
        relay.close()
    assert code == 3
    assert found["slot"]["active"] is True
    assert found["answer"].endswith(
        f"; the relay (pid {found['slot']['active_pid']}) is behind, or waits for Kafka's "
        "acknowledgement"
    )


def test_trace_finds_the_row_of_a_table_in_a_schema_named_by_a_reserved_word(
    outbox_db: str, kafka_service: Any, names: Any
) -> None:
    with psycopg.connect(outbox_db, autocommit=True) as conn:
        conn.execute('CREATE SCHEMA "user"')
        conn.execute('CREATE TABLE "user".outbox_events (LIKE public.outbox_events INCLUDING ALL)')
        event = str(uuid.uuid4())
        conn.execute(
            'INSERT INTO "user".outbox_events (id, aggregate_type, aggregate_id, event_type, '
            "payload) VALUES (%s, 'order', '1', 'order.created', '{}')",
            [event],
        )
    code, found = trace(
        outbox_db, kafka_service.bootstrap, names, event, "--table", '"user".outbox_events'
    )
    assert code == 3
    assert found["row"]["id"] == event
    assert found["committed"] is True


def test_trace_reads_a_lagging_slot_up_to_a_bound_of_wal(
    outbox_db: str, kafka_service: Any, names: Any
) -> None:
    """A slot far behind on a busy database: the changes of other tables are decoded and left
    out, so a bound on changes alone would let trace decode every byte of WAL the slot holds
    back, on the primary. --max-wal-bytes bounds it, and the answer says the scan was cut."""
    setup_slot(outbox_db, names)
    with psycopg.connect(outbox_db, autocommit=True) as conn:
        conn.execute("CREATE TABLE busy (n int, pad text)")
        conn.execute("INSERT INTO busy SELECT n, repeat('x', 200) FROM generate_series(1, 20000) n")
    event = write(outbox_db)  # after about 5 MB of other WAL
    code, found = trace(
        outbox_db, kafka_service.bootstrap, names, event, "--max-wal-bytes", "1000000"
    )
    assert code == 3
    assert found["pending"] is None
    assert found["pending_scan"] == "cut"
    assert "--max-wal-bytes" in found["answer"], found["answer"]
    code, found = trace(outbox_db, kafka_service.bootstrap, names, event)  # 1 GB by default
    assert found["pending"]["form"] == "row"
