"""The polling relay end to end, against a real PostgreSQL and a real Kafka broker."""

from __future__ import annotations

import json
import random
import re
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import psycopg
import pytest
from confluent_kafka.admin import AdminClient, AlterConfigOpType, ConfigEntry, ConfigResource
from relaytools import (
    Load,
    Received,
    RelayProcess,
    Writer,
    check,
    consume,
    install_poller,
    relay_env,
    setup_slot,
    wait_until,
)

pytestmark = pytest.mark.integration


@pytest.fixture
def poller_db(outbox_db: str) -> str:
    install_poller(outbox_db)
    return outbox_db


def poller(
    tmp_path: Path, dsn: str, kafka: Any, names: Any, name: str = "poll", **extra: str
) -> RelayProcess:
    env = relay_env(dsn, kafka.bootstrap, names, poll_interval="1", **extra)
    return RelayProcess(tmp_path, env, name=name, command="poll")


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cdc_relay", *args], capture_output=True, text=True, timeout=120
    )


def rows(dsn: str, query: str, *params: Any) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute(query, params).fetchall()


def unprocessed(dsn: str) -> int:
    ((count,),) = rows(dsn, "SELECT count(*) FROM outbox_events WHERE processed_at IS NULL")
    return int(count)


def test_poll_and_stream_put_the_same_messages_on_the_wire_in_the_same_order(
    tmp_path: Path, poller_db: str, kafka_service: Any, names: Any
) -> None:
    setup_slot(poller_db, names)
    streamed, polled = names.topic_prefix + "_stream", names.topic_prefix + "_poll"
    stream = RelayProcess(
        tmp_path,
        relay_env(
            poller_db, kafka_service.bootstrap, names, topic_template=streamed + ".{aggregate_type}"
        ),
        name="stream",
    ).start()
    poll = poller(
        tmp_path,
        poller_db,
        kafka_service,
        names,
        topic_template=polled + ".{aggregate_type}",
        workers="2",
    ).start()
    try:
        # Concurrent writers of small transactions, a large transaction, and payloads whose
        # text form jsonb rewrites (key order, spacing, numbers, escapes, non-ASCII).
        load = Load(poller_db, writers=3, pause=0).start()
        writer = Writer(poller_db)
        writer.transaction(
            [("invoice", f"big{i % 13}", {"i": i, "pad": "x" * 40}) for i in range(3000)]
        )
        odd = {"z": 1, "a": [1.50, 1e3, -0.0], "s": 'quote " \\ \n tab\t', "é": "Zoë ✓ 😀"}
        for i in range(50):
            writer.transaction([("customer", f"odd{i % 4}", {**odd, "i": i})])
        time.sleep(2)
        written = load.stop() + writer.written
        writer.close()

        from_stream = consume(kafka_service.bootstrap, streamed, expected=len(written))
        from_poll = consume(kafka_service.bootstrap, polled, expected=len(written))
        assert poll.stop() == 0
        assert stream.stop() == 0
    finally:
        poll.close()
        stream.close()

    for prefix, received in ((streamed, from_stream), (polled, from_poll)):
        verdict = check(written, received, prefix)
        print(prefix, verdict)
        assert verdict.lost == []
        assert verdict.mismatched == []
        assert verdict.out_of_order == []
        assert verdict.duplicates == 0

    def wire(received: list[Received], prefix: str) -> dict[str, tuple[Any, ...]]:
        return {
            r.id: (r.topic.removeprefix(prefix), r.partition, r.key, r.headers, r.value)
            for r in received
        }

    def per_aggregate(received: list[Received]) -> dict[Any, list[str]]:
        order = defaultdict(list)
        for r in sorted(received, key=lambda r: (r.topic, r.partition, r.offset)):
            order[(dict(r.headers)["aggregate_type"], r.key)].append(r.id)
        return dict(order)

    assert wire(from_poll, polled) == wire(from_stream, streamed)
    assert per_aggregate(from_poll) == per_aggregate(from_stream)
    assert len(written) > 3000 + 50 + 100


