"""Switching from the poller to the CDC relay under a steady write load."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo
from relaytools import (
    Load,
    Received,
    RelayProcess,
    Writer,
    check,
    consume,
    handover,
    install_poller,
    pending_inserts,
    relay_env,
    wait_until,
)
from test_observability import scrape

from cdc_relay.devstack import free_ports
from cdc_relay.outbox import write_event

pytestmark = pytest.mark.integration


def start_handover(dsn: str, bootstrap: str, names: Any) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "cdc_relay", "setup-slot", "--from-poller"],
        env={**os.environ, **relay_env(dsn, bootstrap, names)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def query(dsn: str, statement: Any, *params: Any) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        cur = conn.execute(statement, params)
        return cur.fetchall() if cur.description else []


def slots(dsn: str) -> list[tuple[str, bool]]:
    """The database's replication slots: name, temporary."""
    return [
        (name, temporary)
        for name, temporary in query(
            dsn,
            "SELECT slot_name::text, temporary FROM pg_replication_slots "
            "WHERE database = current_database() ORDER BY 1",
        )
    ]


def marking_waits(dsn: str) -> list[int]:
    """Sessions of the database waiting for a row lock in an UPDATE: the handover's marking."""
    return [
        pid
        for (pid,) in query(
            dsn,
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
            "AND wait_event_type = 'Lock' AND query LIKE 'UPDATE%%'",
        )
    ]


@contextmanager
def marking_held(dsn: str, offset: int) -> Iterator[psycopg.Connection[Any]]:
    """Make marking the unprocessed row at ``offset`` (in seq order), or any later one, wait
    until the block ends or the connection yielded closes: a trigger waits for an advisory
    lock this session holds. (A row lock would not do: its transaction would hold up the
    creation of the handover's slot, which waits for running transactions.)"""
    with psycopg.connect(dsn, autocommit=True) as conn:
        ((seq,),) = conn.execute(
            "SELECT seq FROM outbox_events WHERE processed_at IS NULL ORDER BY seq "
            "OFFSET %s LIMIT 1",
            [offset],
        ).fetchall()
        conn.execute(
            "CREATE OR REPLACE FUNCTION test_hold_marking() RETURNS trigger LANGUAGE plpgsql "
            "AS $$ BEGIN PERFORM pg_advisory_xact_lock_shared(4242); RETURN NEW; END $$"
        )
        conn.execute(
            sql.SQL(
                "CREATE OR REPLACE TRIGGER test_hold_marking BEFORE UPDATE ON outbox_events "
                "FOR EACH ROW WHEN (OLD.seq >= {}) EXECUTE FUNCTION test_hold_marking()"
            ).format(sql.Literal(seq))
        )
        conn.execute("SELECT pg_advisory_lock(4242)")
        yield conn


def processed(dsn: str) -> int:
    with psycopg.connect(dsn) as conn:
        query = "SELECT count(*) FROM outbox_events WHERE processed_at IS NOT NULL"
        ((count,),) = conn.execute(query).fetchall()
        return int(count)


def test_switch_from_poll_to_stream_under_load_loses_nothing_and_publishes_nothing_twice(
    tmp_path: Path, outbox_db: str, kafka_service: Any, names: Any
) -> None:
    install_poller(outbox_db)
    env = relay_env(outbox_db, kafka_service.bootstrap, names, workers="2")
    poller = RelayProcess(tmp_path, env, name="poll", command="poll").start()
    stream = RelayProcess(tmp_path, relay_env(outbox_db, kafka_service.bootstrap, names))
    load = Load(outbox_db, writers=3, pause=0.002).start()
    try:
        wait_until(lambda: processed(outbox_db) > 500, 60, "the poller to publish")

        refused = handover(outbox_db, kafka_service.bootstrap, names)
        assert refused.returncode == 1
        assert "poller sessions are connected" in refused.stderr
        assert "stop every cdc-relay poll (SIGTERM)" in refused.stderr

        assert poller.stop() == 0, poller.log()
        time.sleep(0.5)  # a backlog builds up that the handover publishes
        switched = handover(outbox_db, kafka_service.bootstrap, names)
        assert switched.returncode == 0, switched.stderr
        stream.start()
        time.sleep(2)
        written = load.stop()
        received = consume(kafka_service.bootstrap, names.topic_prefix, expected=len(written))
        assert stream.stop() == 0
    finally:
        load.stop()
        poller.close()
        stream.close()

    print(switched.stdout)
    lines = switched.stdout.splitlines()
    assert lines[0] == f"created publication {names.publication} on public.outbox_events"
    assert lines[1].startswith(f"created slot {names.slot} (pgoutput) at ")
    handed_over = int(lines[2].split()[1])
    assert handed_over > 0
    verdict = check(written, received, names.topic_prefix)
    print(verdict, f"handed over={handed_over}")
    assert verdict.lost == []
    assert verdict.duplicates == 0
    assert verdict.mismatched == []
    assert verdict.out_of_order == []  # one poller process, then the handover, then stream
    assert pending_inserts(outbox_db, names.slot, names.publication) == 0


