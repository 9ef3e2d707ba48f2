"""Fault injection: real processes, real faults, for ``stream`` and for ``poll``.

Each scenario runs under a steady write load; then the checker compares what committed with
what Kafka holds: nothing lost, nothing altered, order per aggregate kept, duplicates within
what was in flight. The relays must ride out broker, PostgreSQL and network faults by
themselves (the same process, reconnecting with backoff); the time from each fault's end to
the first delivery after it is measured and reported in a table at the end of the run.

A fault of the relay (a kill, a restart elsewhere) is a test per relay. A fault of a service
or of the network hits every client at once, so both relays live through the same one, side
by side, relaying the same events to their own topics: half the broker restarts, which are
most of the suite's time.

This is the short version; ``make chaos`` (CDC_RELAY_CHAOS=1) runs the long one: 20 kills,
30 s outages, and the network cut in three ways (refused, blackholed, stalled: see TcpProxy).
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import faulttools
import pytest
from faulttools import (
    CHAOS,
    KILLS,
    OUTAGE,
    FaultRun,
    Instant,
    Mode,
    ProxiedKafka,
    Result,
    ResultsTable,
    TcpProxy,
    create_topics,
)
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from relaytools import Load, RelayProcess, check, consume, relay_env, slot_row, wait_until

from cdc_relay.lsn import parse as parse_lsn
from cdc_relay.postgres.shards import Shard, every_shard
from cdc_relay.postgres.slot import SlotSpec, setup

pytestmark = [
    pytest.mark.integration,
    pytest.mark.faults,
    pytest.mark.timeout(1800 if CHAOS else 300),
]

RELAYS = ("stream", "stream-eos", "poll")
CUTS: tuple[Mode, ...] = ("refuse", "blackhole", "stall") if CHAOS else ("refuse",)

MakeRun = Callable[..., FaultRun]


@pytest.fixture(scope="session")
def fault_results(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> ResultsTable:
    """The results table: in CDC_RELAY_FAULT_RESULTS, else in pytest's temporary directory,
    and printed at the end of the run."""
    given = os.environ.get("CDC_RELAY_FAULT_RESULTS")
    path = Path(given) if given else tmp_path_factory.getbasetemp() / "fault-results.md"
    table = ResultsTable(path.absolute())
    request.config.pluginmanager.register(table, "cdc-relay-fault-results")
    return table


@pytest.fixture
def make_run(
    tmp_path: Path, outbox_db: str, kafka_service: Any, names: Any, fault_results: ResultsTable
) -> Iterator[MakeRun]:
    """``make_run(scenario, *kinds, **where)``: a FaultRun on this test's database and names."""
    runs: list[FaultRun] = []

    def make(scenario: str, *kinds: str, **where: str) -> FaultRun:
        run = FaultRun(
            scenario,
            kinds or RELAYS,
            dsn=outbox_db,
            bootstrap=where.pop("bootstrap", kafka_service.bootstrap),
            names=names,
            log_dir=tmp_path,
            table=fault_results,
            **where,
        )
        runs.append(run)
        return run

    yield make
    for run in runs:
        run.close()


def _seeded() -> random.Random:
    seed = int(os.environ.get("CDC_RELAY_FAULT_SEED") or time.time_ns() % 1_000_000)
    print(f"random moments from seed {seed} (CDC_RELAY_FAULT_SEED={seed} repeats them)")
    return random.Random(seed)


# -- the relay killed ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", RELAYS)
def test_sigkill_at_random_moments(make_run: MakeRun, kind: str) -> None:
    run = make_run(f"SIGKILL x{KILLS} at random moments", kind).start()
    rng = _seeded()
    for _ in range(KILLS):
        time.sleep(rng.uniform(0.5, 4.0))  # now and then before it has even started
        run.restart()
    run.assert_sound(run.finish(), restarts=KILLS + 1)


