"""A slot PostgreSQL gave up on: invalidated by max_slot_wal_keep_size (PostgreSQL 15 and 18)
or, on 18, by idle_replication_slot_timeout. Nothing brings such a slot back: `stream` must stop
with one line naming the cause and the remedy, whether it meets the slot at start or when it
reconnects, and `status` must say so and exit non-zero.

Each version runs on throwaway clusters of this module (max_slot_wal_keep_size = 1MB; on 18,
another with the idle timeout): the session's servers keep their settings. The idle timeout's
minimum is a minute: its slot is made when the module's first test begins, and its test, the
last, waits for what is left of the minute.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.rows import dict_row
from relaytools import (
    RelayProcess,
    Writer,
    check,
    consume,
    relay_env,
    setup_slot,
    wait_slot,
    wait_until,
)

from cdc_relay import metrics, schema
from cdc_relay.devstack.postgres import LocalPostgres
from cdc_relay.postgres import failover
from cdc_relay.postgres.slot import SlotSpec, setup
from cdc_relay.queries import QUERIES

pytestmark = pytest.mark.integration

DATABASE = "outbox"


@dataclass(frozen=True)
class IdleSlot:
    dsn: str
    slot: str
    created: float  # time.monotonic()


@pytest.fixture(scope="module")
def idle_slot18(tmp_path_factory: pytest.TempPathFactory, pg18_bin: Path) -> Iterator[IdleSlot]:
    """A slot no relay streams, on a PostgreSQL 18 cluster of its own whose
    idle_replication_slot_timeout is its minimum, one minute (max_slot_wal_keep_size would
    invalidate it first on the other one). Made when the module's first test begins, so that
    the minute passes while the others run."""
    pg = LocalPostgres(
        tmp_path_factory.mktemp("pg18_idle"),
        bindir=pg18_bin,
        settings={"idle_replication_slot_timeout": "1min"},
    ).start()
    try:
        with psycopg.connect(pg.dsn, autocommit=True) as conn:
            conn.execute(schema.text("outbox").encode())
        slot = f"idle_{uuid.uuid4().hex[:12]}"
        setup(pg.dsn, SlotSpec(slot=slot, publication=slot, table="outbox_events"))
        yield IdleSlot(pg.dsn, slot, time.monotonic())
    finally:
        pg.cleanup(keep_logs=True)


@pytest.fixture(scope="module", params=["pg15", "pg18"])
def server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """A cluster whose slots may hold back at most 1 MB of WAL; yields the outbox's DSN."""
    # The idle slot's minute runs from the first test of the module (without PostgreSQL 18 the
    # fixture skips, which the PostgreSQL 18 tests then do, not these).
    with contextlib.suppress(pytest.skip.Exception):
        request.getfixturevalue("idle_slot18")
    bindir = request.getfixturevalue("pg18_bin") if request.param == "pg18" else None
    pg = LocalPostgres(
        tmp_path_factory.mktemp(request.param),
        bindir=bindir,
        settings={"max_slot_wal_keep_size": "1MB"},
    ).start()
    try:
        with psycopg.connect(pg.dsn, autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {DATABASE}")
        with psycopg.connect(pg.dsn_for(DATABASE), autocommit=True) as conn:
            conn.execute(schema.text("outbox").encode())
        yield pg.dsn_for(DATABASE)
    finally:
        pg.cleanup(keep_logs=True)


def _slot(dsn: str, slot: str) -> dict[str, Any]:
    with psycopg.connect(dsn, autocommit=True, row_factory=dict_row) as conn:
        row = conn.execute(QUERIES["slot"], {"slot": slot}).fetchone()
    assert row is not None, f"slot {slot} is gone"
    return row


def _invalidate(dsn: str, slot: str) -> dict[str, Any]:
    """Write and switch WAL segments, with checkpoints, until PostgreSQL gives up on ``slot``
    (the checkpointer ends a walsender that streams it first); return its row then."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        for _ in range(20):
            conn.execute("CREATE TEMPORARY TABLE IF NOT EXISTS filler (n int)")
            conn.execute("INSERT INTO filler SELECT generate_series(1, 1000)")
            conn.execute("SELECT pg_switch_wal()")
            conn.execute("CHECKPOINT")
            row = _slot(dsn, slot)
            if row["invalidated"]:
                return row
    raise AssertionError(f"slot {slot} still valid: {_slot(dsn, slot)}")


def _status(dsn: str, slot: str, *options: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cdc_relay", "status", "--dsn", dsn, "--slot", slot, *options],
        capture_output=True,
        text=True,
        timeout=120,
    )


def _expected(slot: str, row: dict[str, Any], cause: str) -> str:
    return (
        f"replication slot '{slot}' was invalidated by PostgreSQL ({cause}), so the changes it "
        "had not confirmed may be gone from the WAL and it can never be streamed again; drop it "
        "(cdc-relay drop-slot) and make it anew with cdc-relay setup-slot --republish-since "
        "TIME, which first publishes again the events created since TIME: the time of the old "
        "relay's last progress line less its lag and your longest transaction (earlier costs "
        f"only duplicates; the slot had confirmed {row['confirmed_flush_lsn']}) "
        '(docs/failover.md, "A slot PostgreSQL gave up on")'
    )


WAL_REMOVED = "wal_removed: the WAL it held back grew past max_slot_wal_keep_size"


def _assert_status_names_it(dsn: str, slot: str, message: str) -> None:
    status = _status(dsn, slot, "--wait", "0")
    print(status.stdout, status.stderr)
    assert status.returncode == 3, status.stdout + status.stderr
    assert f"ALERT: {message}" in status.stderr.splitlines(), status.stderr
    assert "WAL status        lost" in status.stdout.splitlines(), status.stdout
    as_json = _status(dsn, slot, "--json", "--wait", "0")
    assert as_json.returncode == 3, as_json.stdout + as_json.stderr
    assert '"invalidated": "wal_removed"' in as_json.stdout, as_json.stdout


def test_the_slot_query_tells_a_usable_slot_from_an_invalidated_one_and_sets_the_gauges(
    server: str, names: Any
) -> None:
    setup_slot(server, names)
    usable = _slot(server, names.slot)
    assert usable["invalidated"] is None
    assert usable["wal_status"] in ("reserved", "extended")
    # max_slot_wal_keep_size is 1 MB, which PostgreSQL counts in whole WAL segments (16 MB)
    assert usable["safe_wal_bytes"] is not None
    assert 0 < usable["safe_wal_bytes"] <= 16 * 1024 * 1024
    assert failover.slot_invalidated(names.slot, usable) is None
    metrics.observe_slot(usable)
    assert metrics.SLOT_INVALIDATED._value.get() == 0
    assert metrics.SLOT_SAFE_WAL._value.get() == usable["safe_wal_bytes"]

    lost = _invalidate(server, names.slot)
    assert (lost["wal_status"], lost["invalidated"], lost["safe_wal_bytes"]) == (
        "lost",
        "wal_removed",
        None,
    )
    metrics.observe_slot(lost)
    assert metrics.SLOT_INVALIDATED._value.get() == 1
    assert metrics.SLOT_SAFE_WAL._value.get() == 0


def test_stream_refuses_a_slot_invalidated_while_it_was_down_and_status_says_so(
    tmp_path: Path, server: str, kafka_service: Any, names: Any
) -> None:
    setup_slot(server, names)
    writer = Writer(server)
    relay = RelayProcess(tmp_path, relay_env(server, kafka_service.bootstrap, names)).start()
    try:
        wait_slot(server, names.slot, active=True)
        relayed = [w for n in range(10) for w in writer.transaction([("order", f"a{n}", {})])]
        received = consume(kafka_service.bootstrap, names.topic_prefix, expected=len(relayed))
        assert check(relayed, received, names.topic_prefix).lost == []
        assert relay.stop() == 0, relay.log()

        writer.transaction([("order", "a1", {"after": "the stop"})])  # never relayed
        row = _invalidate(server, names.slot)
        relay.start()
        assert relay.wait(120) == 1, relay.log()
    finally:
        writer.close()
        relay.close()
    message = _expected(names.slot, row, WAL_REMOVED)
    log = relay.log_path.read_text()
    assert log.strip().splitlines()[-1] == f"cdc-relay: error: {message}", log
    assert "Traceback" not in log, log
    _assert_status_names_it(server, names.slot, message)


def test_a_slot_invalidated_under_a_paused_relay_stops_it_when_it_reconnects(
    tmp_path: Path, server: str, kafka_service: Any, names: Any
) -> None:
    setup_slot(server, names)
    writer = Writer(server)
    relay = RelayProcess(tmp_path, relay_env(server, kafka_service.bootstrap, names)).start()
    try:
        wait_slot(server, names.slot, active=True)
        writer.transaction([("order", "a1", {})])
        relay.signal(signal.SIGSTOP)  # it holds the slot but confirms nothing any more
        writer.transaction([("order", "a1", {"while": "paused"})])
        row = _invalidate(server, names.slot)  # the checkpointer ends its walsender first
        relay.signal(signal.SIGCONT)
        assert relay.wait(120) == 1, relay.log()
    finally:
        writer.close()
        relay.close()
    message = _expected(names.slot, row, WAL_REMOVED)
    log = relay.log()
    assert log.strip().splitlines()[-1] == f"cdc-relay: error: {message}", log
    assert "Traceback" not in log, log
    # The checkpointer ended the walsender; the relay met the invalidated slot reconnecting.
    assert "replication stream ended: FATAL:" in log, log
    _assert_status_names_it(server, names.slot, message)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [sys.executable, "-m", "cdc_relay", *args], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def test_the_remedy_drop_slot_then_setup_slot_republish_since_loses_nothing(
    tmp_path: Path, server: str, outbox_db_on: Any, kafka_service: Any, names: Any
) -> None:
    """docs/failover.md's remedy, as typed: drop-slot, setup-slot --republish-since T (T: the newest
    event on Kafka, less a margin), then stream. Every event reaches Kafka, the first delivery of
    each in order per aggregate; sent twice: only those created since T that the old slot had
    relayed. On a database of its own: ``--republish-since T`` publishes every row created
    since T, and rows the module's previous test wrote a moment before would be among them."""
    server = outbox_db_on(server)
    setup_slot(server, names)
    writer = Writer(server)
    relay = RelayProcess(tmp_path, relay_env(server, kafka_service.bootstrap, names)).start()

    def write(first: int, last: int) -> list[Any]:
        events = [("order", f"a{n % 4}", {"n": n}) for n in range(first, last)]
        return [w for event in events for w in writer.transaction([event])]

    try:
        wait_slot(server, names.slot, active=True)
        relayed = write(0, 20)
        consume(kafka_service.bootstrap, names.topic_prefix, expected=len(relayed))
        assert relay.stop() == 0, relay.log()
        with psycopg.connect(server) as conn:
            # the newest event on Kafka, less a margin: a row's created_at is its
            # transaction's start
            since = conn.execute(
                "SELECT max(created_at) - interval '1 second' FROM outbox_events"
                " WHERE id = ANY(%s::uuid[])",
                [[w.id for w in relayed]],
            ).fetchone()[0]  # type: ignore[index]
        missed = write(20, 30)
        _invalidate(server, names.slot)

        _cli("drop-slot", "--dsn", server, "--slot", names.slot, "--publication",
             names.publication, "--yes")  # fmt: skip
        made = _cli(
            "setup-slot", "--dsn", server, "--slot", names.slot, "--publication",
            names.publication, "--kafka-bootstrap", kafka_service.bootstrap, "--topic-template",
            f"{names.topic_prefix}.{{aggregate_type}}", "--republish-since", since.isoformat(),
        )  # fmt: skip
        relay.start()
        after = write(30, 40)
        written = relayed + missed + after
        received = consume(kafka_service.bootstrap, names.topic_prefix, expected=len(written))
        assert relay.stop() == 0, relay.log()
    finally:
        writer.close()
        relay.close()
    print(made.stdout)
    verdict = check(written, received, names.topic_prefix)
    counts: dict[str, int] = {}
    for r in received:
        counts[r.id] = counts.get(r.id, 0) + 1
    twice = {event_id for event_id, n in counts.items() if n > 1}
    print(f"{verdict}; sent twice: {len(twice)}")
    assert verdict.lost == []
    assert verdict.out_of_order == []
    assert verdict.mismatched == []
    assert twice, "events Kafka had since T go out again"
    assert twice <= {w.id for w in relayed}  # the margin's, and only those
    assert max(counts.values()) == 2