@pytest.mark.parametrize("how", ["SIGKILL", "SIGTERM", "lost connection"])
def test_a_handover_stopped_midway_leaves_no_slot_and_the_pollers_take_over(
    tmp_path: Path, outbox_db: str, kafka_service: Any, names: Any, how: str
) -> None:
    install_poller(outbox_db)
    writer = Writer(outbox_db)
    for k in range(3):
        writer.transaction([("order", f"a{i % 10}", {"k": k, "i": i}) for i in range(500)])
    writer.close()
    # The handover publishes batch 1 (rows 0-499) and marks it, publishes batch 2 and waits to
    # mark it.
    with marking_held(outbox_db, 700):
        proc = start_handover(outbox_db, kafka_service.bootstrap, names)
        try:
            wait_until(lambda: marking_waits(outbox_db), 60, "the handover to wait for the row")
            ((temporary, is_temporary),) = slots(outbox_db)
            assert is_temporary, temporary  # the slot itself does not exist yet
            if how == "SIGKILL":
                proc.kill()
            elif how == "SIGTERM":
                proc.send_signal(signal.SIGTERM)
            else:
                query(outbox_db, "SELECT pg_terminate_backend(%s)", marking_waits(outbox_db)[0])
            _, stderr = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
    wait_until(lambda: slots(outbox_db) == [], 30, "no slot left")

    if how == "SIGKILL":
        assert proc.returncode == -signal.SIGKILL
    else:
        assert proc.returncode == 1, stderr
        cause = (
            "it was interrupted (SIGTERM)"
            if how == "SIGTERM"
            else "PostgreSQL failed: terminating connection due to administrator command"
        )
        assert stderr.strip().splitlines()[-1] == (
            f"cdc-relay: error: the handover stopped before it finished: {cause}; it was "
            "undone (no slot was created; 500 events were published and marked processed): "
            "run it again, or start the pollers again"
        ), stderr

    # The pollers take over: nothing lost, at most the batch published and not marked twice.
    poll = RelayProcess(
        tmp_path, relay_env(outbox_db, kafka_service.bootstrap, names), command="poll"
    ).start()
    try:
        received = consume(kafka_service.bootstrap, names.topic_prefix, expected=1500)
        assert poll.stop() == 0, poll.log()
    finally:
        poll.close()
    verdict = check(writer.written, received, names.topic_prefix)
    print(how, verdict)
    assert verdict.lost == []
    assert verdict.mismatched == []
    assert verdict.out_of_order == []
    assert verdict.duplicates <= 500


