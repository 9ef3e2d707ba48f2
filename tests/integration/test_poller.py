"""The polling relay end to end, against a real PostgreSQL and a real Kafka broker."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import faulttools
import psycopg
import pytest
from confluent_kafka.admin import AdminClient, AlterConfigOpType, ConfigEntry, ConfigResource
from faulttools import ProxiedKafka
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg.rows import dict_row
from relaytools import (
    Load,
    Received,
    RelayProcess,
    Writer,
    check,
    consume,
    find_on_kafka,
    handover,
    install_poller,
    relay_env,
    setup_slot,
    wait_until,
)

from cdc_relay import schema
from cdc_relay.postgres import store

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


def lost_rows(dsn: str, ids: list[str]) -> list[tuple[Any, ...]]:
    """What the database says of rows Kafka did not show: whether a poller marked them."""
    return rows(
        dsn,
        "SELECT id::text, seq, aggregate_id, attempts, created_at, processed_at, last_error "
        "FROM outbox_events WHERE id = ANY(%s::uuid[]) ORDER BY seq",
        ids,
    )


def processed(dsn: str) -> int:
    ((count,),) = rows(dsn, "SELECT count(*) FROM outbox_events WHERE processed_at IS NOT NULL")
    return int(count)


def unprocessed(dsn: str) -> int:
    ((count,),) = rows(dsn, "SELECT count(*) FROM outbox_events WHERE processed_at IS NULL")
    return int(count)


@pytest.mark.pg18
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
        # Only a row the refused producer held without a report may be on Kafka twice: it
        # may have been written in a request of another partition before the producer
        # stopped, and is tried again (at least once). Any other is published once.
        unknown = set(re.findall(r"event (\S+) failed with other rows.*no report", relay.log()))
        twice = {id for id, n in Counter(r.id for r in received).items() if n > 1}
        assert twice <= unknown, (twice, unknown)
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


@pytest.mark.pg18
def test_several_pollers_at_once_publish_every_row_once(
    tmp_path: Path, poller_db: str, kafka_service: Any, names: Any
) -> None:
    # A broker just started, and topics made by the first events: partitions whose leader is
    # not ready yet refuse a first batch while accepting the next (sink.REQUIRED, one request
    # in flight: with five, a row was now and then marked processed that Kafka never had).
    kafka_service.stop()
    kafka_service.start()
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
        # Many aggregates, so that one poller's batches cannot hold them all.
        load = Load(poller_db, writers=3, pause=0, aggregates=200).start()
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
    if verdict.lost:
        print("lost rows:", lost_rows(poller_db, verdict.lost))
        print("on Kafka:", find_on_kafka(kafka_service.bootstrap, names.topic_prefix, verdict.lost))
    assert verdict.lost == []
    assert verdict.mismatched == []
    assert verdict.duplicates == 0
    assert verdict.out_of_order == []  # one poller at a time publishes an aggregate
    assert sum(published) == len(written)
    assert sum(1 for n in published if n > 0) >= 2  # they did share the work


def test_a_poller_whose_host_vanishes_mid_claim_is_not_overtaken_by_its_replacement(
    tmp_path: Path, poller_db: str, kafka_service: Any, names: Any
) -> None:
    """A host vanishing freezes its poller (SIGSTOP here): neither its PostgreSQL nor its
    Kafka connection moves again, and PostgreSQL keeps its session, with the claim, until it
    notices (TCP keepalives, or an operator: pg_terminate_backend, as here). A replacement
    poller started meanwhile must not publish the later rows of the claimed aggregates before
    the claimed rows: it leaves those aggregates alone until the session is gone."""

    def claim_holders() -> list[int]:  # the pollers' sessions in the middle of a claim
        return [
            pid
            for (pid,) in rows(
                poller_db,
                "SELECT pid FROM pg_stat_activity "
                "WHERE application_name = 'cdc-relay poll' AND state = 'idle in transaction'",
            )
        ]

    vanishing = poller(tmp_path, poller_db, kafka_service, names, name="vanishing")
    vanishing.env["CDC_RELAY_BATCH_SIZE"] = "100"
    replacement = poller(tmp_path, poller_db, kafka_service, names, name="replacement")
    load = Load(poller_db, writers=3, pause=0.001, aggregates=50).start()
    vanishing.start()
    try:
        wait_until(lambda: processed(poller_db) > 500, 60, "the first poller to publish")
        for _ in range(50):  # freeze it in the middle of a claim
            time.sleep(random.uniform(0, 0.05))
            vanishing.signal(signal.SIGSTOP)
            held = claim_holders()
            if held:
                break
            vanishing.signal(signal.SIGCONT)
        else:
            pytest.fail("never caught the poller holding a claim in 50 tries")
        before = processed(poller_db)
        replacement.start()
        time.sleep(5)  # the replacement publishes every aggregate but the claimed ones
        assert processed(poller_db) > before  # it did work meanwhile
        rows(poller_db, "SELECT pg_terminate_backend(pid) FROM unnest(%s::int[]) AS pid", held)
        time.sleep(2)  # now it takes those too
        written = load.stop()
        received = consume(kafka_service.bootstrap, names.topic_prefix, expected=len(written))
        assert replacement.stop() == 0
    finally:
        load.stop()
        vanishing.kill()
        replacement.close()
        vanishing.close()
    verdict = check(written, received, names.topic_prefix)
    print(verdict, "claim holders frozen:", held)
    if verdict.lost:
        print("lost rows:", lost_rows(poller_db, verdict.lost))
        print("on Kafka:", find_on_kafka(kafka_service.bootstrap, names.topic_prefix, verdict.lost))
    assert verdict.lost == []
    assert verdict.mismatched == []
    assert verdict.out_of_order == []
    assert verdict.duplicates <= 100  # at most the frozen claim, published twice


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
        "cdc-relay: error: table no_such_table does not exist; create it with cdc-relay schema "
        "apply outbox, or name yours with --table"
    )
    # Each claim locks up to --batch-size aggregates in PostgreSQL's shared lock table.
    greedy = cli(*base, "--workers", "8", "--batch-size", "100000")
    assert greedy.returncode == 1
    (line,) = greedy.stderr.strip().splitlines()[-1:]
    assert line.startswith("cdc-relay: error: --workers x --batch-size = 800000 aggregate locks")
    assert "raise max_locks_per_transaction" in line
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
    # A trigger of an older schema poller notified a channel named by the table's names,
    # where the poller no longer listens.
    with psycopg.connect(outbox_db, autocommit=True) as conn:
        conn.execute(schema.text("poller").encode())
        conn.execute(
            "CREATE OR REPLACE FUNCTION outbox_events_notify() RETURNS trigger LANGUAGE plpgsql"
            " AS $$ BEGIN PERFORM pg_notify(TG_TABLE_SCHEMA || '.' || TG_TABLE_NAME, '');"
            " RETURN NULL; END $$"
        )
    older = cli(*base).stderr.strip().splitlines()
    assert (
        "an older version of the trigger of schema poller, on another channel, notifies the "
        "pollers of new rows in public.outbox_events" in older[0]
    ), older
    assert "run cdc-relay schema apply poller" in older[0]
    install_poller(outbox_db)
    current = cli(*base).stderr.strip().splitlines()
    assert len(current) == 1, current  # no warning, the broker's error alone


# -- database errors while polling -----------------------------------------------------------


def _terminate_pollers(dsn: str) -> None:
    rows(
        dsn,
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
        "WHERE datname = current_database() AND application_name = 'cdc-relay poll'",
    )


def test_a_read_only_database_is_waited_out_and_every_row_arrives_once_writable(
    tmp_path: Path, poller_db: str, kafka_service: Any, names: Any
) -> None:
    database = sql.Identifier(conninfo_to_dict(poller_db)["dbname"])
    admin = make_conninfo(poller_db, options="-cdefault_transaction_read_only=off")
    relay = poller(tmp_path, poller_db, kafka_service, names).start()
    writer = Writer(poller_db)  # its session predates the setting: it stays writable
    try:
        writer.transaction([("order", "ro0", {"n": 0})])
        consume(kafka_service.bootstrap, names.topic_prefix, expected=1, settle=0)
        # As after a demotion: the poller's new sessions are read-only.
        with psycopg.connect(poller_db, autocommit=True) as conn:
            conn.execute(
                sql.SQL("ALTER DATABASE {} SET default_transaction_read_only = on").format(database)
            )
        _terminate_pollers(poller_db)
        for i in range(1, 21):
            writer.transaction([("order", f"ro{i % 3}", {"n": i})])
        wait_until(lambda: "the database is read-only" in relay.log(), 30, "the read-only warning")
        time.sleep(2)
        assert relay.alive(), relay.log()
        assert unprocessed(poller_db) == 20  # nothing claimed, nothing marked

        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(
                sql.SQL("ALTER DATABASE {} RESET default_transaction_read_only").format(database)
            )
        writer.close()
        received = consume(kafka_service.bootstrap, names.topic_prefix, expected=21)
        wait_until(lambda: unprocessed(poller_db) == 0, 30, "every row marked processed")
        assert relay.stop() == 0
    finally:
        relay.close()
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(
                sql.SQL("ALTER DATABASE {} RESET default_transaction_read_only").format(database)
            )
    verdict = check(writer.written, received, names.topic_prefix)
    print(verdict)
    assert verdict.lost == []
    assert verdict.duplicates == 0
    assert verdict.out_of_order == []
    assert verdict.mismatched == []
    log = relay.log()
    assert "waiting for a writable primary" in log
    assert "Traceback" not in log


@pytest.mark.parametrize("change", ["drop column", "retype payload"])
def test_a_table_changed_under_the_poller_stops_it_with_one_line_and_nothing_marked(
    tmp_path: Path, poller_db: str, kafka_service: Any, names: Any, change: str
) -> None:
    relay = poller(tmp_path, poller_db, kafka_service, names).start()
    try:
        writer = Writer(poller_db)
        writer.transaction([("order", "a", {"n": 0})])
        writer.close()
        consume(kafka_service.bootstrap, names.topic_prefix, expected=1, settle=0)
        with psycopg.connect(poller_db, autocommit=True) as conn:
            if change == "drop column":
                conn.execute("ALTER TABLE outbox_events DROP COLUMN attempts CASCADE")
                payload = '{"n": 1}'
            else:
                # jsonb -> bytea: read with the jsonb expression it would go out as hex text
                conn.execute(
                    "ALTER TABLE outbox_events ALTER COLUMN payload TYPE bytea "
                    "USING convert_to(payload::text, 'UTF8')"
                )
                payload = b'{"n": 1}'
            conn.execute(
                "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload) "
                "VALUES ('order', 'a', 'order.changed', %s)",
                [payload],
            )
        assert relay.wait(60) == 1
    finally:
        relay.close()
    log = relay.log()
    assert "Traceback" not in log
    if change == "drop column":
        assert log.strip().splitlines()[-1] == (
            "cdc-relay: error: PostgreSQL refused the poller's query on public.outbox_events: "
            "column t.attempts does not exist (SQLSTATE 42703); make public.outbox_events as "
            "cdc-relay schema show outbox does, then run it again"
        )
    else:
        assert log.strip().splitlines()[-1] == (
            "cdc-relay: error: the payload column of public.outbox_events changed type while "
            "the relay ran; nothing was published from it since: start the relay again, which "
            "reads the payload by the column's type"
        )
    assert unprocessed(poller_db) == 1
    # Only the first event reached Kafka.
    received = consume(kafka_service.bootstrap, names.topic_prefix, expected=2, timeout=5)
    assert len(received) == 1


# -- the outbox table however --table names it -----------------------------------------------


def _outbox_in_schema(dsn: str, name: str) -> str:
    """A second outbox, with sql/poller.sql, in schema ``name``; returns a DSN that finds it
    first."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(name)))
        conn.execute(sql.SQL("SET search_path = {}").format(sql.Identifier(name)))
        conn.execute(schema.text("outbox").encode())
        conn.execute(schema.text("poller").encode())
    return make_conninfo(dsn, options=f"-csearch_path={name}")


