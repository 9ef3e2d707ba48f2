"""What a run leaves behind: results.json, results.md (the machine as the harness read it, and
the tables), plot.png; and the description of the machine itself."""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import confluent_kafka
import psycopg

import cdc_relay
from bench import debezium
from bench.sql import QUERIES
from bench.workload import RATE_SETTING, WORKLOADS, reached
from cdc_relay.devstack.kafka import KAFKA_VERSION

if TYPE_CHECKING:
    from matplotlib.figure import Figure

REPO = Path(__file__).parents[1]
NONE = "\N{EN DASH}"
"""What a table shows where a figure does not apply."""


def _first(path: str, prefix: str) -> str | None:
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(prefix):
                return line.split(":", 1)[1].strip() if ":" in line else line
    except OSError:
        return None
    return None


def _os_name() -> str:
    try:
        for line in Path("/etc/os-release").read_text().splitlines():
            if line.startswith("PRETTY_NAME="):
                return line.split("=", 1)[1].strip('"')
    except OSError:
        pass
    return platform.system()


def _git_commit() -> str:
    try:
        commit = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return f"{commit} (with uncommitted changes)" if dirty else commit


def describe_machine(postgres_dsn: str) -> dict[str, Any]:
    """The machine and the software versions, as read here and now."""
    memory_kib = _first("/proc/meminfo", "MemTotal")
    with psycopg.connect(postgres_dsn, autocommit=True) as conn:
        settings = dict(conn.execute(QUERIES["server"]).fetchall())
    try:
        java = debezium.java_version()
    except Exception as err:  # noqa: BLE001 - a description, not a requirement
        java = f"unknown ({err})"
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "cpu_model": _first("/proc/cpuinfo", "model name") or platform.processor() or "unknown",
        "cores": os.cpu_count(),
        "memory_gib": round(int(memory_kib.split()[0]) / 2**20, 1) if memory_kib else None,
        "kernel": f"{platform.system()} {platform.release()} {platform.machine()}",
        "os": _os_name(),
        "postgresql": settings.pop("server_version", "unknown"),
        "postgresql_settings": settings,
        "kafka": KAFKA_VERSION,
        "java": java,
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "librdkafka": confluent_kafka.libversion()[0],
        "confluent_kafka": confluent_kafka.version()[0],
        "psycopg": psycopg.__version__,
        "libpq": psycopg.pq.version(),
        "debezium": debezium.DEBEZIUM_VERSION,
        "cdc_relay": f"{cdc_relay.__version__}, commit {_git_commit()}, {relay_build()}",
    }


def relay_build() -> str:
    """The build the contestants run, ``compiled (mypyc)`` or ``pure Python``: what
    ``cdc-relay --version`` says where they start, in a folder of their own (a package in the
    harness's folder is not theirs), with the harness's PYTHONPATH."""
    result = subprocess.run(
        [sys.executable, "-m", "cdc_relay", "--version"],
        capture_output=True,
        text=True,
        cwd=tempfile.gettempdir(),
        check=False,
        timeout=120,
    )
    if result.returncode != 0:
        return f"build unknown ({(result.stdout + result.stderr).strip()[-200:]})"
    return result.stdout.strip().rsplit(", ", 1)[-1]


def _num(value: Any, digits: int = 0) -> str:
    if value is None:
        return NONE
    if isinstance(value, int | float):
        return f"{value:,.{digits}f}"
    return str(value)


def _status(row: dict[str, Any]) -> str:
    if row["status"] == "ok":
        extra = f", {row['duplicates']:,} duplicates" if row.get("duplicates") else ""
        return f"ok: {row['events_delivered']:,}/{row['events_written']:,}{extra}"
    reason = " ".join(str(row.get("reason") or "").split())
    if len(reason) > 160:
        reason = reason[:157] + "..."
    return f"{row['status'].upper()}: {reason}".replace("|", "\\|")