def test_no_poller_runs_beside_a_handover_and_stream_starts_after_it(
    tmp_path: Path, outbox_db: str, kafka_service: Any, names: Any
) -> None:
    """Pollers started during the handover, or reconnecting during it, stop without claiming;
    a standby stream relay takes the slot only once the handover has published everything."""
    install_poller(outbox_db)
    role = f"poller_{names.suffix}"
    with psycopg.connect(outbox_db, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
        conn.execute(
            sql.SQL("GRANT SELECT, UPDATE ON outbox_events TO {}").format(sql.Identifier(role))
        )
        conn.execute(
            sql.SQL("GRANT SELECT ON cdc_relay_handovers TO {}").format(sql.Identifier(role))
        )
    as_role = make_conninfo(outbox_db, user=role)
    env = relay_env(as_role, kafka_service.bootstrap, names, workers="2", batch_size="50")
    first = RelayProcess(tmp_path, env, name="first", command="poll").start()
    late = RelayProcess(
        tmp_path, relay_env(outbox_db, kafka_service.bootstrap, names), name="late", command="poll"
    )
    stream = RelayProcess(
        tmp_path, relay_env(outbox_db, kafka_service.bootstrap, names, standby="true")
    )
    load = Load(outbox_db, writers=2, pause=0.005).start()
    proc = None
    try:
        wait_until(lambda: processed(outbox_db) > 200, 60, "the poller to publish")
        # The first poller loses its connections and cannot log in again for now.
        query(outbox_db, sql.SQL("ALTER ROLE {} NOLOGIN").format(sql.Identifier(role)))
        query(
            outbox_db,
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s",
            role,
        )
        wait_until(lambda: "lost the database connection" in first.log(), 30, "a reconnect")
        with marking_held(outbox_db, 0) as held:
            proc = start_handover(outbox_db, kafka_service.bootstrap, names)
            wait_until(lambda: marking_waits(outbox_db), 60, "the handover to wait for the row")

            # A poller started now stops at once, and so does the first one as it reconnects.
            late.start()
            assert late.wait(60) == 1
            query(outbox_db, sql.SQL("ALTER ROLE {} LOGIN").format(sql.Identifier(role)))
            assert first.wait(60) == 1
            for poller in (late, first):
                assert (
                    poller.log()
                    .strip()
                    .splitlines()[-1]
                    .startswith(
                        "cdc-relay: error: a handover to stream (cdc-relay setup-slot "
                        "--from-poller) is running on public.outbox_events (pid "
                    )
                ), poller.log()

            # A standby stream relay finds no slot to take yet.
            stream.start()
            time.sleep(3)
            assert [temporary for _, temporary in slots(outbox_db)] == [True]
            assert "streaming slot" not in stream.log()
            held.close()
            stdout, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 0, stderr
        if not stream.alive():  # it gave up on the missing slot: start it again, as a supervisor
            assert "does not exist" in stream.log(), stream.log()
            stream.start()
        wait_until(lambda: "streaming slot" in stream.log(), 60, "the stream relay to stream")
        time.sleep(2)
        written = load.stop()
        received = consume(kafka_service.bootstrap, names.topic_prefix, expected=len(written))
        assert stream.stop() == 0, stream.log()
    finally:
        load.stop()
        if proc is not None and proc.poll() is None:
            proc.kill()
        for relay in (first, late, stream):
            relay.close()
        with psycopg.connect(outbox_db, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
            conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))
    print(stdout)
    verdict = check(written, received, names.topic_prefix)
    print(verdict)
    assert verdict.lost == []
    assert verdict.mismatched == []
    # Per aggregate: what the poller published, then the handover's backlog, then the stream.
    assert verdict.out_of_order == []
    assert verdict.duplicates <= 100  # the first poller's batches in flight when it was cut


