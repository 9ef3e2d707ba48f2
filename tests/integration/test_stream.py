"""The CDC relay end to end, against a real PostgreSQL and a real Kafka broker."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest
from relaytools import (
    Load,
    RelayProcess,
    Writer,
    check,
    consume,
    create_topics,
    pending_inserts,
    relay_env,
    setup_slot,
    slot_row,
    wait_slot,
    wait_until,
)

from cdc_relay import schema
from cdc_relay.lsn import parse as parse_lsn

pytestmark = pytest.mark.integration


@pytest.fixture
def relay(tmp_path: Path, outbox_db: str, kafka_service: Any, names: Any) -> Any:
    setup_slot(outbox_db, names)
    process = RelayProcess(tmp_path, relay_env(outbox_db, kafka_service.bootstrap, names))
    yield process
    process.close()


@pytest.mark.pg18
def test_every_event_arrives_with_topic_key_headers_value_in_commit_order(
    relay: RelayProcess, outbox_db: str, kafka_service: Any, names: Any
) -> None:
    relay.start()
    writer = Writer(outbox_db)
    # single-event transactions, several aggregates and aggregate types
    for i in range(300):
        writer.transaction([(("order", "customer", "invoice")[i % 3], f"a{i % 11}", {"i": i})])
    # one transaction of 10,000 events
    writer.transaction(
        [("order", f"big{i % 13}", {"i": i, "pad": "x" * 50}) for i in range(10_000)]
    )
    # the insert-then-delete pattern: the table stays empty, the event still goes out
    writer.transaction([("order", "deleted", {"gone": True})], delete_after=True)
    writer.close()
    # several concurrent writers
    load = Load(outbox_db, writers=4, pause=0).start()
    time.sleep(3)
    written = writer.written + load.stop()

    received = consume(kafka_service.bootstrap, names.topic_prefix, expected=len(written))
    verdict = check(written, received, names.topic_prefix)
    print(verdict)
    assert verdict.lost == []
    assert verdict.mismatched == []
    assert verdict.out_of_order == []
    assert verdict.duplicates == 0  # no fault happened: exactly once on the wire
    assert len(written) > 10_300 + 100
    with psycopg.connect(outbox_db) as conn:
        row = conn.execute("SELECT count(*) FROM outbox_events WHERE aggregate_id = 'deleted'")
        assert row.fetchone() == (0,)

    assert relay.stop() == 0
    # A clean stop confirms everything: the slot holds no outbox insert any more.
    assert pending_inserts(outbox_db, names.slot, names.publication) == 0


def test_broker_down_confirms_nothing_unacknowledged_and_delivers_after_restart(
    tmp_path: Path, outbox_db: str, kafka_service: Any, names: Any
) -> None:
    setup_slot(outbox_db, names)
    # A short wal_sender_timeout and a tiny producer queue: while the broker is down the
    # relay sits in back-pressure, and only its status updates keep the walsender from
    # cutting it off (ARCHITECTURE.md, invariant 6).
    dsn = f"{outbox_db} options='-c wal_sender_timeout=2s'"
    env = relay_env(dsn, kafka_service.bootstrap, names)
    env["CDC_RELAY_KAFKA_CONFIG"] = "queue.buffering.max.messages=10"
    # Restarted while the broker is down, the relay waits this long for it at start-up: more
    # than a busy machine takes to start the broker again.
    env["CDC_RELAY_KAFKA_TIMEOUT"] = "120"
    relay = RelayProcess(tmp_path, env)
    try:
        _broker_down(relay, outbox_db, kafka_service, names)
    finally:
        relay.close()


def _broker_down(relay: RelayProcess, outbox_db: str, kafka_service: Any, names: Any) -> None:
    relay.start()
    writer = Writer(outbox_db)
    writer.transaction([("order", "before", {"n": 0})])
    consume(kafka_service.bootstrap, names.topic_prefix, expected=1, settle=0)
    pid = slot_row(outbox_db, names.slot)["active_pid"]

    kafka_service.stop()
    try:
        for i in range(50):
            writer.transaction([("order", f"down{i % 5}", {"n": i})])
        time.sleep(8)  # four wal_sender_timeouts pass; the relay keeps its connection
        assert relay.alive()
        assert slot_row(outbox_db, names.slot)["active_pid"] == pid, relay.log()
        assert "disconnected" not in relay.log()
        relay.kill()  # the hard way: whatever was confirmed is all PostgreSQL knows
        wait_slot(outbox_db, names.slot, active=False)
        # Every event written while the broker was down is still in the slot.
        assert pending_inserts(outbox_db, names.slot, names.publication) == 50
        relay.start()
        time.sleep(3)  # the relay runs, waiting for the broker without confirming
        assert relay.alive(), relay.log()
    finally:
        kafka_service.start()
    writer.close()

    received = consume(kafka_service.bootstrap, names.topic_prefix, expected=51)
    verdict = check(writer.written, received, names.topic_prefix)
    print(verdict)
    assert verdict.lost == []
    assert verdict.out_of_order == []
    assert verdict.mismatched == []
    assert relay.stop() == 0
    assert pending_inserts(outbox_db, names.slot, names.publication) == 0


@pytest.mark.pg18
def test_sigkill_mid_stream_loses_nothing_and_duplicates_only_what_was_in_flight(
    relay: RelayProcess, outbox_db: str, kafka_service: Any, names: Any
) -> None:
    rng = random.Random(2)
    relay.start()
    load = Load(outbox_db, writers=3, pause=0.001).start()
    kills = []
    for _ in range(5):
        time.sleep(rng.uniform(1.5, 4.0))
        relay.kill()
        kill_time = time.monotonic()
        wait_slot(outbox_db, names.slot, active=False)
        kills.append((kill_time, slot_row(outbox_db, names.slot)["confirmed"]))
        relay.start()
    time.sleep(2)
    written = load.stop()

    received = consume(kafka_service.bootstrap, names.topic_prefix, expected=len(written))
    verdict = check(written, received, names.topic_prefix)
    # In flight at a kill: committed before it, not confirmed by the slot at that moment.
    in_flight = sum(
        sum(1 for w in written if w.committed_at < at and w.after_commit_lsn > parse_lsn(confirmed))
        for at, confirmed in kills
    )
    print(f"kills={len(kills)} {verdict} in_flight_bound={in_flight}")
    assert verdict.lost == []
    assert verdict.out_of_order == []
    assert verdict.mismatched == []
    assert verdict.duplicates <= in_flight
    assert relay.stop() == 0


def test_idle_outbox_beside_a_busy_table_does_not_pin_wal(
    relay: RelayProcess, outbox_db: str, names: Any
) -> None:
    relay.start()
    wait_slot(outbox_db, names.slot, active=True)
    written = 0
    with psycopg.connect(outbox_db, autocommit=True) as conn:
        conn.execute("CREATE TABLE noise (id bigserial, body text)")
        conn.execute("ALTER TABLE noise ALTER body SET STORAGE EXTERNAL")  # no compression
        start = conn.execute("SELECT pg_current_wal_lsn()").fetchone()
        for _ in range(40):
            conn.execute(
                "INSERT INTO noise (body) SELECT repeat(md5(random()::text), 64) "
                "FROM generate_series(1, 1000)"
            )
        end = conn.execute("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), %s)", start).fetchone()
        assert end is not None
        written = int(end[0])
        assert written > 64 * 1024 * 1024  # enough WAL that a pinned slot would show it

        def retained_small() -> bool:
            conn.execute("CHECKPOINT")  # logs a running-xacts record the slot can move to
            return slot_row(outbox_db, names.slot)["retained"] < 16 * 1024 * 1024

        wait_until(retained_small, 60, "the slot to release the busy table's WAL", interval=1)
    print(f"wal_written={written} retained={slot_row(outbox_db, names.slot)['retained']}")
    assert relay.alive()


def test_second_stream_on_an_active_slot_fails_with_a_clear_message(
    relay: RelayProcess, outbox_db: str, kafka_service: Any, names: Any, tmp_path: Path
) -> None:
    relay.start()
    wait_slot(outbox_db, names.slot, active=True)
    second = RelayProcess(
        tmp_path, relay_env(outbox_db, kafka_service.bootstrap, names), name="second"
    ).start()
    code = second.wait(60)
    assert code != 0
    last = second.log().strip().splitlines()[-1]
    assert "in use by another process" in last, second.log()
    assert last.startswith("cdc-relay: error:")
    assert relay.alive()


def test_setup_slot_is_idempotent_and_dry_run_changes_nothing(outbox_db: str, names: Any) -> None:
    base = [sys.executable, "-m", "cdc_relay", "setup-slot", "--dsn", outbox_db]
    base += ["--slot", names.slot, "--publication", names.publication]
    dry = subprocess.run([*base, "--dry-run"], capture_output=True, text=True, check=True)
    assert "CREATE PUBLICATION" in dry.stdout
    assert "pg_create_logical_replication_slot" in dry.stdout
    with psycopg.connect(outbox_db) as conn:
        assert conn.execute(
            "SELECT count(*) FROM pg_replication_slots WHERE slot_name = %s", (names.slot,)
        ).fetchone() == (0,)

    first = subprocess.run(base, capture_output=True, text=True, check=True)
    assert f"created slot {names.slot} (pgoutput)" in first.stdout
    again = subprocess.run(base, capture_output=True, text=True, check=True)
    assert "created" not in again.stdout
    assert f"exists: slot {names.slot}" in again.stdout
    assert f"exists: publication {names.publication}" in again.stdout

    wal2json = subprocess.run(
        [
            *base[:-4],
            "--slot",
            names.slot + "_w2j",
            "--publication",
            names.publication,
            "--plugin",
            "wal2json",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert f"created slot {names.slot}_w2j (wal2json)" in wal2json.stdout


def test_setup_slot_preflight_failures_say_what_to_do(
    outbox_db: str, names: Any, replica_postgres: Any
) -> None:
    def run(dsn: str, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "cdc_relay",
                "setup-slot",
                "--dsn",
                dsn,
                "--slot",
                names.slot,
                "--publication",
                names.publication,
                *args,
            ],
            capture_output=True,
            text=True,
        )

    wal = run(replica_postgres.dsn)
    assert wal.returncode != 0
    assert wal.stderr.strip() == (
        "cdc-relay: error: wal_level is 'replica'; set wal_level = logical in postgresql.conf "
        "(or ALTER SYSTEM SET wal_level = logical) and restart PostgreSQL"
    )

    missing = run(outbox_db, "--table", "no_such_table")
    assert missing.returncode != 0
    assert "table no_such_table does not exist" in missing.stderr
    assert len(missing.stderr.strip().splitlines()) == 1

    with psycopg.connect(outbox_db, autocommit=True) as conn:
        conn.execute(f"CREATE ROLE {names.slot}_app LOGIN")
    user_dsn = f"{outbox_db} user={names.slot}_app"
    try:
        no_repl = run(user_dsn)
    finally:
        with psycopg.connect(outbox_db, autocommit=True) as conn:
            conn.execute(f"DROP ROLE {names.slot}_app")
    assert no_repl.returncode != 0
    assert f"role {names.slot}_app lacks REPLICATION" in no_repl.stderr

    stream = subprocess.run(
        [
            sys.executable,
            "-m",
            "cdc_relay",
            "stream",
            "--dsn",
            outbox_db,
            "--slot",
            "nope",
            "--kafka-bootstrap",
            "127.0.0.1:1",
        ],
        capture_output=True,
        text=True,
    )
    assert stream.returncode != 0
    assert stream.stderr.strip() == (
        "cdc-relay: error: replication slot 'nope' does not exist; run cdc-relay setup-slot first"
    )


def test_sigterm_waits_for_acks_confirms_and_exits_zero(
    relay: RelayProcess, outbox_db: str, kafka_service: Any, names: Any
) -> None:
    relay.start()
    load = Load(outbox_db, writers=2, pause=0).start()
    # A SIGTERM before the relay has started up would only end the Python process.
    wait_slot(outbox_db, names.slot, active=True)
    time.sleep(1)
    relay.signal(signal.SIGTERM)  # mid-stream, events in flight
    assert relay.wait(30) == 0
    written = load.stop()
    # What the relay confirmed, it had delivered: restart and check nothing is lost.
    relay.start()
    received = consume(kafka_service.bootstrap, names.topic_prefix, expected=len(written))
    verdict = check(written, received, names.topic_prefix)
    print(verdict)
    assert verdict.lost == []
    assert verdict.out_of_order == []
    assert "stopped" in relay.log()
    assert relay.stop() == 0
    assert pending_inserts(outbox_db, names.slot, names.publication) == 0


def test_a_quiet_stream_does_not_wait_out_linger_ms(
    tmp_path: Path, outbox_db: str, kafka_service: Any, names: Any
) -> None:
    """With librdkafka holding each batch open for a minute, the events of a quiet stream
    still reach Kafka well within it: the relay sends them once the first has waited
    linger.HOLD (cdc_relay/relay/linger.py). Not a timing test: the bound is the minute."""
    setup_slot(outbox_db, names)
    # Made beforehand: the first event of a topic Kafka makes on demand waits for its
    # partitions, and then for linger.ms (the relay looks once per quiet moment).
    create_topics(kafka_service.bootstrap, {f"{names.topic_prefix}.order": {}})
    env = relay_env(outbox_db, kafka_service.bootstrap, names, kafka_config="linger.ms=60000")
    relay = RelayProcess(tmp_path, env)
    try:
        relay.start()
        wait_slot(outbox_db, names.slot, active=True)
        writer = Writer(outbox_db)
        for i in range(3):  # one at a time, each after the last arrived
            writer.transaction([("order", f"quiet{i}", {"i": i})])
            received = consume(
                kafka_service.bootstrap, names.topic_prefix, expected=i + 1, timeout=30, settle=0
            )
            assert len(received) == i + 1
        writer.close()
        verdict = check(writer.written, received, names.topic_prefix)
        assert verdict.lost == [] and verdict.out_of_order == []
        assert relay.stop() == 0
    finally:
        relay.close()


def test_unreachable_broker_is_a_one_line_error(outbox_db: str, names: Any) -> None:
    setup_slot(outbox_db, names)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "cdc_relay",
            "stream",
            "--dsn",
            outbox_db,
            "--slot",
            names.slot,
            "--publication",
            names.publication,
            "--kafka-bootstrap",
            "127.0.0.1:9",
            "--kafka-timeout",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    message = result.stderr.strip()
    assert "\n" not in message
    # between the two: librdkafka's last error, "(Connect to ... failed: Connection refused)"
    assert message.startswith("cdc-relay: error: no Kafka broker answered at 127.0.0.1:9 within 2s")
    assert message.endswith(
        "; check --kafka-bootstrap, that the broker is running, and that "
        "security.protocol=PLAINTEXT is what its listener there speaks"
    )
    # Nothing was read from the slot, so nothing can have been confirmed.
    assert slot_row(outbox_db, names.slot)["active"] is False


@pytest.mark.parametrize("where", ["producer", "broker"])
def test_event_kafka_refuses_stops_the_relay_and_is_not_confirmed(
    tmp_path: Path, outbox_db: str, kafka_service: Any, names: Any, where: str
) -> None:
    setup_slot(outbox_db, names)
    env = relay_env(outbox_db, kafka_service.bootstrap, names)
    if where == "broker":
        # The client lets it through; the broker (message.max.bytes ~1 MB) refuses it.
        env["CDC_RELAY_KAFKA_CONFIG"] = "message.max.bytes=10000000"
    relay = RelayProcess(tmp_path, env).start()
    try:
        writer = Writer(outbox_db)
        writer.transaction([("order", "ok", {"n": 1})])
        consume(kafka_service.bootstrap, names.topic_prefix, expected=1, settle=0)
        # Random hex: compression cannot shrink it under the broker's limit.
        blob = random.randbytes(1_500_000).hex()
        (big,) = writer.transaction([("order", "big", {"blob": blob})])
        writer.transaction([("order", "after", {"n": 2})])
        writer.close()
        code = relay.wait(60)
    finally:
        relay.close()
    last = relay.log().strip().splitlines()[-1]
    assert code == 1, relay.log()
    assert last.startswith(f"cdc-relay: error: Kafka refused event {big.id} (order.changed, ")
    assert "MSG_SIZE_TOO_LARGE" in last or "too large" in last.lower(), last
    assert "message.max.bytes" in last
    # Neither the refused event nor the one after it was confirmed: both wait in the slot.
    assert pending_inserts(outbox_db, names.slot, names.publication) == 2


@pytest.mark.pg18
def test_postgres_restart_mid_stream_reconnects_by_itself_and_loses_nothing(
    relay: RelayProcess, outbox_db: str, kafka_service: Any, postgres_service: Any, names: Any
) -> None:
    relay.start()
    before = Writer(outbox_db)
    for i in range(200):
        before.transaction([("order", f"r{i % 9}", {"i": i, "j": j}) for j in range(100)])
    before.close()
    postgres_service.restart("fast")  # the relay is still streaming the backlog
    after = Writer(outbox_db)
    for i in range(100):
        after.transaction([("order", f"r{i % 9}", {"after": i})])
    after.close()
    written = before.written + after.written
    received = consume(kafka_service.bootstrap, names.topic_prefix, expected=len(written))
    verdict = check(written, received, names.topic_prefix)
    print(verdict)
    assert "reconnected" in relay.log()
    assert relay.alive()
    assert verdict.lost == []
    assert verdict.out_of_order == []


def test_a_database_not_encoded_in_utf8_is_refused_with_the_remedy(
    postgres_service: Any, names: Any
) -> None:
    name = f"latin_{names.suffix}"
    with psycopg.connect(postgres_service.dsn, autocommit=True) as conn:
        conn.execute(
            f"CREATE DATABASE {name} ENCODING 'LATIN1' LC_COLLATE 'C' LC_CTYPE 'C' "
            "TEMPLATE template0"
        )
    dsn = postgres_service.dsn_for(name)
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(schema.text("outbox").encode())
        for command in ("setup-slot", "stream"):
            args = ["--dsn", dsn, "--slot", names.slot, "--kafka-bootstrap", "127.0.0.1:1"]
            done = subprocess.run(
                [sys.executable, "-m", "cdc_relay", command, *args],
                capture_output=True,
                text=True,
                check=False,
            )
            assert done.returncode == 1, done
            assert done.stderr.startswith(f"cdc-relay: error: database {name} is encoded in LATIN1")
            assert len(done.stderr.strip().splitlines()) == 1
    finally:
        with psycopg.connect(postgres_service.dsn, autocommit=True) as conn:
            conn.execute(f"DROP DATABASE {name} WITH (FORCE)")


def test_a_slot_dropped_while_the_relay_reconnects_stops_it_with_the_remedy(
    relay: RelayProcess, outbox_db: str, kafka_service: Any, names: Any
) -> None:
    relay.start()
    writer = Writer(outbox_db)
    writer.transaction([("order", "a", {"n": 1})])
    consume(kafka_service.bootstrap, names.topic_prefix, expected=1, settle=0)
    writer.close()
    with psycopg.connect(outbox_db, autocommit=True) as conn:
        # Cut the walsender and drop the slot before the relay's reconnect takes it again.
        for _ in range(50):
            conn.execute(
                "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots "
                "WHERE slot_name = %s AND active_pid IS NOT NULL",
                (names.slot,),
            )
            try:
                conn.execute("SELECT pg_drop_replication_slot(%s)", (names.slot,))
                break
            except psycopg.errors.ObjectInUse:
                time.sleep(0.05)
        else:
            raise AssertionError("the slot could not be dropped")
    assert relay.wait(60) == 1, relay.log()
    last = relay.log().strip().splitlines()[-1]
    assert last == (
        f"cdc-relay: error: replication slot '{names.slot}' does not exist; run cdc-relay "
        "setup-slot first"
    ), relay.log()
    assert "Traceback" not in relay.log()


@pytest.mark.pg18
@pytest.mark.parametrize("publication", ["OutboxPub", "outbox pub, v2"])
def test_a_publication_whose_name_pgoutput_would_fold_or_split_streams_every_event(
    tmp_path: Path, outbox_db: str, kafka_service: Any, names: Any, publication: str
) -> None:
    """pgoutput reads publication_names as a list of identifiers: unquoted, ``OutboxPub`` was
    asked for as ``outboxpub`` (PostgreSQL 15 ended every stream at the first change, 18 skipped
    the change with a warning and the slot moved past it), and a comma split the name."""
    publication = f"{publication} {names.suffix}"
    setup = subprocess.run(
        [sys.executable, "-m", "cdc_relay", "setup-slot", "--dsn", outbox_db],
        env={
            **relay_env(outbox_db, kafka_service.bootstrap, names),
            "CDC_RELAY_PUBLICATION": publication,
        },
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert setup.returncode == 0, setup.stderr
    env = relay_env(outbox_db, kafka_service.bootstrap, names)
    env["CDC_RELAY_PUBLICATION"] = publication
    relay = RelayProcess(tmp_path, env)
    try:
        relay.start()
        writer = Writer(outbox_db)
        for i in range(5):
            writer.transaction([("order", f"a{i % 2}", {"i": i})])
        writer.close()
        received = consume(kafka_service.bootstrap, names.topic_prefix, expected=5, timeout=60)
        assert relay.stop() == 0
    finally:
        relay.close()
    verdict = check(writer.written, received, names.topic_prefix)
    assert verdict.lost == []
    assert verdict.out_of_order == []
    assert "does not exist" not in relay.log()
    assert pending_inserts(outbox_db, names.slot, publication) == 0
