"""`make demo` works: its own PostgreSQL and Kafka, the relay, orders arriving on Kafka."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def test_demo_relays_the_orders_and_stops_cleanly(tmp_path: Path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "demo" / "run.py"),
            "--orders",
            "3",
            "--interval",
            "0.2",
            "--dir",
            str(tmp_path / "demo"),
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "created slot cdc_relay (pgoutput)" in output
    # its broker creates no topic on demand: the relay made the topic (--create-topics)
    assert "created topic outbox.event.order (the broker's partition count" in output, output
    assert output.count("order.created {") == 3, output
    assert "3 events arrived on Kafka; relay exit code 0" in output