def test_an_idle_slot_invalidated_on_18_is_named_by_stream_and_status(
    request: pytest.FixtureRequest,
    tmp_path: Path,
    server: str,
    idle_slot18: IdleSlot,
    kafka_service: Any,
    names: Any,
) -> None:
    if request.node.callspec.params["server"] != "pg18":
        pytest.skip("idle_replication_slot_timeout is new in PostgreSQL 18")
    idle = idle_slot18

    def idled_out() -> bool:
        with psycopg.connect(idle.dsn, autocommit=True) as conn:
            conn.execute("CHECKPOINT")  # where PostgreSQL invalidates idle slots
        return bool(_slot(idle.dsn, idle.slot)["invalidated"])

    waited = time.monotonic()
    wait_until(idled_out, 120, "the idle timeout to invalidate the slot", interval=2)
    row = _slot(idle.dsn, idle.slot)
    print(
        f"invalidated {time.monotonic() - idle.created:.0f} s after its creation, "
        f"{time.monotonic() - waited:.0f} s of them waited for here: {row}"
    )
    assert row["invalidated"] == "idle_timeout"
    env = relay_env(idle.dsn, kafka_service.bootstrap, names, slot=idle.slot)
    relay = RelayProcess(tmp_path, env).start()
    try:
        assert relay.wait(120) == 1, relay.log()
    finally:
        relay.close()
    message = _expected(
        idle.slot,
        row,
        "idle_timeout: it was inactive for longer than idle_replication_slot_timeout",
    )
    assert relay.log().strip().splitlines()[-1] == f"cdc-relay: error: {message}"
    status = _status(idle.dsn, idle.slot, "--wait", "0")
    assert status.returncode == 3, status.stdout + status.stderr
    assert f"ALERT: {message}" in status.stderr.splitlines(), status.stderr
