"""The schema from the installed package: ``cdc-relay schema apply``, ``setup-slot
--create-table``, and the roles script through psql."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from typing import Any

import psycopg
import pytest
from psycopg import sql

from cdc_relay.devstack import DevstackError
from cdc_relay.devstack.postgres import find_bindir

pytestmark = pytest.mark.integration


def cli(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cdc_relay", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **env},
    )


def one(dsn: str, query: str, *params: Any) -> Any:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(query, params).fetchone()
    return None if row is None else row[0]


def test_schema_apply_makes_each_schema_and_applied_again_keeps_what_is_there(
    empty_db: str,
) -> None:
    dbname = one(empty_db, "SELECT current_database()")
    refused = cli("schema", "apply", "poller", "--dsn", empty_db)
    assert refused.returncode == 1
    assert refused.stderr.strip() == (
        'cdc-relay: error: PostgreSQL refused schema poller: relation "outbox_events" does not '
        "exist (SQLSTATE 42P01); apply the outbox first: cdc-relay schema apply outbox"
    )
    # Two at once (a retried Job beside a migration): they take turns, both succeed.
    command = [sys.executable, "-m", "cdc_relay", "schema", "apply", "outbox", "--dsn", empty_db]
    both = [subprocess.Popen(command, stdout=subprocess.PIPE, text=True) for _ in range(2)]
    for process in both:
        out, _ = process.communicate(timeout=120)
        assert process.returncode == 0
        assert out == (
            f"applied schema outbox to database {dbname}: the outbox table, the stream's "
            "dead-letter table and outbox_emit()\n"
        )
    with psycopg.connect(empty_db, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload) "
            "VALUES ('order', '1', 'order.created', '{}')"
        )
    for name in ("outbox", "poller", "consumer", "poller", "consumer"):
        done = cli("schema", "apply", name, "--dsn", empty_db)
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith(f"applied schema {name} to database {dbname}: ")
    assert one(empty_db, "SELECT count(*) FROM outbox_events") == 1  # kept
    for relation in ("outbox_events", "cdc_relay_dead_letters", "outbox_dead_letters"):
        assert one(empty_db, "SELECT to_regclass(%s) IS NOT NULL", relation), relation
    assert one(empty_db, "SELECT to_regclass('processed_events') IS NOT NULL")
    assert one(empty_db, "SELECT count(*) FROM pg_proc WHERE proname = 'outbox_emit'") == 1
    assert one(empty_db, "SELECT count(*) FROM pg_trigger WHERE tgname = 'outbox_events_notify'")


def test_setup_slot_creates_a_missing_outbox_table_when_asked(empty_db: str, names: Any) -> None:
    base = ["setup-slot", "--dsn", empty_db, "--slot", names.slot]
    base += ["--publication", names.publication]
    missing = cli(*base)
    assert missing.returncode == 1
    assert missing.stderr.strip().endswith(
        "does not exist in database " + one(empty_db, "SELECT current_database()") + "; create "
        "it with cdc-relay schema apply outbox (or setup-slot --create-table), or name yours "
        "with --table"
    )
    # A dry run makes the table inside a transaction it rolls back: every check runs, on it.
    dry = cli(*base, "--create-table", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert dry.stdout.splitlines()[:2] == [
        "-- preflight passed; setup-slot would run:",
        "-- cdc-relay schema apply outbox, in schema public",
    ]
    assert "CREATE PUBLICATION" in dry.stdout
    assert one(empty_db, "SELECT to_regclass('outbox_events')") is None
    # The ConfigMap's switch of the Kubernetes setup Job: CDC_RELAY_CREATE_TABLE.
    made = cli(*base, CDC_RELAY_CREATE_TABLE="true")
    assert made.returncode == 0, made.stderr
    lines = made.stdout.splitlines()
    assert lines[0] == "created table public.outbox_events (cdc-relay schema outbox)"
    assert lines[1] == f"created publication {names.publication} on public.outbox_events"
    assert lines[2].startswith(f"created slot {names.slot} (pgoutput) at ")
    again = cli(*base, "--create-table")
    assert again.returncode == 0, again.stderr
    assert [line.split(" ")[0] for line in again.stdout.splitlines()] == ["exists:", "exists:"]
    # Another schema: the table is made there (with the rest of the outbox schema).
    with psycopg.connect(empty_db, autocommit=True) as conn:
        conn.execute("CREATE SCHEMA app")
    other = cli(
        "setup-slot",
        "--dsn",
        empty_db,
        "--slot",
        names.slot + "_app",
        "--publication",
        names.publication + "_app",
        "--table",
        "app.outbox_events",
        "--create-table",
    )
    assert other.returncode == 0, other.stderr
    assert other.stdout.splitlines()[0] == (
        "created table app.outbox_events (cdc-relay schema outbox)"
    )
    assert one(empty_db, "SELECT to_regclass('app.cdc_relay_dead_letters') IS NOT NULL")
    # A table of another name is not the schema's to make.
    wrong = cli(*base, "--table", "public.orders", "--create-table")
    assert wrong.returncode == 2
    assert wrong.stderr.strip() == (
        "cdc-relay: error: --create-table makes the table of cdc-relay schema show outbox, "
        "outbox_events, not public.orders: create public.orders yourself (that schema is a "
        "start), or drop --create-table"
    )


def test_the_roles_script_runs_from_schema_show_through_psql(outbox_db: str) -> None:
    try:
        psql = find_bindir() / "psql"
    except DevstackError as err:
        pytest.skip(f"no psql: {err}")
    suffix = uuid.uuid4().hex[:8]
    stream_role, poller_role = f"t_stream_{suffix}", f"t_poller_{suffix}"
    writer_role = f"t_writer_{suffix}"
    script = cli("schema", "show", "roles").stdout
    try:
        ran = subprocess.run(
            [
                str(psql),
                *("-X", "-q", "-v", "ON_ERROR_STOP=1", "-d", outbox_db),
                *("-v", f"stream_role={stream_role}", "-v", f"poller_role={poller_role}"),
                *("-v", f"writer_role={writer_role}", "-f", "-"),
            ],
            input=script,
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "CDC_RELAY_STREAM_PASSWORD": f"pw-{suffix}"},
        )
        assert ran.returncode == 0, ran.stderr
        assert one(outbox_db, "SELECT rolreplication FROM pg_roles WHERE rolname = %s", stream_role)
        assert one(
            outbox_db, "SELECT has_table_privilege(%s, 'outbox_events', 'SELECT')", stream_role
        )
        assert not one(
            outbox_db, "SELECT has_table_privilege(%s, 'outbox_events', 'INSERT')", poller_role
        )
        assert one(
            outbox_db, "SELECT has_table_privilege(%s, 'outbox_events', 'INSERT')", writer_role
        )
        # pg_logical_emit_message: the writer's, not PUBLIC's (tests/integration/
        # test_message_privileges.py tries each role)
        emit = "SELECT bool_and(has_function_privilege(%s, oid, 'EXECUTE')) FROM pg_proc"
        emit += " WHERE proname = 'pg_logical_emit_message'"
        assert one(outbox_db, emit, writer_role)
        assert not one(outbox_db, emit, poller_role)
        assert one(
            outbox_db,
            "SELECT rolpassword IS NOT NULL FROM pg_authid WHERE rolname = %s",
            stream_role,
        )
    finally:  # roles belong to the whole cluster, which other tests share
        with psycopg.connect(outbox_db, autocommit=True) as conn:
            for role in (stream_role, poller_role, writer_role):
                if conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", [role]).fetchone():
                    conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
                    conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))
