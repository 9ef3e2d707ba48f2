"""The outage's log: a line per change of state and a summary now and then, whatever the number
of failed attempts the producers report."""

from __future__ import annotations

import logging
import threading

import pytest

from cdc_relay.kafka.outage import Outage


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _lines(caplog: pytest.LogCaptureFixture) -> list[tuple[str, str]]:
    return [
        (r.levelname, r.getMessage()) for r in caplog.records if r.name == "cdc_relay.kafka.outage"
    ]


def test_an_outage_is_one_warning_then_summaries_then_one_line_when_back(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    clock = Clock()
    kafka = Outage("Kafka", summary_interval=30, clock=clock)
    kafka.noted("Connect to ipv4#127.0.0.1:9092 failed: Connection refused")
    assert _lines(caplog) == []  # one failed connection is not an outage
    kafka.failed("Connect to ipv4#127.0.0.1:9092 failed: Connection refused")
    for _ in range(400):  # 40 s of librdkafka's reports from several producers
        clock.now += 0.1
        kafka.failed("1/1 brokers are down")
        kafka.noted("Connect to ipv4#127.0.0.1:9092 failed: Connection refused")
    kafka.waiting(1234)  # the summary is not due again yet
    clock.now += 25
    kafka.waiting(1234)
    kafka.back()
    kafka.back()
    assert _lines(caplog) == [
        (
            "WARNING",
            "Kafka unreachable: Connect to ipv4#127.0.0.1:9092 failed: Connection refused; "
            "retrying until it is back (events wait, in order, and nothing after them is "
            "confirmed)",
        ),
        (
            "WARNING",
            "Kafka still unreachable after 30 s (599 failed attempts since the last line; the "
            "last: Connect to ipv4#127.0.0.1:9092 failed: Connection refused)",
        ),
        (
            "WARNING",
            "Kafka still unreachable after 65 s (201 failed attempts since the last line; the "
            "last: Connect to ipv4#127.0.0.1:9092 failed: Connection refused); 1234 events "
            "wait for it",
        ),
        ("INFO", "Kafka reachable again after 65 s"),
    ]
    assert not kafka.down


def test_each_outage_is_told_once(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    clock = Clock()
    kafka = Outage("Kafka", clock=clock)
    for _ in range(3):
        kafka.failed("1/1 brokers are down")
        clock.now += 5
        kafka.back()
        clock.now += 5
    assert [level for level, _ in _lines(caplog)] == ["WARNING", "INFO"] * 3


def test_workers_reporting_at_once_give_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    kafka = Outage("Kafka")
    start = threading.Barrier(8)

    def report() -> None:
        start.wait()
        for _ in range(200):
            kafka.failed("Connection refused")

    workers = [threading.Thread(target=report) for _ in range(8)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert [level for level, _ in _lines(caplog)] == ["WARNING"]