def test_sigkill_at_random_moments_on_two_shards(
    tmp_path: Path, outbox_db: str, kafka_service: Any, names: Any, fault_results: ResultsTable
) -> None:
    """One outbox over two shard relays (stream --shard K/2), killed at random moments, each
    of them several times: together they lose nothing and keep every aggregate's order; each
    kill repeats at most what its shard had in flight."""
    spec = SlotSpec(slot=names.slot, publication=names.publication, table="outbox_events")
    shards = every_shard(2)
    for shard in shards:
        setup(outbox_db, spec.sharded(shard))
    prefix = f"{names.topic_prefix}_shards"
    create_topics(kafka_service.bootstrap, prefix)
    env = relay_env(
        outbox_db, kafka_service.bootstrap, names, topic_template=prefix + ".{aggregate_type}"
    )
    relays = [
        RelayProcess(tmp_path, {**env, "CDC_RELAY_SHARD": str(s)}, name=f"shard{s.index}")
        for s in shards
    ]

    def confirmed(shard: Shard) -> int:
        return parse_lsn(str(slot_row(outbox_db, spec.sharded(shard).slot)["confirmed"]))

    def delivering() -> None:
        for shard in shards:
            start = confirmed(shard)
            wait_until(lambda s=shard, at=start: confirmed(s) > at, 60, f"shard {shard}", 0.1)

    load = Load(outbox_db, writers=2, pause=0.01, reconnect=True).start()
    kills: list[tuple[Shard, Instant, int, Instant]] = []  # killed, confirmed, restarted
    try:
        for relay in relays:
            relay.start()
        delivering()
        rng = _seeded()
        victims = [shards[n % 2] for n in range(KILLS)]  # both, the order drawn at random
        rng.shuffle(victims)
        for shard in victims:
            time.sleep(rng.uniform(0.5, 4.0))
            relay = relays[shard.index]
            relay.kill()
            killed = Instant()
            wait_until(
                lambda s=shard: not slot_row(outbox_db, spec.sharded(s).slot)["active"],
                30,
                "the slot to be free",
                0.05,
            )
            at = confirmed(shard)
            relay.start()
            kills.append((shard, killed, at, Instant()))
        delivering()
        written = load.stop()
        received = consume(kafka_service.bootstrap, prefix, len(written), settle=1.0)
        alive = [relay.alive() for relay in relays]
    finally:
        load.stop()
        for relay in relays:
            relay.close()
    verdict = check(written, received, prefix)
    # What each kill may repeat: its shard's events committed before it and past the position
    # the shard's slot had confirmed (PostgreSQL replays them to the restarted relay).
    bound = sum(
        1
        for shard, killed, at, _ in kills
        for w in written
        if shard.owns(w.aggregate_id) and w.committed_at < killed.mono and w.after_commit_lsn > at
    )
    # From each restart to the first message of the restarted shard appended after it.
    stamps = sorted((r.timestamp, r.key) for r in received if r.timestamp is not None)
    recoveries: list[float | None] = [
        next(
            (
                t - restarted.wall
                for t, key in stamps
                if t > restarted.wall and shard.owns((key or b"").decode())
            ),
            None,
        )
        for shard, _, _, restarted in kills
    ]
    result = Result(
        scenario=f"SIGKILL x{KILLS} at random moments, on 2 shards",
        relay="stream --shard K/2",
        written=verdict.written,
        lost=len(verdict.lost),
        duplicated=verdict.duplicates,
        bound=bound,
        out_of_order=len(verdict.out_of_order),
        mismatched=len(verdict.mismatched),
        recoveries=recoveries,
    )
    fault_results.add(result)
    print(verdict, f"bound={bound}", result.recovery_text())
    assert verdict.lost == []
    assert verdict.mismatched == []
    assert verdict.out_of_order == []
    assert verdict.duplicates <= bound
    assert alive == [True, True]
    assert {shard.index for shard, _, _, _ in kills} == {0, 1}


@pytest.mark.parametrize("kind", RELAYS)
def test_restart_in_an_empty_working_folder(make_run: MakeRun, tmp_path: Path, kind: str) -> None:
    """The relay keeps no local state: killed, or stopped, and started again in a new empty
    folder (working directory, HOME and TMPDIR), it loses and repeats nothing beyond what was
    in flight, and it leaves its folders empty."""
    run = make_run("restarted in an empty folder (SIGKILL, then SIGTERM)", kind)
    folders = [tmp_path / f"{kind}-folder-{n}" for n in range(3)]

    def into(folder: Path) -> Path:
        folder.mkdir()
        run.relay.env.update(HOME=str(folder), TMPDIR=str(folder))
        return folder

    run.relay.cwd = into(folders[0])
    run.start()
    time.sleep(random.uniform(0.5, 2.0))
    run.restart(cwd=into(folders[1]))
    run.wait_delivering()
    run.restart(graceful=True, cwd=into(folders[2]))
    run.assert_sound(run.finish(), restarts=3)
    assert {f.name: sorted(p.name for p in f.iterdir()) for f in folders} == {
        f.name: [] for f in folders
    }


# -- the broker ---------------------------------------------------------------------------------


def test_broker_stopped_then_started(make_run: MakeRun, kafka_service: Any) -> None:
    run = make_run(f"broker stopped for {OUTAGE:g} s").start()
    with run.fault("broker stopped", quiet_early=True) as marks:
        try:
            kafka_service.stop()
            marks.quiet()
            time.sleep(OUTAGE)
        finally:
            kafka_service.start()
    outcomes = run.finish()
    run.assert_sound(outcomes)
    for outcome in outcomes:
        assert_quiet_outage(outcome.kind, outcome.relay.log())