def test_the_handover_fences_a_poller_frozen_through_it_and_one_started_after_it(
    tmp_path: Path, outbox_db: str, kafka_service: Any, names: Any
) -> None:
    """``stream`` marks no row, so a poller running after the handover would publish every
    event since again: one frozen (SIGSTOP) through the handover, whose sessions PostgreSQL
    ended so that the handover could run, and one started after it (an orchestrator's
    restart) each stop with one line as they connect, and publish nothing."""
    install_poller(outbox_db)
    env = relay_env(outbox_db, kafka_service.bootstrap, names, poll_interval="1")
    frozen = RelayProcess(tmp_path, env, name="frozen", command="poll").start()
    late = RelayProcess(tmp_path, env, name="late", command="poll")
    writer = Writer(outbox_db)
    try:
        for i in range(5):
            writer.transaction([("order", f"a{i}", {"i": i})])
        wait_until(lambda: processed(outbox_db) == 5, 60, "the poller to publish")
        frozen.signal(signal.SIGSTOP)
        query(
            outbox_db,
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE application_name = 'cdc-relay poll'",
        )
        switched = handover(outbox_db, kafka_service.bootstrap, names)
        assert switched.returncode == 0, switched.stderr
        for i in range(5):
            writer.transaction([("order", f"a{i}", {"i": 5 + i})])  # stream's to relay
        frozen.signal(signal.SIGCONT)
        assert frozen.wait(60) == 1, frozen.log()
        late.start()
        assert late.wait(60) == 1, late.log()
        # A second handover would publish again every row since the first, unmarked.
        query(outbox_db, sql.SQL("SELECT pg_drop_replication_slot(%s)"), names.slot)
        again = handover(outbox_db, kafka_service.bootstrap, names)
        assert again.returncode == 1
        assert again.stderr.strip() == (
            f"cdc-relay: error: public.outbox_events was handed over to stream before (slot "
            f"{names.slot}): no row since is marked processed, and a handover now would "
            f"publish them all again; stream it with slot {names.slot}, or make a lost slot "
            "anew with setup-slot --republish-since"
        )
    finally:
        frozen.signal(signal.SIGCONT)
        frozen.close()
        late.close()
        writer.close()
    for poller in (frozen, late):
        line = poller.log().strip().splitlines()[-1]
        assert line.startswith(
            "cdc-relay: error: table public.outbox_events was handed over to stream "
            "(cdc-relay setup-slot --from-poller) at "
        ), poller.log()
        assert f"run cdc-relay stream --slot {names.slot}, not poll" in line
    assert processed(outbox_db) == 5
    received = consume(kafka_service.bootstrap, names.topic_prefix, expected=10, timeout=5)
    assert sorted(r.id for r in received) == sorted(w.id for w in writer.written[:5])


# -- claim order: two transactions of one aggregate committing out of seq order -------------


def out_of_seq_order(dsn: str, key: str, between: Callable[[], object] = lambda: None) -> None:
    """Events ``key``-1 and ``key``-2 of aggregate ``key``: the first inserted (lower seq) by a
    transaction that commits after the second's; ``between`` runs once the second committed."""
    with psycopg.connect(dsn) as first, psycopg.connect(dsn) as second:
        for conn, n in ((first, 1), (second, 2)):
            write_event(
                conn,
                aggregate_type="order",
                aggregate_id=key,
                event_type="order.changed",
                payload={"n": f"{key}-{n}"},
            )
        second.commit()
        between()
        first.commit()


def order_of(received: list[Received], key: str) -> list[str]:
    """The events of aggregate ``key`` on Kafka, in partition order (first deliveries)."""
    ordered = sorted((r for r in received if r.key == key.encode()), key=lambda r: r.offset)
    return list(dict.fromkeys(json.loads(r.value or b"{}")["n"] for r in ordered))


