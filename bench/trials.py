"""One trial: a contestant on one workload, in a fresh database with fresh topics, measured
the same way as every other contestant and checked for lost events."""

from __future__ import annotations

import contextlib
import statistics
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from bench import kafka, workload
from bench.contestants import Contestant, Trial
from bench.procs import Process, Usage, server_cpu
from bench.sql import QUERIES
from cdc_relay.devstack.kafka import LocalKafka
from cdc_relay.devstack.postgres import SUPERUSER, LocalPostgres

SCHEMA = Path(__file__).parents[1] / "sql"
SCHEMA_FILES = ("outbox.sql", "poller.sql")
STALL_TIMEOUT = 180.0
"""A contestant that delivers nothing new for this long has failed."""
READY_TIMEOUT = 180.0

Say = Callable[[str], None]


class TrialFailed(Exception):
    """The contestant did not deliver every event; the message says what happened."""

    def __init__(self, message: str, verdict: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.verdict = verdict or {}
        """The counts, when the failure was found by reading Kafka back."""


@dataclass(frozen=True)
class Services:
    postgres: LocalPostgres
    kafka: LocalKafka
    workdir: Path


def _schema_files() -> list[Path]:
    # The outbox, and what the poller adds to it (its NOTIFY trigger): the same schema, and so
    # the same writes, for every contestant. Not the rest of sql/: roles.sql, for one, is a
    # psql script.
    return [SCHEMA / name for name in SCHEMA_FILES if (SCHEMA / name).is_file()]


@contextlib.contextmanager
def trial_for(services: Services, contestant: Contestant, workload_name: str) -> Iterator[Trial]:
    """A fresh database with the outbox schema, fresh topics; both removed afterwards."""
    tag = f"{contestant.name}_{workload_name}".replace("-", "_").lower()
    suffix = uuid.uuid4().hex[:6]
    database = f"bench_{tag}_{suffix}"
    postgres = services.postgres
    workdir = services.workdir / f"{tag}_{suffix}"
    workdir.mkdir(parents=True)
    trial = Trial(
        dsn=postgres.dsn_for(database),
        host="127.0.0.1",
        port=postgres.port,
        user=SUPERUSER,
        database=database,
        bootstrap=services.kafka.bootstrap,
        slot=f"bench_{tag}",
        publication=f"bench_{tag}",
        topic_prefix=f"bench.{tag}.{suffix}",
        workdir=workdir,
        server_pid=postgres.pid or 0,
    )
    topics = [*event_topics(trial), warmup_topic(trial)]
    with psycopg.connect(postgres.dsn, autocommit=True) as conn:
        conn.execute(sql.SQL(QUERIES["create_database"]).format(database=sql.Identifier(database)))
    try:
        with psycopg.connect(trial.dsn, autocommit=True) as conn:
            for path in _schema_files():
                conn.execute(path.read_bytes())
        workload.install(trial.dsn)
        kafka.create_topics(trial.bootstrap, topics)
        yield trial
    finally:
        _drop_database(postgres.dsn, database)
        with contextlib.suppress(Exception):
            kafka.delete_topics(trial.bootstrap, topics)


def _drop_database(admin_dsn: str, database: str) -> None:
    """Drop a database after its sessions and slots, walsenders included."""
    deadline = time.monotonic() + 60
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        while True:
            conn.execute(QUERIES["terminate_sessions"], {"database": database})
            slots = conn.execute(QUERIES["database_slots"], {"database": database}).fetchall()
            if not slots or time.monotonic() > deadline:
                break
            for slot, active in slots:
                if not active:
                    with contextlib.suppress(psycopg.errors.ObjectInUse):
                        conn.execute(QUERIES["drop_slot"], {"slot": slot})
            time.sleep(0.1)
        conn.execute(sql.SQL(QUERIES["drop_database"]).format(database=sql.Identifier(database)))


def event_topics(trial: Trial) -> list[str]:
    return [f"{trial.topic_prefix}.{t}" for t in workload.AGGREGATE_TYPES]


def warmup_topic(trial: Trial) -> str:
    return f"{trial.topic_prefix}.{workload.WARMUP_TYPE}"


def _one(dsn: str, name: str, **params: Any) -> Any:
    with psycopg.connect(dsn, autocommit=True) as conn:
        cursor = conn.execute(QUERIES[name], params)
        row = cursor.fetchone() if cursor.description is not None else None
    return None if row is None else row[0]


def _start(contestant: Contestant, trial: Trial) -> Process:
    command, env = contestant.command(trial)
    log = trial.workdir / f"{contestant.name}.log"
    return Process(command, log, env=env, cwd=trial.workdir).start()


def _died(process: Process, what: str) -> TrialFailed:
    usage = process.wait(0)
    code = usage.exit_code if usage else "?"
    return TrialFailed(
        f"the process exited (code {code}) {what}; last lines of {process.log_path}:\n"
        f"{process.log_tail(15)}"
    )


def _wait_delivered(
    process: Process,
    trial: Trial,
    topics: list[str],
    expected: int,
    say: Say,
    reader: kafka.LiveReader | kafka.CommitWatch | None = None,
) -> None:
    """Until the topics hold ``expected`` messages (as ``reader`` counts them, when given);
    fail when the contestant dies or stalls."""
    marks = reader or kafka.Watermarks(trial.bootstrap, topics)
    try:
        count, progress, shown = 0, time.monotonic(), time.monotonic()
        while True:
            if not process.alive():
                raise _died(process, f"after delivering {count:,} of {expected:,} events")
            now_count = marks.count()
            now = time.monotonic()
            # A transaction's commit markers count too: settled, the last one is committed.
            if now_count >= expected and (
                not isinstance(marks, kafka.CommitWatch) or marks.settled()
            ):
                return
            if now_count > count:
                count, progress = now_count, now
            elif now - progress > STALL_TIMEOUT:
                raise TrialFailed(
                    f"no event delivered for {STALL_TIMEOUT:g} s, {count:,} of {expected:,} "
                    f"on Kafka; last lines of {process.log_path}:\n{process.log_tail(15)}"
                )
            if now - shown > 15:
                say(f"{count:,} of {expected:,} events on Kafka")
                shown = now
            time.sleep(0.2)
    finally:
        if reader is None:
            marks.close()


def _live_reader(contestant: Contestant, trial: Trial) -> kafka.LiveReader | None:
    """For a transactional contestant, a read_committed consumer reading as it delivers."""
    if not contestant.transactional:
        return None
    return kafka.LiveReader(trial.bootstrap, event_topics(trial)).start()


def _wait_ready(contestant: Contestant, process: Process, trial: Trial) -> None:
    """Until the contestant delivers: a warm-up event arrives, or the slot is being read."""
    deadline = time.monotonic() + READY_TIMEOUT
    if contestant.delivers_to_kafka:
        workload.write_warmup(trial.dsn)
        marks = kafka.Watermarks(trial.bootstrap, [warmup_topic(trial)])
        try:
            while marks.count() < 1:
                if not process.alive():
                    raise _died(process, "while starting")
                if time.monotonic() > deadline:
                    raise TrialFailed(f"the warm-up event did not arrive in {READY_TIMEOUT:g} s")
                time.sleep(0.1)
        finally:
            marks.close()
        return
    while not all(_one(trial.dsn, "slot_active", slot=s) for s in contestant.slots(trial)):
        if not process.alive():
            raise _died(process, "while starting")
        if time.monotonic() > deadline:
            raise TrialFailed(f"the slot was not read within {READY_TIMEOUT:g} s")
        time.sleep(0.05)


def _stop(contestant: Contestant, process: Process) -> tuple[Usage, bool]:
    return process.stop(contestant.stop_signal)


def _figures(usage: Usage, db_cpu: float, wal_bytes: int, events: int) -> dict[str, Any]:
    return {
        "cpu_s": round(usage.cpu_s, 2),
        "postgres_cpu_s": round(db_cpu, 2),
        "peak_rss_mib": round(usage.peak_rss_bytes / 2**20, 1),
        "wal_bytes_per_event": round(wal_bytes / events, 1) if events else None,
        "exit_code": usage.exit_code,
    }


def _verify(deliveries: kafka.Deliveries, written: set[str]) -> dict[str, Any]:
    delivered = set(deliveries.first_append_ms)
    lost = len(written - delivered)
    unknown = len(delivered - written)
    verdict = {
        "events_written": len(written),
        "events_delivered": len(delivered & written),
        "lost": lost,
        "duplicates": deliveries.duplicates,
    }
    problems = []
    if lost:
        problems.append(f"{lost:,} of {len(written):,} events lost")
    if unknown:
        problems.append(f"{unknown:,} events on Kafka that were never written")
    if deliveries.without_id:
        problems.append(f"{deliveries.without_id:,} messages without an id header")
    if deliveries.other_timestamps:
        problems.append(f"{deliveries.other_timestamps:,} messages not stamped LogAppendTime")
    if problems:
        raise TrialFailed("; ".join(problems), verdict)
    return verdict


def backlog(
    contestant: Contestant,
    trial: Trial,
    events: int,
    per_transaction: int,
    say: Say,
) -> dict[str, Any]:
    """Write the backlog, then start the contestant and time it until all is delivered."""
    contestant.prepare(trial)
    _one(trial.dsn, "checkpoint")
    start_lsn = _one(trial.dsn, "wal_lsn")
    say(f"writing {events:,} events in transactions of {per_transaction}")
    seconds = workload.write_backlog(trial.dsn, events, per_transaction)
    trial = replace(trial, end_lsn=_one(trial.dsn, "wal_lsn"))
    say(f"written in {seconds:.1f} s; starting {contestant.name}")
    db_cpu = server_cpu(trial.server_pid)
    # For a transactional contestant, when its commits made the messages readable.
    watch = (
        kafka.CommitWatch(trial.bootstrap, event_topics(trial)).start()
        if contestant.transactional
        else None
    )
    process = _start(contestant, trial)
    try:
        if contestant.delivers_to_kafka:
            _wait_delivered(process, trial, event_topics(trial), events, say, watch)
            usage, clean = _stop(contestant, process)
        else:
            finished = process.wait(STALL_TIMEOUT + events / 1000)
            if finished is None or finished.exit_code != 0:
                raise _died(process, "before reading up to the end of the backlog")
            usage, clean = finished, True
        db_cpu = server_cpu(trial.server_pid) - db_cpu
    finally:
        process.kill()
        if watch is not None:
            watch.close()
    wal_bytes = _one(trial.dsn, "wal_bytes_since", lsn=start_lsn)
    result: dict[str, Any] = {"write_s": round(seconds, 1), "stopped_cleanly": clean}
    result |= _figures(usage, db_cpu, wal_bytes, events)
    if not contestant.delivers_to_kafka:
        for slot in contestant.slots(trial):
            if not _one(trial.dsn, "slot_confirmed_past", slot=slot, lsn=trial.end_lsn):
                raise TrialFailed(f"slot {slot} was not confirmed up to {trial.end_lsn}")
        drain = usage.wall_s
        return result | {
            "events_written": events,
            "events_delivered": events,
            "lost": 0,
            "duplicates": 0,
            "events_per_s": round(events / drain),
            "time_to_drain_s": round(drain, 2),
            "startup_s": None,
        }
    say("reading every message back")
    deliveries = kafka.read_all(trial.bootstrap, event_topics(trial))
    result |= _verify(deliveries, workload.event_ids(trial.dsn))
    if watch is None:
        stamps = [stamp / 1000 for stamp in deliveries.first_append_ms.values()]
        first, last = min(stamps), max(stamps)
    else:  # committed, not appended: when a read_committed consumer could read them
        spans = deliveries.offsets.items()
        first = min(watch.readable_at(*where, low) for where, (low, _) in spans)
        last = max(watch.readable_at(*where, high) for where, (_, high) in spans)
        result["commit_watch_longest_wait_s"] = round(watch.longest_wait, 3)
    return result | {
        "events_per_s": round(events / max(last - first, 0.001)),
        "time_to_drain_s": round(last - process.started, 2),
        "startup_s": round(first - process.started, 2),
    }


def _percentiles(latencies: list[float]) -> dict[str, float]:
    cuts = statistics.quantiles(latencies, n=100, method="inclusive")
    return {
        "p50": round(cuts[49] * 1000, 1),
        "p95": round(cuts[94] * 1000, 1),
        "p99": round(cuts[98] * 1000, 1),
        "max": round(max(latencies) * 1000, 1),
    }


def steady(
    contestant: Contestant,
    trial: Trial,
    rate: float,
    duration: float,
    warmup: float,
    per_transaction: int,
    say: Say,
) -> dict[str, Any]:
    """Start the contestant, write at a steady rate for ``warmup`` s, then measure ``duration``
    s more at the same rate. Every event must arrive; the figures are the measured part's."""
    contestant.prepare(trial)
    reader = _live_reader(contestant, trial)
    process = _start(contestant, trial)
    try:
        _wait_ready(contestant, process, trial)
        say(
            f"up after {time.time() - process.started:.1f} s; {rate:g} events/s for "
            f"{warmup:g} s of warm-up, then {duration:g} s measured"
        )
        warm = workload.SteadyWriter(trial.dsn, rate, warmup, per_transaction)
        if warmup > 0:
            warm.start().join()
        _one(trial.dsn, "checkpoint")
        start_lsn = _one(trial.dsn, "wal_lsn")
        cpu_before = process.cpu_now()
        db_cpu = server_cpu(trial.server_pid)
        writer = workload.SteadyWriter(
            trial.dsn, rate, duration, per_transaction, first=len(warm.committed)
        )
        writer_started = time.time()
        writer.start().join()
        events = len(writer.committed)
        end_lsn = _one(trial.dsn, "wal_lsn")
        short = "" if workload.reached(writer.achieved_rate, rate) else f", short of {rate:,g}"
        say(f"wrote {events:,} events at {writer.achieved_rate:,.0f} events/s{short}")
        if contestant.delivers_to_kafka:
            expected = len(warm.committed) + events
            _wait_delivered(process, trial, event_topics(trial), expected, say, reader)
        else:
            deadline = time.monotonic() + STALL_TIMEOUT
            while not all(
                _one(trial.dsn, "slot_sent_past", slot=slot, lsn=end_lsn)
                for slot in contestant.slots(trial)
            ):
                if not process.alive():
                    raise _died(process, "before reading up to the end of the workload")
                if time.monotonic() > deadline:
                    raise TrialFailed(f"not caught up with the workload {STALL_TIMEOUT:g} s after")
                time.sleep(0.01)
            caught_up = time.time()
        cpu = process.cpu_now() - cpu_before
        db_cpu = server_cpu(trial.server_pid) - db_cpu
        usage, clean = _stop(contestant, process)
    finally:
        process.kill()
        if reader is not None:
            reader.close()
    wal_bytes = _one(trial.dsn, "wal_bytes_since", lsn=start_lsn)
    usage = replace(usage, cpu_s=cpu)
    result: dict[str, Any] = {
        "target_rate": rate,
        "write_rate": round(writer.achieved_rate),
        "rate_reached": workload.reached(writer.achieved_rate, rate),
        "stopped_cleanly": clean,
    } | _figures(usage, db_cpu, wal_bytes, events)
    if not contestant.delivers_to_kafka:
        return result | {
            "events_written": events,
            "events_delivered": events,
            "lost": 0,
            "duplicates": 0,
            "events_per_s": round(events / (caught_up - writer_started)),
            "latency_ms": None,
        }
    say("reading every message back")
    deliveries = kafka.read_all(trial.bootstrap, event_topics(trial))
    result |= _verify(deliveries, set(warm.committed) | set(writer.committed))
    result |= {"events_written": events, "events_delivered": events}  # the measured ones
    if reader is None:
        seen = {i: stamp / 1000 for i, stamp in deliveries.first_append_ms.items()}
    else:  # committed, not appended: when a read_committed consumer could read them
        seen = reader.first_read
    latencies = [seen[i] - t for i, t in writer.committed.items()]
    stamps = [seen[i] for i in writer.committed]
    span = max(stamps) - min(stamps)
    return result | {
        "events_per_s": round(events / max(span, 0.001)),
        "latency_ms": _percentiles(latencies),
    }
