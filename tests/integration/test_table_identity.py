"""The outbox table by identity, while the relay streams: renamed, moved to another schema,
dropped and made again, partitioned with partitions attached and detached, another table in
the publication, the table dropped from the publication, a row filter or a column list put on
it. Each ends with every committed event on Kafka, or with the relay stopped by a one-line
error and the slot not confirmed past an event it did not relay."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest
from relaytools import (
    RelayProcess,
    consume,
    relay_env,
    setup_slot,
    slot_row,
    wait_until,
)

from cdc_relay import schema
from cdc_relay.lsn import parse as parse_lsn

pytestmark = pytest.mark.integration


def _relay(
    tmp_path: Path, dsn: str, kafka: Any, names: Any, name: str = "relay", **extra: str
) -> RelayProcess:
    return RelayProcess(tmp_path, relay_env(dsn, kafka.bootstrap, names, **extra), name=name)


def _sql(dsn: str, *statements: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        for statement in statements:
            conn.execute(statement)  # type: ignore[arg-type]


def _insert(dsn: str, table: str, aggregate_id: str) -> tuple[str, int]:
    """One event in its own transaction; its id and the WAL position after its commit."""
    event_id = str(uuid.uuid4())
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            f"INSERT INTO {table} (id, aggregate_type, aggregate_id, event_type, payload) "  # noqa: S608 - test names
            "VALUES (%s, 'order', %s, 'order.noted', '{\"n\": 1}')",
            (event_id, aggregate_id),
        )
        row = conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()
    assert row is not None
    return event_id, parse_lsn(row[0])


def _wal_lsn(dsn: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()
    assert row is not None
    return parse_lsn(row[0])


def _ids(kafka: Any, names: Any, expected: int) -> list[str]:
    return [r.id for r in consume(kafka.bootstrap, names.topic_prefix, expected, settle=1)]


def _streaming(tmp_path: Path, dsn: str, kafka: Any, names: Any) -> tuple[RelayProcess, str]:
    """A relay streaming the outbox, shown by a first event on Kafka; the relay and its id."""
    relay = _relay(tmp_path, dsn, kafka, names).start()
    try:
        first, _ = _insert(dsn, "outbox_events", "a")
        assert _ids(kafka, names, 1) == [first]
    except BaseException:
        relay.close()
        raise
    return relay, first


def _stopped_with(relay: RelayProcess, text: str) -> str:
    assert relay.wait(60) == 1, relay.log()
    log = relay.log()
    assert "Traceback" not in log, log
    last = log.strip().splitlines()[-1]
    assert last.startswith("cdc-relay: error: "), last
    assert text in last, last
    return last


def _stopped_by(
    tmp_path: Path,
    dsn: str,
    kafka: Any,
    names: Any,
    statement: str,
    writes: tuple[tuple[str, str], ...],
    text: str,
) -> None:
    """A streaming relay, then ``statement``, then an event for each (table, aggregate id) of
    ``writes``: the relay stops with ``text``, its slot not confirmed past the WAL position
    before the statement (an operator can still republish what it did not relay)."""
    relay, _ = _streaming(tmp_path, dsn, kafka, names)
    try:
        before = _wal_lsn(dsn)
        _sql(dsn, statement)
        for table, aggregate_id in writes:
            _insert(dsn, table, aggregate_id)
        _stopped_with(relay, text)
    finally:
        relay.close()
    assert parse_lsn(str(slot_row(dsn, names.slot)["confirmed"])) <= before


def test_a_renamed_table_and_one_moved_to_another_schema_are_followed(
    tmp_path: Path, outbox_db: str, kafka_service: Any, names: Any
) -> None:
    setup_slot(outbox_db, names)
    relay, first = _streaming(tmp_path, outbox_db, kafka_service, names)
    try:
        _sql(outbox_db, "ALTER TABLE outbox_events RENAME TO outbox_events_v2")
        renamed, _ = _insert(outbox_db, "outbox_events_v2", "a")
        _sql(outbox_db, "CREATE SCHEMA moved", "ALTER TABLE outbox_events_v2 SET SCHEMA moved")
        moved, _ = _insert(outbox_db, "moved.outbox_events_v2", "a")
        assert _ids(kafka_service, names, 3) == [first, renamed, moved]
        wait_until(lambda: "moved.outbox_events_v2" in relay.log(), 10, "the rename logged")
        assert relay.alive()
        assert relay.stop() == 0, relay.log()
    finally:
        relay.close()
    assert "following it" in relay.log()


def test_a_wal2json_slot_stops_at_a_rename_before_confirming_past_it(
    tmp_path: Path, outbox_db: str, kafka_service: Any, names: Any
) -> None:
    setup_slot(outbox_db, names, plugin="wal2json")
    _stopped_by(
        tmp_path,
        outbox_db,
        kafka_service,
        names,
        "ALTER TABLE outbox_events RENAME TO outbox_events_v2",
        (("outbox_events_v2", "a"),),
        "renamed to public.outbox_events_v2",
    )


def test_the_table_dropped_from_the_publication_stops_the_relay_before_the_slot_passes_it(
    tmp_path: Path, outbox_db: str, kafka_service: Any, names: Any
) -> None:
    setup_slot(outbox_db, names)
    _stopped_by(
        tmp_path,
        outbox_db,
        kafka_service,
        names,
        f"ALTER PUBLICATION {names.publication} DROP TABLE outbox_events",
        (("outbox_events", "a"),),
        f"ALTER PUBLICATION {names.publication} ADD TABLE",
    )
    # `status` says so, as an alert (exit 3).
    args = ["--dsn", outbox_db, "--slot", names.slot, "--publication", names.publication]
    shown = subprocess.run(
        [sys.executable, "-m", "cdc_relay", "status", *args],
        capture_output=True,
        text=True,
        check=False,
    )
    assert shown.returncode == 3, shown
    assert "(does not cover the table)" in shown.stdout
    assert f"ALTER PUBLICATION {names.publication} ADD TABLE" in shown.stderr
    # Started again, the relay refuses at once with the same remedy.
    again = _relay(tmp_path, outbox_db, kafka_service, names).start()
    try:
        _stopped_with(again, "does not publish public.outbox_events")
    finally:
        again.close()


def _filter(names: Any) -> str:
    """A row filter on the outbox's publication: the walsender never sends a row it keeps out,
    so a relay that went on would confirm the slot past events nobody relays."""
    return (
        f"ALTER PUBLICATION {names.publication} SET TABLE outbox_events WHERE (aggregate_id <> 'b')"
    )


@pytest.mark.pg18
def test_a_row_filter_put_on_the_publication_stops_the_relay_before_the_slot_passes_a_row(
    tmp_path: Path, outbox_db: str, kafka_service: Any, names: Any
) -> None:
    setup_slot(outbox_db, names)
    _stopped_by(
        tmp_path,
        outbox_db,
        kafka_service,
        names,
        _filter(names),
        (("outbox_events", "b"), ("outbox_events", "a")),  # b: kept out by the filter
        "publishes only the rows of public.outbox_events where",
    )


@pytest.mark.pg18
def test_a_publication_with_a_row_filter_is_refused_by_stream_setup_slot_status_and_prune(
    tmp_path: Path, outbox_db: str, kafka_service: Any, names: Any
) -> None:
    setup_slot(outbox_db, names)
    _sql(outbox_db, _filter(names))
    before = _wal_lsn(outbox_db)
    _insert(outbox_db, "outbox_events", "b")  # kept out by the filter
    _insert(outbox_db, "outbox_events", "a")
    relay = _relay(tmp_path, outbox_db, kafka_service, names).start()
    try:
        line = _stopped_with(relay, "publishes only the rows of public.outbox_events where")
    finally:
        relay.close()
    assert f"ALTER PUBLICATION {names.publication} SET TABLE public.outbox_events" in line
    assert parse_lsn(str(slot_row(outbox_db, names.slot)["confirmed"])) <= before
    # setup-slot and status say so; prune, which trusts the slot for the rows it confirmed,
    # deletes nothing (the row the filter kept out was never relayed).
    time.sleep(1.1)
    args = ["--dsn", outbox_db, "--slot", names.slot, "--publication", names.publication]
    for command, code in (("setup-slot", 1), ("status", 3), ("prune", 1)):
        more = ["--older-than", "1s"] if command == "prune" else []
        shown = subprocess.run(
            [sys.executable, "-m", "cdc_relay", command, *args, *more],
            capture_output=True,
            text=True,
            check=False,
        )
        assert shown.returncode == code, shown
        assert "publishes only the rows of public.outbox_events where" in shown.stderr, shown
    with psycopg.connect(outbox_db) as conn:
        assert conn.execute("SELECT count(*) FROM outbox_events").fetchone() == (2,)


@pytest.mark.pg18  # the column lists of pg_get_publication_tables differ on 15 and 16+
def test_a_column_list_on_the_publication_is_refused_at_start_and_stops_a_streaming_relay(
    tmp_path: Path, outbox_db: str, kafka_service: Any, names: Any
) -> None:
    # The walsender never sends a column the list leaves out: events would lose a header or
    # their created_at (the CloudEvents time) on the way, as nothing else on the wire shows.
    setup_slot(outbox_db, names)
    listed = (
        f"ALTER PUBLICATION {names.publication} SET TABLE outbox_events "
        "(id, aggregate_type, aggregate_id, event_type, payload)"
    )
    _sql(outbox_db, listed)
    relay = _relay(tmp_path, outbox_db, kafka_service, names).start()
    try:
        line = _stopped_with(relay, "leaves columns seq, attempts, retry_after, last_error")
    finally:
        relay.close()
    assert "created_at, processed_at of public.outbox_events out (a column list)" in line
    _sql(outbox_db, f"ALTER PUBLICATION {names.publication} SET TABLE outbox_events")
    # The list taken off, the relay cannot tell what the publication left out meanwhile (its
    # entry was made again): nothing was written, so that is accepted before it starts.
    accepted = subprocess.run(
        [sys.executable, "-m", "cdc_relay", "setup-slot", "--dsn", outbox_db, "--slot",
         names.slot, "--publication", names.publication, "--accept-gap"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert "accepted (--accept-gap)" in accepted.stdout, accepted
    _stopped_by(
        tmp_path,
        outbox_db,
        kafka_service,
        names,
        listed,
        (("outbox_events", "a"),),
        "(a column list)",
    )


def test_a_dropped_table_stops_the_relay_and_its_events_arrive_after_it_is_made_again(
    tmp_path: Path, outbox_db: str, kafka_service: Any, names: Any
) -> None:
    setup_slot(outbox_db, names)
    relay, first = _streaming(tmp_path, outbox_db, kafka_service, names)
    try:
        # The last event of the old table commits just before the drop.
        with psycopg.connect(outbox_db) as conn:
            last_id = str(uuid.uuid4())
            conn.execute(
                "INSERT INTO outbox_events (id, aggregate_type, aggregate_id, event_type, "
                "payload) VALUES (%s, 'order', 'a', 'order.noted', '{}')",
                (last_id,),
            )
            conn.commit()
            conn.execute("DROP TABLE outbox_events CASCADE")
            conn.commit()
        _stopped_with(relay, "was dropped")
    finally:
        relay.close()
    _sql(
        outbox_db,
        schema.text("outbox"),
        f"ALTER PUBLICATION {names.publication} ADD TABLE outbox_events",
    )
    # A table made again under the name: the relay cannot tell what was written to it before
    # it was published (nothing, here), so that is accepted before it starts again.
    accepted = subprocess.run(
        [sys.executable, "-m", "cdc_relay", "setup-slot", "--dsn", outbox_db, "--slot",
         names.slot, "--publication", names.publication, "--accept-gap"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert "accepted (--accept-gap)" in accepted.stdout, accepted
    again = _relay(tmp_path, outbox_db, kafka_service, names, name="again").start()
    try:
        after, _ = _insert(outbox_db, "outbox_events", "a")
        ids = _ids(kafka_service, names, 3)
        assert again.stop() == 0, again.log()
    finally:
        again.close()
    # The old table's last event (relayed before the stop, or replayed now by its name) and
    # the new table's, in commit order; duplicates only of what was not confirmed.
    assert list(dict.fromkeys(ids)) == [first, last_id, after]


def test_a_row_of_another_published_table_stops_the_relay_unless_told_to_skip_it(
    tmp_path: Path, outbox_db: str, kafka_service: Any, names: Any
) -> None:
    setup_slot(outbox_db, names)
    relay, first = _streaming(tmp_path, outbox_db, kafka_service, names)
    try:
        _sql(
            outbox_db,
            "CREATE TABLE audit (id int)",
            f"ALTER PUBLICATION {names.publication} ADD TABLE audit",
            "INSERT INTO audit VALUES (1)",
        )
        second, _ = _insert(outbox_db, "outbox_events", "a")
        _stopped_with(relay, "a row of table public.audit arrived")
    finally:
        relay.close()
    _sql(outbox_db, f"ALTER PUBLICATION {names.publication} DROP TABLE audit")
    skipping = _relay(
        tmp_path, outbox_db, kafka_service, names, name="skipping", ignore_other_tables="true"
    ).start()
    try:
        third, _ = _insert(outbox_db, "outbox_events", "a")
        assert list(dict.fromkeys(_ids(kafka_service, names, 3))) == [first, second, third]
        assert skipping.stop() == 0, skipping.log()
    finally:
        skipping.close()
    assert "skipped a row of table public.audit" in skipping.log()


PARTITIONED = """
CREATE TABLE outbox_part (
    id uuid NOT NULL, aggregate_type text NOT NULL, aggregate_id text NOT NULL,
    event_type text NOT NULL, payload jsonb NOT NULL, created_at timestamptz NOT NULL DEFAULT now()
) PARTITION BY RANGE (created_at);
CREATE TABLE outbox_part_old PARTITION OF outbox_part
    FOR VALUES FROM ('2000-01-01') TO ('2020-01-01');
