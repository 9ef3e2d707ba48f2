"""Transaction shapes an application may give its outbox writes, against a real PostgreSQL, a
real Kafka and the real relays: two-phase commit (committed while the relay runs, prepared
before it started and committed after, rolled back), rows deleted in their own transaction or
a later one, a savepoint rolled back or released, the table's replica identity changed while
streaming, and a table that inherits from the outbox.

Each ends in one of two outcomes: every committed event on Kafka once, as stored, in commit
order per aggregate (and nothing of what rolled back), or the relay stopped with one line
naming the cause and the remedy, the slot confirmed nothing past the event it did not relay.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql
from relaytools import (
    RelayProcess,
    Written,
    check,
    consume,
    install_poller,
    pending_inserts,
    relay_env,
    setup_slot,
    slot_row,
    wait_slot,
)
from test_exactly_once import eos_relay

from cdc_relay.lsn import parse as parse_lsn
from cdc_relay.outbox import write_event

pytestmark = [pytest.mark.integration, pytest.mark.slow]


# -- transactions statement by statement, and what committed --------------------------------


class Ledger:
    """What committed, in commit order (the order the checker expects per aggregate), and the
    events whose transaction or savepoint rolled back, which must never reach Kafka."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self.committed: list[Written] = []
        self.rolled_back: list[str] = []
        self._conn = psycopg.connect(dsn, autocommit=True)

    def begin(self, *events: tuple[str, int]) -> Tx:
        """A transaction, begun with ``count`` events of each (aggregate id, count)."""
        tx = Tx(self)
        for aggregate_id, count in events:
            tx.insert(aggregate_id, count)
        return tx

    def sql(self, statement: str, *params: Any) -> None:
        """A statement in its own transaction."""
        self._conn.execute(statement.encode(), params or None)

    def commit_prepared(self, tx: Tx) -> list[Written]:
        """COMMIT PREPARED from another session than the one that prepared it."""
        assert tx.gid is not None
        self.sql(f"COMMIT PREPARED '{tx.gid}'")
        return self._committed(tx)

    def rollback_prepared(self, tx: Tx) -> None:
        assert tx.gid is not None
        self.sql(f"ROLLBACK PREPARED '{tx.gid}'")
        self.rolled_back.extend(tx.kept)

    def wal_lsn(self) -> int:
        row = self._conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()
        assert row is not None
        return parse_lsn(row[0])

    def _committed(self, tx: Tx) -> list[Written]:
        after = self.wal_lsn()
        now = time.monotonic()
        batch = [
            Written(
                id=event_id,
                aggregate_type="order",
                aggregate_id=tx.aggregates[event_id],
                event_type="order.changed",
                payload=tx.payloads[event_id].encode(),
                after_commit_lsn=after,
                committed_at=now,
            )
            for event_id in tx.kept
        ]
        self.committed.extend(batch)
        return batch

    def close(self) -> None:
        self._conn.close()


