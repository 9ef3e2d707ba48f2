"""Decoding breadth on real services: wal2json, logical messages, other outbox layouts,
schema changes, payload edge cases, refused events, huge transactions."""

from __future__ import annotations

import json
import random
import urllib.request
from collections import defaultdict
from pathlib import Path
from typing import Any

import psycopg
import pytest
from relaytools import (
    RelayProcess,
    Writer,
    consume,
    pending_inserts,
    relay_env,
    setup_slot,
    wait_until,
    writers_only,
)

from cdc_relay.devstack import free_ports
from cdc_relay.outbox import write_event

pytestmark = pytest.mark.integration


def _relay(tmp_path: Path, dsn: str, kafka: Any, names: Any, name: str = "relay", **extra: str):
    return RelayProcess(tmp_path, relay_env(dsn, kafka.bootstrap, names, **extra), name=name)


def _by_topic_suffix(received: list[Any], prefix: str) -> dict[str, list[tuple[Any, ...]]]:
    """Messages per topic (prefix cut off), in partition order within each partition."""
    out: dict[str, list[tuple[Any, ...]]] = defaultdict(list)
    for r in sorted(received, key=lambda r: (r.topic, r.partition, r.offset)):
        out[r.topic.removeprefix(prefix)].append((r.partition, r.key, r.value, r.headers))
    return dict(out)


def test_wal2json_and_pgoutput_slots_put_byte_identical_messages_on_kafka(
    tmp_path: Path, outbox_db: str, kafka_service: Any, names: Any
) -> None:
    setup_slot(outbox_db, names)
    setup_slot(outbox_db, names, plugin="wal2json", slot=names.slot + "_w2j")
    prefix_w2j = names.topic_prefix + "w2j"
    writer = Writer(outbox_db)
    rng = random.Random(4)
    for i in range(200):
        size = rng.choice((1, 1, 3, 20))
        writer.transaction(
            [
                (("order", "customer")[j % 2], f"a{rng.randint(0, 9)}", {"i": i, "j": j, "s": "é"})
                for j in range(size)
            ]
        )
    with psycopg.connect(outbox_db) as conn:  # the table-less form rides along
        for i in range(20):
            write_event(
                conn,
                aggregate_type="order",
                aggregate_id=f"m{i % 3}",
                event_type="order.noted",
                payload={"i": i, "note": "via message"},
                as_message=True,
            )
            conn.commit()
    expected = len(writer.written) + 20
    writer.close()

    writers_only(outbox_db)  # the messages: stream --messages, once only writers may emit
    pg = _relay(tmp_path, outbox_db, kafka_service, names, "pgoutput", messages="true").start()
    w2j_env = {
        "slot": names.slot + "_w2j",
        "topic_template": prefix_w2j + ".{aggregate_type}",
        "messages": "true",
    }
    w2j = _relay(tmp_path, outbox_db, kafka_service, names, name="wal2json", **w2j_env).start()
    try:
        from_pg = consume(kafka_service.bootstrap, names.topic_prefix, expected)
        from_w2j = consume(kafka_service.bootstrap, prefix_w2j, expected)
        assert pg.stop() == 0
        assert w2j.stop() == 0
    finally:
        pg.close()
        w2j.close()
    assert len(from_pg) == expected
    assert _by_topic_suffix(from_w2j, prefix_w2j) == _by_topic_suffix(from_pg, names.topic_prefix)


