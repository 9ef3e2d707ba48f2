"""The benchmark harness end to end at tiny sizes: every figure, for every contestant it ran.

Only cdc-relay's own contestants (Debezium's JVM alone takes longer than the whole run), and
no timing is asserted: the harness measures, the test checks that it reports.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900)]

REPO = Path(__file__).parents[2]
# One of each kind the harness runs differently (a relay, exactly once, the poller's workers):
# stream-wal2json and poll-1 differ from these by an option alone.
CONTESTANTS = ("stream", "stream-eos", "poll-4")
EVERY_RUN = (
    "events_written",
    "events_delivered",
    "events_per_s",
    "cpu_s",
    "postgres_cpu_s",
    "peak_rss_mib",
    "wal_bytes_per_event",
)
BACKLOG = ("time_to_drain_s", "startup_s")
STEADY = ("write_rate", "target_rate")
LATENCY = ("p50", "p95", "p99", "max")
MACHINE = ("date", "cpu_model", "cores", "memory_gib", "kernel", "postgresql", "kafka", "java")


def test_a_tiny_run_reports_every_figure(tmp_path: Path) -> None:
    command = [
        sys.executable,
        "-m",
        "bench.run",
        "--events=2000",
        "--rate=500",
        "--high-rate=1000",
        "--duration=2",
        "--warmup=1",
        "--preflight-events=100",
        f"--contestants={','.join(CONTESTANTS)}",
        "--profile",
        "--profile-events=2000",
        f"--out={tmp_path}",
    ]
    run = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=840)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-6000:]

    [results] = [path for path in tmp_path.iterdir() if path.is_dir() and path.name != "tmp"]
    data = json.loads((results / "results.json").read_text())
    assert (results / "plot.png").stat().st_size > 0
    assert (results / "profile.txt").stat().st_size > 0
    table = (results / "results.md").read_text()
    assert (tmp_path / "latest.md").read_text() == table

    for key in MACHINE:
        assert data["machine"][key], key
    # A small run: it goes on whatever the load, and says whether the machine was busy.
    assert data["load"]["full_run"] == []
    assert len(data["load"]["start"]) == len(data["load"]["end"]) == 3
    assert data["load"]["noisy"] == (data["load"]["start"][0] > data["load"]["quiet"])
    assert ("(noisy)" in table.splitlines()[0]) == data["load"]["noisy"]
    workloads = ("backlog", "steady", "steady-high")
    assert data["settings"]["workloads"] == list(workloads)
    rows = {(row["contestant"], row["workload"]): row for row in data["results"]}
    assert set(rows) == {(c, w) for c in CONTESTANTS for w in workloads}
    assert rows[("stream", "backlog")]["status"] == "ok"
    for (contestant, workload), row in rows.items():
        assert f"| {contestant} |" in table
        if row["status"] == "not available":
            assert row["reason"]
            continue
        assert row["status"] == "ok", row
        assert row["lost"] == 0
        assert row["events_delivered"] == row["events_written"] > 0
        keys = EVERY_RUN + (BACKLOG if workload == "backlog" else STEADY)
        for key in keys:
            assert isinstance(row[key], int | float), (contestant, workload, key, row)
        if workload != "backlog":
            assert isinstance(row["rate_reached"], bool)
            for key in LATENCY:
                assert isinstance(row["latency_ms"][key], int | float), (contestant, key)
    assert "## Steady-high: 1,000 events/s" in table

    profile = data["profile"]
    assert profile["status"] == "ok", profile
    assert profile["hottest"]
    assert all(f["function"] and f["self_s"] >= 0 for f in profile["hottest"])