def test_broker_down_holds_the_batch_and_everything_arrives_after_restart(
    tmp_path: Path, poller_db: str, kafka_service: Any, names: Any
) -> None:
    relay = poller(tmp_path, poller_db, kafka_service, names, shutdown_timeout="2").start()
    try:
        writer = Writer(poller_db)
        writer.transaction([("order", "before", {"n": 0})])
        consume(kafka_service.bootstrap, names.topic_prefix, expected=1, settle=0)

        kafka_service.stop()
        try:
            for i in range(30):
                writer.transaction([("order", f"down{i % 5}", {"n": i})])

            def claimed() -> int:
                """Unprocessed rows a poller holds locked: claimed, waiting for Kafka."""
                ((free,),) = rows(
                    poller_db,
                    "SELECT count(*) FROM (SELECT 1 FROM outbox_events WHERE processed_at IS "
                    "NULL FOR UPDATE SKIP LOCKED) s",
                )
                return 30 - int(free)

            wait_until(lambda: claimed() > 0, 30, "the poller to claim rows")
            # The batch waits for the broker: no attempt is spent, nothing marked.
            assert rows(
                poller_db,
                "SELECT count(*), max(attempts) FROM outbox_events WHERE processed_at IS NULL",
            ) == [(30, 0)]
            relay.signal(signal.SIGTERM)  # it releases the batch after --shutdown-timeout
            assert relay.wait(30) == 0, relay.log()
            assert "stopping before Kafka answered" in relay.log()
            assert rows(
                poller_db,
                "SELECT count(*), max(attempts) FROM outbox_events WHERE processed_at IS NULL",
            ) == [(30, 0)]
        finally:
            kafka_service.start()
        writer.close()
        relay.start()

        received = consume(kafka_service.bootstrap, names.topic_prefix, expected=31)
        verdict = check(writer.written, received, names.topic_prefix)
        print(verdict)
        assert verdict.lost == []
        assert verdict.out_of_order == []
        assert verdict.mismatched == []
        assert verdict.duplicates == 0  # the released batch never reached the broker
        assert relay.stop() == 0
    finally:
        relay.close()
    assert rows(poller_db, "SELECT count(*) FROM outbox_events WHERE processed_at IS NULL") == [
        (0,)
    ]


def _raise_topic_limit(bootstrap: str, topic: str, limit: int) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    resource = ConfigResource(
        ConfigResource.Type.TOPIC,
        topic,
        incremental_configs=[
            ConfigEntry(
                "max.message.bytes", str(limit), incremental_operation=AlterConfigOpType.SET
            )
        ],
    )
    for future in admin.incremental_alter_configs([resource]).values():
        future.result(timeout=30)