@pytest.mark.parametrize(
    ("spelling", "table", "resolved"),
    [
        ("schema-qualified", '"app".Outbox_Events', "app.outbox_events"),
        ("mixed case", "Outbox_Events", "public.outbox_events"),
        ("through search_path", "outbox_events", "app.outbox_events"),
    ],
)
def test_every_command_uses_the_table_as_postgresql_resolves_table(
    tmp_path: Path,
    poller_db: str,
    kafka_service: Any,
    names: Any,
    spelling: str,
    table: str,
    resolved: str,
) -> None:
    in_app = _outbox_in_schema(poller_db, "app")
    writes = poller_db if resolved.startswith("public.") else in_app
    dsn = in_app if spelling == "through search_path" else poller_db
    writer = Writer(writes)
    for i in range(10):
        writer.transaction([("order", f"t{i % 3}", {"i": i})])

    relay = poller(tmp_path, dsn, kafka_service, names, table=table, progress_interval="0.5")
    relay.start()
    try:
        wait_until(
            lambda: (
                "progress: 10 events published, 0 publish failures; 0 unprocessed rows, "
                "0 dead letters" in relay.log()
            ),
            60,
            "a progress line with the table's counts",
        )
        assert relay.stop() == 0
    finally:
        relay.close()
    assert f"polling {resolved} with 1 worker" in relay.log()
    assert "Traceback" not in relay.log()

    # The handover's backlog, with a dead letter in it that the commands find and retry.
    backlog = [writer.transaction([("order", f"t{i % 3}", {"i": i})])[0] for i in range(10, 15)]
    writer.close()
    with psycopg.connect(writes, autocommit=True) as conn:
        conn.execute(
            sql.SQL(
                "UPDATE {} SET attempts = 10, retry_after = 'infinity', last_error = 'too large' "
                "WHERE id = %s"
            ).format(sql.Identifier(*resolved.split("."))),
            [backlog[0].id],
        )
    listed = cli("dead-letters", "list", "--dsn", dsn, "--table", table)
    assert listed.returncode == 0, listed.stderr
    assert backlog[0].id in listed.stdout
    retried = cli("dead-letters", "retry", "--dsn", dsn, "--table", table, "--all")
    assert retried.returncode == 0, retried.stderr
    assert retried.stdout.strip() == "queued 1 dead letter again"
    pruned = cli("prune", "--dsn", dsn, "--table", table, "--older-than", "0s")
    assert pruned.returncode == 0, pruned.stderr
    assert pruned.stdout.startswith("pruned 10 processed rows"), pruned.stdout

    env = relay_env(dsn, kafka_service.bootstrap, names, table=table)
    switched = subprocess.run(
        [sys.executable, "-m", "cdc_relay", "setup-slot", "--from-poller"],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert switched.returncode == 0, switched.stderr
    assert f"created publication {names.publication} on {resolved}" in switched.stdout
    assert "published 5 events that were unprocessed" in switched.stdout

    received = consume(kafka_service.bootstrap, names.topic_prefix, expected=15)
    verdict = check(writer.written, received, names.topic_prefix)
    print(spelling, verdict)
    assert verdict.lost == []
    assert verdict.duplicates == 0
    assert verdict.mismatched == []
    assert verdict.out_of_order == []


# -- bytea payloads ---------------------------------------------------------------------------


@pytest.mark.parametrize("column_type", ["bytea", "a domain over bytea"])
def test_a_bytea_payload_goes_to_kafka_as_the_stored_bytes(
    tmp_path: Path, poller_db: str, kafka_service: Any, names: Any, column_type: str
) -> None:
    with psycopg.connect(poller_db, autocommit=True) as conn:
        if column_type != "bytea":
            conn.execute("CREATE DOMAIN blob AS bytea")
        conn.execute(
            sql.SQL(
                "ALTER TABLE outbox_events ALTER COLUMN payload TYPE {} "
                "USING convert_to(payload::text, 'UTF8')"
            ).format(sql.Identifier("bytea" if column_type == "bytea" else "blob"))
        )
    samples = [
        b"\x00\xff\xfe\x00 not text",
        b"\\x41 looks like hex",
        "Zoë, in Latin-1".encode("latin-1"),
        b'{"json": "as bytes"}',
        random.randbytes(3000),
    ]
    stored: dict[str, bytes] = {}

    def write(batch: list[bytes]) -> None:
        with psycopg.connect(poller_db) as conn:
            for n, payload in enumerate(batch):
                ((event_id,),) = conn.execute(
                    "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload)"
                    " VALUES ('file', %s, 'file.stored', %s) RETURNING id::text",
                    [f"f{n % 2}", payload],
                ).fetchall()
                stored[event_id] = payload

    write(samples)  # published by the poller
    relay = poller(tmp_path, poller_db, kafka_service, names).start()
    try:
        consume(kafka_service.bootstrap, names.topic_prefix, expected=len(samples), settle=0)
        assert relay.stop() == 0
    finally:
        relay.close()
    write(samples[::-1])  # published by the handover
    switched = handover(poller_db, kafka_service.bootstrap, names)
    assert switched.returncode == 0, switched.stderr
    assert f"published {len(samples)} events" in switched.stdout

    received = consume(kafka_service.bootstrap, names.topic_prefix, expected=2 * len(samples))
    assert {r.id: r.value for r in received} == stored
    assert len(received) == len(stored)


def _plan_nodes(plan: dict[str, Any]) -> list[dict[str, Any]]:
    return [plan, *(node for child in plan.get("Plans", ()) for node in _plan_nodes(child))]


def test_a_claim_reads_a_batch_not_the_backlog_however_stale_the_statistics(
    poller_db: str,
) -> None:
    """A steady outbox's statistics say almost every row is processed; then the poller falls
    behind and a backlog builds before the next ANALYZE. A claim that sorted the backlog (the
    planner's choice when it believes few rows are unprocessed) would cost more the further
    behind the poller is, and a poller at a steady rate would fall further behind with every
    claim. Both steps of the claim must walk the queue in seq order and stop at the batch."""
    from cdc_relay.postgres.store import resolve

    with psycopg.connect(poller_db, autocommit=True, row_factory=dict_row) as conn:
        conn.execute("ALTER TABLE outbox_events SET (autovacuum_enabled = off)")
        insert = (
            "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload, "
            "processed_at) SELECT 'order', (g %% 5000)::text, 'created', '{\"n\": 1}', {done} "
            "FROM generate_series(1, %s) AS g"
        )
        conn.execute(insert.replace("{done}", "now()"), (300_000,))
        conn.execute(insert.replace("{done}", "NULL"), (100,))
        conn.execute("VACUUM ANALYZE outbox_events")
        conn.execute(insert.replace("{done}", "NULL"), (100_000,))  # the backlog, unanalysed
        outbox = resolve(conn, "outbox_events")
        batch = 500
        with conn.transaction():
            steps = {}
            params: dict[str, Any] = {
                "limit": batch,
                "shard": 0,
                "shards": 1,
                "table_oid": outbox.table.oid,
                "skip": [],
            }
            explain = sql.SQL("EXPLAIN (ANALYZE, FORMAT JSON) ")

            def plan(query: sql.Composed, values: dict[str, Any]) -> dict[str, Any]:
                row = conn.execute(explain + query, values).fetchone()
                assert row is not None
                return dict(row["QUERY PLAN"][0]["Plan"])

            steps["claim_aggregates"] = plan(outbox.query("claim_aggregates"), params)
            locked = conn.execute(outbox.query("claim_aggregates"), params).fetchone()
            assert locked is not None and locked["keys"]
            steps["claim"] = plan(outbox.query("claim"), {"limit": batch, "keys": locked["keys"]})
    for step, found in steps.items():
        nodes = _plan_nodes(found)
        assert not [n for n in nodes if n["Node Type"] in ("Sort", "Incremental Sort")], (
            step,
            json.dumps(found, indent=1)[:3000],
        )
        # rows the scans of the queue handed up: a batch's worth, not the 100,000 behind it
        scanned = sum(
            n["Actual Rows"] * n["Actual Loops"]
            for n in nodes
            if n.get("Relation Name") == "outbox_events" and n.get("Alias") == "t"
        )
        assert 0 < scanned <= 2 * batch, (step, scanned)


# -- the NOTIFY channel ------------------------------------------------------------------------


@pytest.mark.parametrize("length", [49, 50])
def test_the_notify_trigger_fits_any_table_name_and_wakes_the_poller_listening(
    poller_db: str, length: int
) -> None:
    """``schema.table`` is 63 bytes with a schema of 49 characters and 64 with one of 50: a
    channel named so would be refused by pg_notify from 64 bytes on (every INSERT failing),
    and cut short by LISTEN."""
    name = "tenant_" + "a" * (length - len("tenant_"))
    in_schema = _outbox_in_schema(poller_db, name)
    with psycopg.connect(in_schema, autocommit=True, row_factory=dict_row) as conn:
        outbox = store.resolve(conn, f"{name}.outbox_events")
    with psycopg.connect(in_schema, autocommit=True) as listener:
        listener.execute(outbox.listen)  # the poller's own statement
        writer = Writer(in_schema)
        try:
            writer.transaction([("order", "1", {"n": 1})])  # the trigger fires
        finally:
            writer.close()
        heard = [n.channel for n in listener.notifies(timeout=5, stop_after=1)]
    assert heard == [outbox.channel]


# -- a claim PostgreSQL released is not delivered late -----------------------------------------

proxied_kafka = pytest.fixture(scope="module")(faulttools.proxied_kafka)


def poller_pids(dsn: str) -> list[int]:
    """The backends of the pollers' sessions (their workers' and listeners')."""
    return [
        int(pid)
        for (pid,) in rows(
            dsn,
            "SELECT pid FROM pg_stat_activity "
            "WHERE datname = current_database() AND application_name = 'cdc-relay poll'",
        )
    ]


def claiming(dsn: str) -> bool:
    """Whether a poller holds an aggregate's lock: it is inside a claim's transaction."""
    ((count,),) = rows(
        dsn,
        "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid "
        "WHERE a.application_name = 'cdc-relay poll' AND l.locktype = 'advisory' "
        "AND l.mode = 'ExclusiveLock' AND l.granted",
    )
    return bool(count)


def test_a_frozen_poller_cut_off_from_kafka_drops_the_claim_postgresql_released(
    tmp_path: Path, poller_db: str, proxied_kafka: ProxiedKafka, names: Any
) -> None:
    """Poller A claims e1..e3 while its link to Kafka is down, and is frozen (SIGSTOP);
    PostgreSQL ends its session; poller B publishes e1..e4. A is resumed, its link still
    down: it must drop e1..e3 rather than deliver them after e4 once the link is back (a
    compacted topic would end on e3)."""
    kafka, proxy = proxied_kafka.broker, proxied_kafka.proxy
    writer = Writer(poller_db)
    a = poller(tmp_path, poller_db, kafka, names, name="a")
    a.env["CDC_RELAY_KAFKA_BOOTSTRAP"] = proxied_kafka.relay_bootstrap
    a.start()
    b = poller(tmp_path, poller_db, kafka, names, name="b")
    b.env["CDC_RELAY_KAFKA_BOOTSTRAP"] = kafka.bootstrap  # not through the proxy
    try:
        writer.transaction([("order", "warm", {"n": 0})])
        consume(kafka.bootstrap, names.topic_prefix, expected=1, timeout=60, settle=0)
        proxy.cut("refuse")  # A's link to Kafka is down from here on
        writer.transaction([("order", "x", {"n": n}) for n in (1, 2, 3)])  # claimed at once
        wait_until(lambda: claiming(poller_db), 30, "A claiming e1..e3")
        time.sleep(0.5)  # produced, held by A's producer
        a.signal(signal.SIGSTOP)
        rows(
            poller_db,
            "SELECT pg_terminate_backend(pid) FROM unnest(%s::int[]) AS pid",
            poller_pids(poller_db),
        )
        writer.transaction([("order", "x", {"n": 4})])
        b.start()
        consume(kafka.bootstrap, names.topic_prefix, expected=5, timeout=60, settle=0)
        assert b.stop() == 0
        a.signal(signal.SIGCONT)
        wait_until(lambda: "dropped 3 messages" in a.log(), 30, "A dropping its queue")
        proxy.restore()
        # A sentinel of the same aggregate, published by A through the restored link: it
        # follows on the partition whatever A's producer still held.
        writer.transaction([("order", "x", {"n": 5})])
        received = consume(kafka.bootstrap, names.topic_prefix, expected=6, timeout=60)
        assert a.stop() == 0
    finally:
        proxy.restore()
        a.signal(signal.SIGCONT)
        a.close()
        b.close()
        writer.close()
    numbers = {w.id: json.loads(w.payload)["n"] for w in writer.written}
    on_x = [numbers[r.id] for r in sorted(received, key=lambda r: r.offset) if r.key == b"x"]
    assert on_x == [1, 2, 3, 4, 5], a.log()


# -- the backoff -----------------------------------------------------------------------------


def test_a_failed_row_waits_its_backoff_from_the_failure_not_from_the_claim(
    poller_db: str,
) -> None:
    """A batch may wait long for Kafka inside its claim's transaction (the broker away); a
    backoff counted from the claim (the transaction's now()) would have passed by the time
    the row is marked failed, and the row would be tried again at once."""
    writer = Writer(poller_db)
    (row,) = writer.transaction([("order", "1", {})])
    writer.close()
    with psycopg.connect(poller_db, autocommit=True, row_factory=dict_row) as conn:
        outbox = store.resolve(conn, "outbox_events")
    claims = store.PgClaims(poller_db, outbox)
    try:
        with claims.transaction():
            keys = claims.claim_aggregates(10, 0, 1, [])
            assert [r.id for r in claims.claim(10, keys)] == [row.id]
            time.sleep(2)  # Kafka answers late
            claims.mark_failed([row.id], ["refused"], [1.0], [True], 10)
    finally:
        claims.close()
    ((waits,),) = rows(
        poller_db, "SELECT retry_after > clock_timestamp() FROM outbox_events WHERE id = %s", row.id
    )
    assert waits, "the row is due again at once"


@pytest.mark.parametrize("column", ["event_type", "aggregate_type"])
def test_a_row_whose_type_is_null_is_a_dead_letter_and_every_other_row_goes(
    tmp_path: Path, poller_db: str, kafka_service: Any, names: Any, column: str
) -> None:
    # A table of the user's that lets the column be NULL: the row cannot be routed, which is
    # the row's own fault (a dead letter naming the column), never a crash on every restart
    # (event_type) nor a row left unclaimed without a word (aggregate_type: its lock key was
    # NULL).
    with psycopg.connect(poller_db, autocommit=True) as conn:
        conn.execute(
            sql.SQL("ALTER TABLE outbox_events ALTER COLUMN {} DROP NOT NULL").format(
                sql.Identifier(column)
            )
        )
    writer = Writer(poller_db)
    good = writer.transaction([("order", "o1", {"i": 0}), ("order", "o2", {"i": 1})])
    with psycopg.connect(poller_db, autocommit=True) as conn:
        ((bad,),) = conn.execute(
            "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload) "
            "VALUES ('order', 'o1', 'order.changed', '{}') RETURNING id::text"
        ).fetchall()
        conn.execute(
            sql.SQL("UPDATE outbox_events SET {} = NULL WHERE id = %s").format(
                sql.Identifier(column)
            ),
            (bad,),
        )
    good += writer.transaction([("order", "o1", {"i": 2}), ("order", "o2", {"i": 3})])
    writer.close()
    relay = poller(tmp_path, poller_db, kafka_service, names, max_attempts="1")
    relay.start()
    try:
        received = consume(kafka_service.bootstrap, names.topic_prefix, expected=len(good))
        wait_until(
            lambda: (
                rows(
                    poller_db,
                    "SELECT count(*) FROM outbox_events WHERE processed_at IS NULL "
                    "AND retry_after IS DISTINCT FROM 'infinity'",
                )
                == [(0,)]
            ),
            60,
            "every row published or dead",
        )
        assert relay.alive(), relay.log()[-3000:]
    finally:
        relay.stop()
    assert sorted(r.id for r in received) == sorted(w.id for w in good)
    ((dead, error),) = rows(
        poller_db, "SELECT id::text, last_error FROM outbox_events WHERE retry_after = 'infinity'"
    )
    assert dead == bad
    assert f"{column} is NULL" in error, error
    assert "Traceback" not in relay.log()
    listed = cli("dead-letters", "list", "--dsn", poller_db)
    assert listed.returncode == 0, listed.stderr
    ((line,),) = [listed.stdout.splitlines()[1:]]
    assert line.split()[:2] == [bad, "1"] and f"{column} is NULL" in line, line


def test_an_idle_poller_stopped_says_no_message_was_waiting_for_kafka(
    tmp_path: Path, poller_db: str, kafka_service: Any, names: Any
) -> None:
    relay = poller(tmp_path, poller_db, kafka_service, names, workers="2").start()
    try:
        writer = Writer(poller_db)
        writer.transaction([("order", "o-1", {"n": 1})])
        writer.close()
        wait_until(lambda: unprocessed(poller_db) == 0, 30, "the row to be published")
        # Idle past two of the client's statistics reports (every 5 s), which its queue holds
        # until served: they are not messages waiting for Kafka.
        time.sleep(11)
        assert relay.stop() == 0
    finally:
        relay.close()
    assert "stopped; 0 messages were still waiting for Kafka" in relay.log(), relay.log()


def test_a_table_whose_aggregate_type_is_an_enum_is_polled(
    tmp_path: Path, poller_db: str, kafka_service: Any, names: Any
) -> None:
    # The claim's lock key reads type and id as text: an enum (or uuid, integer) column is
    # hashed as its text, as `||` did, and coalescing a NULL to '' must not cast '' to the enum.
    with psycopg.connect(poller_db, autocommit=True) as conn:
        conn.execute("CREATE TYPE aggregate_kind AS ENUM ('order', 'customer')")
        conn.execute("DROP VIEW outbox_dead_letters")  # made again below, on the new type
        conn.execute(
            "ALTER TABLE outbox_events ALTER COLUMN aggregate_type TYPE aggregate_kind "
            "USING aggregate_type::aggregate_kind"
        )
    install_poller(poller_db)
    writer = Writer(poller_db)
    written = writer.transaction([("order", "o1", {"i": 0}), ("customer", "c1", {"i": 1})])
    written += writer.transaction([("order", "o1", {"i": 2})])
    writer.close()
    relay = poller(tmp_path, poller_db, kafka_service, names).start()
    try:
        received = consume(kafka_service.bootstrap, names.topic_prefix, expected=len(written))
        assert relay.alive(), relay.log()[-3000:]
    finally:
        relay.stop()
    verdict = check(written, received, names.topic_prefix)
    assert (verdict.lost, verdict.duplicates, verdict.out_of_order) == ([], 0, []), verdict
    assert "Traceback" not in relay.log()
