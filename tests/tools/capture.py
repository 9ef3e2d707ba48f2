"""Capture real pgoutput and wal2json messages for the decoders' unit tests.

    python tests/tools/capture.py "host=... dbname=..." tests/unit/data
    python tests/tools/capture.py "host=... dbname=..." tests/unit/data --positions
    python tests/tools/capture.py "host=... dbname=..." tests/unit/data --cut
    python tests/tools/capture.py "host=... dbname=..." tests/unit/data --trace

Runs a small workload, streams it through two temporary slots (pgoutput with
``messages 'true'``, and wal2json format-version 2 with the options the relay uses) and
writes one JSON line per XLogData message to pgoutput.jsonl and wal2json.jsonl: the label of
the step that caused it and the message bytes in hex. With ``--positions``, the workload of
units that share a position (POSITION_STEPS) goes to pgoutput-positions.jsonl and
wal2json-positions.jsonl instead; with ``--trace``, rows with a trace column
(TRACE_STEPS) go to pgoutput-trace.jsonl and wal2json-trace.jsonl. Needs a database where
sql/outbox.sql
was applied, and the wal2json plugin installed.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import psycopg

from cdc_relay.events import Begin, LogicalMessage
from cdc_relay.lsn import parse
from cdc_relay.postgres import pgoutput, wal2json
from cdc_relay.postgres.replication import ReplicationConnection, XLogData

PUBLICATION = "capture_pgoutput"

STEPS = [
    (
        "single insert",
        "INSERT INTO outbox_events (id, aggregate_type, aggregate_id, event_type, payload) "
        "VALUES ('6f1c1b7e-2a51-4c43-9d0e-3f5d2b8a9c01', 'order', 'o-1', 'order.created', "
        """'{"total": 42, "items": [1, 2]}')""",
    ),
    (
        "two inserts in one transaction",
        "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload) VALUES "
        """('order', 'o-2', 'order.created', '{"n": 1}'), """
        """('customer', 'c-1', 'customer.updated', '{"n": 2}')""",
    ),
    (
        "non-ascii payload",
        "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload) VALUES "
        """('order', 'ö-3', 'order.créé', '{"name": "Zoë 😀", "city": "Łódź"}')""",
    ),
    (
        "toasted payload",
        "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload) "
        "SELECT 'order', 'o-4', 'order.big', jsonb_build_object('blob', "
        "string_agg(md5(i::text), '')) FROM generate_series(1, 200) i",
    ),
    (
        "insert then delete",
        "WITH e AS (INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, "
        """payload) VALUES ('order', 'o-5', 'order.shipped', '{}') RETURNING id) """
        "DELETE FROM outbox_events WHERE id IN (SELECT id FROM e)",
    ),
    ("update", "UPDATE outbox_events SET attempts = attempts + 1 WHERE aggregate_id = 'o-1'"),
    ("delete", "DELETE FROM outbox_events WHERE aggregate_id = 'o-2'"),
    ("add column", "ALTER TABLE outbox_events ADD COLUMN IF NOT EXISTS tenant text"),
    (
        "insert after schema change",
        "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload, tenant) "
        """VALUES ('order', 'o-6', 'order.created', '{"v": 2}', 't-1')""",
    ),
    ("drop column", "ALTER TABLE outbox_events DROP COLUMN IF EXISTS tenant"),
    (
        "logical message",
        """SELECT pg_logical_emit_message(true, 'outbox', '{"id": "m-1"}')""",
    ),
    ("truncate", "TRUNCATE outbox_events"),
]

# Two units at one LSN (ARCHITECTURE.md, invariant 11): a non-transactional message ends where
# the next WAL record starts; emitted last in a transaction, that record is the commit's.
POSITION_STEPS = [
    (
        "message at the commit of its transaction",
        "BEGIN; "
        "INSERT INTO outbox_events (id, aggregate_type, aggregate_id, event_type, payload) "
        "SELECT ('6f1c1b7e-2a51-4c43-9d0e-' || lpad(i::text, 12, '0'))::uuid, 'order', "
        """'o-' || i, 'order.created', jsonb_build_object('n', i) """
        "FROM generate_series(1, 6) i; "
        """SELECT pg_logical_emit_message(false, 'outbox', '{"v": 2, "id": "m-at-commit", """
        """"aggregate_type": "order", "aggregate_id": "o-m", "event_type": "order.noted", """
        """"payload": {"m": 1}}'); """
        "COMMIT",
    ),
    (
        "a transaction after it",
        "INSERT INTO outbox_events (id, aggregate_type, aggregate_id, event_type, payload) "
        "VALUES ('6f1c1b7e-2a51-4c43-9d0e-0000000000ff', 'order', 'o-7', 'order.created', "
        """'{"n": 7}')""",
    ),
]


# A resharding cut as reshard writes it (slot.write_cut: a transactional message of prefix
# cdc-relay-cut naming the old slots, alone in its transaction), between outbox transactions.
CUT_MESSAGE = '{"cut": "6f1c1b7e-0c00-4c43-9d0e-00000000c001", "slots": ["old"]}'


# Two events per transaction, of aggregates o-0 and o-1, ids ending in the series' numbers.
_CUT_INSERT = (
    "INSERT INTO outbox_events (id, aggregate_type, aggregate_id, event_type, payload) "
    "SELECT ('6f1c1b7e-2a51-4c43-9d0e-' || lpad(i::text, 12, '0'))::uuid, 'order', "
    """'o-' || (i %% 2), 'order.created', jsonb_build_object('n', i) """
    "FROM generate_series(%s, %s + 1) i"
)


