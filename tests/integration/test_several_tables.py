"""Several outbox tables on one slot: one outbox per tenant schema, one publication, one
walsender. Each table's events reach their own topics ({schema} in the template), in commit
order per aggregate per table, through a SIGKILL; a table the publication stops covering
stops the relay before the slot passes its rows; what cannot be relayed is refused at once."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest
from relaytools import (
    Load,
    Received,
    RelayProcess,
    check,
    consume,
    relay_env,
    slot_row,
    writers_only,
)

from cdc_relay import schema
from cdc_relay.lsn import parse as parse_lsn
from cdc_relay.postgres.shards import Shard

pytestmark = pytest.mark.integration

TENANTS = ("tenant_a", "tenant_b")
TABLES = tuple(f"{tenant}.outbox_events" for tenant in TENANTS)


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cdc_relay", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )


def _sql(dsn: str, *statements: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        for statement in statements:
            conn.execute(statement)  # type: ignore[arg-type]


def _tenants(dsn: str, *tenants: str) -> None:
    """An outbox (cdc-relay schema outbox) in a schema of each tenant."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        for tenant in tenants:
            conn.execute(f"CREATE SCHEMA {tenant}")  # type: ignore[arg-type]
            schema.apply(conn, "outbox", tenant)


def _in(dsn: str, tenant: str) -> str:
    """A DSN whose unqualified ``outbox_events`` is the tenant's (the writers use it)."""
    return f"{dsn} options='-c search_path={tenant}'"


def _setup(dsn: str, names: Any, *more: str, tables: tuple[str, ...] = TABLES) -> str:
    args = ["--dsn", dsn, "--slot", names.slot, "--publication", names.publication]
    for table in tables:
        args += ["--table", table]
    done = cli("setup-slot", *args, *more)
    assert done.returncode == 0, done.stderr
    return done.stdout


def _relay(
    tmp_path: Path, dsn: str, kafka: Any, names: Any, name: str = "relay", **extra: str
) -> RelayProcess:
    extra.setdefault("topic_template", names.topic_prefix + ".{schema}.{aggregate_type}")
    extra.setdefault("table", " ".join(TABLES))  # several, as the variable takes them
    return RelayProcess(tmp_path, relay_env(dsn, kafka.bootstrap, names, **extra), name=name)


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


def _topics(kafka: Any, names: Any, expected: int) -> dict[str, str]:
    """Event id -> topic of what Kafka holds, once ``expected`` events are there."""
    received = consume(kafka.bootstrap, names.topic_prefix, expected, settle=1)
    return {r.id: r.topic for r in received}


def _stopped_with(relay: RelayProcess, text: str) -> str:
    assert relay.wait(60) == 1, relay.log()
    log = relay.log()
    assert "Traceback" not in log, log
    last = log.strip().splitlines()[-1]
    assert last.startswith("cdc-relay: error: "), last
    assert text in last, last
    return last


def _of(tenant: str, received: list[Received], names: Any) -> list[Received]:
    return [r for r in received if r.topic.startswith(f"{names.topic_prefix}.{tenant}.")]


