"""Database failover with failover slots (PostgreSQL 17+, run here on 18): a primary and a
physical standby that keeps a synchronised copy of the relay's slot; the primary dies, the
standby is promoted, and the relay, given both hosts, goes on from the copy by itself."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from failover_pair import DATABASE, OUTBOX_SQL, SYNCHRONOUS, Pair, start_pair
from relaytools import (
    Load,
    RelayProcess,
    check,
    consume,
    install_poller,
    relay_env,
    setup_slot,
    wait_slot,
    wait_until,
)

from cdc_relay.devstack.postgres import LocalPostgres
from cdc_relay.kafka.checkpoints import read_checkpoint
from cdc_relay.kafka.exactly_once import transactional_id
from cdc_relay.kafka.sink import producer_config
from cdc_relay.lsn import parse as parse_lsn

pytestmark = pytest.mark.integration


@pytest.fixture
def pair(tmp_path: Path, pg18_bin: Path) -> Iterator[Pair]:
    """A PostgreSQL 18 primary with a synchronous standby, set up for failover slots."""
    pair = start_pair(tmp_path, pg18_bin, SYNCHRONOUS)
    try:
        yield pair
    finally:
        pair.standby.cleanup(keep_logs=True)
        pair.primary.cleanup(keep_logs=True)


def _setup_slot(dsn: str, names: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "cdc_relay",
            "setup-slot",
            "--failover",
            "--dsn",
            dsn,
            "--slot",
            names.slot,
            "--publication",
            names.publication,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )


def _copy(standby: LocalPostgres, slot: str) -> tuple[bool, str | None]:
    """Whether the standby holds a synchronised copy of ``slot``, and its confirmed position."""
    with psycopg.connect(standby.dsn_for(DATABASE), autocommit=True) as conn:
        row = conn.execute(
            "SELECT synced AND NOT temporary, confirmed_flush_lsn::text"
            " FROM pg_replication_slots WHERE slot_name = %s",
            [slot],
        ).fetchone()
    return (bool(row[0]), row[1]) if row else (False, None)


def _synchronised(pair: Pair, slot: str) -> bool:
    """Whether the standby's copy of ``slot`` is synchronised (it would survive a promotion).

    The standby keeps its copy temporary until the primary's slot has moved its restart
    position past what the copy reserved, which needs a running-transactions record in the
    WAL: the primary writes one every 15 s; this asks for one now, to wait less.
    """
    with psycopg.connect(pair.primary.dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_log_standby_snapshot()")
    return _copy(pair.standby, slot)[0]


@pytest.mark.parametrize("exactly_once", [False, True], ids=["at-least-once", "exactly-once"])
def test_stream_follows_the_promoted_standby_from_its_synchronised_slot(
    tmp_path: Path, pair: Pair, kafka_service: Any, names: Any, exactly_once: bool
) -> None:
    """Exactly once as well: the relay reconnects to the promoted server in the middle of its
    Kafka transactions; a read_committed consumer sees every event once, and the checkpoints
    written from then on name the new timeline (a later restart trusts them whole)."""
    created = _setup_slot(pair.dsn, names)
    print(created.stdout)
    assert created.returncode == 0, created.stdout + created.stderr
    assert f"ok: slot {names.slot} has failover = true" in created.stdout
    assert "missing" not in created.stdout

    checkpoints = f"{names.topic_prefix}_checkpoints"
    eos = {"exactly_once": "1", "checkpoint_topic": checkpoints} if exactly_once else {}
    env = relay_env(pair.dsn, kafka_service.bootstrap, names, **eos)
    relay = RelayProcess(tmp_path, env).start()
    streaming = time.monotonic()
    load = Load(pair.dsn, writers=3, pause=0.002, reconnect=True).start()
    try:
        wait_until(lambda: _synchronised(pair, names.slot), 60, "a synchronised copy")
        again = _setup_slot(pair.dsn, names)  # idempotent; now it sees the copy
        assert again.returncode == 0, again.stdout + again.stderr
        assert f"ok: holds a synchronised copy of slot {names.slot}" in again.stdout
        time.sleep(3)  # the relay streams under load

        # The copy's position just before the kill: the copy can only move on from there, so
        # what the relay may send again is bounded by what committed after it.
        _, copy_confirmed = _copy(pair.standby, names.slot)
        assert copy_confirmed is not None
        print(f"copy synchronised {time.monotonic() - streaming:.1f} s after the relay started")
        killed_wall, killed = time.time(), time.monotonic()
        pair.primary.stop("immediate")
        pair.standby.promote()
        promoted = time.monotonic()
        print(f"promoted {promoted - killed:.2f} s after the kill; copy at {copy_confirmed}")
        time.sleep(5)  # the writers go on against the new primary
        written = load.stop()
    except BaseException:
        load._stop.set()  # the writers' threads end; the test's error is the one to show
        relay.close()
        raise
    try:
        received = consume(kafka_service.bootstrap, names.topic_prefix, expected=len(written))
        assert relay.alive(), relay.log()
        assert relay.stop() == 0, relay.log()
    finally:
        relay.close()

    verdict = check(written, received, names.topic_prefix)
    # Which primary committed each event: a writer that lost its connection at a COMMIT looks
    # the transaction up afterwards, so its own clock cannot tell.
    with psycopg.connect(pair.standby.dsn_for(DATABASE)) as conn:
        committed = dict(
            conn.execute(
                "SELECT id::text, extract(epoch FROM pg_xact_commit_timestamp(xmin))::float8"
                " FROM outbox_events"
            ).fetchall()
        )
    on_old = [w for w in written if committed[w.id] < killed_wall]
    on_new = {w.id for w in written if committed[w.id] >= killed_wall}
    unconfirmed = sum(w.after_commit_lsn > parse_lsn(copy_confirmed) for w in on_old)
    first_new = min((r.timestamp or 0.0 for r in received if r.id in on_new), default=None)
    recovery = None if first_new is None else first_new - killed_wall
    print(
        f"{verdict} on_old_primary={len(on_old)} on_new_primary={len(on_new)} "
        f"unconfirmed_at_kill={unconfirmed} promotion={promoted - killed:.2f} s "
        f"recovery={recovery and round(recovery, 2)} s (kill to the first event the new "
        "primary committed on Kafka)"
    )
    assert "reconnected" in relay.log()
    assert len(on_old) > 100 and len(on_new) > 100
    assert verdict.lost == []
    assert verdict.out_of_order == []
    assert verdict.mismatched == []
    assert verdict.duplicates <= unconfirmed
    assert recovery is not None and recovery < 60
    if exactly_once:
        assert verdict.duplicates == 0
        assert "the server is on timeline 2 now (was 1)" in relay.log()
        config = producer_config(kafka_service.bootstrap, {})
        held = read_checkpoint(config, checkpoints, transactional_id(names.slot), 30)
        assert held.timeline == 2, held


def _processed(pair: Pair) -> int:
    with psycopg.connect(pair.primary.dsn_for(DATABASE)) as conn:
        row = conn.execute("SELECT count(*) FROM outbox_events WHERE processed_at IS NOT NULL")
        return int(row.fetchone()[0])  # type: ignore[index]


def test_poll_follows_the_promoted_standby_and_sends_again_only_rows_marked_after(
    tmp_path: Path, pair: Pair, kafka_service: Any, names: Any
) -> None:
    install_poller(pair.primary.dsn_for(DATABASE))
    env = relay_env(pair.dsn, kafka_service.bootstrap, names, poll_interval="1", workers="2")
    relay = RelayProcess(tmp_path, env, name="poll", command="poll").start()
    load = Load(pair.dsn, writers=3, pause=0.002, reconnect=True).start()
    try:
        wait_until(lambda: _processed(pair) > 3000, 60, "the poller at work on the primary")
        killed_wall, killed = time.time(), time.monotonic()
        pair.primary.stop("immediate")
        pair.standby.promote()
        promoted = time.monotonic()
        time.sleep(5)
        written = load.stop()
    except BaseException:
        load._stop.set()
        relay.close()
        raise
    try:
        received = consume(kafka_service.bootstrap, names.topic_prefix, expected=len(written))
        assert relay.alive(), relay.log()
        assert relay.stop() == 0, relay.log()
    finally:
        relay.close()

    verdict = check(written, received, names.topic_prefix)
    with psycopg.connect(pair.standby.dsn_for(DATABASE)) as conn:
        # created_at: the start of the writing transaction (the mark rewrote the row, so its
        # xmin is the mark's); one begun after the kill committed on the new primary
        rows = conn.execute(
            "SELECT id::text, extract(epoch FROM created_at)::float8,"
            " extract(epoch FROM processed_at)::float8 FROM outbox_events"
        ).fetchall()
    on_new = {event_id for event_id, created, _ in rows if created >= killed_wall}
    marked_after = {event_id for event_id, _, processed in rows if processed >= killed_wall}
    counts: dict[str, int] = {}
    for r in received:
        counts[r.id] = counts.get(r.id, 0) + 1
    sent_again = {event_id for event_id, n in counts.items() if n > 1}
    first_new = min((r.timestamp or 0.0 for r in received if r.id in on_new), default=None)
    recovery = None if first_new is None else first_new - killed_wall
    print(
        f"{verdict} on_old_primary={len(rows) - len(on_new)} on_new_primary={len(on_new)} "
        f"sent_again={len(sent_again)} marked_after_kill={len(marked_after)} "
        f"promotion={promoted - killed:.2f} s recovery={recovery and round(recovery, 2)} s"
    )
    assert len(on_new) > 100
    assert verdict.lost == []
    assert verdict.out_of_order == []
    assert verdict.mismatched == []
    # A row is sent again only if the mark of its first sending died with the old primary.
    assert sent_again <= marked_after
    assert recovery is not None and recovery < 60


def test_a_slot_without_failover_is_gone_after_a_promotion_and_stream_and_status_say_so(
    tmp_path: Path, pair: Pair, kafka_service: Any, names: Any
) -> None:
    setup_slot(pair.primary.dsn_for(DATABASE), names)  # no failover: it stays on the primary
    env = relay_env(pair.dsn, kafka_service.bootstrap, names)
    relay = RelayProcess(tmp_path, env).start()
    try:
        wait_slot(pair.primary.dsn_for(DATABASE), names.slot, active=True)
        pair.primary.stop("immediate")
        pair.standby.promote()
        assert relay.wait(120) == 1, relay.log()  # when it reconnects
        assert "reconnect" in relay.log()
        relay.start()
        assert relay.wait(120) == 1, relay.log()  # when it starts
    finally:
        relay.close()
    gone = (
        f"replication slot '{names.slot}' does not exist on this server, which is on timeline "
        "2: it was promoted from a standby (or restored from a backup) and the slot, no "
        "failover slot, stayed behind; make it anew with cdc-relay setup-slot "
        "--republish-since TIME, which first publishes again the events created since TIME: the "
        "time of the old relay's last progress line less its lag and your longest transaction "
        "(earlier costs only duplicates) "
        '(docs/failover.md, "Hot standby and database failover")'
    )
    log = (tmp_path / "relay-1.log").read_text()
    assert log.strip().splitlines()[-1] == f"cdc-relay: error: {gone}", log
    # At start, stream reads what the slot was (the row of cdc_relay_slots came over with the
    # data), as status and setup-slot do: the timelines and the remedies.
    lineage = (
        f"slot {names.slot} existed and is gone: made by setup-slot at ",
        "the server was promoted since (timeline 1 then, 2 now) and the slot, no failover "
        "slot, stayed behind. Made anew at the WAL's position now it would skip every event "
        "committed since ",
        ": make it with cdc-relay setup-slot --republish-since TIME, which publishes those "
        "first (TIME: ",
        "or with cdc-relay setup-slot --accept-gap to skip them",
    )
    log = (tmp_path / "relay-2.log").read_text()
    last = log.strip().splitlines()[-1]
    assert last.startswith("cdc-relay: error: ") and all(part in last for part in lineage), log
    for command in ("status", "setup-slot"):
        shown = subprocess.run(
            [sys.executable, "-m", "cdc_relay", command, "--dsn", pair.dsn, "--slot", names.slot,
             "--publication", names.publication],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert shown.returncode == (3 if command == "status" else 1), shown
        alerts = [line for line in shown.stderr.splitlines() if "existed and is gone" in line]
        assert len(alerts) == 1 and all(part in alerts[0] for part in lineage), shown.stderr


@pytest.mark.pg18
def test_setup_slot_failover_says_what_is_missing_in_one_line_each(
    outbox_db: str, names: Any
) -> None:
    with psycopg.connect(outbox_db) as conn:
        row = conn.execute("SELECT current_setting('server_version_num')::int").fetchone()
    assert row is not None
    result = _setup_slot(outbox_db, names)
    output = result.stdout + result.stderr
    print(output)
    assert result.returncode == 1, output
    if row[0] < 170000:
        (line,) = output.strip().splitlines()
        assert line.startswith("cdc-relay: error: PostgreSQL 1")
        assert line.endswith(
            " has no failover slots (new in 17); upgrade, or run setup-slot without --failover "
            'and see docs/failover.md, "Hot standby and database failover"'
        )
        return
    # A lone server: the slot is made, and what a standby would need is reported.
    assert f"ok: slot {names.slot} has failover = true" in output
    assert (
        "missing: synchronized_standby_slots is empty, so the relay may get changes no standby "
        "has yet; ALTER SYSTEM SET synchronized_standby_slots = '<the standby slot>'; "
        "SELECT pg_reload_conf()"
    ) in output
    assert "note: no standby among the hosts of --dsn" in output
    assert "1 setting above missing" in output.splitlines()[-1]
    with psycopg.connect(outbox_db) as conn:
        failover = conn.execute(
            "SELECT failover FROM pg_replication_slots WHERE slot_name = %s", [names.slot]
        ).fetchone()
    assert failover == (True,)


def _setup_slot_on(dsn: str, names: Any, out: Path) -> subprocess.Popen[bytes]:
    """setup-slot (no failover) as a process, its stdout and stderr in ``out``.out/.err."""
    with out.with_suffix(".out").open("wb") as stdout, out.with_suffix(".err").open("wb") as err:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "cdc_relay",
                "setup-slot",
                "--dsn",
                dsn,
                "--slot",
                names.slot,
                "--publication",
                names.publication,
            ],
            stdout=stdout,
            stderr=err,
        )


def _set(server: LocalPostgres, setting: str, value: str) -> None:
    """Restart ``server`` with ``setting`` (given on its command line, which ALTER SYSTEM does
    not override)."""
    server.settings[setting] = value
    server.restart()


def _active_on(dsn: str, slot: str) -> bool:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT active FROM pg_replication_slots WHERE slot_name = %s", [slot]
        ).fetchone()
    return bool(row and row[0])


def test_stream_decodes_on_a_standby_while_the_application_writes_to_the_primary(
    tmp_path: Path, pg18_bin: Path, kafka_service: Any, names: Any
) -> None:
    """Decoding on a standby (PostgreSQL 16+): the slot and the walsender are the standby's,
    the primary only takes the writes."""
    pair = start_pair(tmp_path, pg18_bin, {})  # asynchronous, hot_standby_feedback on
    primary, standby = pair.primary.dsn_for(DATABASE), pair.standby.dsn_for(DATABASE)
    relay = RelayProcess(tmp_path, relay_env(standby, kafka_service.bootstrap, names))
    try:
        _set(pair.standby, "hot_standby_feedback", "off")
        refused = _setup_slot_on(standby, names, tmp_path / "no-feedback")
        assert refused.wait(60) == 1
        assert (tmp_path / "no-feedback.err").read_text().splitlines() == [
            "cdc-relay: error: this server is a standby with hot_standby_feedback off, so the "
            "primary may remove catalog rows the slot needs and PostgreSQL would invalidate it; "
            "ALTER SYSTEM SET hot_standby_feedback = on; SELECT pg_reload_conf() on the standby "
            "(with a primary_slot_name, so that the primary keeps them across disconnections)"
        ]
        _set(pair.standby, "hot_standby_feedback", "on")  # as the line says

        refused = _setup_slot_on(standby, names, tmp_path / "refused")
        assert refused.wait(60) == 1
        (line,) = (tmp_path / "refused.err").read_text().splitlines()
        statement = (
            f'CREATE PUBLICATION "{names.publication}" FOR TABLE public.outbox_events '
            "WITH (publish = 'insert', publish_via_partition_root = true)"
        )
        assert line == (
            f"cdc-relay: error: this server is a standby, where publication {names.publication} "
            f"cannot be created; create it on the primary ({statement}), then run setup-slot "
            "here again"
        )
        with psycopg.connect(primary, autocommit=True) as conn:
            conn.execute(statement)  # as the line says

        # A transaction running on the primary holds the slot's creation until it ends and
        # the primary logs its running transactions: setup-slot says so after a few seconds.
        with psycopg.connect(primary) as running:
            running.execute("SELECT pg_current_xact_id()")
            begun = time.monotonic()
            creating = _setup_slot_on(standby, names, tmp_path / "setup")
            wait_until(
                lambda: "pg_log_standby_snapshot()" in (tmp_path / "setup.err").read_text(),
                30,
                "the hint",
            )
            hinted = time.monotonic() - begun
            assert creating.poll() is None
        with psycopg.connect(primary, autocommit=True) as conn:
            while creating.poll() is None and time.monotonic() - begun < 90:
                conn.execute("SELECT pg_log_standby_snapshot()")
                time.sleep(0.5)
        assert creating.wait(1) == 0, (tmp_path / "setup.err").read_text()
        created = time.monotonic() - begun
        (hint,) = (tmp_path / "setup.err").read_text().splitlines()
        assert hint == (
            f"creating slot {names.slot} on a standby waits for the transactions running on "
            "the primary to end and for the primary to log its running transactions, which it "
            "does every 15 s while busy and never while idle; run SELECT "
            "pg_log_standby_snapshot() on the primary to have it now"
        )
        assert f"created slot {names.slot} (pgoutput)" in (tmp_path / "setup.out").read_text()

        relay.start()
        wait_until(lambda: _active_on(standby, names.slot), 60, "the relay on the standby's slot")
        load = Load(primary, writers=3, pause=0.002).start()
        time.sleep(8)
        written = load.stop()
        # Then the primary stops and the standby is promoted: the slot is the standby's own,
        # so the relay goes on with what the new primary commits.
        pair.primary.stop("fast")
        pair.standby.promote()
        load = Load(standby, writers=3, pause=0.002).start()
        time.sleep(4)
        after_promotion = load.stop()
        written += after_promotion
        received = consume(kafka_service.bootstrap, names.topic_prefix, expected=len(written))
        assert relay.alive(), relay.log()
        assert relay.stop() == 0, relay.log()
        with psycopg.connect(standby, autocommit=True) as conn:
            row = conn.execute(
                "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = %s",
                [names.slot],
            ).fetchone()
        confirmed = parse_lsn(row[0]) if row else 0
        pair.primary.start()  # the old primary, as it was: it never decoded anything
        with psycopg.connect(pair.primary.dsn, autocommit=True) as conn:
            on_primary = conn.execute(
                "SELECT count(*) FROM pg_replication_slots WHERE slot_type = 'logical'"
            ).fetchone()
    finally:
        relay.close()
        pair.standby.cleanup(keep_logs=True)
        pair.primary.cleanup(keep_logs=True)
    verdict = check(written, received, names.topic_prefix)
    print(
        f"{verdict} (after the promotion: {len(after_promotion)}, relay reconnections: "
        f"{relay.log().count('reconnected')}); hint after {hinted:.1f} s, "
        f"slot created {created:.1f} s after setup-slot "
        "began (a transaction held open on the primary, then pg_log_standby_snapshot())"
    )
    assert on_primary == (0,)  # the primary decodes nothing
    # The relay confirmed on the standby what it delivered (the LSN rule's cap, the watcher's
    # WAL position, is the standby's replay position there).
    assert confirmed >= max(w.after_commit_lsn for w in written)
    assert len(written) - len(after_promotion) > 500 and len(after_promotion) > 100
    assert verdict.lost == []
    assert verdict.out_of_order == []
    assert verdict.mismatched == []
    assert verdict.duplicates == 0  # no crash, no reconnect: nothing sent twice


def test_setup_slot_refuses_a_standby_before_16_in_one_line(tmp_path: Path, names: Any) -> None:
    """PostgreSQL 15 decodes on a primary only: against its standby setup-slot says so."""
    primary = LocalPostgres(tmp_path / "primary").start()  # the default server's binaries
    standby = LocalPostgres(
        tmp_path / "standby", standby_of=primary, settings={"hot_standby_feedback": "on"}
    )
    try:
        with psycopg.connect(primary.dsn, autocommit=True) as conn:
            conn.execute(OUTBOX_SQL.read_bytes())
            version = conn.execute("SELECT current_setting('server_version')").fetchone()
        assert version is not None
        if int(version[0].split(".")[0]) >= 16:
            pytest.skip(f"the default server is PostgreSQL {version[0]}, which decodes there")
        standby.start()
        refused = _setup_slot_on(standby.dsn, names, tmp_path / "refused")
        assert refused.wait(60) == 1
        assert (tmp_path / "refused.err").read_text().splitlines() == [
            f"cdc-relay: error: this server is a standby, and PostgreSQL {version[0]} decodes on "
            "a standby only from 16 on; run setup-slot and stream against the primary, or upgrade"
        ]
    finally:
        standby.cleanup(keep_logs=True)
        primary.cleanup(keep_logs=True)
