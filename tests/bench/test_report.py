"""What results.md and plot.png say, from made-up results: no services, no run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from matplotlib.text import Text

from bench import report, rounds

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


def test_rounds_give_the_median_of_each_figure_and_each_rounds_own() -> None:
    """``--rounds 3``: one row per trial, its figures the median of the rounds (a loss or a
    duplicate in any round counts), every round's figures in a table of their own."""
    latencies = [
        {"p50": p50, "p95": 20.0, "p99": p99, "max": 40.0}
        for p50, p99 in ((5.0, 12.0), (6.0, 30.0), (4.0, 11.0))
    ]
    backlog = [
        _ok("stream", "backlog", events_per_s=r, cpu_s=c, duplicates=d)
        for r, c, d in ((90_000, 4.6, 0), (60_000, 7.0, 2), (85_000, 4.9, 0))
    ]
    steady = [_ok("stream", "steady", latency_ms=latency) for latency in latencies]
    merged_backlog, merged_steady = rounds.merge(backlog), rounds.merge(steady)
    assert (merged_backlog["events_per_s"], merged_backlog["cpu_s"]) == (85_000, 4.9)
    assert merged_backlog["duplicates"] == 2
    assert merged_steady["latency_ms"] == {"p50": 5.0, "p95": 20.0, "p99": 12.0, "max": 40.0}
    data = _data(["backlog", "steady"], [merged_backlog, merged_steady], noisy=False)
    data["settings"]["rounds"] = 3
    text = report.markdown(data)
    assert "| stream | 85,000 |" in text
    assert "## Rounds: 3, in turns" in text
    assert "| stream | backlog | 90,000 / 60,000 / 85,000 | 4.6 / 7.0 / 4.9 |" in text
    assert (
        "| stream | steady | 1,000 / 1,000 / 1,000 | 1.0 / 1.0 / 1.0 | 12.0 / 30.0 / 11.0 |" in text
    )


def test_a_round_that_failed_fails_the_trial_and_one_round_is_the_row_itself() -> None:
    ok = _ok("stream", "backlog")
    failed = {"contestant": "stream", "workload": "backlog", "status": "failed", "reason": "lost 3"}
    assert rounds.merge([ok]) is ok
    merged = rounds.merge([ok, failed])
    assert (merged["status"], merged["reason"]) == ("failed", "round 2 of 2: lost 3")
    assert [r["status"] for r in merged["rounds"]] == ["ok", "failed"]
    assert "round 2 of 2: lost 3" in report.markdown(_data(["backlog"], [merged], noisy=False))