def test_two_transactions_of_one_aggregate_committing_out_of_seq_order(
    tmp_path: Path, outbox_db: str, kafka_service: Any, names: Any
) -> None:
    """What docs/how-it-works.md states of the order of each path: poll publishes the rows a
    claim finds in seq order, and a row committed after a later one of its aggregate went out
    follows it, counted; the handover publishes in seq order, and counts such a row among its
    backlog; the republish publishes in seq order."""
    install_poller(outbox_db)
    (port,) = free_ports(1)
    env = relay_env(
        outbox_db, kafka_service.bootstrap, names, poll_interval="0.2", metrics_port=str(port)
    )
    poll = RelayProcess(tmp_path, env, name="poll", command="poll")
    try:
        out_of_seq_order(outbox_db, "both-before-a-claim")  # committed before the poller runs
        poll.start()
        wait_until(lambda: processed(outbox_db) == 2, 60, "the poller to publish")
        out_of_seq_order(  # the second published before the first commits
            outbox_db,
            "poll",
            lambda: wait_until(lambda: processed(outbox_db) == 3, 60, "the second published"),
        )
        wait_until(lambda: processed(outbox_db) == 4, 60, "the first published")
        samples = scrape(port)
        assert samples['outbox_events_out_of_seq_order_total{relay="poll"}'] == 1.0
        out_of_seq_order(  # the second published, the first left to the handover
            outbox_db,
            "handover",
            lambda: (
                wait_until(lambda: processed(outbox_db) == 5, 60, "the second published"),
                poll.stop(),
            ),
        )
        assert poll.wait(10) == 0, poll.log()
    finally:
        poll.close()
    late = [line for line in poll.log().splitlines() if "out of seq order" in line]
    assert len(late) == 1, poll.log()

    out_of_seq_order(outbox_db, "the-backlog")
    switched = handover(outbox_db, kafka_service.bootstrap, names)
    assert switched.returncode == 0, switched.stderr
    assert "1 of them out of seq order" in switched.stdout, switched.stdout

    # A lost slot made anew: the pair is in the table, and republished in seq order.
    query(outbox_db, "SELECT pg_drop_replication_slot(%s)", names.slot)
    out_of_seq_order(outbox_db, "republished")
    made = subprocess.run(
        [sys.executable, "-m", "cdc_relay", "setup-slot", "--republish-since", "1h"],
        env={**os.environ, **relay_env(outbox_db, kafka_service.bootstrap, names)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert made.returncode == 0, made.stderr

    received = consume(kafka_service.bootstrap, names.topic_prefix, expected=10)
    assert order_of(received, "both-before-a-claim") == [
        "both-before-a-claim-1",
        "both-before-a-claim-2",
    ]
    assert order_of(received, "poll") == ["poll-2", "poll-1"]
    assert order_of(received, "handover") == ["handover-2", "handover-1"]
    assert order_of(received, "the-backlog") == ["the-backlog-1", "the-backlog-2"]
    assert order_of(received, "republished")[-2:] == ["republished-1", "republished-2"]


def test_a_fence_table_a_non_writer_made_first_is_refused_not_taken(
    tmp_path: Path, outbox_db: str, kafka_service: Any, names: Any
) -> None:
    """Adversarial review: schema poller makes cdc_relay_handovers with CREATE TABLE IF NOT
    EXISTS, which takes a table of that name as it finds it. Where PUBLIC may create in the
    outbox's schema (PostgreSQL 14's public, and databases pg_upgrade brought from it; roles.sql
    only warns), a role with CONNECT alone makes it first and owns it: the handover writes its
    fence there, the owner deletes it, and a poller an orchestrator starts again publishes every
    event since the handover a second time, after stream's newer ones of the same aggregates.
    The handover now refuses, in one line, a fence table whose owner is neither its role nor a
    superuser."""
    hostile = f"t_hostile_{os.getpid()}_{time.monotonic_ns() % 10**6}"
    query(outbox_db, "GRANT CREATE ON SCHEMA public TO PUBLIC")
    query(outbox_db, sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(hostile)))
    try:
        with psycopg.connect(outbox_db, autocommit=True) as conn:
            conn.execute(sql.SQL("SET ROLE {}").format(sql.Identifier(hostile)))
            conn.execute(
                "CREATE TABLE cdc_relay_handovers (table_oid oid PRIMARY KEY, table_name text "
                "NOT NULL, slot text NOT NULL, lsn pg_lsn, started_at timestamptz NOT NULL "
                "DEFAULT now(), handed_over_at timestamptz)"
            )
            conn.execute("GRANT ALL ON cdc_relay_handovers TO PUBLIC")
        install_poller(outbox_db)  # the operator applies schema poller: it takes that table
        # The handover refuses to keep its fence in a table another role made first.
        switched = handover(outbox_db, kafka_service.bootstrap, names)
        assert switched.returncode == 1, switched.stdout
        assert f"is owned by role {hostile}" in switched.stderr, switched.stderr
    finally:
        query(outbox_db, "DROP TABLE IF EXISTS cdc_relay_handovers CASCADE")
        query(outbox_db, sql.SQL("DROP OWNED BY {}").format(sql.Identifier(hostile)))
        query(outbox_db, sql.SQL("DROP ROLE {}").format(sql.Identifier(hostile)))