def _backlog_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| contestant | events/s | time to drain (s) | of which start-up (s) | CPU (s) "
        "| PostgreSQL CPU (s) | peak RSS (MiB) | WAL bytes/event | delivered |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        ok = r["status"] == "ok"
        lines.append(
            f"| {r['contestant']} | {_num(r.get('events_per_s')) if ok else NONE} "
            f"| {_num(r.get('time_to_drain_s'), 1) if ok else NONE} "
            f"| {_num(r.get('startup_s'), 1) if ok else NONE} "
            f"| {_num(r.get('cpu_s'), 1) if ok else NONE} "
            f"| {_num(r.get('postgres_cpu_s'), 1) if ok else NONE} "
            f"| {_num(r.get('peak_rss_mib')) if ok else NONE} "
            f"| {_num(r.get('wal_bytes_per_event')) if ok else NONE} | {_status(r)} |"
        )
    return lines


def _steady_table(rows: list[dict[str, Any]], target: float) -> list[str]:
    lines = [
        "| contestant | events/s (written) | p50 (ms) | p95 (ms) | p99 (ms) | max (ms) "
        "| CPU (s) | PostgreSQL CPU (s) | peak RSS (MiB) | WAL bytes/event | delivered |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        ok = r["status"] == "ok"
        lat = (r.get("latency_ms") or {}) if ok else {}
        written = _num(r.get("write_rate"))
        if ok and r.get("write_rate") is not None and not reached(r["write_rate"], target):
            written += ", short"
        rate = f"{_num(r.get('events_per_s'))} ({written})" if ok else NONE
        lines.append(
            f"| {r['contestant']} | {rate} | {_num(lat.get('p50'), 1)} "
            f"| {_num(lat.get('p95'), 1)} | {_num(lat.get('p99'), 1)} "
            f"| {_num(lat.get('max'), 1)} | {_num(r.get('cpu_s'), 1) if ok else NONE} "
            f"| {_num(r.get('postgres_cpu_s'), 1) if ok else NONE} "
            f"| {_num(r.get('peak_rss_mib')) if ok else NONE} "
            f"| {_num(r.get('wal_bytes_per_event')) if ok else NONE} | {_status(r)} |"
        )
    return lines


def workloads_run(data: dict[str, Any]) -> list[str]:
    """The workloads the run ran, in their order (older results name none: their rows do)."""
    named = data["settings"].get("workloads")
    if named is None:
        named = {r["workload"] for r in data["results"]}
    return [w for w in WORKLOADS if w in named]


def _written(rows: list[dict[str, Any]]) -> list[int]:
    """The rates a steady workload's writer reached, in the trials that ran to the end."""
    return [r["write_rate"] for r in rows if r["status"] == "ok" and r.get("write_rate")]


def _span(values: list[int]) -> str:
    low, high = min(values), max(values)
    return f"{low:,}" if low == high else f"{low:,}\N{EN DASH}{high:,}"


def steady_title(data: dict[str, Any], workload: str) -> str:
    """What a steady workload was: its rate, the rate written when that fell short, its time.

    The target is claimed only when every trial's writer reached it.
    """
    s = data["settings"]
    target = s[RATE_SETTING[workload]]
    rows = [r for r in data["results"] if r["workload"] == workload]
    written = _written(rows)
    duration = f"for {s['duration']:g} s"
    if all(reached(w, target) for w in written):
        return f"{target:,} events/s {duration}"
    return f"{target:,} events/s targeted, {_span(written)} written, {duration}"


def _steady_section(data: dict[str, Any], workload: str) -> list[str]:
    s = data["settings"]
    target = s[RATE_SETTING[workload]]
    rows = [r for r in data["results"] if r["workload"] == workload]
    lines = [f"## {workload.capitalize()}: {steady_title(data, workload)}", ""]
    written = _written(rows)
    short = [w for w in written if not reached(w, target)]
    if short:
        lines += [
            f"The writer did not reach {target:,} events/s in {len(short)} of {len(written)} "
            f"trials: it fell behind its schedule and wrote {_span(short)} events/s there "
            "(*written*, marked short). Those trials' figures are at the rate written, not at "
            f"{target:,} events/s.",
            "",
        ]
    return lines + _steady_table(rows, target)


def _load_lines(data: dict[str, Any]) -> list[str]:
    """Whether the run was noisy, and why: nothing for a quiet run or older results."""
    figures = data.get("load")
    if not figures or figures.get("noisy") is False:
        return []
    if figures.get("noisy") is None:
        return [
            "**Load unknown**: the load average could not be read, so whether other work "
            "shared the cores is not known.",
            "",
        ]
    start, end = figures["start"], figures.get("end")
    kind = (
        "a full run started with --allow-noisy"
        if figures.get("full_run")
        else "a small run, which goes on whatever the load"
    )
    at_end = f" and {end[0]:.2f} at the end, the run's own work included" if end else ""
    return [
        f"**Noisy run**: the 1-minute load average was {start[0]:.2f} at the start (a quiet "
        f"run starts at {figures['quiet']:.1f} or less){at_end}; {kind}. Other work shared "
        "the cores, and these figures measure it too.",
        "",
    ]


def markdown(data: dict[str, Any]) -> str:
    m = data["machine"]
    s = data["settings"]
    rows = data["results"]
    pg = m["postgresql_settings"]
    ran = workloads_run(data)
    noisy = (data.get("load") or {}).get("noisy")
    high = f"; *steady-high*: the same at {s['high_rate']:,} events/s" if "high_rate" in s else ""
    out = [
        f"# cdc-relay benchmark, {m['date']}{' (noisy)' if noisy else ''}",
        "",
        f"**Machine**: {m['cpu_model']}, {m['cores']} cores, {m['memory_gib']} GiB memory, "
        f"{m['kernel']}, {m['os']}; load average {m['load_average_start']} at the start, "
        f"{m.get('load_average_end', '?')} at the end (all services and contestants share "
        "these cores).",
        "",
        *_load_lines(data),
        f"**Software**: PostgreSQL {m['postgresql']} "
        f"({', '.join(f'{k}={v}' for k, v in pg.items())}); Kafka {m['kafka']} (single-node "
        f"KRaft broker, and Connect for Debezium); {m['java']}; {m['python']}; "
        f"librdkafka {m['librdkafka']}; psycopg {m['psycopg']}; Debezium {m['debezium']}; "
        f"cdc-relay {m['cdc_relay']}. Run took {data['elapsed_s'] / 60:.1f} min.",
        "",
        "**Workloads** (each contestant gets a fresh database and fresh topics of "
        f"{s['partitions']} partitions stamped with LogAppendTime): *backlog*: "
        f"{s['events']:,} events in transactions of {s['transaction_size']}, written before "
        f"the contestant starts; *steady*: {s['rate']:,} events/s in transactions of "
        f"{s['steady_transaction_size']} while it runs: once a first event showed it delivers, "
        f"{s['warmup']:g} s of warm-up at that rate, then {s['duration']:g} s measured (every "
        f"event of both parts must arrive; the figures are the measured part's){high}.",
        "",
    ]
    for workload in WORKLOADS:
        if workload not in ran:
            out += [f"## {workload.capitalize()}", "", "Not run.", ""]
        elif workload == "backlog":
            out += [
                f"## Backlog: {s['events']:,} events",
                "",
                *_backlog_table([r for r in rows if r["workload"] == "backlog"]),
                "",
            ]
        else:
            out += [*_steady_section(data, workload), ""]
    out += [
        "How to read them: *events/s* of the backlog is events divided by the time from the "
        "first to the last delivery (the broker's append times); *time to drain* runs from "
        "the start of the contestant's process to the last delivery. For a steady rate, "
        "*events/s* is the measured events divided by the time from their first to their last "
        "delivery, and *written* the rate the writer reached, *short* when it fell behind the "
        "target. Latency is the broker's "
        "LogAppendTime of an event's first delivery minus the time the writer saw its COMMIT "
        "return, same clock, for every event. *CPU* is user + system seconds of the "
        "contestant's process tree: for the backlog over its whole run (start-up included), "
        "for the steady rate from the start of the measured part until its last event was "
        "delivered; *PostgreSQL CPU* is that of every server process over the same span (the "
        "walsender's decoding, the poller's queries, and for the steady rate the writer's "
        "own backends); *peak RSS* of the tree over the whole run; *WAL bytes/event* is the "
        "growth of pg_current_wal_lsn() from the start of the (measured) workload until the "
        "contestant stopped, divided by its events (a poller's UPDATEs count). "
        "pg_recvlogical is the ceiling: it reads the same kind of slot into "
        "/dev/null, delivers nothing to Kafka, so it has no latency; its backlog time runs to "
        "its exit at the end LSN of the workload; pg_recvlogical-shards-2 is two shards' ceiling, "
        "one pg_recvlogical on each shard's slot, each walsender decoding the whole WAL.",
    ]
    out += _rounds_section(data)
    profile = data.get("profile")
    if profile:
        out += ["", *profile_markdown(profile)]
    return "\n".join(out) + "\n"


def _rounds_section(data: dict[str, Any]) -> list[str]:
    """With ``--rounds``: each round's main figures beside the median the tables give."""
    rows = [r for r in data["results"] if r.get("rounds")]
    if not rows:
        return []
    count = data["settings"].get("rounds", len(rows[0]["rounds"]))
    out = [
        "",
        f"## Rounds: {count}, in turns",
        "",
        f"Every trial ran {count} times, round 1 of every contestant and workload first, then "
        "round 2 ...; each figure above is the median of its rounds (lost and duplicated "
        "events: the sum). Each round's:",
        "",
        "| contestant | workload | events/s | CPU (s) | p99 (ms) | peak RSS (MiB) |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        cells = [
            " / ".join(
                "failed" if r["status"] != "ok" else _num(r.get(key), digits) for r in row["rounds"]
            )
            for key, digits in (("events_per_s", 0), ("cpu_s", 1), ("p99_ms", 1))
        ]
        rss = " / ".join(_num(r.get("peak_rss_mib")) for r in row["rounds"])
        out.append(f"| {row['contestant']} | {row['workload']} | {' | '.join(cells)} | {rss} |")
    return out


def profile_markdown(profile: dict[str, Any]) -> list[str]:
    if profile.get("status") != "ok":
        return ["## Profile of `cdc-relay stream`", "", f"Not made: {profile.get('reason')}"]
    lines = [
        f"## Profile of `cdc-relay stream` (backlog of {profile['events']:,} events)",
        "",
        f"pyinstrument, wall-clock samples of the relay's thread over its whole run "
        f"({profile['profiled_s']:.1f} s; {profile['events_per_s']:,} events/s under the "
        "profiler). Hottest functions by own time (not counting the functions they call):",
        "",
        "| function | where | own time (s) | own % | with callees % |",
        "|---|---|---:|---:|---:|",
    ]
    lines += [
        f"| `{f['function']}` | {f['where']} | {f['self_s']:.2f} | {f['self_pct']:.1f} "
        f"| {f['total_pct']:.1f} |"
        for f in profile["hottest"]
    ]
    return lines


def bar_label(row: dict[str, Any] | None) -> str | None:
    """What a throughput bar without a figure says: the workload was not run, the contestant
    is not available here, or the trial failed; None for a figure."""
    if row is None:
        return "not run"
    if row["status"] == "ok":
        return None
    return "n/a" if row["status"] == "not available" else "failed"


def _sizes(data: dict[str, Any], workload: str) -> str:
    """A workload's size as run, for the plot's legend and titles."""
    if workload not in workloads_run(data):
        return f"{workload}: not run"
    if workload == "backlog":
        return f"backlog: {data['settings']['events']:,} events"
    return f"{workload}: {steady_title(data, workload)}"


def figure(data: dict[str, Any]) -> Figure:
    """Throughput bars per contestant and workload; latency percentiles of each steady rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = data["results"]
    names = list(dict.fromkeys(r["contestant"] for r in rows))
    by = {(r["contestant"], r["workload"]): r for r in rows}
    steady = list(RATE_SETTING)
    fig = plt.figure(figsize=(13, 10))
    grid = fig.add_gridspec(2, len(steady))
    left = fig.add_subplot(grid[0, :])
    width = 0.8 / len(WORKLOADS)
    for k, wl in enumerate(WORKLOADS):
        offset = (k - (len(WORKLOADS) - 1) / 2) * width
        cells = [by.get((n, wl)) for n in names]
        values = [r["events_per_s"] if r and r["status"] == "ok" else 0 for r in cells]
        bars = left.bar(
            [i + offset for i in range(len(names))], values, width, label=_sizes(data, wl)
        )
        for bar, row in zip(bars, cells, strict=True):
            label = bar_label(row)
            if label is not None:
                left.annotate(
                    label,
                    (bar.get_x() + bar.get_width() / 2, 0),
                    ha="center",
                    va="bottom",
                    fontsize=8,
                    rotation=90,
                )
    left.set_xticks(range(len(names)), names, rotation=20, ha="right")
    left.set_ylabel("events/s")
    left.set_title("Throughput: events delivered per second")
    left.legend(fontsize=9)
    for column, wl in enumerate(steady):
        axes = fig.add_subplot(grid[1, column])
        axes.set_title(f"Latency, {_sizes(data, wl)}", fontsize=10)
        with_latency = [
            (n, row["latency_ms"])
            for n in names
            if (row := by.get((n, wl))) is not None and row.get("latency_ms")
        ]
        if not with_latency:
            reason = "not run" if wl not in workloads_run(data) else "no latency measured"
            axes.text(0.5, 0.5, reason, ha="center", va="center", transform=axes.transAxes)
            axes.set_xticks([])
            axes.set_yticks([])
            continue
        bar_width = 0.27
        for k, pct in enumerate(("p50", "p95", "p99")):
            axes.bar(
                [i + (k - 1) * bar_width for i in range(len(with_latency))],
                [lat[pct] for _, lat in with_latency],
                bar_width,
                label=pct,
            )
        axes.set_xticks(
            range(len(with_latency)), [n for n, _ in with_latency], rotation=20, ha="right"
        )
        axes.set_yscale("log")
        # From the decade below the lowest bar: a lone p50 is not cut to a sliver.
        lowest = min(lat[pct] for _, lat in with_latency for pct in ("p50", "p95", "p99"))
        if lowest > 0:
            axes.set_ylim(bottom=10 ** math.floor(math.log10(lowest)))
        axes.set_ylabel("ms (log scale)")
        axes.legend(fontsize=9)
    m = data["machine"]
    title = f"cdc-relay benchmark {m['date']}, {m['cpu_model']}"
    figures = data.get("load") or {}
    if figures.get("noisy"):
        title += (
            f"\nNOISY: load average {figures['start'][0]:.2f} at the start "
            f"(quiet: at most {figures['quiet']:.1f})"
        )
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def plot(data: dict[str, Any], path: Path) -> None:
    """The figure, as a PNG."""
    import matplotlib.pyplot as plt

    fig = figure(data)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write(data: dict[str, Any], out: Path, latest: Path | None) -> None:
    """results.json, results.md and plot.png in ``out``; a copy of the table as ``latest``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(data, indent=2) + "\n")
    text = markdown(data)
    (out / "results.md").write_text(text)
    plot(data, out / "plot.png")
    if latest is not None:
        shutil.copyfile(out / "results.md", latest)