@pytest.mark.parametrize("plugin", ["pgoutput", "wal2json"])
def test_two_tenants_under_concurrent_writers_and_a_sigkill_lose_nothing_in_order(
    tmp_path: Path, empty_db: str, kafka_service: Any, names: Any, plugin: str
) -> None:
    _tenants(empty_db, *TENANTS)
    # Each table has its own column layout: tenant_b's event_type is its last column (the
    # relay maps columns by name, per table).
    _sql(
        empty_db,
        "ALTER TABLE tenant_b.outbox_events DROP COLUMN event_type",
        "ALTER TABLE tenant_b.outbox_events ADD COLUMN event_type text NOT NULL DEFAULT ''",
        "ALTER TABLE tenant_b.outbox_events ADD COLUMN note text",
    )
    created = _setup(empty_db, names, "--plugin", plugin)
    assert f"created publication {names.publication} on {', '.join(TABLES)}" in created
    again = _setup(empty_db, names, "--plugin", plugin)
    assert f"exists: publication {names.publication} on {', '.join(TABLES)}" in again

    relay = _relay(tmp_path, empty_db, kafka_service, names).start()
    try:
        # The same aggregate ids in both tables: their orders are two, one per table.
        loads = {
            tenant: Load(_in(empty_db, tenant), writers=2, pause=0.002, aggregates=5).start()
            for tenant in TENANTS
        }
        time.sleep(3)
        relay.kill()  # mid-stream, with events in flight
        killed = time.monotonic()
        time.sleep(1)
        restarted = time.monotonic()
        relay.start()
        time.sleep(3)
        written = {tenant: load.stop() for tenant, load in loads.items()}
        total = sum(len(w) for w in written.values())
        received = consume(kafka_service.bootstrap, names.topic_prefix, expected=total)
        assert relay.stop() == 0, relay.log()
    finally:
        relay.close()
    assert "Traceback" not in relay.log(), relay.log()
    assert {r.topic for r in received} == {
        f"{names.topic_prefix}.{tenant}.{kind}"
        for tenant in TENANTS
        for kind in ("order", "customer")
    }
    for tenant in TENANTS:
        # Both tables took events while no relay ran: the restart had to pick them up.
        assert any(killed < w.committed_at < restarted for w in written[tenant])
        # Its topics hold every event of its table, as stored, each aggregate in commit order;
        # an event of the other table there would be mismatched, and lost from its own.
        verdict = check(
            written[tenant], _of(tenant, received, names), f"{names.topic_prefix}.{tenant}"
        )
        print(f"{plugin} {tenant}:", verdict)
        assert len(written[tenant]) > 100
        assert verdict.lost == []
        assert verdict.mismatched == []
        assert verdict.out_of_order == []


def test_a_table_dropped_from_the_publication_stops_the_relay_before_the_slot_passes_it(
    tmp_path: Path, empty_db: str, kafka_service: Any, names: Any
) -> None:
    _tenants(empty_db, *TENANTS)
    _setup(empty_db, names)
    relay = _relay(tmp_path, empty_db, kafka_service, names).start()
    try:
        first, _ = _insert(empty_db, TABLES[0], "a")
        second, _ = _insert(empty_db, TABLES[1], "a")
        assert _topics(kafka_service, names, 2) == {
            first: f"{names.topic_prefix}.tenant_a.order",
            second: f"{names.topic_prefix}.tenant_b.order",
        }
        before = _wal_lsn(empty_db)
        _sql(empty_db, f"ALTER PUBLICATION {names.publication} DROP TABLE {TABLES[1]}")
        _insert(empty_db, TABLES[1], "a")  # not decoded: the publication no longer has it
        _insert(empty_db, TABLES[0], "a")  # the other table goes on meanwhile
        _stopped_with(
            relay,
            f"publication {names.publication} does not publish {TABLES[1]}, so its events "
            f"would not be relayed; run ALTER PUBLICATION {names.publication} ADD TABLE "
            f"{TABLES[1]}",
        )
    finally:
        relay.close()
    # Not past the insert the publication did not carry: an operator can republish it.
    assert parse_lsn(str(slot_row(empty_db, names.slot)["confirmed"])) <= before
    # Started again, the relay refuses at once; status says so of that table.
    again = _relay(tmp_path, empty_db, kafka_service, names, name="again").start()
    try:
        _stopped_with(again, f"does not publish {TABLES[1]}")
    finally:
        again.close()
    base = ["--dsn", empty_db, "--slot", names.slot, "--publication", names.publication]
    shown = cli("status", *base, "--table", TABLES[1])
    assert shown.returncode == 3, shown
    assert f"ADD TABLE {TABLES[1]}" in shown.stderr


