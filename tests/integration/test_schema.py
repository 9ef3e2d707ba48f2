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

from cdc_relay import schema
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
            "dead-letter table, the slots' lineage table and outbox_emit()\n"
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
    pruner_role, writer_role = f"t_pruner_{suffix}", f"t_writer_{suffix}"
    script = cli("schema", "show", "roles").stdout
    try:
        ran = subprocess.run(
            [
                str(psql),
                *("-X", "-q", "-v", "ON_ERROR_STOP=1", "-d", outbox_db),
                *("-v", f"stream_role={stream_role}", "-v", f"poller_role={poller_role}"),
                *("-v", f"pruner_role={pruner_role}", "-v", f"writer_role={writer_role}"),
                *("-f", "-"),
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
            for role in (stream_role, poller_role, pruner_role, writer_role):
                if conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", [role]).fetchone():
                    conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
                    conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


# -- the roles script from any starting state ---------------------------------------------------

KINDS = ("stream", "poller", "pruner")

FINGERPRINT = """
SELECT 'role' AS what, '' AS name,
       concat_ws(',', r.rolcanlogin, r.rolreplication, r.rolsuper, r.rolcreatedb,
                 r.rolcreaterole, r.rolbypassrls, r.rolinherit) AS holds
FROM pg_roles r WHERE r.rolname = %(role)s
UNION ALL
SELECT 'member of', g.rolname, ''
FROM pg_auth_members a JOIN pg_roles g ON g.oid = a.roleid JOIN pg_roles m ON m.oid = a.member
WHERE m.rolname = %(role)s
UNION ALL
SELECT 'database', d.datname, p
FROM pg_database d, unnest(ARRAY['CONNECT', 'CREATE', 'TEMP']) p
WHERE d.datname = current_database() AND has_database_privilege(%(role)s, d.oid, p)
UNION ALL
SELECT 'schema', n.nspname, p
FROM pg_namespace n, unnest(ARRAY['USAGE', 'CREATE']) p
WHERE n.nspname NOT LIKE 'pg\\_%%' AND n.nspname <> 'information_schema'
  AND has_schema_privilege(%(role)s, n.oid, p)
UNION ALL
SELECT 'relation', c.oid::regclass::text, p
FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace,
     unnest(ARRAY['SELECT', 'INSERT', 'UPDATE', 'DELETE', 'TRUNCATE', 'REFERENCES', 'TRIGGER']) p
WHERE c.relkind IN ('r', 'p', 'v', 'm') AND n.nspname NOT IN ('pg_catalog', 'information_schema')
  AND has_table_privilege(%(role)s, c.oid, p)
UNION ALL
SELECT 'sequence', c.oid::regclass::text, p
FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace,
     unnest(ARRAY['USAGE', 'SELECT', 'UPDATE']) p
WHERE c.relkind = 'S' AND has_sequence_privilege(%(role)s, c.oid, p)
UNION ALL
SELECT 'column', a.attrelid::regclass::text || '.' || a.attname, p
FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid
JOIN pg_namespace n ON n.oid = c.relnamespace,
     unnest(ARRAY['INSERT', 'UPDATE']) p
WHERE c.relkind IN ('r', 'p') AND n.nspname NOT IN ('pg_catalog', 'information_schema')
  AND a.attnum > 0 AND NOT a.attisdropped
  AND has_column_privilege(%(role)s, a.attrelid, a.attnum, p)
UNION ALL
SELECT 'function', p.oid::regprocedure::text, 'EXECUTE'
FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
WHERE n.nspname NOT IN ('pg_catalog', 'information_schema')
  AND has_function_privilege(%(role)s, p.oid, 'EXECUTE')
UNION ALL
SELECT 'default privileges', d.defaclobjtype::text, ''
FROM pg_default_acl d, aclexplode(d.defaclacl) e JOIN pg_roles r ON r.oid = e.grantee
WHERE r.rolname = %(role)s
ORDER BY 1, 2, 3
"""


def fingerprint(dsn: str, role: str) -> list[tuple[str, str, str]]:
    """What ``role`` may do in the database, however it came by it (its own grants, its
    memberships, PUBLIC's)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        return [tuple(row) for row in conn.execute(FINGERPRINT, {"role": role})]


def roles_script(dsn: str, roles: dict[str, str]) -> subprocess.CompletedProcess[str]:
    try:
        psql = find_bindir() / "psql"
    except DevstackError as err:
        pytest.skip(f"no psql: {err}")
    names = [arg for kind, role in roles.items() for arg in ("-v", f"{kind}_role={role}")]
    return subprocess.run(
        [str(psql), "-X", "-q", "-v", "ON_ERROR_STOP=1", "-d", dsn, *names, "-f", "-"],
        input=cli("schema", "show", "roles").stdout,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.pg18
def test_the_roles_script_takes_back_what_was_granted_before(outbox_db: str) -> None:
    """Two sets of the three roles: one new, one given more first (a table of its own to
    write, pg_write_all_data, another role's privileges, CREATE on schema public, column and
    default privileges, DELETE for the poller). After the script both may do exactly the
    same, and what docs/security.md says."""
    with psycopg.connect(outbox_db, autocommit=True) as conn:
        conn.execute(schema.text("poller").encode())
    suffix = uuid.uuid4().hex[:8]
    new = {kind: f"t_{kind}_new_{suffix}" for kind in (*KINDS, "writer")}
    given = {kind: f"t_{kind}_given_{suffix}" for kind in (*KINDS, "writer")}
    app = f"t_app_{suffix}"
    database = one(outbox_db, "SELECT current_database()")
    extras = [
        f"CREATE ROLE {app}",
        f"GRANT ALL ON outbox_events, cdc_relay_dead_letters, cdc_relay_handovers TO {app}",
        *(f"CREATE ROLE {given[kind]} LOGIN" for kind in KINDS),
        f"GRANT pg_write_all_data TO {given['stream']}",
        f"GRANT {app} TO {given['poller']}",
        f"GRANT ALL ON cdc_relay_dead_letters TO {given['poller']}, {given['pruner']}",
        f"GRANT INSERT, DELETE, TRUNCATE ON outbox_events TO {given['stream']}",
        f"GRANT DELETE, UPDATE (payload) ON outbox_events TO {given['poller']}",
        f"GRANT INSERT (payload) ON outbox_events TO {given['pruner']} WITH GRANT OPTION",
        f"GRANT CREATE ON SCHEMA public TO {', '.join(given[kind] for kind in KINDS)}",
        f'GRANT CREATE, TEMP ON DATABASE "{database}" TO {", ".join(given[k] for k in KINDS)}',
        f"GRANT USAGE ON SEQUENCE outbox_events_seq_seq TO {given['poller']}",
        f"ALTER DEFAULT PRIVILEGES GRANT SELECT, INSERT ON TABLES TO {given['stream']}",
        "CREATE SCHEMA extra",
        "CREATE TABLE extra.other (n int)",
        f"GRANT ALL ON SCHEMA extra TO {given['pruner']}",
        f"GRANT ALL ON extra.other TO {given['pruner']}",
    ]
    try:
        made = roles_script(outbox_db, new)
        assert made.returncode == 0, made.stderr
        with psycopg.connect(outbox_db, autocommit=True) as conn:
            for statement in extras:
                conn.execute(statement)
        assert fingerprint(outbox_db, given["stream"]) != fingerprint(outbox_db, new["stream"])
        for _ in range(2):  # idempotent
            taken_back = roles_script(outbox_db, given)
            assert taken_back.returncode == 0, taken_back.stderr
            for kind in KINDS:
                was_given = set(fingerprint(outbox_db, given[kind]))
                assert was_given - set(fingerprint(outbox_db, new[kind])) == set(), kind
                assert set(fingerprint(outbox_db, new[kind])) - was_given == set(), kind

        # What docs/security.md says each may do with the outbox.
        def may(role: str) -> set[str]:
            return {
                f"{what} {name} {holds}".strip()
                for what, name, holds in fingerprint(outbox_db, role)
                if (what in ("relation", "column") and "outbox_events" in name)
                or what in ("role", "member of")
            }

        assert may(new["stream"]) == {
            "role  t,t,f,f,f,f,t",
            "relation outbox_events SELECT",
        }
        assert may(new["poller"]) == {
            "role  t,f,f,f,f,f,t",
            "relation outbox_events SELECT",
            *(
                f"column outbox_events.{column} UPDATE"
                for column in ("attempts", "retry_after", "last_error", "processed_at")
            ),
        }
        assert may(new["pruner"]) == {
            "role  t,f,f,f,f,f,t",
            "relation outbox_events SELECT",
            "relation outbox_events DELETE",
        }

        # An owner has every privilege on what it owns: the script stops, and says what to do.
        with psycopg.connect(outbox_db, autocommit=True) as conn:
            conn.execute(f"ALTER TABLE extra.other OWNER TO {given['pruner']}")
        owns = roles_script(outbox_db, given)
        assert owns.returncode == 3
        assert (
            f"role {given['pruner']} owns 1 object(s) (in database {database}): an owner has "
            f"every privilege on them; run REASSIGN OWNED BY {given['pruner']} TO the owner of "
            "the outbox in each of those databases, then this script again"
        ) in owns.stderr, owns.stderr
    finally:  # roles belong to the whole cluster, which other tests share
        with psycopg.connect(outbox_db, autocommit=True) as conn:
            for role in (*new.values(), *given.values(), app):
                if conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", [role]).fetchone():
                    conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
                    conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))
