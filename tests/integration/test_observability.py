"""Metrics, health, status and logs of a real stream."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import psycopg
import pytest
from relaytools import RelayProcess, Writer, consume, relay_env, scrape, setup_slot, wait_until

from cdc_relay.devstack import free_ports

pytestmark = pytest.mark.integration


def probe(port: int, path: str) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return exc.code


def test_metrics_move_as_events_flow_and_readiness_follows_the_broker(
    tmp_path: Path, outbox_db: str, kafka_service: Any, names: Any
) -> None:
    setup_slot(outbox_db, names)
    (port,) = free_ports(1)
    env = relay_env(outbox_db, kafka_service.bootstrap, names)
    env.update(CDC_RELAY_METRICS_PORT=str(port), CDC_RELAY_METRICS_HOST="127.0.0.1")
    relay = RelayProcess(tmp_path, env).start()
    try:
        wait_until(lambda: _up(port) and probe(port, "/readyz") == 200, 60, "readiness")
        assert probe(port, "/healthz") == 200
        before = scrape(port)
        published = 'outbox_events_published_total{relay="stream"}'
        assert before.get(published, 0) == 0
        assert before['cdc_relay_connected{service="postgres"}'] == 1
        assert before['cdc_relay_connected{service="kafka"}'] == 1
        wait_until(
            lambda: scrape(port).get("cdc_relay_slot_wal_retained_bytes", 0) > 0,
            30,
            "the WAL retained gauge",
        )

        writer = Writer(outbox_db)
        for i in range(40):
            writer.transaction([("order", f"m{i % 4}", {"i": i})])
        writer.close()
        wait_until(lambda: scrape(port).get(published) == 40, 60, "40 events published")
        after = scrape(port)
        assert after["cdc_relay_end_to_end_latency_seconds_count"] == 40
        assert after["cdc_relay_end_to_end_latency_seconds_sum"] > 0
        assert after["cdc_relay_events_in_flight"] == 0
        assert after["outbox_events_pending"] == 0
        assert after["cdc_relay_seconds_since_last_event"] < 30
        wait_until(
            lambda: scrape(port)["cdc_relay_confirmed_lsn"] > before["cdc_relay_confirmed_lsn"],
            10,
            "the confirmed LSN to move",
        )

        kafka_service.stop()
        try:
            wait_until(lambda: probe(port, "/readyz") == 503, 60, "not ready without a broker")
            assert probe(port, "/healthz") == 200  # waiting is not dead
            assert scrape(port)['cdc_relay_connected{service="kafka"}'] == 0
        finally:
            kafka_service.start()
        wait_until(lambda: probe(port, "/readyz") == 200, 60, "ready again")
        assert relay.stop() == 0
    finally:
        relay.close()


def _up(port: int) -> bool:
    try:
        probe(port, "/healthz")
    except OSError:
        return False
    return True


def test_status_reports_the_slot_and_exits_3_past_a_threshold(
    tmp_path: Path, outbox_db: str, kafka_service: Any, names: Any
) -> None:
    setup_slot(outbox_db, names)
    base = [sys.executable, "-m", "cdc_relay", "status", "--dsn", outbox_db, "--slot", names.slot]
    idle = subprocess.run([*base, "--json"], capture_output=True, text=True, check=True)
    state = json.loads(idle.stdout)
    assert state["exists"] is True
    assert state["active"] is False
    assert state["plugin"] == "pgoutput"
    assert state["alerts"] == []

    relay = RelayProcess(tmp_path, relay_env(outbox_db, kafka_service.bootstrap, names)).start()
    try:
        wait_until(
            lambda: json.loads(
                subprocess.run([*base, "--json"], capture_output=True, text=True).stdout
            )["active"],
            30,
            "the slot to be active",
        )
        table = subprocess.run([*base, "--require-active"], capture_output=True, text=True)
        assert table.returncode == 0, table.stderr
        assert "active            yes (pid " in table.stdout
        crossed = subprocess.run([*base, "--max-wal-retained", "0"], capture_output=True, text=True)
        assert crossed.returncode == 3
        assert "bytes of WAL retained (limit 0)" in crossed.stderr
    finally:
        relay.close()
    missing = subprocess.run([*base[:-1], "no_such_slot", "--json"], capture_output=True, text=True)
    assert missing.returncode == 3
    assert json.loads(missing.stdout)["alerts"] == ["slot no_such_slot does not exist"]


@pytest.mark.parametrize("log_format", ["text", "json"])
def test_logs_never_show_the_password(
    tmp_path: Path, outbox_db: str, kafka_service: Any, names: Any, log_format: str
) -> None:
    password = f"pw-{names.suffix}-Secret"
    role = f"{names.slot}_relay"
    with psycopg.connect(outbox_db, autocommit=True) as conn:
        conn.execute(f"CREATE ROLE {role} LOGIN REPLICATION PASSWORD '{password}'")
        conn.execute(f"GRANT SELECT ON outbox_events TO {role}")
    try:
        setup_slot(outbox_db, names)
        with psycopg.connect(outbox_db, autocommit=True) as conn:
            # what a stream role moves of its slot's lineage (sql/roles.sql grants the same)
            conn.execute(
                "GRANT SELECT, UPDATE (confirmed_lsn, confirmed_from, published, verified_lsn) "
                f"ON cdc_relay_slots TO {role}"
            )
        dsn = f"{outbox_db} user={role} password={password}"
        env = relay_env(dsn, kafka_service.bootstrap, names, log_format=log_format)
        relay = RelayProcess(tmp_path, env, name=f"relay-{log_format}").start()
        try:
            writer = Writer(outbox_db)
            writer.transaction([("order", "p1", {"n": 1})])
            writer.close()
            consume(kafka_service.bootstrap, names.topic_prefix, expected=1, settle=0)
            assert relay.stop() == 0
        finally:
            relay.close()
        # an error path too: a slot that does not exist
        failed = subprocess.run(
            [sys.executable, "-m", "cdc_relay", "stream", "--slot", "nope"],
            env={**env, "PATH": "/usr/bin:/bin"},
            capture_output=True,
            text=True,
        )
        output = relay.log() + failed.stdout + failed.stderr
        assert failed.returncode != 0
        assert "streaming slot" in output
        assert password not in output
        if log_format == "json":
            lines = [line for line in relay.log().splitlines() if line.startswith("{")]
            assert lines
            for line in lines:
                document = json.loads(line)
                assert {"time", "level", "message"} <= document.keys()
    finally:
        with psycopg.connect(outbox_db, autocommit=True) as conn:
            conn.execute(f"DROP OWNED BY {role}")
            conn.execute(f"DROP ROLE {role}")


def readyz(port: int) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as response:
            return int(response.status), response.read().decode().strip()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode().strip()


def test_a_waiting_standby_exports_its_role_and_is_ready_until_it_streams(
    tmp_path: Path, outbox_db: str, kafka_service: Any, names: Any
) -> None:
    """The standby overlay's pair: the waiting relay says cdc_relay_standby 1 and is
    connected to PostgreSQL (the server answers its attempts to take the slot), so the alert
    rules leave it alone; once the first relay stops, it streams and says 0."""
    setup_slot(outbox_db, names)
    first_port, second_port = free_ports(2)
    env = relay_env(outbox_db, kafka_service.bootstrap, names, standby="true")
    env.update(CDC_RELAY_METRICS_HOST="127.0.0.1")
    first = RelayProcess(tmp_path, {**env, "CDC_RELAY_METRICS_PORT": str(first_port)}, "first")
    second = RelayProcess(tmp_path, {**env, "CDC_RELAY_METRICS_PORT": str(second_port)}, "second")
    postgres = 'cdc_relay_connected{service="postgres"}'
    try:
        first.start()
        wait_until(lambda: _up(first_port) and readyz(first_port)[0] == 200, 60, "first ready")
        second.start()
        wait_until(lambda: "standing by" in second.log(), 60, "the second relay standing by")
        wait_until(lambda: _up(second_port) and readyz(second_port)[0] == 200, 60, "its readiness")
        assert readyz(second_port) == (200, f"standing by for slot {names.slot}")
        waiting, streaming = scrape(second_port), scrape(first_port)
        assert (waiting["cdc_relay_standby"], waiting[postgres]) == (1, 1)
        assert (streaming["cdc_relay_standby"], streaming[postgres]) == (0, 1)
        assert readyz(first_port) == (200, "ok")

        assert first.stop() == 0
        wait_until(lambda: scrape(second_port)["cdc_relay_standby"] == 0, 60, "the takeover")
        assert scrape(second_port)[postgres] == 1
        wait_until(lambda: readyz(second_port) == (200, "ok"), 30, "ready as the streaming one")
        assert second.stop() == 0
    finally:
        first.close()
        second.close()