CUT_STEPS = [
    *[("before the cut", _CUT_INSERT % (first, first)) for first in (1, 3, 5)],
    (
        "the cut",
        f"BEGIN; SELECT pg_logical_emit_message(true, 'cdc-relay-cut', '{CUT_MESSAGE}'); COMMIT",
    ),
    *[("after the cut", _CUT_INSERT % (first, first)) for first in (101, 103, 105)],
]


# --trace-column's values as applications store them (tests/unit/test_trace_context_values.py): a
# plain traceparent, and java.util.Properties text as Debezium's outbox extension writes into its
# tracingspancontext column (Properties.store: a date comment, "=" and ":" escaped in values).
_TRACE_INSERT = (
    "INSERT INTO outbox_events (id, aggregate_type, aggregate_id, event_type, payload, "
    "tracingspancontext) VALUES ('6f1c1b7e-2a51-4c43-9d0e-7ace000000%s', 'order', 'o-t', "
    "'order.traced', '{}', %s)"
)
TRACE_STEPS = [
    ("trace column", "ALTER TABLE outbox_events ADD COLUMN IF NOT EXISTS tracingspancontext text"),
    (
        "plain traceparent",
        _TRACE_INSERT % ("01", "'00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01'"),
    ),
    (
        "debezium properties",
        _TRACE_INSERT
        % (
            "02",
            "E'#Tue Dec 02 15:16:00 UTC 2026\\n"
            "traceparent=00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01\\n"
            "tracestate=rojo\\\\=00f067aa0ba902b7,congo\\\\=t61rcWkgMzE\\n'",
        ),
    ),
    (
        "properties without tracestate",
        _TRACE_INSERT
        % (
            "03",
            "E'#Tue Dec 02 15:16:00 UTC 2026\\r\\n"
            "traceparent=00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00\\r\\n'",
        ),
    ),
    ("null trace", _TRACE_INSERT % ("04", "NULL")),
    ("malformed traceparent", _TRACE_INSERT % ("05", "'00-0AF7651916CD43DD8448EB211C80319C-x-01'")),
    ("empty trace", _TRACE_INSERT % ("06", "''")),
    ("drop trace column", "ALTER TABLE outbox_events DROP COLUMN IF EXISTS tracingspancontext"),
]


SLOTS = {
    "pgoutput": (
        "capture_pgoutput",
        {"proto_version": "1", "publication_names": PUBLICATION, "messages": "true"},
    ),
    "wal2json": (
        "capture_wal2json",
        {
            **wal2json.START_OPTIONS,
            "add-tables": "public.outbox_events",
            "add-msg-prefixes": "outbox",
        },
    ),
}


def main(dsn: str, out_dir: str, steps: list[tuple[str, str]] = STEPS, suffix: str = "") -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"DROP PUBLICATION IF EXISTS {PUBLICATION}")
        conn.execute(f"CREATE PUBLICATION {PUBLICATION} FOR TABLE outbox_events")
        for plugin, (slot, _) in SLOTS.items():
            conn.execute(
                "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots "
                "WHERE slot_name = %s",
                (slot,),
            )
            conn.execute("SELECT pg_create_logical_replication_slot(%s, %s)", (slot, plugin))
        marks = []
        for label, statement in steps:
            conn.execute(statement)
            lsn = conn.execute("SELECT pg_current_wal_insert_lsn()::text").fetchone()
            marks.append((label, lsn[0] if lsn else ""))
    for plugin, (slot, options) in SLOTS.items():
        records = capture(dsn, plugin, slot, options, marks)
        out = Path(out_dir) / f"{plugin}{suffix}.jsonl"
        out.write_text("".join(json.dumps(r) + "\n" for r in records))
        print(f"{len(records)} messages written to {out}")
    with psycopg.connect(dsn, autocommit=True) as conn:
        for slot, _ in SLOTS.values():
            conn.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
        conn.execute(f"DROP PUBLICATION {PUBLICATION}")


def capture(
    dsn: str, plugin: str, slot: str, options: dict[str, str], marks: list[tuple[str, str]]
) -> list[dict[str, str]]:
    stream = ReplicationConnection(dsn)
    stream.start(slot, 0, options)
    decoder = wal2json.Wal2JsonDecoder()
    records = []
    label = ""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        message = stream.read(0.5)
        if isinstance(message, XLogData):
            decoded = (
                [pgoutput.decode(message.data)]
                if plugin == "pgoutput"
                else decoder.decode(message.data)
            )
            for record in decoded:
                if isinstance(record, Begin):
                    # The step: the first whose end mark lies past this transaction's commit.
                    label = next(name for name, mark in marks if parse(mark) > record.final_lsn)
                elif isinstance(record, LogicalMessage) and not record.transactional:
                    label = next(name for name, mark in marks if parse(mark) >= record.lsn)
            records.append({"step": label, "hex": message.data.hex()})
    stream.close()
    return records


if __name__ == "__main__":
    if sys.argv[3:] == ["--positions"]:
        main(sys.argv[1], sys.argv[2], POSITION_STEPS, "-positions")
    elif sys.argv[3:] == ["--cut"]:
        main(sys.argv[1], sys.argv[2], CUT_STEPS, "-cut")
    elif sys.argv[3:] == ["--trace"]:
        main(sys.argv[1], sys.argv[2], TRACE_STEPS, "-trace")
    else:
        main(sys.argv[1], sys.argv[2])