def test_a_table_dropped_from_the_publication_and_added_back_at_once_stops_the_relay(
    tmp_path: Path, empty_db: str, kafka_service: Any, names: Any
) -> None:
    """Faster than the watcher looks (every second): the table is published at every look,
    but the row written in between was never decoded; its entry in the publication is new."""
    _tenants(empty_db, *TENANTS)
    _setup(empty_db, names)
    relay = _relay(tmp_path, empty_db, kafka_service, names).start()
    try:
        first, _ = _insert(empty_db, TABLES[1], "a")
        assert list(_topics(kafka_service, names, 1)) == [first]
        before = _wal_lsn(empty_db)
        with psycopg.connect(empty_db, autocommit=True) as conn:
            conn.execute(f"ALTER PUBLICATION {names.publication} DROP TABLE {TABLES[1]}")  # type: ignore[arg-type]
            conn.execute(
                f"INSERT INTO {TABLES[1]} (aggregate_type, aggregate_id, event_type, payload) "  # type: ignore[arg-type]  # noqa: S608 - test names
                "VALUES ('order', 'a', 'order.noted', '{}')"
            )
            conn.execute(f"ALTER PUBLICATION {names.publication} ADD TABLE {TABLES[1]}")  # type: ignore[arg-type]
        _insert(empty_db, TABLES[0], "a")
        last = _stopped_with(relay, f"{TABLES[1]}")
        assert "were not decoded" in last, last
    finally:
        relay.close()
    assert parse_lsn(str(slot_row(empty_db, names.slot)["confirmed"])) <= before


@pytest.mark.parametrize("plugin", ["pgoutput", "wal2json"])
def test_a_table_added_to_the_publication_while_streaming_is_relayed_once_named(
    tmp_path: Path, empty_db: str, kafka_service: Any, names: Any, plugin: str
) -> None:
    """A new tenant's outbox added to the publication: pgoutput stops at its first row,
    wal2json (which selects rows by --table) when the watcher sees it published; neither
    confirms past its rows, so a restart with --table naming it relays them."""
    _tenants(empty_db, *TENANTS, "tenant_c")
    _setup(empty_db, names, "--plugin", plugin)
    relay = _relay(tmp_path, empty_db, kafka_service, names).start()
    try:
        first, _ = _insert(empty_db, TABLES[0], "a")
        assert list(_topics(kafka_service, names, 1)) == [first]
        _sql(empty_db, f"ALTER PUBLICATION {names.publication} ADD TABLE tenant_c.outbox_events")
        new, _ = _insert(empty_db, "tenant_c.outbox_events", "a")
        after, _ = _insert(empty_db, TABLES[1], "a")
        _stopped_with(
            relay,
            "--table tenant_c.outbox_events added"
            if plugin == "pgoutput"
            else f"publication {names.publication} publishes tenant_c.outbox_events beside",
        )
    finally:
        relay.close()
    again = _relay(
        tmp_path,
        empty_db,
        kafka_service,
        names,
        name="again",
        table=" ".join((*TABLES, "tenant_c.outbox_events")),
    ).start()
    try:
        topics = _topics(kafka_service, names, 3)
        assert topics[new] == f"{names.topic_prefix}.tenant_c.order"
        assert topics[after] == f"{names.topic_prefix}.tenant_b.order"
        assert again.stop() == 0, again.log()
    finally:
        again.close()


def test_a_wal2json_slot_stops_when_one_of_its_tables_is_renamed(
    tmp_path: Path, empty_db: str, kafka_service: Any, names: Any
) -> None:
    _tenants(empty_db, *TENANTS)
    _setup(empty_db, names, "--plugin", "wal2json")
    relay = _relay(tmp_path, empty_db, kafka_service, names).start()
    try:
        first, _ = _insert(empty_db, TABLES[1], "a")
        assert list(_topics(kafka_service, names, 1)) == [first]
        before = _wal_lsn(empty_db)
        _sql(empty_db, "ALTER TABLE tenant_b.outbox_events RENAME TO outbox_v2")
        _insert(empty_db, "tenant_b.outbox_v2", "a")
        _stopped_with(relay, "tenant_b.outbox_events was renamed to tenant_b.outbox_v2")
    finally:
        relay.close()
    assert parse_lsn(str(slot_row(empty_db, names.slot)["confirmed"])) <= before


