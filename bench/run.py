"""``python -m bench.run``: every contestant on every workload, on one machine, one run.

python -m bench.run                                  # the full size (make bench)
python -m bench.run --events 20000 --duration 10     # a quick run
python -m bench.run --contestants stream,debezium --workloads backlog
python -m bench.run --contestants stream,pg_recvlogical --rounds 3   # medians of 3 rounds
python -m bench.run --list                           # which contestants can run here

A full run (see ``full_run``) is refused while the machine's load average is above
``bench.load.QUIET``, unless ``--allow-noisy`` is given.
"""

from __future__ import annotations

import argparse
import datetime
import os
import pstats
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from bench import load, report, rounds, trials
from bench.contestants import CONTESTANTS, Contestant, Stream
from bench.kafka import PARTITIONS
from bench.trials import Services, TrialFailed
from bench.workload import RATE_SETTING, WORKLOADS
from cdc_relay.devstack.kafka import LocalKafka
from cdc_relay.devstack.postgres import LocalPostgres

RESULTS = Path(__file__).with_name("results")

EVENTS = 1_000_000
"""The backlog of a full run."""
DURATION = 60.0
"""The measured seconds of each steady workload in a full run."""
PROFILE_EVENTS = 200_000
"""The profile's backlog in a full run."""

# The bench cluster: fsync off as in every devstack cluster; room for a whole backlog's WAL
# without a checkpoint in the middle of a trial (each trial starts right after one).
POSTGRES_SETTINGS = {
    "shared_buffers": "256MB",
    "max_wal_size": "16GB",
    "checkpoint_timeout": "1h",
}


