"""Failover readiness on PostgreSQL 18: right after setup-slot --failover the standby's copy of
the slot is not usable yet (a promotion would drop it), and status, the relay's gauge and its
log say so; once the standby has made its copy persistent they say it is ready, with the lag;
when the standby stops synchronising and PostgreSQL gives up on its copy, they say it again."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest
from failover_pair import DATABASE, SYNCHRONOUS, Pair, start_pair
from relaytools import RelayProcess, Writer, relay_env, scrape, wait_until

from cdc_relay.devstack import free_ports
from cdc_relay.devstack.postgres import LocalPostgres

pytestmark = pytest.mark.integration

READY = "is failover-ready: "
NOT_READY = "is not failover-ready: "


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cdc_relay", *args], capture_output=True, text=True, timeout=120
    )


def _status(pair: Pair, names: Any, *more: str) -> subprocess.CompletedProcess[str]:
    return _cli(
        "status",
        "--dsn",
        pair.dsn,
        "--slot",
        names.slot,
        "--publication",
        names.publication,
        "--require-failover-ready",
        "--wait",
        "0",
        *more,
    )


def _on(server: LocalPostgres, *statements: str) -> None:
    with psycopg.connect(server.dsn, autocommit=True) as conn:
        for statement in statements:
            conn.execute(statement.encode())


def _gauge(port: int, slot: str) -> float | None:
    return scrape(port).get(f'cdc_relay_slot_failover_ready{{slot="{slot}"}}')


def _transitions(relay: RelayProcess) -> list[str]:
    """The relay's readiness lines, in order."""
    return [line for line in relay.log().splitlines() if READY in line or NOT_READY in line]


