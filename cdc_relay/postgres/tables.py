"""The outbox tables by identity: resolved as PostgreSQL resolves a name, known by oid.

Set-up (slot.py), status (ops/status.py), the stream, the poller's store and the commands
beside them all name a table so. It imports nothing of the relay's but its queries, so that
any of them may import it: store.py, which status counts through, could not take it from a
module that imports store.py.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql

from cdc_relay.queries import QUERIES


@dataclass(frozen=True)
class OutboxTable:
    """The outbox table by identity: the relay follows its OID through renames and schema
    moves, as the publication does."""

    oid: int
    schema: str
    name: str
    partitioned: bool

    @property
    def qualified(self) -> str:
        """``schema.name``, each quoted only where SQL needs it."""
        return f"{_ident(self.schema)}.{_ident(self.name)}"

    @property
    def identifier(self) -> sql.Identifier:
        """The table as a query's ``{table}`` names it: ``"schema"."name"``."""
        return sql.Identifier(self.schema, self.name)


def _ident(name: str) -> str:
    if re.fullmatch(r"[a-z_][a-z0-9_$]*", name):
        return name
    return '"' + name.replace('"', '""') + '"'


def find_table(conn: psycopg.Connection[dict[str, Any]], table: str) -> OutboxTable | None:
    """``--table`` resolved as PostgreSQL resolves it (search_path, case folding, quotes)."""
    row = conn.execute(QUERIES["outbox_table"], {"table": table}).fetchone()
    return OutboxTable(**row) if row else None


def table_by_oid(conn: psycopg.Connection[dict[str, Any]], oid: int) -> OutboxTable | None:
    """The table of ``oid`` as it is named now; None once it is dropped."""
    row = conn.execute(QUERIES["outbox_table_by_oid"], {"oid": oid}).fetchone()
    return OutboxTable(**row) if row else None


def untrusted_owner(conn: psycopg.Connection[Any], table: str) -> str | None:
    """The owner of ``table`` (a table the relays keep state in: slot lineage, handover
    fences) when it is neither this role, a role it is a direct member of, nor a superuser;
    None otherwise. CREATE TABLE IF NOT EXISTS takes a table another role made first as it
    finds it, and its owner could rewrite what it says."""
    row = conn.execute(QUERIES["untrusted_owner"], {"table": table}).fetchone()
    if row is None:
        return None
    return str(row["owner"] if isinstance(row, dict) else row[0])


def untrusted_message(table: str, owner: str, what: str) -> str:
    """The one line for a table ``untrusted_owner`` names."""
    return (
        f"table {table}, where {what}, is owned by role {owner}, neither this role nor a "
        "superuser: a role that made it first may rewrite it; check it, then ALTER TABLE "
        f"{table} OWNER TO the role that runs this (or drop it and make it again)"
    )
