"""--trace-column on a real PostgreSQL and Kafka: a consumer reads the W3C ``traceparent`` and
``tracestate`` the application stored with each event, from ``stream`` (pgoutput and
wal2json), ``poll`` and the handover (``setup-slot --from-poller``); a malformed traceparent
goes out as stored and is named in the log; a trace column the table lacks stops the relay at
start, in one line. (The golden files trace_context.jsonl and trace_cloudevents.jsonl hold the
exact bytes on every path, the republish included: test_golden.py, test_republish.py.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import psycopg
import pytest
from relaytools import RelayProcess, consume, install_poller, relay_env, setup_slot

pytestmark = pytest.mark.integration

PARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
STATE = "rojo=00f067aa0ba902b7,congo=t61rcWkgMzE"
PLAIN = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
MALFORMED = "00-0af7651916cd43dd8448eb211c80319c-B7AD6B7169203331-01"
# as Debezium's outbox extension stores it (java.util.Properties.store)
DEBEZIUM = (
    f"#Tue Dec 02 15:16:00 UTC 2026\ntraceparent={PARENT}\n"
    "tracestate=rojo\\=00f067aa0ba902b7,congo\\=t61rcWkgMzE\n"
)

# the stored value -> the headers a consumer reads
ROWS: list[tuple[str | None, dict[str, str]]] = [
    (PLAIN, {"traceparent": PLAIN}),
    (DEBEZIUM, {"traceparent": PARENT, "tracestate": STATE}),
    (None, {}),
    (MALFORMED, {"traceparent": MALFORMED}),
]


def _trace_column(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("ALTER TABLE outbox_events ADD COLUMN tracingspancontext text")


def _write(dsn: str, first: int) -> list[str]:
    """The rows of ROWS, ids from ``first``; their ids."""
    ids = []
    with psycopg.connect(dsn) as conn, conn.transaction():
        for n, (stored, _) in enumerate(ROWS, first):
            event_id = f"7ace0000-0000-4000-8000-{n:012d}"
            conn.execute(
                "INSERT INTO outbox_events (id, aggregate_type, aggregate_id, event_type, "
                "payload, tracingspancontext) VALUES (%s, 'order', %s, 'order.traced', '{}', %s)",
                (event_id, f"o-{n}", stored),
            )
            ids.append(event_id)
    return ids


def _traces(received: list[Any], ids: list[str]) -> list[dict[str, str]]:
    """What a consumer reads of each event's trace headers, in the order of ``ids``."""
    by_id = {}
    for message in received:
        headers = [(name, value.decode()) for name, value in message.headers]
        names = [name for name, _ in headers]
        assert len(names) == len(set(names)), f"a header twice: {names}"
        by_id[message.id] = {n: v for n, v in headers if n in ("traceparent", "tracestate")}
    return [by_id[event_id] for event_id in ids]


@pytest.mark.parametrize("command", ["stream-pgoutput", "stream-wal2json", "poll"])
def test_a_consumer_reads_the_stored_trace_context(
    tmp_path: Path, outbox_db: str, kafka_service: Any, names: Any, command: str
) -> None:
    _trace_column(outbox_db)
    relay_command, _, plugin = command.partition("-")
    if relay_command == "stream":
        setup_slot(outbox_db, names, plugin=plugin)
    else:
        install_poller(outbox_db)
    env = relay_env(
        outbox_db,
        kafka_service.bootstrap,
        names,
        trace_column="tracingspancontext",
        poll_interval="0.5",
    )
    relay = RelayProcess(tmp_path, env, name=command, command=relay_command).start()
    try:
        ids = _write(outbox_db, 1)
        received = consume(kafka_service.bootstrap, names.topic_prefix, len(ids), settle=1)
        assert relay.stop() == 0, relay.log()
    finally:
        relay.close()
    assert _traces(received, ids) == [headers for _, headers in ROWS]
    [line] = [line for line in relay.log().splitlines() if MALFORMED in line]
    assert "WARNING" in line
    assert ids[3] in line
    assert "sent as stored" in line


def test_the_handover_sends_the_pollers_trace_context(
    tmp_path: Path, outbox_db: str, kafka_service: Any, names: Any
) -> None:
    """The rows a poller left, published by setup-slot --from-poller, carry theirs too."""
    _trace_column(outbox_db)
    install_poller(outbox_db)
    ids = _write(outbox_db, 11)
    result = subprocess.run(
        [sys.executable, "-m", "cdc_relay", "setup-slot", "--from-poller"],
        env={
            **os.environ,
            **relay_env(
                outbox_db, kafka_service.bootstrap, names, trace_column="tracingspancontext"
            ),
        },
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    received = consume(kafka_service.bootstrap, names.topic_prefix, len(ids), settle=1)
    assert _traces(received, ids) == [headers for _, headers in ROWS]


@pytest.mark.parametrize("command", ["stream", "poll"])
def test_a_trace_column_the_table_lacks_stops_the_relay_at_start(
    tmp_path: Path, outbox_db: str, kafka_service: Any, names: Any, command: str
) -> None:
    if command == "stream":
        setup_slot(outbox_db, names)
    else:
        install_poller(outbox_db)
    env = relay_env(outbox_db, kafka_service.bootstrap, names, trace_column="tracecontext")
    result = subprocess.run(
        [sys.executable, "-m", "cdc_relay", command],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if "tracecontext" in line]
    assert len(lines) == 1, result.stderr
    assert "has no column tracecontext (--trace-column)" in lines[0]
