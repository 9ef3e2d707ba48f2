"""``cdc-relay prune``: old rows go once their events are on Kafka, and never before.

With ``--slot`` (an outbox ``stream`` relays) a row goes once the slot has confirmed its
transaction, by the rule of cdc_relay/postgres/horizon.py; without it (the poller's outbox) once it
is processed. Against the real PostgreSQL and Kafka: the relay is killed while prune runs
every second, and every row deleted must have been on Kafka by then; rows the slot has not
confirmed, rows of transactions open while prune runs, and rows across a wraparound of the
transaction ids are each held to the rule.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg
import pytest
from faulttools import create_topics
from psycopg import sql
from psycopg.rows import tuple_row
from relaytools import (
    Load,
    RelayProcess,
    Writer,
    Written,
    check,
    consume,
    relay_env,
    setup_slot,
    slot_row,
    wait_until,
)

from cdc_relay import schema
from cdc_relay.devstack.postgres import LocalPostgres, _server_account
from cdc_relay.lsn import Lsn, format_lsn
from cdc_relay.lsn import parse as parse_lsn
from cdc_relay.ops.prune import delete_confirmed
from cdc_relay.postgres import horizon
from cdc_relay.postgres.connection import connect
from cdc_relay.postgres.slot import SlotSpec, setup
from cdc_relay.postgres.tables import find_table

pytestmark = pytest.mark.integration

FAR = datetime(2100, 1, 1, tzinfo=UTC)  # a cut-off every row is older than

# Every row a DELETE takes, and when, in the deleting transaction (so before it commits).
RECORD_DELETES = """
CREATE TABLE pruned_rows (id uuid PRIMARY KEY, deleted_at timestamptz NOT NULL);
CREATE FUNCTION record_pruned() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO pruned_rows SELECT id, clock_timestamp() FROM gone;
    RETURN NULL;
END $$;
CREATE TRIGGER record_pruned AFTER DELETE ON outbox_events
    REFERENCING OLD TABLE AS gone FOR EACH STATEMENT EXECUTE FUNCTION record_pruned();
"""


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cdc_relay", *args], capture_output=True, text=True, timeout=120
    )


def prune(dsn: str, names: Any, *more: str) -> subprocess.CompletedProcess[str]:
    """``prune --slot`` of the test's slot and publication, every row old enough."""
    return cli(
        "prune",
        "--dsn",
        dsn,
        "--slot",
        names.slot,
        "--publication",
        names.publication,
        "--older-than",
        "0s",
        *more,
    )


def ids_in_table(dsn: str) -> set[str]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return {r[0] for r in conn.execute("SELECT id::text FROM outbox_events").fetchall()}


def confirmed_lsn(dsn: str, slot: str) -> Lsn:
    return parse_lsn(str(slot_row(dsn, slot)["confirmed"]))


def wait_confirmed(dsn: str, slot: str, written: list[Written], timeout: float = 60) -> None:
    """Until the slot has confirmed the commits of ``written``."""
    last = max(w.after_commit_lsn for w in written)
    wait_until(lambda: confirmed_lsn(dsn, slot) >= last, timeout, f"slot {slot} past {last}")


def advance_slot(dsn: str, slot: str, lsn: Lsn) -> None:
    """Move the slot to ``lsn`` as a relay's confirmation would: PostgreSQL moves it no
    further than the flushed WAL, so this writes an empty transaction after ``lsn`` and waits
    for its flush, as horizon.wait_for does for a relay."""
    with psycopg.connect(dsn, autocommit=True) as conn:

        def there() -> bool:
            conn.execute("SELECT pg_current_xact_id()")  # WAL after lsn, flushed soon
            conn.execute(
                "SELECT pg_replication_slot_advance(%s, %s::pg_lsn)", (slot, format_lsn(lsn))
            )
            return confirmed_lsn(dsn, slot) >= lsn

        wait_until(there, 10, f"slot {slot} advanced to {format_lsn(lsn)}", 0.05)


@pytest.fixture
def kafka_topics(kafka_service: Any, names: Any) -> str:
    """The test's topics, stamped by the broker when it appends a message (LogAppendTime)."""
    create_topics(kafka_service.bootstrap, names.topic_prefix)
    return kafka_service.bootstrap


# -- the relay killed while prune runs every second --------------------------------------------