@pytest.mark.pg18
def test_logical_messages_are_events_and_rolled_back_ones_never_reach_kafka(
    tmp_path: Path, outbox_db: str, kafka_service: Any, names: Any
) -> None:
    setup_slot(outbox_db, names)
    writers_only(outbox_db)
    relay = _relay(tmp_path, outbox_db, kafka_service, names, messages="true").start()
    try:
        payload = {"total": "12.50", "lines": [1, 2], "name": "Zoë"}
        with psycopg.connect(outbox_db) as conn:
            with conn.transaction():
                row_id = write_event(
                    conn,
                    aggregate_type="order",
                    aggregate_id="o-1",
                    event_type="created",
                    payload=payload,
                )
            with conn.transaction():
                message_id = write_event(
                    conn,
                    aggregate_type="order",
                    aggregate_id="o-1",
                    event_type="created",
                    payload=payload,
                    as_message=True,
                )
            conn.execute("BEGIN")
            write_event(
                conn,
                aggregate_type="order",
                aggregate_id="o-1",
                event_type="rolled.back",
                payload={},
                as_message=True,
            )
            conn.execute("ROLLBACK")
            with conn.transaction():  # another application's message: not ours to relay
                conn.execute("SELECT pg_logical_emit_message(true, 'other', 'x')")
            with conn.transaction():  # the last one, so everything before it has arrived
                last_id = write_event(
                    conn,
                    aggregate_type="order",
                    aggregate_id="o-1",
                    event_type="last",
                    payload={},
                    as_message=True,
                )
        received = consume(kafka_service.bootstrap, names.topic_prefix, expected=3)
        assert relay.stop() == 0
    finally:
        relay.close()
    ids = [r.id for r in received]
    assert ids == [str(row_id), str(message_id), str(last_id)]
    row, message = received[0], received[1]
    assert message.value == row.value  # byte-identical payloads, row or message
    assert (message.topic, message.key) == (row.topic, row.key)
    assert dict(message.headers)["event_type"] == b"created"


@pytest.mark.pg18
def test_a_debezium_style_outbox_streams_without_migration(
    tmp_path: Path, outbox_db: str, kafka_service: Any, names: Any
) -> None:
    with psycopg.connect(outbox_db, autocommit=True) as conn:
        conn.execute("CREATE SCHEMA app")
        conn.execute(
            "CREATE TABLE app.outbox (id uuid PRIMARY KEY, aggregatetype varchar(255) NOT NULL,"
            " aggregateid varchar(255) NOT NULL, type varchar(255) NOT NULL, payload jsonb,"
            " tenant text)"
        )
    setup_slot(outbox_db, names, table="app.outbox")
    relay = _relay(
        tmp_path,
        outbox_db,
        kafka_service,
        names,
        table="app.outbox",
        column="aggregate_type=aggregatetype aggregate_id=aggregateid event_type=type",
        header_column="tenant",
    ).start()
    try:
        with psycopg.connect(outbox_db) as conn:
            conn.execute(
                "INSERT INTO app.outbox VALUES (gen_random_uuid(), 'invoice', 'i-1', "
                """'InvoiceCreated', '{"amount": 3}', 'acme')"""
            )
            conn.commit()
        (message,) = consume(kafka_service.bootstrap, names.topic_prefix, expected=1)
        assert relay.stop() == 0
    finally:
        relay.close()
    assert message.topic == names.topic_prefix + ".invoice"
    assert message.key == b"i-1"
    assert message.value == b'{"amount": 3}'
    headers = dict(message.headers)
    assert headers["event_type"] == b"InvoiceCreated"
    assert headers["tenant"] == b"acme"


