"""One configuration file drives setup-slot and stream against the real services: the file
alone (CDC_RELAY_CONFIG, no other setting), a key of the stream's at the top level that
setup-slot has too and leaves alone, a key of setup-slot's table, and every event on Kafka."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import psycopg
import pytest
from relaytools import RelayProcess, Writer, check, consume, wait_slot

pytestmark = pytest.mark.integration


@pytest.mark.pg18
def test_one_file_sets_up_the_slot_and_streams(
    tmp_path: Path,
    outbox_db: str,
    kafka_service: Any,
    names: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in list(os.environ):  # no setting but the file's (the tests' own variables stay)
        if name.startswith("CDC_RELAY_") and not name.startswith("CDC_RELAY_TEST_"):
            monkeypatch.delenv(name)
    with psycopg.connect(outbox_db, autocommit=True) as conn:
        conn.execute("ALTER TABLE outbox_events ADD COLUMN tenant text DEFAULT 'acme'")
    config = tmp_path / "cdc-relay.toml"
    config.write_text(
        f"""
dsn = "{outbox_db}"
kafka-bootstrap = "{kafka_service.bootstrap}"
slot = "{names.slot}"
publication = "{names.publication}"
table = "public.outbox_events"
topic-template = "{names.topic_prefix}.{{aggregate_type}}"
# stream's: setup-slot has the option too, for a republish, and leaves it alone otherwise
header-column = ["tenant"]
# the relays': setup-slot has no such options
shutdown-timeout = 10
log-format = "json"

[setup-slot]
create-table = true   # the table exists: left as it is

[stream]
status-interval = 1
"""
    )
    environ = {**os.environ, "CDC_RELAY_CONFIG": str(config)}
    setup = subprocess.run(
        [sys.executable, "-m", "cdc_relay", "setup-slot"],
        env=environ,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert setup.returncode == 0, setup.stderr
    assert f"created publication {names.publication}" in setup.stdout
    assert f"slot {names.slot}" in setup.stdout

    shown = subprocess.run(
        [sys.executable, "-m", "cdc_relay", "config", "show", "stream"],
        env=environ,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    lines = {line.split()[0]: line for line in shown.splitlines()[1:]}
    assert lines["status-interval"].split()[1:] == ["1", f"file:{config}", "[stream]"]
    assert lines["header-column"].split()[1:] == ["tenant", f"file:{config}", "top", "level"]

    relay = RelayProcess(tmp_path, {"CDC_RELAY_CONFIG": str(config)})
    writer = Writer(outbox_db)
    try:
        relay.start()
        wait_slot(outbox_db, names.slot, active=True, timeout=120)
        for i in range(50):
            writer.transaction([(("order", "invoice")[i % 2], f"a{i % 7}", {"i": i})])
        received = consume(kafka_service.bootstrap, names.topic_prefix, expected=50)
        assert len({message.id for message in received}) == 50, relay.log()
        assert relay.stop() == 0, relay.log()
    finally:
        writer.close()
        relay.close()
    # the header column of the file's top level, after the headers every message carries
    assert {message.headers[-1] for message in received} == {("tenant", b"acme")}
    without = [dataclasses.replace(m, headers=m.headers[:-1]) for m in received]
    verdict = check(writer.written, without, names.topic_prefix)
    assert verdict.lost == []
    assert verdict.mismatched == []
    assert verdict.out_of_order == []
    # the log is JSON lines, as the file's top level asked of the relay
    assert relay.log().lstrip().startswith("{")
