"""The outbox schema, shipped in the package: the SQL files of ``cdc_relay/sql`` by name.

``cdc-relay schema show NAME`` prints one and ``cdc-relay schema apply NAME`` applies one, so
an installed package needs no checkout; the repository's ``sql/`` is the same folder.
"""

from __future__ import annotations

from importlib.resources import files
from typing import Any

import psycopg
from psycopg import sql

from cdc_relay.errors import RelayError, UsageError
from cdc_relay.queries import QUERIES

SCHEMAS = {
    "outbox": "the outbox table, the stream's dead-letter table, the slots' lineage table and "
    "outbox_emit()",
    "poller": "what cdc-relay poll adds to the outbox: its NOTIFY trigger, the dead-letter view, "
    "the handovers' fences",
    "consumer": "processed_events, for idempotent consumers (cdc_relay.consumer)",
    "roles": "least-privilege roles for stream, poll and prune, and the writer role: a psql "
    "script, run by a superuser",
}
APPLICABLE = ("outbox", "poller", "consumer")
OUTBOX_TABLE = "outbox_events"
"""The table the outbox schema creates."""

ROLES_HOWTO = (
    'cdc-relay schema show roles | psql "$ADMIN_DSN" -v ON_ERROR_STOP=1 -f -   '
    "(psql 15 or newer; the passwords come from CDC_RELAY_STREAM_PASSWORD, "
    "CDC_RELAY_POLLER_PASSWORD and CDC_RELAY_PRUNER_PASSWORD in psql's environment)"
)


def text(name: str) -> str:
    """The SQL of schema ``name`` (one of SCHEMAS)."""
    if name not in SCHEMAS:
        raise UsageError(f"no schema {name!r}; choose one of {', '.join(SCHEMAS)}")
    return files("cdc_relay").joinpath(f"sql/{name}.sql").read_text(encoding="utf-8")


def applicable(name: str) -> str:
    """The SQL of schema ``name`` if ``apply`` can apply it; UsageError saying how otherwise."""
    if name == "roles":
        raise UsageError(
            "roles is a psql script (it reads the passwords from psql's environment, never "
            f"from a command line or a log); run it with psql: {ROLES_HOWTO}"
        )
    return text(name)


def apply(conn: psycopg.Connection[Any], name: str, schema: str | None = None) -> None:
    """Apply schema ``name`` in one transaction of ``conn`` (autocommit), or in the caller's
    open one; every script is idempotent. With ``schema``, its objects are made there rather
    than in the first schema of the search path."""
    script = applicable(name)
    try:
        with conn.transaction():
            conn.execute(QUERIES["schema_lock"])
            if schema is not None:
                conn.execute(QUERIES["schema_path"], {"path": sql.Identifier(schema).as_string()})
            conn.execute(script.encode())  # several statements: no parameters allowed
    except psycopg.OperationalError:
        raise
    except psycopg.DatabaseError as exc:
        raise RelayError(_refused(name, schema, exc)) from None


def _refused(name: str, schema: str | None, exc: psycopg.DatabaseError) -> str:
    code = exc.sqlstate or ""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if code == "42P01" and name == "poller":
        remedy = "apply the outbox first: cdc-relay schema apply outbox"
    elif code == "42501":
        remedy = (
            "apply it as a role that may create objects in the schema (for outbox and poller: "
            "the role that owns, or is to own, the outbox table)"
        )
    elif code == "3F000":
        remedy = f"create schema {schema} first" if schema else "set a search_path that exists"
    else:
        remedy = "see cdc-relay schema show " + name
    return f"PostgreSQL refused schema {name}: {first} (SQLSTATE {code}); {remedy}"


def outbox_target(conn: psycopg.Connection[dict[str, Any]], table: str) -> str:
    """The schema in which the outbox schema is to make ``table``, which must be named
    outbox_events (the table that schema creates); UsageError otherwise."""
    try:
        row = conn.execute(QUERIES["table_parts"], {"table": table}).fetchone() or {}
    except psycopg.OperationalError:
        raise
    except psycopg.DatabaseError as exc:
        first = str(exc).strip().splitlines()[0]
        raise UsageError(
            f"--table {table!r} is not a table name PostgreSQL reads: {first}"
        ) from None
    *path, name = row["parts"]
    if name != OUTBOX_TABLE or len(path) > 1:
        raise UsageError(
            f"--create-table makes the table of cdc-relay schema show outbox, {OUTBOX_TABLE}, "
            f"not {table}: create {table} yourself (that schema is a start), or drop "
            "--create-table"
        )
    schema = path[0] if path else row["current"]
    if schema is None:
        raise UsageError(
            f"no schema of the search path exists to create {table} in; name one in --table"
        )
    return str(schema)