def test_tables_that_swap_names_are_told_apart_by_identity(
    tmp_path: Path, empty_db: str, kafka_service: Any, names: Any
) -> None:
    """pgoutput: renames are followed, and {schema} stays the one the relay started with, so a
    table's events stay on its topics whatever it is called now."""
    _tenants(empty_db, *TENANTS)
    _setup(empty_db, names)
    relay = _relay(tmp_path, empty_db, kafka_service, names).start()
    try:
        a, _ = _insert(empty_db, TABLES[0], "x")
        assert list(_topics(kafka_service, names, 1)) == [a]
        _sql(
            empty_db,
            "CREATE SCHEMA swap",
            "ALTER TABLE tenant_a.outbox_events SET SCHEMA swap",
            "ALTER TABLE tenant_b.outbox_events SET SCHEMA tenant_a",
            "ALTER TABLE swap.outbox_events SET SCHEMA tenant_b",
        )
        was_b, _ = _insert(empty_db, "tenant_a.outbox_events", "x")  # tenant_b's table
        was_a, _ = _insert(empty_db, "tenant_b.outbox_events", "x")  # tenant_a's table
        topics = _topics(kafka_service, names, 3)
        assert topics[was_b] == f"{names.topic_prefix}.tenant_b.order"
        assert topics[was_a] == f"{names.topic_prefix}.tenant_a.order"
        time.sleep(1.5)  # a watcher round or more: it follows both renames
        assert relay.alive(), relay.log()
        assert relay.stop() == 0, relay.log()
    finally:
        relay.close()


def test_what_cannot_be_relayed_is_refused_with_one_line(
    tmp_path: Path, empty_db: str, kafka_service: Any, names: Any
) -> None:
    _tenants(empty_db, *TENANTS, "tenant_c")
    base = ["--dsn", empty_db, "--slot", names.slot, "--publication", names.publication]
    # The same table twice (once through search_path) is a typo, not two outboxes.
    twice = cli(
        "setup-slot",
        "--dsn",
        _in(empty_db, "tenant_a"),
        "--slot",
        names.slot,
        "--publication",
        names.publication,
        "--table",
        "tenant_a.outbox_events",
        "--table",
        "outbox_events",
    )
    assert twice.returncode == 1, twice
    assert "as another --table does; name each outbox table once" in twice.stderr
    _setup(empty_db, names)
    # A table left out of the publication at start: stream refuses, naming it.
    missing = _relay(
        tmp_path,
        empty_db,
        kafka_service,
        names,
        name="missing",
        table=" ".join((*TABLES, "tenant_c.outbox_events")),
    ).start()
    try:
        _stopped_with(missing, "does not publish tenant_c.outbox_events")
    finally:
        missing.close()
    # setup-slot on the existing publication says how to add it, and changes nothing.
    added = cli("setup-slot", *base, *(f"--table={t}" for t in (*TABLES, "tenant_c.outbox_events")))
    assert added.returncode == 1
    assert "ADD TABLE tenant_c.outbox_events" in added.stderr
    # The same table under two spellings, at stream's start.
    same = _relay(
        tmp_path,
        empty_db,
        kafka_service,
        names,
        name="same",
        table="tenant_a.outbox_events tenant_b.outbox_events TENANT_A.OUTBOX_EVENTS",
    ).start()
    try:
        _stopped_with(same, "are the same table, tenant_a.outbox_events")
    finally:
        same.close()
    # The CloudEvents default source names one table.
    ce = cli(
        "stream",
        *base,
        "--table",
        TABLES[0],
        "--table",
        TABLES[1],
        "--cloudevents",
        "--kafka-bootstrap",
        kafka_service.bootstrap,
    )
    assert ce.returncode == 2 and "give --cloudevents-source" in ce.stderr, ce.stderr
    # reshard moves one table's publication: with two, the other's rows would be in no stream.
    reshard = cli("reshard", *base, "--table", TABLES[0], "--from", "1", "--to", "2")
    assert reshard.returncode == 1, reshard
    assert f"publishes {TABLES[1]} beside {TABLES[0]}" in reshard.stderr
    # poll relays one table: a template naming the table is refused at start-up.
    poll = cli(
        "poll",
        "--dsn",
        empty_db,
        "--table",
        TABLES[0],
        "--kafka-bootstrap",
        kafka_service.bootstrap,
        "--topic-template",
        "x.{schema}.{aggregate_type}",
    )
    assert poll.returncode == 2, poll  # a usage error
    assert "only cdc-relay stream tells apart" in poll.stderr.strip().splitlines()[-1]

    # A table whose layout lacks a column the mapping names: stops at its first row, after the
    # other table's events, naming the table.
    _sql(empty_db, "ALTER TABLE tenant_b.outbox_events RENAME COLUMN event_type TO kind")
    relay = _relay(tmp_path, empty_db, kafka_service, names).start()
    try:
        first, _ = _insert(empty_db, TABLES[0], "a")
        assert list(_topics(kafka_service, names, 1)) == [first]
        before = _wal_lsn(empty_db)
        with psycopg.connect(empty_db, autocommit=True) as conn:
            conn.execute(
                "INSERT INTO tenant_b.outbox_events (aggregate_type, aggregate_id, kind, payload)"
                " VALUES ('order', 'a', 'order.noted', '{}')"
            )
        _stopped_with(relay, "table tenant_b.outbox_events has no column event_type")
    finally:
        relay.close()
    assert parse_lsn(str(slot_row(empty_db, names.slot)["confirmed"])) <= before