CREATE TABLE outbox_part_now PARTITION OF outbox_part
    FOR VALUES FROM ('2020-01-01') TO ('2100-01-01');
"""


def test_a_partitioned_outbox_with_partitions_attached_and_detached_while_streaming(
    tmp_path: Path, outbox_db: str, kafka_service: Any, names: Any
) -> None:
    _sql(outbox_db, PARTITIONED)
    setup_slot(outbox_db, names, table="outbox_part")
    relay = _relay(tmp_path, outbox_db, kafka_service, names, table="outbox_part").start()
    try:
        first, _ = _insert(outbox_db, "outbox_part", "a")
        assert _ids(kafka_service, names, 1) == [first]
        _sql(
            outbox_db,
            "CREATE TABLE outbox_part_future (LIKE outbox_part INCLUDING DEFAULTS)",
            "ALTER TABLE outbox_part ATTACH PARTITION outbox_part_future "
            "FOR VALUES FROM ('2100-01-01') TO ('2200-01-01')",
            "ALTER TABLE outbox_part DETACH PARTITION outbox_part_old",
        )
        attached = str(uuid.uuid4())
        _sql(
            outbox_db,
            "INSERT INTO outbox_part (id, aggregate_type, aggregate_id, event_type, payload, "  # noqa: S608
            f"created_at) VALUES ('{attached}', 'order', 'a', 'order.noted', '{{}}', "
            "'2150-01-01')",
            # The detached partition is a table of its own now, not the outbox.
            "INSERT INTO outbox_part_old (id, aggregate_type, aggregate_id, event_type, "  # noqa: S608
            f"payload, created_at) VALUES ('{uuid.uuid4()}', 'order', 'a', 'x', '{{}}', "
            "'2010-01-01')",
        )
        last, _ = _insert(outbox_db, "outbox_part", "a")
        assert _ids(kafka_service, names, 3) == [first, attached, last]
        assert relay.alive(), relay.log()
        assert relay.stop() == 0, relay.log()
    finally:
        relay.close()


def test_a_partitioned_outbox_needs_a_publication_via_its_root(
    tmp_path: Path, outbox_db: str, kafka_service: Any, names: Any
) -> None:
    _sql(
        outbox_db,
        PARTITIONED,
        f"CREATE PUBLICATION {names.publication} FOR TABLE outbox_part WITH (publish = 'insert')",
    )
    _sql(outbox_db, f"SELECT pg_create_logical_replication_slot('{names.slot}', 'pgoutput')")
    relay = _relay(tmp_path, outbox_db, kafka_service, names, table="outbox_part").start()
    try:
        _stopped_with(relay, "publish_via_partition_root = true")
    finally:
        relay.close()


def test_a_table_name_resolved_through_search_path_to_another_table_is_refused(
    tmp_path: Path, outbox_db: str, kafka_service: Any, names: Any
) -> None:
    setup_slot(outbox_db, names)
    _sql(
        outbox_db, "CREATE SCHEMA tenant", "CREATE TABLE tenant.outbox_events (LIKE outbox_events)"
    )
    dsn = f"{outbox_db} options='-c search_path=tenant,public'"
    relay = _relay(tmp_path, dsn, kafka_service, names, table="outbox_events").start()
    try:
        _stopped_with(relay, "does not publish tenant.outbox_events")
    finally:
        relay.close()
