"""stream --exactly-once against a real PostgreSQL and a real Kafka broker: a read_committed
consumer sees every event once, in order, whatever kills the relay (ARCHITECTURE.md,
"Exactly once")."""

from __future__ import annotations

import random
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from relaytools import (
    Load,
    RelayProcess,
    Writer,
    check,
    consume,
    relay_env,
    setup_slot,
    slot_row,
    wait_slot,
    wait_until,
)

pytestmark = pytest.mark.integration


def eos_relay(
    tmp_path: Path, dsn: str, kafka: Any, names: Any, name: str = "eos", **extra: str
) -> RelayProcess:
    env = relay_env(
        dsn,
        kafka.bootstrap,
        names,
        exactly_once="1",
        checkpoint_topic=f"{names.topic_prefix}_checkpoints",
        **extra,
    )
    return RelayProcess(tmp_path, env, name=name)


def delivering(dsn: str, slot: str) -> None:
    start = slot_row(dsn, slot)["confirmed"]
    wait_until(lambda: slot_row(dsn, slot)["confirmed"] != start, 60, "the relay to confirm", 0.1)


def test_sigkill_at_random_moments_publishes_every_event_once(
    tmp_path: Path, outbox_db: str, kafka_service: Any, names: Any
) -> None:
    setup_slot(outbox_db, names)
    relay = eos_relay(tmp_path, outbox_db, kafka_service, names).start()
    load = Load(outbox_db, writers=2, pause=0.005).start()
    rng = random.Random()
    try:
        delivering(outbox_db, names.slot)
        # a large transaction too: it spans several Kafka transactions, and a kill in it
        # leaves a checkpoint in the middle of it
        big = Writer(outbox_db)
        big.transaction([("invoice", f"big{i % 7}", {"i": i}) for i in range(20_000)])
        for _ in range(5):
            time.sleep(rng.uniform(0.3, 3.0))
            relay.kill()
            wait_slot(outbox_db, names.slot, active=False)
            relay.start()
        delivering(outbox_db, names.slot)
        time.sleep(1)
        written = load.stop() + big.written
        big.close()
        received = consume(kafka_service.bootstrap, names.topic_prefix, expected=len(written))
        assert relay.stop() == 0
    finally:
        load.stop()
        relay.close()
    verdict = check(written, received, names.topic_prefix)
    print(verdict)
    assert verdict.lost == []
    assert verdict.duplicates == 0
    assert verdict.out_of_order == []
    assert verdict.mismatched == []
    log = relay.log()
    assert "exactly once: transactional id cdc-relay-" in log
    assert "events of the transaction at" in log or "Kafka holds the stream up to" in log


def test_a_relay_that_lost_the_slot_is_fenced_and_adds_nothing(
    tmp_path: Path, outbox_db: str, kafka_service: Any, names: Any
) -> None:
    """The active relay freezes; a standby takes the slot when PostgreSQL drops the frozen
    one's connection, and fences its producer; resumed, the old relay stops without a
    single event a read_committed consumer would see."""
    setup_slot(outbox_db, names)
    dsn = f"{outbox_db} options='-c wal_sender_timeout=2s'"
    first = eos_relay(tmp_path, dsn, kafka_service, names, name="first").start()
    second = eos_relay(tmp_path, dsn, kafka_service, names, name="second", standby="1")
    load = Load(outbox_db, writers=2, pause=0.005).start()
    try:
        delivering(outbox_db, names.slot)
        second.start()
        time.sleep(1)
        first.signal(signal.SIGSTOP)
        wait_until(lambda: "exactly once: transactional id" in second.log(), 60, "takeover")
        delivering(outbox_db, names.slot)
        first.signal(signal.SIGCONT)
        assert first.wait(60) != 0
        assert "another relay took over this slot's Kafka transactions" in first.log()
        time.sleep(1)
        written = load.stop()
        received = consume(kafka_service.bootstrap, names.topic_prefix, expected=len(written))
        assert second.stop() == 0
    finally:
        load.stop()
        first.close()
        second.close()
    verdict = check(written, received, names.topic_prefix)
    print(verdict)
    assert verdict.lost == []
    assert verdict.duplicates == 0
    assert verdict.out_of_order == []
    assert verdict.mismatched == []


def test_an_event_kafka_refuses_stops_the_relay_and_nothing_is_published_twice(
    tmp_path: Path, outbox_db: str, kafka_service: Any, names: Any
) -> None:
    """A 160 kB event on a topic of max.message.bytes 100 kB, between small events of other
    aggregates in one transaction: its Kafka transaction aborts, the relay finds it (alone in
    a transaction of its own) and stops at it with the usual one-line error; raised limit,
    restarted: every event once."""
    from test_refusals import SCENARIOS, apply_fix, last_line, prepare, write_workload

    scenario = SCENARIOS["too-large"]
    prefix = names.topic_prefix
    prepare(scenario, outbox_db, kafka_service.bootstrap, prefix)
    setup_slot(outbox_db, names)
    workload = write_workload(scenario, outbox_db)
    relay = eos_relay(tmp_path, outbox_db, kafka_service, names)
    try:
        relay.start()
        assert relay.wait(90) == 1, relay.log()[-3000:]
        last = last_line(relay)
        assert last.startswith(f"cdc-relay: error: Kafka refused event {workload.culprit.id}")
        assert scenario.remedy in last, last
        at_stop = consume(kafka_service.bootstrap, prefix, len(workload.before), 30, settle=1.5)
        assert workload.culprit.id not in {r.id for r in at_stop}
        apply_fix(scenario, kafka_service.bootstrap, prefix)
        relay.start()
        received = consume(kafka_service.bootstrap, prefix, len(workload.committed), 60)
        assert relay.stop() == 0
    finally:
        relay.close()
    verdict = check(workload.committed, received, prefix)
    print(verdict)
    assert verdict.lost == []
    assert verdict.duplicates == 0  # the innocents refused with it were aborted, not shown
    assert verdict.out_of_order == []
    assert verdict.mismatched == []
