"""What results.md and plot.png say, from made-up results: no services, no run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from matplotlib.text import Text

from bench import report

MACHINE = {
    "date": "2026-01-01T00:00:00+00:00",
    "cpu_model": "a CPU",
    "cores": 2,
    "memory_gib": 8.0,
    "kernel": "Linux",
    "os": "Debian",
    "load_average_start": "3.11 2.00 1.50",
    "load_average_end": "2.50 2.10 1.60",
    "postgresql": "15",
    "postgresql_settings": {"fsync": "off"},
    "kafka": "4.1.1",
    "java": "java",
    "python": "CPython 3.11",
    "librdkafka": "2",
    "confluent_kafka": "2",
    "psycopg": "3",
    "libpq": 150000,
    "debezium": "3",
    "cdc_relay": "0.1.0",
}
LATENCY = {"p50": 10.0, "p95": 20.0, "p99": 30.0, "max": 40.0}


def _ok(contestant: str, workload: str, **figures: Any) -> dict[str, Any]:
    row = {
        "contestant": contestant,
        "workload": workload,
        "status": "ok",
        "reason": None,
        "events_written": 100,
        "events_delivered": 100,
        "lost": 0,
        "duplicates": 0,
        "events_per_s": 1000,
        "cpu_s": 1.0,
        "postgres_cpu_s": 1.0,
        "peak_rss_mib": 50,
        "wal_bytes_per_event": 500,
    }
    if workload != "backlog":
        row |= {"latency_ms": LATENCY, "write_rate": 5000}
    return row | figures


def _data(workloads: list[str], results: list[dict[str, Any]], noisy: bool) -> dict[str, Any]:
    return {
        "machine": MACHINE,
        "load": {
            "quiet": 1.0,
            "start": [3.11, 2.0, 1.5] if noisy else [0.2, 0.3, 0.4],
            "end": [2.5, 2.1, 1.6],
            "noisy": noisy,
            "full_run": [],
            "allow_noisy": False,
        },
        "settings": {
            "events": 2000,
            "transaction_size": 100,
            "rate": 5000,
            "high_rate": 20000,
            "duration": 5.0,
            "warmup": 1.0,
            "steady_transaction_size": 10,
            "partitions": 3,
            "preflight_events": 100,
            "workloads": workloads,
            "command": "python -m bench.run",
        },
        "results": results,
        "profile": None,
        "elapsed_s": 60.0,
    }


@pytest.fixture
def backlog_only() -> dict[str, Any]:
    results = [
        _ok("stream", "backlog"),
        {"contestant": "poll-1", "workload": "backlog", "status": "failed", "reason": "boom"},
        {
            "contestant": "debezium",
            "workload": "backlog",
            "status": "not available",
            "reason": "no Java",
        },
    ]
    return _data(["backlog"], results, noisy=True)


def _texts(data: dict[str, Any]) -> list[str]:
    import matplotlib.pyplot as plt

    fig = report.figure(data)
    try:
        return [t.get_text() for t in fig.findobj(Text) if t.get_text()]
    finally:
        plt.close(fig)


def test_a_bar_without_a_figure_says_why() -> None:
    assert report.bar_label(None) == "not run"
    assert report.bar_label({"status": "failed"}) == "failed"
    assert report.bar_label({"status": "not available"}) == "n/a"
    assert report.bar_label({"status": "ok"}) is None


def test_the_plot_tells_not_run_from_failed_and_names_the_sizes(
    backlog_only: dict[str, Any],
) -> None:
    texts = _texts(backlog_only)
    assert texts.count("failed") == 1  # poll-1's backlog
    assert texts.count("n/a") == 1  # debezium's backlog
    assert texts.count("not run") == 3 * 2 + 2  # 3 contestants x 2 steady; 2 latency panels
    assert "backlog: 2,000 events" in texts
    assert "steady: not run" in texts
    assert "steady-high: not run" in texts
    assert any("NOISY: load average 3.11" in t for t in texts)


def test_the_plot_gives_the_rates_and_duration_run() -> None:
    results = [
        _ok("stream", "steady", write_rate=5000),
        _ok("stream", "steady-high", write_rate=6400),
        _ok("poll-1", "steady", write_rate=4990),
        _ok("poll-1", "steady-high", write_rate=5100),
    ]
    texts = _texts(_data(["steady", "steady-high"], results, noisy=False))
    assert "steady: 5,000 events/s for 5 s" in texts
    assert "steady-high: 20,000 events/s targeted, 5,100\N{EN DASH}6,400 written, for 5 s" in texts
    assert "backlog: not run" in texts
    assert not any("NOISY" in t for t in texts)


def test_a_rate_not_reached_is_not_claimed() -> None:
    results = [
        _ok("stream", "steady-high", write_rate=6400),
        _ok("pg_recvlogical", "steady-high", write_rate=20000, latency_ms=None),
        _ok("stream", "steady", write_rate=5000),
    ]
    text = report.markdown(_data(["steady", "steady-high"], results, noisy=False))
    assert "## Steady: 5,000 events/s for 5 s" in text
    assert "## Steady-high: 20,000 events/s targeted, 6,400\N{EN DASH}20,000 written" in text
    assert "did not reach 20,000 events/s in 1 of 2 trials" in text
    assert "| stream | 1,000 (6,400, short) | 10.0 |" in text
    assert "| pg_recvlogical | 1,000 (20,000) |" in text
    assert "## Backlog\n\nNot run." in text
    assert "Noisy" not in text


def test_a_noisy_run_says_so_with_the_load_at_start_and_end(
    backlog_only: dict[str, Any],
) -> None:
    text = report.markdown(backlog_only)
    assert text.startswith("# cdc-relay benchmark, 2026-01-01T00:00:00+00:00 (noisy)\n")
    assert "**Noisy run**: the 1-minute load average was 3.11 at the start" in text
    assert "and 2.50 at the end" in text


def test_older_results_still_render(tmp_path: Path, backlog_only: dict[str, Any]) -> None:
    del backlog_only["load"]
    del backlog_only["settings"]["workloads"]
    del backlog_only["settings"]["high_rate"]
    report.write(backlog_only, tmp_path, latest=None)
    assert (tmp_path / "plot.png").stat().st_size > 0
    assert "Noisy" not in (tmp_path / "results.md").read_text()