@pytest.mark.pg18
def test_schema_changes_are_followed_and_a_missing_required_column_stops_cleanly(
    tmp_path: Path, outbox_db: str, kafka_service: Any, names: Any
) -> None:
    setup_slot(outbox_db, names)
    relay = _relay(tmp_path, outbox_db, kafka_service, names, header_column="tenant").start()
    writer = Writer(outbox_db)
    try:
        writer.transaction([("order", "s1", {"step": "before"})])
        with psycopg.connect(outbox_db, autocommit=True) as conn:
            conn.execute("ALTER TABLE outbox_events ADD COLUMN tenant text DEFAULT 'acme'")
        writer.transaction([("order", "s1", {"step": "added"})])
        with psycopg.connect(outbox_db, autocommit=True) as conn:
            conn.execute("ALTER TABLE outbox_events ALTER COLUMN aggregate_id TYPE varchar(64)")
        writer.transaction([("order", "s1", {"step": "retyped"})])
        with psycopg.connect(outbox_db, autocommit=True) as conn:
            conn.execute("ALTER TABLE outbox_events DROP COLUMN tenant")
        writer.transaction([("order", "s1", {"step": "dropped optional"})])
        received = consume(kafka_service.bootstrap, names.topic_prefix, expected=4)
        assert [dict(r.headers).get("tenant") for r in received] == [None, b"acme", b"acme", None]

        with psycopg.connect(outbox_db, autocommit=True) as conn:
            conn.execute("ALTER TABLE outbox_events DROP COLUMN event_type")
            conn.execute(
                "INSERT INTO outbox_events (aggregate_type, aggregate_id, payload) "
                """VALUES ('order', 's1', '{"step": "broken"}')"""
            )
        assert relay.wait(60) == 1
    finally:
        writer.close()
        relay.close()
    assert relay.log().strip().splitlines()[-1] == (
        "cdc-relay: error: table public.outbox_events has no column event_type; restore it "
        "(see cdc-relay schema show outbox) or map yours with --column, then restart the "
        "relay: it resumes "
        "after the last event Kafka acknowledged"
    )
    # The broken row was not confirmed: it still waits in the slot.
    assert pending_inserts(outbox_db, names.slot, names.publication) == 1


@pytest.mark.pg18
def test_payload_edge_cases(tmp_path: Path, outbox_db: str, kafka_service: Any, names: Any) -> None:
    with psycopg.connect(outbox_db, autocommit=True) as conn:
        conn.execute("ALTER TABLE outbox_events ALTER payload DROP NOT NULL")
        conn.execute("ALTER TABLE outbox_events ALTER aggregate_id DROP NOT NULL")
    setup_slot(outbox_db, names)
    big = {"blob": random.randbytes(200_000).hex()}  # TOASTed, out of line
    rows = [
        ("order", "ü-1", {"text": "Zoë 😀 Łódź ☃"}),
        ("order", "big", big),
        ("order lines", "x-1", {"odd": "topic"}),
        ("order", None, {"keyless": True}),
        ("order", "tomb", None),
    ]
    with psycopg.connect(outbox_db) as conn:
        for aggregate_type, aggregate_id, payload in rows:
            conn.execute(
                "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload) "
                "VALUES (%s, %s, 'edge', %s::jsonb)",
                (aggregate_type, aggregate_id, None if payload is None else _json(payload)),
            )
            conn.commit()

    # By default a NULL payload stops the relay at that event, after the others.
    strict = _relay(tmp_path, outbox_db, kafka_service, names, name="strict").start()
    try:
        assert strict.wait(60) == 1
    finally:
        strict.close()
    assert "has a NULL payload" in strict.log().strip().splitlines()[-1]
    assert "--tombstone-on-empty-payload" in strict.log().strip().splitlines()[-1]
    assert pending_inserts(outbox_db, names.slot, names.publication) == 1

    relay = _relay(
        tmp_path, outbox_db, kafka_service, names, tombstone_on_empty_payload="true"
    ).start()
    try:
        received = consume(kafka_service.bootstrap, names.topic_prefix, expected=5)
        assert relay.stop() == 0
    finally:
        relay.close()
    by_type = {(r.topic, r.key): r for r in received}
    prefix = names.topic_prefix
    assert by_type[(prefix + ".order", "ü-1".encode())].value == _json(rows[0][2]).encode()
    assert by_type[(prefix + ".order", b"big")].value == _json(big).encode()
    assert (prefix + ".order_lines", b"x-1") in by_type
    assert by_type[(prefix + ".order", None)].value == b'{"keyless": true}'
    assert by_type[(prefix + ".order", b"tomb")].value is None


def _json(value: object) -> str:
    """As PostgreSQL prints this jsonb (keys of these payloads are already in its order)."""
    return json.dumps(value, ensure_ascii=False)