def assert_quiet_outage(kind: str, log: str) -> None:
    """One warning when Kafka went away and one line when it came back, not a line per failed
    connection attempt of every producer (a poll relay printed 190 lines in a 5 s outage)."""
    lines = log.splitlines()
    went = [n for n, line in enumerate(lines) if "Kafka unreachable" in line]
    back = [n for n, line in enumerate(lines) if "Kafka reachable again" in line]
    assert len(went) == 1, f"{kind}\n{log[-5000:]}"
    assert len(back) == 1, f"{kind}\n{log[-5000:]}"
    noisy = [line for line in lines[went[0] :] if " WARNING " in line or " ERROR " in line]
    # The broker may take long to come back on a busy machine: a summary each 30 s meanwhile.
    assert len(noisy) <= 1 + 3 + 2, f"{kind}: {len(noisy)} lines\n" + "\n".join(noisy)


def test_broker_killed_then_started(make_run: MakeRun, kafka_service: Any) -> None:
    run = make_run("broker SIGKILL, restarted at once").start()
    with run.fault("broker killed", quiet_early=True) as marks:
        try:
            kafka_service.kill()
            marks.quiet()
        finally:
            kafka_service.start()
    outcomes = run.finish()
    run.assert_sound(outcomes)
    for outcome in outcomes:
        assert_quiet_outage(outcome.kind, outcome.relay.log())


# -- PostgreSQL ---------------------------------------------------------------------------------


def _on(request: pytest.FixtureRequest) -> str:
    """How the results table names the server of a ``pg18`` test's run: the default one not at
    all, PostgreSQL 18 so."""
    return " on PostgreSQL 18" if request.node.callspec.params["postgres_service"] == "pg18" else ""


@pytest.mark.pg18
@pytest.mark.parametrize("mode", ["fast", "immediate"])
def test_postgres_restarted(
    request: pytest.FixtureRequest, make_run: MakeRun, postgres_service: Any, mode: str
) -> None:
    run = make_run(f"PostgreSQL restart ({mode} shutdown){_on(request)}").start()
    with run.fault(f"PostgreSQL {mode} restart"):
        try:
            postgres_service.stop(mode)
        finally:
            postgres_service.start()
    run.assert_sound(run.finish())


# -- the network --------------------------------------------------------------------------------


@pytest.mark.pg18
@pytest.mark.parametrize("mode", CUTS)
def test_network_to_postgres_cut_then_restored(
    request: pytest.FixtureRequest, make_run: MakeRun, outbox_db: str, mode: Mode
) -> None:
    server = conninfo_to_dict(outbox_db)
    proxy = TcpProxy(str(server.get("host", "127.0.0.1")), int(server.get("port", 5432)))
    try:
        relay_dsn = make_conninfo(outbox_db, host="127.0.0.1", port=str(proxy.port))
        scenario = f"network to PostgreSQL cut for {OUTAGE:g} s ({mode}){_on(request)}"
        run = make_run(scenario, relay_dsn=relay_dsn)
        run.start()
        before = proxy.accepted
        assert before > 0  # the relays do go through the proxy
        with run.fault(f"network to PostgreSQL cut ({mode})"):
            try:
                proxy.cut(mode)
                time.sleep(OUTAGE)
            finally:
                proxy.restore()
        outcomes = run.finish()
    finally:
        proxy.close()
    run.assert_sound(outcomes)
    if mode != "stall":  # a stall leaves the connections as they were
        assert proxy.accepted > before  # they did connect again, through the proxy


proxied_kafka = pytest.fixture(scope="module")(faulttools.proxied_kafka)


@pytest.mark.parametrize("mode", CUTS)
def test_network_to_kafka_cut_then_restored(
    make_run: MakeRun, proxied_kafka: ProxiedKafka, mode: Mode
) -> None:
    proxy = proxied_kafka.proxy
    run = make_run(
        f"network to Kafka cut for {OUTAGE:g} s ({mode})",
        bootstrap=proxied_kafka.broker.bootstrap,
        relay_bootstrap=proxied_kafka.relay_bootstrap,
    ).start()
    before = proxy.accepted
    assert before > 0
    with run.fault(f"network to Kafka cut ({mode})"):
        try:
            proxy.cut(mode)
            time.sleep(OUTAGE)
        finally:
            proxy.restore()
    run.assert_sound(run.finish())
    if mode != "stall":
        assert proxy.accepted > before