@pytest.mark.parametrize("where", ["producer", "broker"])
def test_a_row_kafka_refuses_becomes_a_dead_letter_and_a_retried_one_is_delivered(
    tmp_path: Path, poller_db: str, kafka_service: Any, names: Any, where: str
) -> None:
    options = {"max_attempts": "3", "backoff_base": "0.05", "backoff_max": "0.2"}
    if where == "broker":
        # The client lets a 3 MB message through; the broker (message.max.bytes ~1 MB) refuses
        # it, and with it the rest of its request: rows of the same partition fail once too.
        options["kafka_config"] = "message.max.bytes=10000000"
    relay = poller(tmp_path, poller_db, kafka_service, names, **options).start()
    try:
        writer = Writer(poller_db)
        for i in range(20):
            writer.transaction([("order", f"ok{i % 4}", {"i": i})])
        wait_until(lambda: unprocessed(poller_db) == 0, 30, "the first rows to be published")
        # Random hex: compression cannot shrink it under the broker's limit.
        blob = random.randbytes(1_500_000).hex()
        (_, big, _) = writer.transaction(
            [
                ("order", "shared", {"n": "before"}),
                ("order", "shared", {"blob": blob}),
                ("order", "shared", {"n": "after"}),
            ]
        )
        for i in range(20, 60):
            writer.transaction([("order", f"ok{i % 4}", {"i": i})])

        def dead_letters() -> list[tuple[Any, ...]]:
            return rows(poller_db, "SELECT id::text, attempts, last_error FROM outbox_dead_letters")

        wait_until(lambda: dead_letters() != [], 60, "the big row to become a dead letter")
        ((dead_id, attempts, last_error),) = dead_letters()
        assert (dead_id, attempts) == (big.id, 3)
        assert "MSG_SIZE_TOO_LARGE" in last_error, last_error

        healthy = [w for w in writer.written if w.id != big.id]
        received = consume(kafka_service.bootstrap, names.topic_prefix, expected=len(healthy))
        verdict = check(writer.written, received, names.topic_prefix)
        print(verdict)
        assert verdict.lost == [big.id]  # every other row went past the poison row
        assert verdict.duplicates == 0
        assert verdict.mismatched == []

        listed = cli("dead-letters", "list", "--dsn", poller_db)
        assert listed.returncode == 0, listed.stderr
        assert big.id in listed.stdout
        assert "MSG_SIZE_TOO_LARGE" in listed.stdout
        as_json = json.loads(cli("dead-letters", "list", "--dsn", poller_db, "--json").stdout)
        assert [(r["id"], r["attempts"], r["aggregate_id"]) for r in as_json] == [
            (big.id, 3, "shared")
        ]

        # Fix the cause, then retry: a poller takes it again (woken by the retry command).
        _raise_topic_limit(kafka_service.bootstrap, names.topic_prefix + ".order", 10_000_000)
        if where == "producer":
            assert relay.stop() == 0
            relay.env["CDC_RELAY_KAFKA_CONFIG"] = "message.max.bytes=10000000"
            relay.start()
        retried = cli("dead-letters", "retry", "--dsn", poller_db, "--id", big.id)
        assert retried.returncode == 0, retried.stderr
        assert retried.stdout.strip() == "queued 1 dead letter again"
        writer.close()

        received = consume(kafka_service.bootstrap, names.topic_prefix, len(writer.written))
        verdict = check(writer.written, received, names.topic_prefix)
        print(verdict)
        assert verdict.lost == []
        assert verdict.duplicates == 0
        assert verdict.mismatched == []
        assert dead_letters() == []
        assert relay.stop() == 0
    finally:
        relay.close()
    # The documented price of flowing past a poison row: once it is a dead letter, the later
    # rows of its aggregate go ahead of it. Other aggregates keep their order, except that
    # rows the broker refused together with it may be overtaken within their batch.
    assert "order/shared" in verdict.out_of_order
    failed_once = {
        f"order/{aggregate}"
        for (aggregate,) in rows(
            poller_db,
            "SELECT DISTINCT aggregate_id FROM outbox_events WHERE last_error IS NOT NULL",
        )
    }
    if where == "producer":
        assert failed_once == {"order/shared"}
    assert set(verdict.out_of_order) <= failed_once


def test_several_pollers_at_once_publish_every_row_once(
    tmp_path: Path, poller_db: str, kafka_service: Any, names: Any
) -> None:
    relays = [
        poller(
            tmp_path,
            poller_db,
            kafka_service,
            names,
            name=f"poll{n}",
            workers="2",
            batch_size="50",
        ).start()
        for n in range(3)
    ]
    try:
        load = Load(poller_db, writers=3, pause=0).start()
        time.sleep(3)
        written = load.stop()
        received = consume(kafka_service.bootstrap, names.topic_prefix, expected=len(written))
        assert [relay.stop() for relay in relays] == [0, 0, 0]
    finally:
        for relay in relays:
            relay.close()
    verdict = check(written, received, names.topic_prefix)
    published = [
        int(re.findall(r"progress: (\d+) events published", relay.log())[-1]) for relay in relays
    ]
    print(verdict, "published per poller:", published)
    assert verdict.lost == []
    assert verdict.mismatched == []
    assert verdict.duplicates == 0
    assert sum(published) == len(written)
    assert sum(1 for n in published if n > 0) >= 2  # they did share the work