def test_prune_every_second_while_the_relay_is_killed_deletes_only_rows_already_on_kafka(
    tmp_path: Path, outbox_db: str, kafka_topics: str, names: Any
) -> None:
    setup_slot(outbox_db, names)
    with psycopg.connect(outbox_db, autocommit=True) as conn:
        conn.execute(RECORD_DELETES)
    relay = RelayProcess(tmp_path, relay_env(outbox_db, kafka_topics, names)).start()
    load = Load(outbox_db, writers=2, pause=0.01).start()
    runs: list[subprocess.CompletedProcess[str]] = []
    stop = threading.Event()

    def prune_every_second() -> None:
        while not stop.is_set():
            began = time.monotonic()
            runs.append(prune(outbox_db, names, "--wait", "10", "--batch-size", "100"))
            stop.wait(max(0.0, 1.0 - (time.monotonic() - began)))

    pruner = threading.Thread(target=prune_every_second, daemon=True)
    pruner.start()
    try:
        for _ in range(5):
            # Killed at a random moment while it delivers, dead for a while (prunes that
            # began meanwhile wait for it), started again.
            progress = confirmed_lsn(outbox_db, names.slot)
            wait_until(
                lambda progress=progress: confirmed_lsn(outbox_db, names.slot) > progress,
                60,
                "the relay to deliver",
            )
            time.sleep(random.uniform(0.5, 2.0))
            relay.kill()
            wait_until(lambda: not slot_row(outbox_db, names.slot)["active"], 30, "a free slot")
            time.sleep(random.uniform(0.0, 3.0))
            relay.start()
        written = load.stop()
        wait_confirmed(outbox_db, names.slot, written)
        stop.set()
        pruner.join(120)
        last = prune(outbox_db, names)  # everything is confirmed and nothing is open
    finally:
        stop.set()
        load.stop()
        relay.close()
    assert last.returncode == 0, last.stderr
    assert ids_in_table(outbox_db) == set(), "a row that every rule lets go stayed"

    received = consume(kafka_topics, names.topic_prefix, len(written), settle=1.0)
    verdict = check(written, received, names.topic_prefix)
    print(verdict, f"prunes={len(runs)}", relay.log()[-2000:])
    assert verdict.lost == []
    assert verdict.mismatched == []
    assert verdict.out_of_order == []

    # Each row went after its event was on Kafka: deleted_at is read in the deleting
    # transaction, the broker stamps the first copy of the event when it appends it (the
    # same clock, in milliseconds).
    appended: dict[str, float] = {}
    for r in received:
        if r.timestamp is not None:
            appended[r.id] = min(r.timestamp, appended.get(r.id, r.timestamp))
    with psycopg.connect(outbox_db, autocommit=True) as conn:
        deleted = conn.execute(
            "SELECT id::text, extract(epoch FROM deleted_at)::float8 FROM pruned_rows"
        ).fetchall()
    assert {i for i, _ in deleted} == {w.id for w in written}
    early = [(i, at - appended[i]) for i, at in deleted if i not in appended or appended[i] > at]
    assert early == [], f"{len(early)} rows deleted before their event was on Kafka: {early[:5]}"

    # The prunes ran throughout and deleted rows; those that gave up did so because the dead
    # relay had not confirmed the position they started at, and deleted nothing.
    done = [r for r in runs if r.returncode == 0]
    assert len(done) >= 3, [r.stderr for r in runs]
    assert sum(int(r.stdout.split()[1]) for r in done) > 0
    for r in runs:
        assert r.returncode == 0 or "nothing was deleted" in r.stderr, r.stderr


# -- rows the slot has not confirmed, and open transactions -----------------------------------


