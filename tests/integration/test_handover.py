"""Switching from the poller to the CDC relay under a steady write load."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest
from relaytools import (
    Load,
    RelayProcess,
    check,
    consume,
    install_poller,
    pending_inserts,
    relay_env,
    wait_until,
)

pytestmark = pytest.mark.integration


def handover(dsn: str, kafka: Any, names: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cdc_relay", "setup-slot", "--from-poller"],
        env=relay_env(dsn, kafka.bootstrap, names),
        capture_output=True,
        text=True,
        timeout=120,
    )


def processed(dsn: str) -> int:
    with psycopg.connect(dsn) as conn:
        query = "SELECT count(*) FROM outbox_events WHERE processed_at IS NOT NULL"
        ((count,),) = conn.execute(query).fetchall()
        return int(count)


def test_switch_from_poll_to_stream_under_load_loses_nothing_and_publishes_nothing_twice(
    tmp_path: Path, outbox_db: str, kafka_service: Any, names: Any
) -> None:
    install_poller(outbox_db)
    env = relay_env(outbox_db, kafka_service.bootstrap, names, workers="2")
    poller = RelayProcess(tmp_path, env, name="poll", command="poll").start()
    stream = RelayProcess(tmp_path, relay_env(outbox_db, kafka_service.bootstrap, names))
    load = Load(outbox_db, writers=3, pause=0.002).start()
    try:
        wait_until(lambda: processed(outbox_db) > 500, 60, "the poller to publish")

        refused = handover(outbox_db, kafka_service, names)
        assert refused.returncode == 1
        assert "poller sessions are connected" in refused.stderr
        assert "stop every cdc-relay poll (SIGTERM)" in refused.stderr

        assert poller.stop() == 0, poller.log()
        time.sleep(0.5)  # a backlog builds up that the handover publishes
        switched = handover(outbox_db, kafka_service, names)
        assert switched.returncode == 0, switched.stderr
        stream.start()
        time.sleep(2)
        written = load.stop()
        received = consume(kafka_service.bootstrap, names.topic_prefix, expected=len(written))
        assert stream.stop() == 0
    finally:
        load.stop()
        poller.close()
        stream.close()

    print(switched.stdout)
    lines = switched.stdout.splitlines()
    assert lines[0] == f"created publication {names.publication} on public.outbox_events"
    assert lines[1].startswith(f"created slot {names.slot} (pgoutput) at ")
    handed_over = int(lines[2].split()[1])
    assert handed_over > 0
    verdict = check(written, received, names.topic_prefix)
    print(verdict, f"handed over={handed_over}")
    assert verdict.lost == []
    assert verdict.duplicates == 0
    assert verdict.mismatched == []
    assert verdict.out_of_order == []  # one poller process, then the handover, then stream
    assert pending_inserts(outbox_db, names.slot, names.publication) == 0