def test_prune_and_dead_letter_commands(poller_db: str) -> None:
    writer = Writer(poller_db)
    written = writer.transaction([("order", f"a{i}", {"i": i}) for i in range(12)])
    writer.close()
    ids = [w.id for w in written]
    with psycopg.connect(poller_db, autocommit=True) as conn:
        # 5 processed long ago, 2 processed lately, 3 waiting, 2 dead letters
        conn.execute(
            "UPDATE outbox_events SET processed_at = now() - interval '8 days' WHERE id = ANY(%s)",
            [ids[:5]],
        )
        conn.execute(
            "UPDATE outbox_events SET processed_at = now() - interval '1 day' WHERE id = ANY(%s)",
            [ids[5:7]],
        )
        conn.execute(
            "UPDATE outbox_events SET attempts = 10, retry_after = 'infinity', "
            "last_error = 'MSG_SIZE_TOO_LARGE: Broker: Message size too large' "
            "WHERE id = ANY(%s)",
            [ids[10:]],
        )

    pruned = cli("prune", "--dsn", poller_db, "--older-than", "7d", "--batch-size", "2")
    assert pruned.returncode == 0, pruned.stderr
    assert pruned.stdout.startswith("pruned 5 processed rows (processed before ")
    left = rows(poller_db, "SELECT id::text FROM outbox_events ORDER BY seq")
    assert [r[0] for r in left] == ids[5:]
    assert cli("prune", "--dsn", poller_db, "--older-than", "12h").stdout.startswith("pruned 2 ")
    assert cli("prune", "--dsn", poller_db, "--older-than", "7x").returncode == 2

    table = cli("dead-letters", "list", "--dsn", poller_db)
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[0].split() == [
        "id",
        "attempts",
        "created",
        "aggregate",
        "event",
        "type",
        "last",
        "error",
    ]
    assert [line.split()[0] for line in lines[1:]] == ids[10:]

    not_dead = cli("dead-letters", "retry", "--dsn", poller_db, "--id", ids[8], "--id", ids[10])
    assert not_dead.returncode == 1
    assert not_dead.stdout.strip() == "queued 1 dead letter again"
    assert not_dead.stderr.strip() == (
        f"cdc-relay: error: not dead letters, left alone: {ids[8]}; see cdc-relay dead-letters list"
    )
    assert cli("dead-letters", "retry", "--dsn", poller_db, "--id", "nope").returncode == 2
    assert cli("dead-letters", "retry", "--dsn", poller_db).returncode == 2
    retried = cli("dead-letters", "retry", "--dsn", poller_db, "--all")
    assert retried.stdout.strip() == "queued 1 dead letter again"
    assert cli("dead-letters", "list", "--dsn", poller_db).stdout.strip() == "no dead letters"
    assert (
        rows(
            poller_db,
            "SELECT attempts, retry_after, last_error IS NOT NULL FROM outbox_events "
            "WHERE id = ANY(%s::uuid[])",
            ids[10:],
        )
        == [(0, None, True)] * 2
    )


def test_poll_start_errors_are_one_line(outbox_db: str, names: Any) -> None:
    base = ["poll", "--dsn", outbox_db, "--kafka-bootstrap", "127.0.0.1:9", "--kafka-timeout", "1"]
    missing = cli(*base, "--table", "no_such_table")
    assert missing.returncode == 1
    assert missing.stderr.strip() == (
        "cdc-relay: error: table no_such_table does not exist; create it with sql/outbox.sql, "
        "or name yours with --table"
    )
    # The table is there but sql/poller.sql is not: the poller warns and goes on polling,
    # then finds no broker.
    unreachable = cli(*base)
    assert unreachable.returncode == 1
    lines = unreachable.stderr.strip().splitlines()
    assert "no trigger notifies the pollers" in lines[0]
    assert lines[-1].startswith(
        "cdc-relay: error: no Kafka broker answered at 127.0.0.1:9 within 1s"
    ), lines
    assert "check --kafka-bootstrap" in lines[-1]