def test_prune_leaves_unconfirmed_rows_and_those_of_open_transactions(
    tmp_path: Path, outbox_db: str, kafka_topics: str, names: Any
) -> None:
    setup_slot(outbox_db, names)
    relay = RelayProcess(tmp_path, relay_env(outbox_db, kafka_topics, names)).start()
    writer = Writer(outbox_db)
    open_conn = psycopg.connect(outbox_db)
    try:
        relayed = [w for i in range(3) for w in writer.transaction([("order", f"a{i}", {})] * 2)]
        wait_confirmed(outbox_db, names.slot, relayed)
        assert relay.stop() == 0
        # Committed while no relay runs: not on Kafka, not confirmed.
        waiting = [w for i in range(3) for w in writer.transaction([("order", f"b{i}", {})] * 2)]
        # A transaction left open, one of its rows in a subtransaction.
        kept = _open_transaction(open_conn)
        before = ids_in_table(outbox_db)
        assert before == {w.id for w in relayed + waiting}

        refused = prune(outbox_db, names, "--wait", "2")
        assert refused.returncode == 1, refused.stdout
        lines = refused.stderr.strip().splitlines()
        assert len(lines) == 1, refused.stderr
        assert lines[0].startswith(f"cdc-relay: error: slot {names.slot} has not confirmed ")
        assert "and no relay streams it); nothing was deleted: start cdc-relay stream" in lines[0]
        assert ids_in_table(outbox_db) == before

        shown = _status(outbox_db, names, "--wait", "1")
        assert shown["slot_relays_table"] is True
        assert shown["confirmed_rows"] is None
        assert "has not confirmed" in shown["confirmed_rows_unknown"]

        # The relay back: the rows committed before the open transaction began go, its own
        # stay (its id, and its subtransaction's, are past the horizon's xmin).
        relay.start()
        wait_confirmed(outbox_db, names.slot, waiting)
        shown = _status(outbox_db, names)
        assert (shown["confirmed_rows"], shown["unconfirmed_rows"]) == (12, 0)
        pruned = prune(outbox_db, names)
        assert pruned.returncode == 0, pruned.stderr
        assert pruned.stdout.startswith("pruned 12 confirmed rows (created before "), pruned.stdout
        assert ids_in_table(outbox_db) == set()

        # A horizon taken while the transaction is open and confirmed by the slot; the
        # transaction commits after it and the relay stops before relaying it. Its rows are
        # committed, older than any cut-off, but not on Kafka: they stay.
        with connect(outbox_db) as conn:
            edge = horizon.take(conn)
            confirmed, _ = horizon.wait_for(conn, names.slot, edge.wal, 60)
            assert confirmed >= edge.wal
            assert relay.stop() == 0
            before_commit = lsn_now(open_conn)
            open_conn.commit()
            after_commit = lsn_now(conn)
            table = find_table(conn, "outbox_events")
            assert table is not None
            assert delete_confirmed(conn, table, edge, FAR, 100) == 0
            assert horizon.counts(conn, table, edge) == (0, 2)
        assert ids_in_table(outbox_db) == set(kept)
        assert confirmed_lsn(outbox_db, names.slot) <= before_commit  # not relayed

        relay.start()
        received = consume(kafka_topics, names.topic_prefix, len(relayed + waiting) + 2)
        assert {r.id for r in received} == {w.id for w in relayed + waiting} | set(kept)
        wait_until(
            lambda: confirmed_lsn(outbox_db, names.slot) >= after_commit,
            60,
            "the open transaction's commit confirmed",
        )
        assert prune(outbox_db, names).stdout.startswith("pruned 2 confirmed rows")
    finally:
        open_conn.close()
        writer.close()
        relay.close()


def _open_transaction(conn: psycopg.Connection[Any]) -> list[str]:
    """Two rows in a transaction left open, the second in a released savepoint; then another
    transaction commits, so that a snapshot taken now has an xmax past the savepoint's id (the
    case ``pg_visible_in_snapshot`` takes for an ended transaction). Returns the rows' ids."""
    ids = [str(uuid.uuid4()), str(uuid.uuid4())]
    insert = (
        "INSERT INTO outbox_events (id, aggregate_type, aggregate_id, event_type, payload) "
        "VALUES (%s, 'order', 'open', 'order.changed', '{}')"
    )
    conn.execute(insert, (ids[0],))
    conn.execute("SAVEPOINT s")
    conn.execute(insert, (ids[1],))
    conn.execute("RELEASE SAVEPOINT s")
    with psycopg.connect(conn.info.dsn, autocommit=True) as other:
        other.execute("SELECT pg_current_xact_id()")
    return ids


def lsn_now(conn: psycopg.Connection[Any]) -> Lsn:
    """The WAL insert position, read on ``conn`` (in its transaction, if one is open)."""
    with conn.cursor(row_factory=tuple_row) as cur:
        row = cur.execute("SELECT pg_current_wal_insert_lsn()::text").fetchone()
    assert row is not None
    return parse_lsn(row[0])