class Tx:
    """One transaction on its own connection, statement by statement. Each event's payload is
    read back as stored right after its insert, so a row the transaction deletes later is
    still known."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        self.conn = psycopg.connect(ledger.dsn, autocommit=True)
        self.conn.execute("BEGIN")
        self.kept: list[str] = []  # the events that commit with the transaction, in order
        self.aggregates: dict[str, str] = {}
        self.payloads: dict[str, str] = {}
        self.gid: str | None = None

    def insert(self, aggregate_id: str, count: int = 1, table: str = "outbox_events") -> list[str]:
        ids = []
        for n in range(count):
            event_id = write_event(
                self.conn,
                aggregate_type="order",
                aggregate_id=aggregate_id,
                event_type="order.changed",
                payload={"aggregate": aggregate_id, "n": len(self.kept) + n, "s": "é"},
                table=table,
            )
            ids.append(str(event_id))
        rows = self.conn.execute(
            "SELECT id::text, payload::text FROM outbox_events WHERE id = ANY(%s::uuid[])", (ids,)
        ).fetchall()
        self.payloads.update(dict(rows))
        self.aggregates.update(dict.fromkeys(ids, aggregate_id))
        self.kept.extend(ids)
        return ids

    def delete(self, ids: list[str]) -> None:
        """Delete rows by id: rows this transaction inserted still have their events go out
        (stream)."""
        self.conn.execute("DELETE FROM outbox_events WHERE id = ANY(%s::uuid[])", (ids,))

    def sql(self, statement: str) -> None:
        self.conn.execute(statement.encode())

    def rolled_back_to_savepoint(self, ids: list[str]) -> None:
        """``ids`` were inserted after a savepoint this transaction rolled back to."""
        self.kept = [i for i in self.kept if i not in ids]
        self.ledger.rolled_back.extend(ids)

    def rollback(self) -> None:
        self.conn.execute("ROLLBACK")
        self.conn.close()
        self.ledger.rolled_back.extend(self.kept)

    def commit(self) -> list[Written]:
        self.conn.execute("COMMIT")
        self.conn.close()
        return self.ledger._committed(self)

    def prepare(self) -> Tx:
        self.gid = f"t_{uuid.uuid4().hex[:12]}"
        self.conn.execute(f"PREPARE TRANSACTION '{self.gid}'".encode())
        self.conn.close()
        return self


@pytest.fixture
def ledger(outbox_db: str) -> Iterator[Ledger]:
    """The test's ledger; at the end the transactions it left prepared are rolled back (a
    database with prepared transactions cannot be dropped)."""
    with psycopg.connect(outbox_db, autocommit=True) as conn:
        row = conn.execute("SELECT current_setting('max_prepared_transactions')::int").fetchone()
    # The test servers allow it (cdc_relay.devstack sets max_prepared_transactions): a server
    # that does not fails here rather than skipping the two-phase commit cases.
    assert row and row[0] > 0, "the test server has max_prepared_transactions = 0"
    book = Ledger(outbox_db)
    try:
        yield book
    finally:
        book.close()
        with psycopg.connect(outbox_db, autocommit=True) as conn:
            gids = conn.execute(
                "SELECT gid FROM pg_prepared_xacts WHERE database = current_database()"
            ).fetchall()
            for (gid,) in gids:
                conn.execute(sql.SQL("ROLLBACK PREPARED {}").format(sql.Literal(gid)))


def _verdict_clean(ledger: Ledger, received: list[Any], prefix: str) -> None:
    verdict = check(ledger.committed, received, prefix)
    print(prefix, verdict)
    assert verdict.lost == []
    assert verdict.duplicates == 0
    assert verdict.out_of_order == []
    assert verdict.mismatched == []
    assert {r.id for r in received}.isdisjoint(ledger.rolled_back)
    assert verdict.received == len(ledger.committed)


def _savepoints(ledger: Ledger) -> None:
    """Savepoints: what one rolled back to inserted is gone, a released one's rows stay, in
    insert order, nested ones too; a released savepoint's rows go with their transaction."""
    saving = ledger.begin()
    saving.insert("savepoints", 1)
    saving.sql("SAVEPOINT a")
    saving.rolled_back_to_savepoint(saving.insert("savepoints", 2))
    saving.sql("ROLLBACK TO SAVEPOINT a")
    saving.sql("SAVEPOINT b")
    saving.insert("savepoints", 2)
    saving.sql("SAVEPOINT c")
    saving.rolled_back_to_savepoint(saving.insert("savepoints", 1))
    saving.sql("ROLLBACK TO SAVEPOINT c")
    saving.insert("savepoints", 1)
    saving.sql("RELEASE SAVEPOINT b")
    saving.insert("savepoints", 1)
    saving.commit()
    rolled = ledger.begin()
    rolled.insert("savepoints", 1)
    rolled.sql("SAVEPOINT d")
    rolled.insert("savepoints", 1)
    rolled.sql("RELEASE SAVEPOINT d")
    rolled.rollback()  # a released savepoint's rows go with their transaction


# -- stream -----------------------------------------------------------------------------------


