"""What a stream relay checks of the database before it reads its slot (StreamRelay.run): the
server's encoding and the writers of ``--messages``; the slot, there, valid and decoded by a
plugin the relay reads; the outbox tables, each there once and covered by the publication (or
wal2json's filter) as the plugin and a shard need; the dead-letter store and the slot's
lineage. Each failure is a PreflightError that says what to do. On the way it notes what the
start decides from the server: its timeline (timeline.Timeline), a new shard's resharding cut
(cut.ShardCut), the types decoded as bytea."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import psycopg

from cdc_relay.errors import PreflightError
from cdc_relay.events import BYTEA_OID
from cdc_relay.kafka.deadletter import DeadLetterStore
from cdc_relay.metrics import observe_slot
from cdc_relay.postgres import failover, gaps
from cdc_relay.postgres.connection import check_encoding, connect
from cdc_relay.postgres.coverage import PLUGINS, besides_problem, coverage_problem
from cdc_relay.postgres.messages import check_writers
from cdc_relay.postgres.store import check_trace_column
from cdc_relay.postgres.tables import OutboxTable, find_table
from cdc_relay.queries import QUERIES
from cdc_relay.relay.cut import AfterCut
from cdc_relay.relay.stream_settings import StreamSettings
from cdc_relay.relay.timeline import Timeline


@dataclass(frozen=True)
class Checked:
    """What the checks found: the outbox tables, the slot's confirmed position and plugin,
    and the types whose values decode as bytea (bytea and its domains)."""

    tables: tuple[OutboxTable, ...]
    confirmed: str
    plugin: str
    bytea_types: frozenset[int]


def check_database(
    settings: StreamSettings,
    timeline: Timeline,
    after_cut: AfterCut,
    dead_letters: DeadLetterStore | None,
) -> Checked:
    """Slot, publication and tables exist as ``stream`` needs them; the server's timeline
    noted in ``timeline``, a new shard's position to its cut given to ``after_cut``."""
    with connect(settings.dsn) as conn:
        check_encoding(conn.execute(QUERIES["server"]).fetchone() or {})
        check_writers(conn, settings.messages)
        slot = conn.execute(QUERIES["slot"], {"slot": settings.slot}).fetchone()
        # The server's timeline: what a missing slot means, and the exactly-once
        # checkpoints' (NULL on a standby).
        server_timeline = (conn.execute(QUERIES["timeline"]).fetchone() or {}).get("timeline")
        if not slot:
            raise PreflightError(
                gaps.gone(conn, settings.slot)
                or failover.slot_gone(settings.slot, server_timeline)
                or f"replication slot {settings.slot!r} does not exist; "
                "run cdc-relay setup-slot first"
            )
        observe_slot(slot)
        timeline.note(server_timeline)
        timeline.guard(conn)
        if invalidated := failover.slot_invalidated(settings.slot, slot):
            raise PreflightError(invalidated)
        if slot["plugin"] not in PLUGINS:
            raise PreflightError(
                f"slot {settings.slot} uses {slot['plugin']}; stream decodes "
                f"{' and '.join(PLUGINS)}: create such a slot with cdc-relay setup-slot"
            )
        tables = find_tables(conn, settings.tables)
        if settings.shard is not None and slot["plugin"] != "pgoutput":
            raise PreflightError(
                f"slot {settings.slot} uses {slot['plugin']}; a shard needs a pgoutput slot "
                "(its publication's row filter sorts the rows out): cdc-relay setup-slot "
                "--shards"
            )
        for table in tables:
            if slot["plugin"] == "pgoutput":
                problem = coverage_problem(
                    conn,
                    settings.publication,
                    table,
                    settings.shard,
                    settings.layout.aggregate_id,
                )
                if problem:
                    raise PreflightError(problem)
            elif table.partitioned:
                raise PreflightError(
                    f"{table.qualified} is partitioned, and wal2json names each row by its "
                    "partition; use a pgoutput slot (cdc-relay setup-slot --plugin pgoutput)"
                )
        for table in tables:
            check_trace_column(conn, table, settings.layout.trace_column)
        if slot["plugin"] == "wal2json":
            problem = besides_problem(conn, settings.publication, tables)
            if problem:
                raise PreflightError(problem)
        if settings.shard is not None:
            after_cut(conn, settings.shard, str(slot["confirmed_flush_lsn"]))
        if dead_letters is not None:
            dead_letters.check(conn)
        gaps.check_stream(conn, settings.slot, slot, settings.publication, tables)
        row = conn.execute(QUERIES["bytea_types"]).fetchone()
        return Checked(
            tables,
            str(slot["confirmed_flush_lsn"]),
            str(slot["plugin"]),
            frozenset(row["oids"] if row else ()) | {BYTEA_OID},
        )


def find_tables(
    conn: psycopg.Connection[dict[str, Any]], names: Sequence[str]
) -> tuple[OutboxTable, ...]:
    """``--table`` (each) resolved as PostgreSQL resolves it; a PreflightError for a table
    that does not exist, or one named twice (``outbox_events`` and ``public.outbox_events``)."""
    if not names:
        raise PreflightError("no outbox table given; name one with --table")
    tables: dict[int, tuple[str, OutboxTable]] = {}
    for name in names:
        table = find_table(conn, name)
        if table is None:
            raise PreflightError(f"table {name} does not exist; check --table")
        if table.oid in tables:
            raise PreflightError(
                f"--table {tables[table.oid][0]} and --table {name} are the same table, "
                f"{table.qualified}; name each outbox table once"
            )
        tables[table.oid] = (name, table)
    return tuple(table for _, table in tables.values())