def test_dead_letter_topic_takes_a_refused_event_and_the_stream_goes_on(
    tmp_path: Path, outbox_db: str, kafka_service: Any, names: Any
) -> None:
    setup_slot(outbox_db, names)
    dead = names.topic_prefix + ".dead-letters"
    relay = _relay(
        tmp_path,
        outbox_db,
        kafka_service,
        names,
        dead_letter_topic=dead,
        kafka_config="message.max.bytes=10000000",
    ).start()
    writer = Writer(outbox_db)
    try:
        writer.transaction([("order", "d", {"n": 1})])
        (big,) = writer.transaction([("order", "d", {"blob": random.randbytes(1_500_000).hex()})])
        writer.transaction([("order", "d", {"n": 2})])
        received = consume(kafka_service.bootstrap, names.topic_prefix, expected=3)
        assert relay.alive()
        assert relay.stop() == 0
    finally:
        writer.close()
        relay.close()
    letters = [r for r in received if r.topic == dead]
    assert [r.id for r in letters] == [big.id]
    headers = dict(letters[0].headers)
    assert headers["original_topic"] == (names.topic_prefix + ".order").encode()
    assert b"too large" in headers["error"].lower()
    assert int(headers["payload_bytes"]) > 1_000_000
    assert letters[0].value is None
    delivered = [r.id for r in received if r.topic != dead]
    # The broker refuses the whole batch the large event was in; the idempotent producer
    # then sends its neighbours again, so they may arrive twice, in order.
    assert list(dict.fromkeys(delivered)) == [writer.written[0].id, writer.written[2].id]
    assert len(delivered) <= 4
    assert pending_inserts(outbox_db, names.slot, names.publication) == 0
    assert "event sent to the dead-letter topic" in relay.log()


def _peak_rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM")


def _one_transaction_through(
    tmp_path: Path, outbox_db: str, kafka: Any, names: Any, events: int, name: str
) -> int:
    """Stream one transaction of ``events`` events; return the relay's peak RSS in KiB."""
    with psycopg.connect(outbox_db) as conn:
        conn.execute(
            "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload) "
            "SELECT 'order', 'h' || (i %% 97), 'order.bulk', jsonb_build_object('i', i, 'pad', "
            "repeat('x', 100)) FROM generate_series(1, %s) i",
            (events,),
        )
        conn.commit()
    (port,) = free_ports(1)
    relay = _relay(
        tmp_path,
        outbox_db,
        kafka,
        names,
        name=name,
        metrics_port=str(port),
        metrics_host="127.0.0.1",
    ).start()
    published = 'outbox_events_published_total{relay="stream"}'
    try:
        wait_until(
            lambda: _scrape(port).get(published) == events, 600, f"{events} events", interval=2
        )
        assert relay.proc is not None
        peak = _peak_rss_kib(relay.proc.pid)
        assert relay.stop() == 0
    finally:
        relay.close()
    return peak


def _scrape(port: int) -> dict[str, float]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            text = response.read().decode()
    except OSError:
        return {}
    return {
        name: float(value)
        for name, _, value in (line.rpartition(" ") for line in text.splitlines())
        if name and not name.startswith("#")
    }


@pytest.mark.slow
@pytest.mark.timeout(600)  # the default 300 s is for ordinary tests
def test_a_transaction_five_times_larger_streams_in_about_the_same_memory(
    tmp_path: Path, outbox_db: str, kafka_service: Any, names: Any
) -> None:
    """One transaction of 50,000 events, then one of 250,000: were anything kept per event
    (a few hundred bytes each in Python), the larger would need 50 MiB more at the least."""
    setup_slot(outbox_db, names)
    small = _one_transaction_through(tmp_path, outbox_db, kafka_service, names, 50_000, "small")
    huge = _one_transaction_through(tmp_path, outbox_db, kafka_service, names, 250_000, "huge")
    print(f"peak RSS: 50,000-event transaction {small} KiB, 250,000-event {huge} KiB")
    # Five times the events, about the same memory: nothing is kept per event.
    assert huge < small * 1.25 + 32 * 1024
    assert pending_inserts(outbox_db, names.slot, names.publication) == 0
