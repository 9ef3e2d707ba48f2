"""What a stream relay tells Prometheus and the probes of its role and state, on the loop's
in-memory stages (test_stream_loop): a standby says so (cdc_relay_standby), is connected to
PostgreSQL while the server answers its attempts to take the slot, and ready only then; a
relay (stream or poll) whose events wait for Kafka with none acknowledged is not ready."""

from __future__ import annotations

import pytest
from memory_outbox import MemoryOutbox
from prometheus_client import REGISTRY
from test_poll_loop import Relay
from test_stream_loop import Wal, acked_ids, backlog, first_seen, relay_on

from cdc_relay.metrics import Health
from cdc_relay.relay import standby


def gauges() -> tuple[float | None, float | None]:
    """cdc_relay_standby and cdc_relay_connected{service="postgres"}, as a scrape reads them."""
    return (
        REGISTRY.get_sample_value("cdc_relay_standby"),
        REGISTRY.get_sample_value("cdc_relay_connected", {"service": "postgres"}),
    )


def test_a_standby_reports_its_role_and_whether_postgresql_answers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Standing by while another relay holds the slot (two attempts), then PostgreSQL away
    for three (a failover), then the slot is free: it takes over."""
    monkeypatch.setattr(standby, "_STANDBY_RETRY", 0.01)
    wal = Wal(backlog())
    relay, sink = relay_on(wal, standby=True)
    relay._register_metrics()
    seen: list[tuple[tuple[float, float], tuple[bool, str]]] = []
    sink.on_poll = lambda: seen.append((gauges(), relay._readiness()))
    wal.taken = 2
    wal.unreachable = 3
    wal.on_idle = lambda: set(acked_ids(sink)) == set(wal.event_ids) and relay.request_stop()

    relay.stream(wal.tables)

    assert first_seen(acked_ids(sink)) == wal.event_ids
    waiting = ((1, 1), (True, "standing by for slot test"))
    away = ((1, 0), (False, "standing by, PostgreSQL does not answer"))
    streaming = ((0, 1), (True, "ok"))
    states = [state for i, state in enumerate(seen) if i == 0 or seen[i - 1] != state]
    assert states == [waiting, away, streaming]
    assert gauges()[0] == 0


def test_a_relay_without_standby_is_never_a_standby() -> None:
    wal = Wal(backlog())
    relay, sink = relay_on(wal)
    relay._register_metrics()
    wal.on_idle = lambda: set(acked_ids(sink)) == set(wal.event_ids) and relay.request_stop()
    relay.stream(wal.tables)
    assert gauges()[0] == 0


def test_not_ready_while_events_wait_for_kafka_with_none_acknowledged() -> None:
    """Connected to both, but Kafka acknowledges nothing (a stalled broker, a partition
    without a leader): not ready once the stall timeout passed, ready again once Kafka
    acknowledges. Alive all along."""
    wal = Wal(backlog())
    relay, sink = relay_on(wal)
    relay.health = Health(stall_timeout=0.2)
    relay._register_metrics()
    sink.hold_all = True
    looks: list[tuple[bool, str]] = []

    def look() -> None:
        if len(looks) > 1000:
            sink.hold_all = False
        looks.append(relay.health.ready())
        if set(acked_ids(sink)) == set(wal.event_ids):
            relay.request_stop()

    wal.on_idle = look
    relay.stream(wal.tables)

    stuck = f"{len(wal.event_ids)} events waiting for Kafka, none acknowledged for"
    assert looks[0] == (True, "ok")
    assert any(not ok and reason.startswith(stuck) for ok, reason in looks)
    assert looks[-1] == (True, "ok")
    assert relay.health.alive() == (True, "ok")


def test_a_poller_whose_rows_wait_for_kafka_with_none_acknowledged_is_not_ready() -> None:
    """The same rule for poll: its workers' producers hold rows, Kafka acknowledges none."""
    store = MemoryOutbox()
    for n in range(10):
        store.add(f"a{n % 3}")
    relay = Relay(store, workers=2)
    relay.relay.health = Health(stall_timeout=0.2)
    relay.relay._listening = True  # the listener's connection, which poll() does not open
    relay.setup = lambda sink: setattr(sink, "hold_all", True)
    looks: list[tuple[bool, str]] = []

    def stuck_then_released() -> bool:
        look = relay.relay.health.ready()
        if look == (False, "starting"):
            return False  # the relay's thread has not registered its readiness yet
        looks.append(look)
        if not looks[-1][0]:
            for sink in relay.sinks:
                sink.hold_all = False
        return store.done()

    relay.run_until(stuck_then_released)

    assert relay.error is None
    assert looks[0] == (True, "ok")
    assert any(
        not ok and "events waiting for Kafka, none acknowledged for" in reason
        for ok, reason in looks
    )
    assert looks[-1] == (True, "ok")
