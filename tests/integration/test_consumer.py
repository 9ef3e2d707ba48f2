"""An idempotent consumer: redelivered events change the consumer's database once."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest
from confluent_kafka import Consumer
from relaytools import RelayProcess, Writer, relay_env, setup_slot

from cdc_relay import schema
from cdc_relay.consumer import first_time, handle

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def read_all(bootstrap: str, topic: str, count: int) -> list[Any]:
    """``count`` messages from the start of ``topic``, with a new consumer group each time:
    reading twice is a redelivery of everything."""
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"replay-{uuid.uuid4()}",
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
        }
    )
    consumer.subscribe([topic])
    messages: list[Any] = []
    try:
        while len(messages) < count:
            msg = consumer.poll(1.0)
            if msg is not None and not msg.error():
                messages.append(msg)
    finally:
        consumer.close()
    return messages


def test_replayed_events_have_their_side_effect_once(
    tmp_path: Path, outbox_db: str, kafka_service: Any, names: Any
) -> None:
    with psycopg.connect(outbox_db, autocommit=True) as conn:
        conn.execute(schema.text("consumer"))
        conn.execute("CREATE TABLE ledger (event_id uuid, amount int)")
    setup_slot(outbox_db, names)
    relay = RelayProcess(tmp_path, relay_env(outbox_db, kafka_service.bootstrap, names)).start()
    try:
        writer = Writer(outbox_db)
        for i in range(20):
            writer.transaction([("payment", f"p{i % 3}", {"amount": i})])
        writer.close()
        topic = names.topic_prefix + ".payment"
        first = read_all(kafka_service.bootstrap, topic, 20)
        assert relay.stop() == 0
    finally:
        relay.close()
    replay = read_all(kafka_service.bootstrap, topic, 20)  # every event delivered again

    def book(conn: psycopg.Connection[Any], message: Any) -> None:
        amount = int(message.value().decode().split(":")[1].strip(" }"))
        conn.execute(
            "INSERT INTO ledger VALUES (%s, %s)",
            (str(uuid.UUID(dict(message.headers())["id"].decode())), amount),
        )

    with psycopg.connect(outbox_db) as conn:
        ran = [handle(conn, m, book, consumer="billing") for m in first + replay]
        # a second consumer keeps its own record
        other = [handle(conn, m, book, consumer="audit") for m in first[:5]]
        ledger = conn.execute("SELECT count(*), sum(amount) FROM ledger").fetchone()
    assert ran == [True] * 20 + [False] * 20
    assert other == [True] * 5
    assert ledger == (25, sum(range(20)) + sum(json_amounts(first[:5])))


def json_amounts(messages: list[Any]) -> list[int]:
    return [int(m.value().decode().split(":")[1].strip(" }")) for m in messages]


def test_a_failed_handler_leaves_no_record_so_the_event_is_retried(outbox_db: str) -> None:
    with psycopg.connect(outbox_db, autocommit=True) as conn:
        conn.execute(schema.text("consumer"))
    event = uuid.uuid4()
    with psycopg.connect(outbox_db) as conn:
        with pytest.raises(RuntimeError), conn.transaction():
            assert first_time(conn, event, "billing")
            raise RuntimeError("the handler failed")
        with conn.transaction():
            assert first_time(conn, event, "billing")  # the failed attempt left no trace
        with conn.transaction():
            assert not first_time(conn, event, "billing")


class Message:
    """What ``handle`` reads of a Kafka message: its headers."""

    def __init__(self, event_id: str) -> None:
        self._headers = [("id", event_id.encode()), ("event_type", b"e")]

    def headers(self) -> list[tuple[str, bytes]]:
        return self._headers


def test_an_event_whose_id_is_not_a_uuid_is_handled_once(outbox_db: str) -> None:
    """``--column id=COLUMN`` maps the id to any column of the outbox, so the id header may
    be any text (Debezium's layouts often use one): the consumer's record keeps it as it is."""
    with psycopg.connect(outbox_db, autocommit=True) as conn:
        conn.execute(schema.text("consumer"))
    seen: list[str] = []
    with psycopg.connect(outbox_db) as conn:
        ran = [
            handle(conn, Message(i), lambda _, m: seen.append(m.headers()[0][1]), "billing")
            for i in ("order-42", "order-42", "Order-42", "6f1c1b7e-2a51-4c43-9d0e-3f5d2b8a9c01")
        ]
    assert ran == [True, False, True, True]
    assert len(seen) == 3
    # A table of an older schema consumer takes UUIDs only: the error says what to change.
    with psycopg.connect(outbox_db, autocommit=True) as conn:
        conn.execute("CREATE SCHEMA older")
        conn.execute(
            "CREATE TABLE older.processed_events (consumer text, event_id uuid, "
            "processed_at timestamptz DEFAULT now(), PRIMARY KEY (consumer, event_id))"
        )
    with psycopg.connect(outbox_db, options="-csearch_path=older") as conn:
        with pytest.raises(ValueError, match="ALTER COLUMN event_id TYPE text"):
            handle(conn, Message("order-42"), lambda _, m: None, "billing")