def _status(dsn: str, names: Any, *more: str) -> dict[str, Any]:
    shown = cli(
        "status",
        "--dsn",
        dsn,
        "--slot",
        names.slot,
        "--publication",
        names.publication,
        "--json",
        *more,
    )
    assert shown.returncode in (0, 3), shown.stderr
    state: dict[str, Any] = json.loads(shown.stdout)
    return state


# -- what prune refuses -------------------------------------------------------------------------


def test_prune_refuses_a_slot_that_does_not_relay_the_table_in_one_line(
    outbox_db: str, postgres_service: Any, names: Any
) -> None:
    setup_slot(outbox_db, names)
    writer = Writer(outbox_db)
    writer.transaction([("order", "e", {})] * 3)
    writer.close()
    other_db = f"{names.slot}_elsewhere"
    with psycopg.connect(outbox_db, autocommit=True) as conn:
        conn.execute("SELECT pg_create_physical_replication_slot(%s)", (f"{names.slot}_phys",))
        conn.execute(
            "SELECT pg_create_logical_replication_slot(%s, 'test_decoding')",
            (f"{names.slot}_td",),
        )
        conn.execute("CREATE TABLE events_without_age (id uuid PRIMARY KEY, payload jsonb)")
        conn.execute(
            sql.SQL("ALTER PUBLICATION {} ADD TABLE events_without_age").format(
                sql.Identifier(names.publication)
            )
        )
        database = conn.execute("SELECT current_database()").fetchone()
    with psycopg.connect(postgres_service.dsn, autocommit=True) as admin:
        admin.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (other_db,))
    try:
        assert database is not None
        db = database[0]
        remedy = "pass --slot the slot that cdc-relay stream reads"
        cases = {
            ("--slot", "nope"): f"replication slot nope does not exist; {remedy}",
            ("--slot", f"{names.slot}_phys"): (
                f"slot {names.slot}_phys is a physical slot, which relays no events; {remedy}"
            ),
            ("--slot", f"{names.slot}_td"): (
                f"slot {names.slot}_td decodes with test_decoding, which cdc-relay stream "
                f"does not read; {remedy} (pgoutput or wal2json)"
            ),
            ("--slot", other_db): (
                f"slot {other_db} belongs to database postgres, not {db}: it relays that "
                f"database's events; {remedy} in {db}, or connect to postgres"
            ),
            ("--slot", names.slot, "--publication", "nope"): (
                "publication nope does not exist; run cdc-relay setup-slot (--publication "
                "names the one cdc-relay stream reads)"
            ),
            ("--slot", names.slot, "--publication", names.publication, "--table", "outbox_x"): (
                "table outbox_x does not exist; create it with cdc-relay schema apply outbox, "
                "or name yours with --table"
            ),
            (
                "--slot",
                names.slot,
                "--publication",
                names.publication,
                "--table",
                "events_without_age",
            ): (
                "table public.events_without_age has no column created_at, which prune --slot "
                "reads a row's age from; add it as cdc-relay schema show outbox has it "
                "(created_at timestamptz NOT NULL DEFAULT now())"
            ),
        }
        with psycopg.connect(outbox_db, autocommit=True) as conn:
            conn.execute(
                sql.SQL("ALTER PUBLICATION {} DROP TABLE outbox_events").format(
                    sql.Identifier(names.publication)
                )
            )
        cases[("--slot", names.slot, "--publication", names.publication)] = (
            f"publication {names.publication} does not publish public.outbox_events, so its "
            f"events would not be relayed; run ALTER PUBLICATION {names.publication} ADD TABLE "
            "public.outbox_events (--publication names the one cdc-relay stream reads)"
        )
        before = ids_in_table(outbox_db)
        for args, message in cases.items():
            refused = cli("prune", "--dsn", outbox_db, "--older-than", "0s", "--wait", "0", *args)
            assert (refused.returncode, refused.stdout) == (1, ""), args
            assert refused.stderr == f"cdc-relay: error: {message}\n", args
        assert ids_in_table(outbox_db) == before
        usage = cli("prune", "--dsn", outbox_db, "--older-than", "1d", "--slot", "x", "--wait", "x")
        assert usage.returncode == 2
        assert "'x' is not a number of seconds from 0 to 3600" in usage.stderr

        shown = cli("status", "--dsn", outbox_db, "--slot", f"{names.slot}_phys", "--json")
        assert shown.returncode == 3
        assert json.loads(shown.stdout)["alerts"] == [cases[("--slot", f"{names.slot}_phys")]]
    finally:
        with psycopg.connect(postgres_service.dsn, autocommit=True) as admin:
            admin.execute("SELECT pg_drop_replication_slot(%s)", (other_db,))