def test_the_window_before_the_standby_holds_a_usable_copy_is_reported_then_cleared(
    tmp_path: Path, pg18_bin: Path, kafka_service: Any, names: Any
) -> None:
    pair = start_pair(tmp_path, pg18_bin, SYNCHRONOUS)
    relay = None
    try:
        # Slot synchronisation through ALTER SYSTEM (not the command line), so that a reload
        # stops it later without a restart.
        del pair.standby.settings["sync_replication_slots"]
        pair.standby.restart()
        _on(
            pair.standby,
            "ALTER SYSTEM SET sync_replication_slots = on",
            "SELECT pg_reload_conf()",
            # The standby replays nothing for now, as a standby behind under load: it copies
            # the new slot, but keeps the copy temporary until it has replayed that far.
            "SELECT pg_wal_replay_pause()",
        )
        standby = f"127.0.0.1:{pair.standby.port}"

        created = _cli(
            "setup-slot", "--failover", "--dsn", pair.dsn, "--slot", names.slot,
            "--publication", names.publication,
        )  # fmt: skip
        assert created.returncode == 0, created.stdout + created.stderr
        assert created.stdout.splitlines()[-1] == (
            "failover: a standby's copy is usable once synchronised and persistent; cdc-relay "
            "status shows it, and status --require-failover-ready exits 0 from then on (3 "
            "until then)"
        )
        waited = _cli(
            "setup-slot", "--failover", "--wait-failover-ready", "2", "--dsn", pair.dsn,
            "--slot", names.slot, "--publication", names.publication,
        )  # fmt: skip
        assert waited.returncode == 1, waited.stdout + waited.stderr
        (error,) = waited.stderr.splitlines()
        assert error.startswith(
            f"cdc-relay: error: after 2 s, no standby holds a usable copy of slot {names.slot}: "
            f"{standby}: "
        ), error
        assert error.endswith("(cdc-relay status --require-failover-ready tells when one does)")

        # The window: status says it, in text and in JSON, and exits 3.
        shown = _status(pair, names)
        print(f"-- status right after setup-slot --failover (exit {shown.returncode}):")
        print(shown.stdout + shown.stderr)
        assert shown.returncode == 3, shown.stdout + shown.stderr
        assert "failover          NOT READY\n" in shown.stdout
        copy_line = next(line for line in shown.stdout.splitlines() if line.startswith("standby"))
        assert copy_line.startswith(f"standby           {standby}: "), shown.stdout
        assert "still temporary" in copy_line or "no copy of slot" in copy_line, copy_line
        (alert,) = shown.stderr.splitlines()
        assert alert.startswith(f"ALERT: no standby holds a usable copy of slot {names.slot}: ")
        data = json.loads(_status(pair, names, "--json").stdout)
        assert data["failover"]["failover_slot"] is True
        assert data["failover"]["ready"] is False
        (found,) = data["failover"]["standbys"]
        assert found["standby"] == standby and found["usable"] is False
        assert found["temporary"] is True or found["present"] is False, found

        # The relay streams, and sees the same.
        (port,) = free_ports(1)
        env = relay_env(pair.dsn, kafka_service.bootstrap, names)
        env.update(CDC_RELAY_METRICS_PORT=str(port), CDC_RELAY_METRICS_HOST="127.0.0.1")
        relay = RelayProcess(tmp_path, env).start()
        writer = Writer(pair.dsn)
        wait_until(lambda: _up(port) and _gauge(port, names.slot) == 0, 60, "the gauge at 0")
        assert [NOT_READY in line for line in _transitions(relay)] == [True], relay.log()
        writer.transaction([("order", "o-1", {"step": n}) for n in range(3)])

        # The standby replays again and makes its copy persistent: ready.
        _on(pair.standby, "SELECT pg_wal_replay_resume()")

        def ready() -> bool:
            _on(pair.primary, "SELECT pg_log_standby_snapshot()")
            return _status(pair, names).returncode == 0

        wait_until(ready, 60, "status --require-failover-ready to pass", interval=1)
        shown = _status(pair, names)
        print(f"-- status once the standby made its copy persistent (exit {shown.returncode}):")
        print(shown.stdout + shown.stderr)
        assert shown.returncode == 0 and shown.stderr == ""
        assert "failover          ready\n" in shown.stdout
        assert f"standby           {standby}: usable copy, confirmed " in shown.stdout
        assert "behind the primary's slot (restart " in shown.stdout
        (found,) = json.loads(_status(pair, names, "--json").stdout)["failover"]["standbys"]
        assert found["usable"] and found["synced"] and not found["temporary"], found
        assert found["confirmed_lag_bytes"] >= 0 and found["restart_lag_bytes"] >= 0
        waited = _cli(
            "setup-slot", "--failover", "--wait-failover-ready", "30", "--dsn", pair.dsn,
            "--slot", names.slot, "--publication", names.publication,
        )  # fmt: skip
        assert waited.returncode == 0, waited.stdout + waited.stderr
        assert waited.stdout.splitlines()[-1] == (
            f"failover: ready: {standby} holds a usable copy of slot {names.slot}"
        )
        wait_until(lambda: _gauge(port, names.slot) == 1, 60, "the gauge at 1")
        samples = scrape(port)
        labels = f'{{slot="{names.slot}",standby="{standby}"}}'
        assert samples[f"cdc_relay_slot_failover_standby_ready{labels}"] == 1
        assert samples[f"cdc_relay_slot_failover_lag_bytes{labels}"] >= 0
        time.sleep(12)  # another sample or more: nothing logged again
        lines = _transitions(relay)
        assert [READY in line for line in lines] == [False, True], relay.log()
        assert f"standby {standby} holds a usable copy" in lines[1]

        # The standby stops synchronising, its copy falls behind, and past the standby's
        # max_slot_wal_keep_size PostgreSQL invalidates it at a restartpoint.
        _on(
            pair.standby,
            "ALTER SYSTEM SET sync_replication_slots = off",
            "ALTER SYSTEM SET max_slot_wal_keep_size = '1MB'",
            "SELECT pg_reload_conf()",
        )
        time.sleep(2)  # the slot synchronisation worker stops
        with psycopg.connect(pair.primary.dsn_for(DATABASE), autocommit=True) as conn:
            conn.execute("CREATE TABLE junk AS SELECT g FROM generate_series(1, 50000) g")
            for _ in range(3):
                conn.execute("INSERT INTO junk SELECT g FROM generate_series(1, 1000) g")
                conn.execute("SELECT pg_switch_wal()")
            conn.execute("CHECKPOINT")
        writer.transaction([("order", "o-1", {"step": "paid"})])

        def invalidated() -> bool:
            _on(pair.standby, "CHECKPOINT")  # a restartpoint, where the standby invalidates
            return "was invalidated (wal_removed" in _status(pair, names).stdout

        wait_until(invalidated, 60, "the copy invalidated", interval=1)
        shown = _status(pair, names)
        print(f"-- status once the standby's copy was invalidated (exit {shown.returncode}):")
        print(shown.stdout + shown.stderr)
        assert shown.returncode == 3
        wait_until(lambda: _gauge(port, names.slot) == 0, 60, "the gauge at 0 again")
        samples = scrape(port)
        assert samples[f"cdc_relay_slot_failover_standby_ready{labels}"] == 0
        time.sleep(12)
        lines = _transitions(relay)
        print("-- the relay's readiness lines:", *lines, sep="\n")
        assert [READY in line for line in lines] == [False, True, False], relay.log()
        assert "was invalidated (wal_removed" in lines[2]
        writer.close()
        assert relay.stop() == 0, relay.log()
    finally:
        if relay is not None:
            relay.close()
        pair.standby.cleanup(keep_logs=True)
        pair.primary.cleanup(keep_logs=True)


def _up(port: int) -> bool:
    try:
        scrape(port)
    except OSError:
        return False
    return True