def _say(prefix: str) -> trials.Say:
    def say(text: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {prefix}: {text}", flush=True)

    return say


def _run_trial(
    services: Services,
    contestant: Contestant,
    workload: str,
    args: argparse.Namespace,
    events: int | None = None,
) -> dict[str, Any]:
    say = _say(f"{contestant.name}/{workload}")
    row: dict[str, Any] = {"contestant": contestant.name, "workload": workload}
    started = time.monotonic()
    try:
        with trials.trial_for(services, contestant, workload) as trial:
            if workload == "backlog":
                figures = trials.backlog(
                    contestant, trial, events or args.events, args.transaction_size, say
                )
            else:
                figures = trials.steady(
                    contestant,
                    trial,
                    getattr(args, RATE_SETTING[workload]),
                    args.duration,
                    args.warmup,
                    args.steady_transaction_size,
                    say,
                )
        row |= {"status": "ok", "reason": None} | figures
    except TrialFailed as err:
        row |= {"status": "failed", "reason": str(err)} | err.verdict
    except Exception as err:  # noqa: BLE001 - one broken trial must not void the others
        traceback.print_exc()
        row |= {"status": "failed", "reason": f"{type(err).__name__}: {err}"}
    row["trial_s"] = round(time.monotonic() - started, 1)
    say(f"{row['status']} in {row['trial_s']:.0f} s: " + _summary(row))
    return row


def _refused(
    services: Services, contestant: Contestant, args: argparse.Namespace
) -> list[dict[str, Any]]:
    """The rows of a contestant that cannot run here, or did not deliver its preflight's
    events; none when it may run."""
    reason = contestant.unavailable()
    status = "not available"
    if reason is None and args.preflight_events:
        check = _run_trial(services, contestant, "backlog", args, events=args.preflight_events)
        if check["status"] != "ok":
            reason = f"did not deliver {args.preflight_events:,} events: {check['reason']}"
            status = "failed"
    if reason is None:
        return []
    if status == "not available":
        _say("bench")(f"{contestant.name}: not available: {reason}")
    return [
        {"contestant": contestant.name, "workload": w, "status": status, "reason": reason}
        for w in args.workload_list
    ]


def _summary(row: dict[str, Any]) -> str:
    if row["status"] != "ok":
        return str(row["reason"]).splitlines()[0]
    keys = ("events_per_s", "time_to_drain_s", "latency_ms", "cpu_s", "peak_rss_mib")
    keys += ("wal_bytes_per_event",)
    return ", ".join(f"{k}={row[k]}" for k in keys if row.get(k) is not None)


def _profile(services: Services, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """``cdc-relay stream`` on the backlog under pyinstrument; its hottest functions."""
    session = services.workdir / "stream.pyisession"
    contestant = Stream("stream-profiled", profile=session)
    events = min(args.profile_events, args.events)
    row = _run_trial(services, contestant, "backlog", args, events=events)
    if row["status"] != "ok":
        return {"status": "failed", "reason": row["reason"], "events": events}
    if not session.is_file():
        return {"status": "failed", "reason": "pyinstrument wrote no session", "events": events}
    stats_path = services.workdir / "stream.pstats"
    # The tree for people, with library internals folded; every frame for the ranking.
    for options in (
        ["-r", "text", "--no-color", "-o", str(out / "profile.txt")],
        ["-r", "pstats", "--show-all", "-o", str(stats_path)],
    ):
        load = [sys.executable, "-m", "pyinstrument", f"--load={session}"]
        subprocess.run(load + options, check=True)
    stats = pstats.Stats(str(stats_path))
    entries = stats.stats  # type: ignore[attr-defined]
    total = max(stats.total_tt, 1e-9)  # type: ignore[attr-defined]
    hottest = []
    for (file, line, function), (_, _, own, cumulative, _) in sorted(
        entries.items(), key=lambda item: item[1][2], reverse=True
    )[: args.profile_top]:
        hottest.append(
            {
                "function": function,
                "where": f"{_short(file)}:{line}",
                "self_s": round(own, 3),
                "self_pct": round(100 * own / total, 1),
                "total_pct": round(100 * cumulative / total, 1),
            }
        )
    return {
        "status": "ok",
        "events": events,
        "events_per_s": row["events_per_s"],
        "profiled_s": round(total, 1),
        "hottest": hottest,
        "text": "profile.txt",
    }


def _short(file: str) -> str:
    """A profiled file's name without the machine's folders: from the package on."""
    if "/cdc_relay/" in file:  # wherever the relay was imported from
        return "cdc_relay/" + file.rsplit("/cdc_relay/", 1)[1]
    for marker in ("site-packages/", "/lib/python3", str(report.REPO) + "/"):
        if marker in file:
            return file.split(marker, 1)[1]
    return file


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.run", description=__doc__.split("\n\n")[0] if __doc__ else None
    )
    names = [c.name for c in CONTESTANTS]
    parser.add_argument("--events", type=int, default=EVENTS, help="backlog size")
    parser.add_argument("--transaction-size", type=int, default=100, help="backlog, per COMMIT")
    parser.add_argument("--rate", type=int, default=5_000, help="steady: events/s")
    parser.add_argument(
        "--high-rate", type=int, default=20_000, help="steady-high: events/s (its only difference)"
    )
    parser.add_argument(
        "--duration", type=float, default=DURATION, help="steady, steady-high: measured seconds"
    )
    parser.add_argument(
        "--warmup",
        type=float,
        default=15.0,
        help="steady, steady-high: seconds at the same rate before the measured --duration "
        "(JIT, caches)",
    )
    parser.add_argument(
        "--steady-transaction-size",
        type=int,
        default=10,
        help="steady, steady-high: events per COMMIT",
    )
    parser.add_argument(
        "--contestants",
        default=",".join(names),
        help=f"comma-separated, from: {', '.join(names)} (default: all)",
    )
    parser.add_argument(
        "--workloads",
        default=",".join(WORKLOADS),
        help=f"comma-separated, from: {', '.join(WORKLOADS)} (default: all)",
    )
    parser.add_argument(
        "--profile", action="store_true", help="also profile `cdc-relay stream` on a backlog"
    )
    parser.add_argument(
        "--profile-events",
        type=int,
        default=PROFILE_EVENTS,
        help=f"its backlog (default {PROFILE_EVENTS:,}, at most --events): the hot spots",
    )
    parser.add_argument("--profile-top", type=int, default=12, help="functions to report")
    parser.add_argument(
        "--preflight-events",
        type=int,
        default=1_000,
        help="each contestant first proves it delivers this many events (0: skip)",
    )
    parser.add_argument(
        "--allow-noisy",
        action="store_true",
        help=f"run a full run even when the 1-minute load average is above {load.QUIET:.1f} "
        "(the results say noisy)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run every trial this many times, in turns, and give the median of each figure "
        "with each round's (bench/rounds.py)",
    )
    parser.add_argument("--out", type=Path, default=RESULTS, help="results folder")
    parser.add_argument("--list", action="store_true", help="list contestants and exit")
    args = parser.parse_args(argv)
    wanted = [n.strip() for n in args.contestants.split(",") if n.strip()]
    unknown = sorted(set(wanted) - set(names))
    if unknown:
        parser.error(f"unknown contestant(s) {', '.join(unknown)}; choose from {', '.join(names)}")
    args.selected = [c for c in CONTESTANTS if c.name in wanted]
    asked = {w.strip() for w in args.workloads.split(",") if w.strip()}
    unknown = sorted(asked - set(WORKLOADS))
    if unknown or not asked:
        parser.error(f"--workloads {args.workloads!r}: choose from {', '.join(WORKLOADS)}")
    args.workload_list = [w for w in WORKLOADS if w in asked]
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: at least 1")
    return args


def full_run(args: argparse.Namespace) -> list[str]:
    """What makes this run a full one: each measurement it makes at its full size or larger.

    Whichever contestants it runs: a backlog of ``EVENTS`` events, a steady workload measured
    for ``DURATION`` seconds, a profile of ``PROFILE_EVENTS`` events. An empty list: a small
    run, whose figures are not meant to stand beside a full run's.
    """
    full = []
    if "backlog" in args.workload_list and args.events >= EVENTS:
        full.append(f"backlog of {args.events:,} events")
    steady = [w for w in args.workload_list if w in RATE_SETTING]
    if steady and args.duration >= DURATION:
        full.append(f"{', '.join(steady)} measured for {args.duration:g} s")
    profiled = min(args.profile_events, args.events)
    if args.profile and profiled >= PROFILE_EVENTS:
        full.append(f"profile on a backlog of {profiled:,} events")
    return full


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.list:
        for contestant in CONTESTANTS:
            reason = contestant.unavailable()
            print(f"{contestant.name:16} {'available' if reason is None else reason}")
        return 0
    command = " ".join(["python -m bench.run", *(sys.argv[1:] if argv is None else argv)])
    full = full_run(args)
    load_start = load.read()
    verdict = load.check(load_start, full, args.allow_noisy, command)
    if verdict.message:
        print(f"bench: {verdict.message}", file=sys.stderr, flush=True)
    if not verdict.go:
        return 2
    started = time.monotonic()
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    out = args.out / stamp
    workdir = args.out / "tmp" / stamp
    workdir.mkdir(parents=True)
    say = _say("bench")
    say(f"services and logs under {workdir}")
    postgres = LocalPostgres(workdir / "postgres", settings=POSTGRES_SETTINGS)
    broker = LocalKafka(workdir / "kafka")
    results: list[dict[str, Any]] = []
    profile: dict[str, Any] | None = None
    try:
        postgres.start()
        broker.start()
        services = Services(postgres, broker, workdir)
        machine = report.describe_machine(postgres.dsn)
        # Round 1 of every contestant (each after its preflight), then round 2, ...
        ran: dict[str, list[list[dict[str, Any]]]] = {}
        refused: set[str] = set()  # not available here, or its preflight failed
        for round_ in range(args.rounds):
            for contestant in args.selected:
                if round_ == 0:
                    rows = _refused(services, contestant, args)
                    ran[contestant.name] = [[row] for row in rows] or [
                        [] for _ in args.workload_list
                    ]
                    if rows:
                        refused.add(contestant.name)
                if contestant.name in refused:
                    continue
                if args.rounds > 1:
                    say(f"round {round_ + 1} of {args.rounds}: {contestant.name}")
                for n, w in enumerate(args.workload_list):
                    ran[contestant.name][n].append(_run_trial(services, contestant, w, args))
        results += [rounds.merge(rows) for trials_ in ran.values() for rows in trials_]
        if args.profile:
            out.mkdir(parents=True, exist_ok=True)
            profile = _profile(services, args, out)
    finally:
        broker.cleanup(keep_logs=True)
        postgres.cleanup(keep_logs=True)
    load_end = load.read()
    machine["load_average_start"] = load.text(load_start)
    machine["load_average_end"] = load.text(load_end)
    data = {
        "machine": machine,
        "load": {
            "quiet": load.QUIET,
            "start": load_start,
            "end": load_end,
            "noisy": verdict.noisy,
            "full_run": full,
            "allow_noisy": args.allow_noisy,
        },
        "settings": {
            "events": args.events,
            "transaction_size": args.transaction_size,
            "rate": args.rate,
            "high_rate": args.high_rate,
            "duration": args.duration,
            "warmup": args.warmup,
            "steady_transaction_size": args.steady_transaction_size,
            "partitions": PARTITIONS,
            "preflight_events": args.preflight_events,
            "rounds": args.rounds,
            "workloads": args.workload_list,
            "command": command,
        },
        "results": results,
        "profile": profile,
        "elapsed_s": round(time.monotonic() - started, 1),
    }
    report.write(data, out, latest=args.out / "latest.md")
    say(f"results in {out} ({data['elapsed_s'] / 60:.1f} min)")
    print(report.markdown(data))
    failed = [r for r in results if r["status"] == "failed"]
    return 1 if failed or (profile and profile["status"] != "ok") else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
