"""/healthz and /readyz (metrics.Health): alive while the loop turns; ready while connected
and moving, that is not once events have waited for Kafka ``stall_timeout`` seconds with none
acknowledged meanwhile."""

from __future__ import annotations

from pathlib import Path

import click

from cdc_relay.commands.cli import cli
from cdc_relay.metrics import STALL_TIMEOUT, Health

ROOT = Path(__file__).resolve().parents[2]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def health(waiting: list[int], delivered: list[int]) -> tuple[Health, Clock]:
    """A connected relay whose events waiting and delivered the test sets."""
    clock = Clock()
    state = Health(liveness_timeout=60, stall_timeout=30, clock=clock)
    state.readiness = lambda: (True, "ok")
    state.progress = lambda: (waiting[0], delivered[0])
    return state, clock


def test_ready_while_idle_however_long() -> None:
    state, clock = health([0], [0])
    for _ in range(10):
        clock.now += 25
        state.beat()
        assert state.ready() == (True, "ok")


def test_ready_while_events_wait_and_kafka_acknowledges_some() -> None:
    waiting, delivered = [500], [0]
    state, clock = health(waiting, delivered)
    for _ in range(10):
        clock.now += 25
        delivered[0] += 10
        state.beat()
        assert state.ready() == (True, "ok")


def test_not_ready_once_events_waited_the_stall_timeout_with_none_acknowledged() -> None:
    waiting, delivered = [3], [7]
    state, clock = health(waiting, delivered)
    assert state.ready() == (True, "ok")  # first look: it moved (7 delivered since start)
    clock.now += 29
    state.beat()
    assert state.ready() == (True, "ok")
    clock.now += 2
    state.beat()
    assert state.ready() == (False, "3 events waiting for Kafka, none acknowledged for 31s")
    assert state.alive() == (True, "ok"), "stuck is not dead: a restart brings no broker back"
    # One acknowledgement, and it is ready again.
    delivered[0] += 1
    assert state.ready() == (True, "ok")
    # Nothing waiting: ready, and the wait counts afresh from when events wait again.
    clock.now += 100
    waiting[0] = 0
    state.beat()
    assert state.ready() == (True, "ok")
    waiting[0] = 1
    clock.now += 29
    state.beat()
    assert state.ready() == (True, "ok")


def test_the_connections_and_liveness_come_first() -> None:
    waiting, delivered = [3], [0]
    state, clock = health(waiting, delivered)
    state.readiness = lambda: (False, "not connected to Kafka")
    clock.now += 40
    state.beat()
    assert state.ready() == (False, "not connected to Kafka")
    clock.now += 61
    assert state.ready() == (False, "loop stalled for 61s")
    assert state.alive() == (False, "loop stalled for 61s")


def test_a_new_health_is_alive_and_not_ready_until_the_relay_says() -> None:
    state = Health()
    assert state.alive() == (True, "ok")
    assert state.ready() == (False, "starting")


def test_the_stall_timeout_outlasts_a_kafka_transaction_and_the_docs_say_it() -> None:
    """Exactly once acknowledges events only at the Kafka transaction's commit: a relay
    keeping one open for the longest --transaction-interval is moving, not stuck."""
    interval = next(p for p in cli.commands["stream"].params if p.name == "transaction_interval")
    assert isinstance(interval.type, click.FloatRange)
    assert interval.type.max is not None and interval.type.max < STALL_TIMEOUT
    said = f"waited {STALL_TIMEOUT:g} s for Kafka"
    for path in (ROOT / "docs" / "operations.md", ROOT / "deploy" / "base" / "deployment.yaml"):
        assert said in " ".join(path.read_text().split()), path
    option = next(p for p in cli.commands["stream"].params if p.name == "metrics_port")
    assert said in " ".join((option.help or "").split())