def test_a_logical_decoding_message_cannot_be_routed_by_table(
    tmp_path: Path, empty_db: str, kafka_service: Any, names: Any
) -> None:
    _tenants(empty_db, *TENANTS)
    _setup(empty_db, names)
    writers_only(empty_db)  # stream --messages, once only writers may emit messages
    relay = _relay(tmp_path, empty_db, kafka_service, names, messages="true").start()
    try:
        first, _ = _insert(empty_db, TABLES[0], "a")
        assert list(_topics(kafka_service, names, 1)) == [first]
        _sql(empty_db, "SELECT tenant_a.outbox_emit('order', 'a', 'order.noted', '{}'::jsonb)")
        _stopped_with(relay, "belongs to no table")
    finally:
        relay.close()


def test_status_and_prune_work_on_each_table_of_the_slot(
    tmp_path: Path, empty_db: str, kafka_service: Any, names: Any
) -> None:
    _tenants(empty_db, *TENANTS)
    _setup(empty_db, names)
    relay = _relay(tmp_path, empty_db, kafka_service, names).start()
    try:
        ids = [_insert(empty_db, TABLES[n % 2], f"a{n}")[0] for n in range(5)]
        assert set(_topics(kafka_service, names, 5)) == set(ids)
        # A row of the second table parked as a poller's dead letter: status counts each
        # table's own (the view outbox_dead_letters shows public.outbox_events' only).
        _sql(
            empty_db,
            f"UPDATE {TABLES[1]} SET attempts = 10, retry_after = 'infinity' "  # noqa: S608 - test names
            f"WHERE id = '{ids[1]}'",
        )
        base = ["--dsn", empty_db, "--slot", names.slot, "--publication", names.publication]
        for table, count, dead in ((TABLES[0], 3, 0), (TABLES[1], 2, 1)):
            shown = cli("status", *base, "--table", table, "--json")
            assert shown.returncode == 0, shown
            state = json.loads(shown.stdout)
            assert (state["confirmed_rows"], state["unconfirmed_rows"]) == (count, 0), state
            assert (state["unprocessed_rows"], state["dead_letters"]) == (count, dead), state
        # trace finds an event of the second table on its tenant's topic.
        traced = cli(
            "trace",
            ids[1],
            "--json",
            *base,
            "--table",
            TABLES[1],
            "--kafka-bootstrap",
            kafka_service.bootstrap,
            "--topic-template",
            names.topic_prefix + ".{schema}.{aggregate_type}",
        )
        assert traced.returncode == 0, traced
        found = json.loads(traced.stdout)
        assert found["on_kafka"] is True, found
        assert found["kafka"]["topic"] == f"{names.topic_prefix}.tenant_b.order", found
        pruned = cli(
            "prune",
            "--dsn",
            empty_db,
            "--table",
            TABLES[0],
            "--slot",
            names.slot,
            "--publication",
            names.publication,
            "--older-than",
            "0s",
        )
        assert pruned.returncode == 0, pruned.stderr
        assert "pruned 3 confirmed rows" in pruned.stdout
        assert relay.stop() == 0
    finally:
        relay.close()
    with psycopg.connect(empty_db, autocommit=True) as conn:
        counts = [
            conn.execute(f"SELECT count(*) FROM {table}").fetchone()  # noqa: S608 - test names
            for table in TABLES
        ]
    assert counts == [(0,), (2,)]