def test_prune_refuses_a_wal2json_slot_with_a_publication_that_is_not_there(
    outbox_db: str, names: Any
) -> None:
    """A wal2json slot's relay selects its tables by name; the publication setup-slot made
    lists them, and is all that shows which tables the slot relays. A --publication naming
    none must not pass for one that lists the table: the slot may relay another table."""
    setup_slot(outbox_db, names, plugin="wal2json")
    writer = Writer(outbox_db)
    writer.transaction([("order", "e", {})] * 3)
    writer.close()
    done = threading.Event()

    def relay() -> None:
        """The slot confirmed as far as the WAL goes, as a relay of another table would."""
        with psycopg.connect(outbox_db, autocommit=True) as conn:
            while not done.wait(0.2):
                advance_slot(outbox_db, names.slot, lsn_now(conn))

    advancing = threading.Thread(target=relay)
    advancing.start()
    try:
        refused = cli(
            "prune",
            "--dsn",
            outbox_db,
            "--slot",
            names.slot,
            "--publication",
            "nope",
            "--older-than",
            "0s",
            "--wait",
            "5",
        )
    finally:
        done.set()
        advancing.join()
    assert (refused.returncode, refused.stdout) == (1, ""), refused.stdout
    assert refused.stderr == (
        f"cdc-relay: error: publication nope does not exist, and with a wal2json slot it is "
        f"what shows which tables the relay of slot {names.slot} selects (cdc-relay setup-slot "
        "lists them there): nothing shows that the slot relays public.outbox_events; name "
        "the slot's publication with --publication\n"
    )
    assert len(ids_in_table(outbox_db)) == 3


# -- partitions and the wraparound of transaction ids ------------------------------------------

PARTITIONED = """
CREATE TABLE outbox_parts (LIKE outbox_events INCLUDING DEFAULTS INCLUDING IDENTITY)
    PARTITION BY RANGE (created_at);
CREATE TABLE outbox_parts_old PARTITION OF outbox_parts
    FOR VALUES FROM ('2000-01-01') TO ('2020-01-01');
CREATE TABLE outbox_parts_new PARTITION OF outbox_parts
    FOR VALUES FROM ('2020-01-01') TO ('2100-01-01');
"""

INSERT_PART = (
    "INSERT INTO outbox_parts (id, aggregate_type, aggregate_id, event_type, payload, "
    "created_at, processed_at) VALUES (%s, 'order', 'p', 'order.changed', '{}', %s, %s) "
    "RETURNING ctid::text"
)


def test_prune_of_a_partitioned_outbox_keeps_the_rows_of_other_partitions_at_the_same_ctid(
    outbox_db: str, names: Any
) -> None:
    """A ctid names a row of one partition; a DELETE by ctid on the partitioned table reaches
    the row at that ctid in every partition. Each mode keeps the rows it must keep there."""
    with psycopg.connect(outbox_db, autocommit=True) as conn:
        conn.execute(PARTITIONED)
        old, new = str(uuid.uuid4()), str(uuid.uuid4())
        # Poller: the old row processed long ago, the new one not processed.
        at_old = conn.execute(INSERT_PART, (old, "2010-01-01", "2010-01-02")).fetchone()
        at_new = conn.execute(INSERT_PART, (new, "2030-01-01", None)).fetchone()
        assert at_old == at_new == ("(0,1)",)
    pruned = cli("prune", "--dsn", outbox_db, "--table", "outbox_parts", "--older-than", "7d")
    assert pruned.returncode == 0, pruned.stderr
    assert pruned.stdout.startswith("pruned 1 processed row "), pruned.stdout
    with psycopg.connect(outbox_db, autocommit=True) as conn:
        assert conn.execute("SELECT id::text FROM outbox_parts").fetchall() == [(new,)]
        conn.execute("DELETE FROM outbox_parts")
        conn.execute("VACUUM outbox_parts_old, outbox_parts_new")  # their ctids free again

    # Slot: the old row confirmed, the new one committed after the horizon, at the same ctid.
    setup(outbox_db, SlotSpec(names.slot, names.publication, "outbox_parts"))
    with psycopg.connect(outbox_db, autocommit=True) as conn:
        assert conn.execute(INSERT_PART, (old, "2010-01-01", None)).fetchone() == ("(0,1)",)
    with connect(outbox_db) as conn:
        edge = horizon.take(conn)
        with psycopg.connect(outbox_db, autocommit=True) as writes:
            assert writes.execute(INSERT_PART, (new, "2030-01-01", None)).fetchone() == ("(0,1)",)
        advance_slot(outbox_db, names.slot, edge.wal)
        table = find_table(conn, "outbox_parts")
        assert table is not None
        assert delete_confirmed(conn, table, edge, FAR, 10) == 1
        rows = conn.execute("SELECT id::text AS id FROM outbox_parts").fetchall()
    assert rows == [{"id": new}]