def test_stream_relays_every_committed_shape_once_in_commit_order_and_nothing_rolled_back(
    tmp_path: Path, outbox_db: str, kafka_service: Any, names: Any, ledger: Ledger
) -> None:
    """One slot of each kind, and an exactly-once relay, on the same writes."""
    bootstrap = kafka_service.bootstrap
    w2j_slot, eos_slot = names.slot + "_w2j", names.slot + "_eos"
    setup_slot(outbox_db, names)
    setup_slot(outbox_db, names, plugin="wal2json", slot=w2j_slot)
    setup_slot(outbox_db, names, slot=eos_slot)
    prefixes = {
        "pgoutput": names.topic_prefix,
        "wal2json": names.topic_prefix + "w2j",
        "eos": names.topic_prefix + "eos",
    }

    # Before any relay runs: a plain commit; a row deleted in a later transaction; one
    # transaction prepared (committed once the relays run) and one to roll back.
    ledger.begin(("shared", 2)).commit()
    ledger.begin(("deleted-later", 2)).commit()
    ledger.sql("DELETE FROM outbox_events WHERE aggregate_id = 'deleted-later'")
    prepared_early = ledger.begin(("shared", 2), ("prepared-early", 3))
    prepared_early.prepare()
    doomed = ledger.begin(("shared", 2), ("doomed", 2))
    doomed.prepare()

    relays = [
        RelayProcess(tmp_path, relay_env(outbox_db, bootstrap, names), name="pgoutput"),
        RelayProcess(
            tmp_path,
            relay_env(
                outbox_db,
                bootstrap,
                names,
                slot=w2j_slot,
                topic_template=prefixes["wal2json"] + ".{aggregate_type}",
            ),
            name="wal2json",
        ),
        eos_relay(
            tmp_path,
            outbox_db,
            kafka_service,
            names,
            slot=eos_slot,
            topic_template=prefixes["eos"] + ".{aggregate_type}",
        ),
    ]
    try:
        for relay in relays:
            relay.start()
        for slot in (names.slot, w2j_slot, eos_slot):
            wait_slot(outbox_db, slot, active=True, timeout=60)

        # Two-phase commit, prepared before the relays started, committed now; the other
        # rolled back.
        ledger.commit_prepared(prepared_early)
        ledger.rollback_prepared(doomed)
        # Prepared while they run, with a transaction of the same aggregate committed
        # between PREPARE and COMMIT PREPARED: that one comes first, in commit order.
        prepared_late = ledger.begin()
        prepared_late.insert("shared", 2)
        inserted_deleted = prepared_late.insert("prepared-late", 2)
        prepared_late.delete(inserted_deleted)  # insert-then-delete in a prepared transaction
        prepared_late.prepare()
        ledger.begin(("shared", 1)).commit()
        ledger.commit_prepared(prepared_late)

        # Insert-then-delete in one transaction: the table stays empty, the events go out.
        same = ledger.begin()
        same.delete(same.insert("deleted-same", 3))
        same.insert("deleted-same", 1)
        same.commit()

        _savepoints(ledger)

        # The outbox's replica identity changed while streaming, inserts before and after.
        for identity in ("FULL", "NOTHING", "DEFAULT"):
            ledger.sql(f"ALTER TABLE outbox_events REPLICA IDENTITY {identity}")
            ledger.begin(("identity", 2), ("shared", 1)).commit()

        assert ledger.rolled_back
        for relay in relays:
            received = consume(bootstrap, prefixes[relay.name], expected=len(ledger.committed))
            _verdict_clean(ledger, received, prefixes[relay.name])
        for relay in relays:
            assert relay.stop() == 0, relay.log()
            assert "Traceback" not in relay.log()
    finally:
        for relay in relays:
            relay.close()
    # A clean stop confirmed every event: the pgoutput slots hold no outbox insert any more.
    assert pending_inserts(outbox_db, names.slot, names.publication) == 0
    assert pending_inserts(outbox_db, eos_slot, names.publication) == 0


@pytest.mark.parametrize("plugin", ["pgoutput", "wal2json"])
@pytest.mark.parametrize("made", ["before the publication", "while streaming"])
def test_a_table_inheriting_from_the_outbox_stops_the_stream_at_its_first_row(
    tmp_path: Path,
    outbox_db: str,
    kafka_service: Any,
    names: Any,
    ledger: Ledger,
    plugin: str,
    made: str,
) -> None:
    """Its rows are rows of outbox_events to SQL (and to poll), but logical decoding sends
    them under the child's name, or not at all when the publication was made before the
    child: the relay must not pass them silently."""
    child = "outbox_child"
    make_child = (
        f"CREATE TABLE {child} () INHERITS (outbox_events)",
        # An identity column is not inherited: the child takes its seq from the parent's.
        f"ALTER TABLE {child} ALTER seq SET DEFAULT "
        "nextval(pg_get_serial_sequence('outbox_events', 'seq'))",
    )
    if made == "before the publication":
        for statement in make_child:
            ledger.sql(statement)
    setup_slot(outbox_db, names, plugin=plugin)
    relay = RelayProcess(tmp_path, relay_env(outbox_db, kafka_service.bootstrap, names)).start()
    try:
        ledger.begin(("a", 2)).commit()
        if made == "while streaming":
            consume(kafka_service.bootstrap, names.topic_prefix, expected=2, settle=0)
            for statement in make_child:
                ledger.sql(statement)
        in_child = ledger.begin()
        in_child.insert("a", 1, table=child)
        before_commit = ledger.wal_lsn()  # the child's commit record comes after this
        in_child.commit()
        ledger.begin(("a", 1)).commit()
        code = relay.wait(60)
    finally:
        relay.close()
    log = relay.log()
    assert code == 1, log
    assert "Traceback" not in log, log
    last = log.strip().splitlines()[-1]
    print(last)
    assert last.startswith("cdc-relay: error: "), last
    assert f"public.{child}" in last, last
    # Nothing from the child's row on was confirmed: it and the row after it wait in the slot.
    assert parse_lsn(slot_row(outbox_db, names.slot)["confirmed"]) <= before_commit
    received = consume(kafka_service.bootstrap, names.topic_prefix, expected=4, timeout=3)
    assert check(ledger.committed, received, names.topic_prefix).duplicates == 0
    assert {r.id for r in received} <= {w.id for w in ledger.committed}


