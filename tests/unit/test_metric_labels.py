"""Metric labels made of event data stay few: a Prometheus series per value of an
application's field would grow without bound (and with it every scrape)."""

from __future__ import annotations

from confluent_kafka import KafkaError
from prometheus_client import REGISTRY

from cdc_relay.kafka.refusals import refusal_error
from cdc_relay.kafka.routing import Message


def failed_series() -> set[str]:
    return {
        sample.labels["event_type"]
        for metric in REGISTRY.collect()
        if metric.name == "outbox_events_failed"
        for sample in metric.samples
        if sample.name == "outbox_events_failed_total" and sample.labels["relay"] == "test"
    }


def test_the_event_type_label_of_failed_events_is_bounded() -> None:
    for n in range(1000):
        message = Message(
            topic="outbox.event.order",
            key=b"1",
            value=b"{}",
            headers=[("id", f"id-{n}".encode()), ("event_type", f"type-{n}".encode())],
        )
        refusal_error(message, KafkaError(KafkaError.MSG_SIZE_TOO_LARGE), "test")
    series = failed_series()
    assert len(series) <= 101
    assert "(other)" in series
    assert "type-0" in series  # the first ones keep their own