@pytest.fixture
def wrapped_postgres(tmp_path: Path) -> Iterator[LocalPostgres]:
    """A cluster of its own whose transaction ids are in epoch 7 and about to wrap around to
    epoch 8: every row is frozen first (pg_resetwal moves the counter; an id written before
    would read as a future one), and the commit log gets the segment of the new ids."""
    server = LocalPostgres(tmp_path / "wrapped")
    account = _server_account()
    try:
        server.start()
        for database in ("postgres", "template1"):
            with psycopg.connect(server.dsn_for(database), autocommit=True) as conn:
                conn.execute("VACUUM FREEZE")
        server.stop()
        xid = 2**32 - 200
        resetwal = [str(server.bindir / "pg_resetwal"), "-e", "7", "-x", str(xid)]
        subprocess.run(
            server._as_server([*resetwal, "-D", str(server.data_dir)], account),
            check=True,
            capture_output=True,
        )
        segment = server.data_dir / "pg_xact" / f"{xid >> 20:04X}"
        segment.write_bytes(bytes(32 * 8192))
        if account is not None:
            os.chown(segment, account.pw_uid, account.pw_gid)
        server.start()
        with psycopg.connect(server.dsn, autocommit=True) as conn:
            conn.execute(schema.text("outbox").encode())
        yield server
    finally:
        server.cleanup(keep_logs=True)


def test_prune_across_the_wraparound_of_transaction_ids(
    wrapped_postgres: LocalPostgres, names: Any
) -> None:
    """Rows written before and after the 32-bit ids wrap go, once confirmed; rows of a
    transaction open at the horizon and of those after it stay, though ``xmin::text::xid8``
    would put all of them in epoch 0, before the horizon's xmin in epoch 8."""
    dsn = wrapped_postgres.dsn
    setup(dsn, SlotSpec(names.slot, names.publication, "outbox_events"))
    writer = Writer(dsn)
    before_wrap = writer.transaction([("order", "w", {})] * 2)
    with psycopg.connect(dsn, autocommit=True) as conn:
        for _ in range(300):
            conn.execute("SELECT pg_current_xact_id()")
    after_wrap = writer.transaction([("order", "w", {})] * 2)
    with psycopg.connect(dsn) as open_conn, connect(dsn) as conn:
        running = _open_transaction(open_conn)
        later = writer.transaction([("order", "w", {})] * 2)
        rows = conn.execute("SELECT id::text AS id, xmin::text::bigint AS x FROM outbox_events")
        xmins = {r["id"]: r["x"] for r in rows}
        assert xmins[before_wrap[0].id] > 2**32 - 200 > 300 > xmins[after_wrap[0].id]

        edge = horizon.take(conn)
        assert edge.xmin >> 32 == 8, edge  # X is in epoch 8, the open transaction's id
        advance_slot(dsn, names.slot, edge.wal)
        table = find_table(conn, "outbox_events")
        assert table is not None
        assert horizon.counts(conn, table, edge) == (4, 2)
        assert delete_confirmed(conn, table, edge, FAR, 3) == 4
        open_conn.commit()
        assert ids_in_table(dsn) == set(running) | {w.id for w in later}
    writer.close()