# -- poll -------------------------------------------------------------------------------------


@pytest.mark.pg18
def test_poll_publishes_committed_shapes_and_is_not_held_up_by_a_prepared_transaction(
    tmp_path: Path, outbox_db: str, kafka_service: Any, names: Any, ledger: Ledger
) -> None:
    """poll publishes what a prepared transaction wrote once it commits, never if it rolls
    back, and goes on with every other aggregate while one holds a row's lock; rows deleted
    before it claims them are never published (poll reads the table)."""
    install_poller(outbox_db)
    # The poller's trigger sends NOTIFY, and PostgreSQL refuses to prepare a transaction that
    # did: with two-phase commit the trigger must go (the pollers then find new rows at the
    # next --poll-interval).
    refused = ledger.begin()
    refused.insert("refused", 1)
    with pytest.raises(psycopg.errors.FeatureNotSupported, match="NOTIFY"):
        refused.prepare()
    refused.rollback()
    ledger.sql("DROP TRIGGER outbox_events_notify ON outbox_events")

    first = ledger.begin()
    held = first.insert("held", 3)
    first.insert("shared", 2)
    first.commit()
    # Deleted in a later transaction before the poller runs: poll reads the table, so this
    # event is never published (stream's relays it).
    ledger.begin(("deleted-later", 1)).commit()
    ledger.sql("DELETE FROM outbox_events WHERE aggregate_id = 'deleted-later'")
    ledger.committed = [w for w in ledger.committed if w.aggregate_id != "deleted-later"]
    prepared_early = ledger.begin(("shared", 2), ("prepared-early", 2))
    prepared_early.prepare()
    doomed = ledger.begin(("doomed", 2))
    doomed.prepare()
    # A prepared transaction that deletes a committed row holds its lock until it is resolved,
    # which may be never (it survives restarts): the poller must not wait for it with the
    # other aggregates held, nor publish the rows of its aggregate behind it. The held rows are
    # the oldest, and more than a batch.
    holding = ledger.begin()
    holding.delete(held[:1])
    holding.prepare()

    env = relay_env(outbox_db, kafka_service.bootstrap, names, poll_interval="1", batch_size="2")
    poller = RelayProcess(tmp_path, env, name="poll", command="poll").start()
    try:
        ledger.begin(("flowing", 2)).commit()
        # Everything committed but the held rows arrives while three transactions stay prepared.
        expected = [w for w in ledger.committed if w.aggregate_id != "held"]
        received = consume(kafka_service.bootstrap, names.topic_prefix, len(expected), 30, 1)
        assert sorted(r.id for r in received) == sorted(w.id for w in expected), poller.log()

        ledger.commit_prepared(prepared_early)
        ledger.rollback_prepared(doomed)
        ledger.rollback_prepared(holding)  # the held row is the outbox's again
        same = ledger.begin()
        same.delete(same.insert("deleted-same", 1))  # never visible to poll: never published
        same.commit()
        ledger.committed.pop()
        _savepoints(ledger)
        received = consume(kafka_service.bootstrap, names.topic_prefix, len(ledger.committed))
        assert poller.stop() == 0, poller.log()
    finally:
        poller.close()
    _verdict_clean(ledger, received, names.topic_prefix)