def test_two_shards_of_two_tables_relay_each_event_once(
    tmp_path: Path, empty_db: str, kafka_service: Any, names: Any
) -> None:
    _tenants(empty_db, *TENANTS)
    created = _setup(empty_db, names, "--shards", "2")
    assert f"created publication {names.publication}_1of2 on {', '.join(TABLES)}" in created
    prefixes = [f"{names.topic_prefix}_s{k}" for k in range(2)]
    relays = [
        _relay(
            tmp_path,
            empty_db,
            kafka_service,
            names,
            name=f"shard{k}",
            shard=f"{k}/2",
            topic_template=prefixes[k] + ".{schema}.{aggregate_type}",
        ).start()
        for k in range(2)
    ]
    try:
        loads = {
            tenant: Load(_in(empty_db, tenant), writers=1, pause=0.002, aggregates=20).start()
            for tenant in TENANTS
        }
        time.sleep(3)
        written = {tenant: load.stop() for tenant, load in loads.items()}
        # Each shard's topics hold exactly the events of its aggregates of both tables, once
        # each, in order per aggregate per table.
        for k, prefix in enumerate(prefixes):
            mine = {
                tenant: [w for w in events if Shard(k, 2).owns(w.aggregate_id)]
                for tenant, events in written.items()
            }
            received = consume(
                kafka_service.bootstrap, prefix, expected=sum(len(m) for m in mine.values())
            )
            for tenant in TENANTS:
                assert 0 < len(mine[tenant]) < len(written[tenant])
                theirs = [r for r in received if r.topic.startswith(f"{prefix}.{tenant}.")]
                verdict = check(mine[tenant], theirs, f"{prefix}.{tenant}")
                print(f"shard {k}/2 {tenant}:", verdict)
                assert verdict.lost == []
                assert verdict.duplicates == 0
                assert verdict.mismatched == []  # an event of the other shard would be here
                assert verdict.out_of_order == []
        assert [relay.stop() for relay in relays] == [0, 0]
    finally:
        for relay in relays:
            relay.close()


def test_setup_slot_creates_each_missing_table_and_dry_run_creates_none(
    empty_db: str, names: Any
) -> None:
    _sql(empty_db, *(f"CREATE SCHEMA {tenant}" for tenant in TENANTS))
    base = ["--dsn", empty_db, "--slot", names.slot, "--publication", names.publication]
    tables = [arg for table in TABLES for arg in ("--table", table)]
    dry = cli("setup-slot", *base, *tables, "--create-table", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert dry.stdout.count("-- cdc-relay schema apply outbox, in schema") == 2, dry.stdout
    assert f"FOR TABLE {', '.join(TABLES)}" in dry.stdout, dry.stdout
    with psycopg.connect(empty_db, autocommit=True) as conn:
        assert conn.execute("SELECT to_regclass(%s), to_regclass(%s)", TABLES).fetchone() == (
            None,
            None,
        )
    done = cli("setup-slot", *base, *tables, "--create-table")
    assert done.returncode == 0, done.stderr
    for table in TABLES:
        assert f"created table {table}" in done.stdout
    assert f"created publication {names.publication} on {', '.join(TABLES)}" in done.stdout


def test_prune_refuses_a_table_a_wal2json_slot_does_not_select(empty_db: str, names: Any) -> None:
    """wal2json selects rows by name: a table outside the slot's list is not relayed, so its
    rows are never "confirmed", whatever the slot's position."""
    _tenants(empty_db, *TENANTS, "tenant_c")
    _setup(empty_db, names, "--plugin", "wal2json")
    _insert(empty_db, "tenant_c.outbox_events", "a")
    base = ["--dsn", empty_db, "--slot", names.slot, "--publication", names.publication]
    pruned = cli("prune", *base, "--table", "tenant_c.outbox_events", "--older-than", "0s")
    assert pruned.returncode == 1, pruned
    assert "does not list tenant_c.outbox_events" in pruned.stderr
    shown = cli("status", *base, "--table", "tenant_c.outbox_events", "--json")
    assert json.loads(shown.stdout)["slot_relays_table"] is False, shown.stdout
    with psycopg.connect(empty_db, autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM tenant_c.outbox_events").fetchone()
    assert row == (1,)
