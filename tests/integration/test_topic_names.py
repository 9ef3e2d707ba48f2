"""Aggregate types whose topics meet: what each relay does, against the real Kafka.

Two cases (docs/wire.md, "What lands on Kafka"):

- Kafka's own rule: ``.`` and ``_`` are the same to it in a topic name, so once
  ``<prefix>.order_line`` exists the broker refuses to create ``<prefix>.order.line``, and
  the client only hears "unknown topic" after ``topic.metadata.propagation.max.ms`` (30 s).
  The relay refuses such an event itself, at once, as the culprit (its refusal policy:
  ``stream`` stops naming it, or dead-letters it; ``poll`` retries it, then parks it).
- The relay's own rule: characters Kafka does not allow in a topic name become ``_``, so
  ``order/line`` and ``order_line`` would share ``<prefix>.order_line``; the second name a
  relay meets is refused, naming both and the topic.

And an event Kafka does not answer for is named in a warning within seconds, with the
reason when the topic's metadata tells it; the stop line counts it.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import psycopg
import pytest
from relaytools import (
    RelayProcess,
    Writer,
    Written,
    consume,
    install_poller,
    pending_inserts,
    relay_env,
    setup_slot,
    wait_until,
)

pytestmark = pytest.mark.integration

# The relay must say it within this; librdkafka alone takes 30 s (and twice that for the
# stream, which sends the refused event again alone before it stops).
SECONDS = 20


def last_line(relay: RelayProcess) -> str:
    lines = relay.log().strip().splitlines()
    return lines[-1] if lines else ""


def stop_line(relay: RelayProcess) -> str:
    return next(line for line in reversed(relay.log().splitlines()) if "stopped;" in line)


def write(dsn: str, *events: tuple[str, str]) -> list[Written]:
    """One transaction per (aggregate type, aggregate id)."""
    writer = Writer(dsn)
    try:
        return [writer.transaction([(kind, key, {"key": key})])[0] for kind, key in events]
    finally:
        writer.close()


def ids_on(received: list[Any], topic: str) -> set[str]:
    return {r.id for r in received if r.topic == topic}


def test_stream_refuses_an_event_whose_topic_collides_in_kafka_then_dead_letters_it(
    tmp_path: Path, outbox_db: str, kafka_service: Any, names: Any
) -> None:
    prefix = names.topic_prefix
    setup_slot(outbox_db, names)
    first, culprit, after = write(
        outbox_db, ("order_line", "k1"), ("order.line", "k2"), ("order_line", "k3")
    )
    relay = RelayProcess(tmp_path, relay_env(outbox_db, kafka_service.bootstrap, names))
    try:
        started = time.monotonic()
        relay.start()
        code = relay.wait(SECONDS)
        took = time.monotonic() - started
        last = last_line(relay)
        assert code == 1, relay.log()[-4000:]
        assert last.startswith(
            f"cdc-relay: error: Kafka refused event {culprit.id} (order.line.changed, aggregate "
            f"k2) for topic {prefix}.order.line: "
        ), last
        assert f"collides with existing topic {prefix}.order_line" in last, last
        assert "--dead-letter-topic" in last, last
        assert "Traceback" not in relay.log()
        # The refused event is counted: it is sent again on restart.
        assert "stopped; 1 event not acknowledged" in stop_line(relay), relay.log()
        print(f"stopped after {took:.1f} s")
        # Its transaction and the next stay in the slot; what came before is on Kafka.
        assert pending_inserts(outbox_db, names.slot, names.publication) == 2
        received = consume(kafka_service.bootstrap, prefix, 1, 30, settle=1)
        assert [r.id for r in received] == [first.id]

        # Set aside: the topic exists now (a later run's case), and the event is refused
        # again, at once, from Kafka's topic list.
        dead = f"{prefix}.dead-letters"
        relay.env["CDC_RELAY_DEAD_LETTER_TOPIC"] = dead
        relay.start()
        received = consume(kafka_service.bootstrap, prefix, 3, SECONDS, settle=1)
        assert relay.alive(), relay.log()[-4000:]
        assert relay.stop() == 0
    finally:
        relay.close()
    assert ids_on(received, f"{prefix}.order_line") == {first.id, after.id}
    (letter,) = [r for r in received if r.topic == dead]
    headers = dict(letter.headers)
    assert letter.id == culprit.id
    assert headers["original_topic"] == f"{prefix}.order.line".encode()
    assert headers["error_code"] == b"TOPIC_EXCEPTION"
    assert b"collides with existing topic" in headers["error"]
    assert pending_inserts(outbox_db, names.slot, names.publication) == 0


def test_poll_parks_an_event_whose_topic_collides_in_kafka_and_delivers_the_others(
    tmp_path: Path, outbox_db: str, kafka_service: Any, names: Any
) -> None:
    prefix = names.topic_prefix
    install_poller(outbox_db)
    first, culprit, after = write(
        outbox_db, ("order_line", "k1"), ("order.line", "k2"), ("order_line", "k3")
    )
    env = relay_env(
        outbox_db,
        kafka_service.bootstrap,
        names,
        max_attempts="2",
        backoff_base="0.05",
        backoff_max="0.1",
        poll_interval="0.5",
    )
    relay = RelayProcess(tmp_path, env, name="poll", command="poll")

    def dead_letters() -> list[tuple[Any, ...]]:
        with psycopg.connect(outbox_db, autocommit=True) as conn:
            return conn.execute("SELECT id::text, last_error FROM outbox_dead_letters").fetchall()

    try:
        relay.start()
        wait_until(lambda: dead_letters() != [], SECONDS, "the event to become a dead letter")
        received = consume(kafka_service.bootstrap, prefix, 2, SECONDS, settle=1)
        assert relay.stop() == 0
    finally:
        relay.close()
    ((dead_id, error),) = dead_letters()
    assert dead_id == culprit.id
    assert f"collides with existing topic {prefix}.order_line" in error, error
    assert ids_on(received, f"{prefix}.order_line") == {first.id, after.id}
    assert f"gave up on event {culprit.id} after 2 attempts" in relay.log()
    assert "Traceback" not in relay.log()


def test_stream_refuses_a_second_aggregate_type_made_into_the_same_topic(
    tmp_path: Path, outbox_db: str, kafka_service: Any, names: Any
) -> None:
    prefix = names.topic_prefix
    setup_slot(outbox_db, names)
    first, second = write(outbox_db, ("order/line", "k1"), ("order_line", "k2"))
    relay = RelayProcess(tmp_path, relay_env(outbox_db, kafka_service.bootstrap, names))
    try:
        relay.start()
        code = relay.wait(SECONDS)
    finally:
        relay.close()
    last = last_line(relay)
    assert code == 1, relay.log()[-4000:]
    assert last.startswith("cdc-relay: error: "), last
    assert second.id in last, last
    assert f"'order_line' and 'order/line' both make topic {prefix}.order_line" in last, last
    assert "Traceback" not in relay.log()
    received = consume(kafka_service.bootstrap, prefix, 1, 30, settle=1)
    assert [(r.topic, r.id) for r in received] == [(f"{prefix}.order_line", first.id)]
    assert pending_inserts(outbox_db, names.slot, names.publication) == 1


def test_an_event_kafka_does_not_answer_for_is_named_and_counted_when_stopping(
    tmp_path: Path, outbox_db: str, kafka_service: Any, names: Any
) -> None:
    """A topic that does not exist and that the producer may not create: librdkafka waits
    ``topic.metadata.propagation.max.ms`` before it refuses the event, saying nothing
    meanwhile. Stopped before that, the refusal comes while the stop waits for Kafka."""
    setup_slot(outbox_db, names)
    (event,) = write(outbox_db, ("fresh", "k1"))
    config = "allow.auto.create.topics=false topic.metadata.propagation.max.ms=12000"
    env = relay_env(outbox_db, kafka_service.bootstrap, names, kafka_config=config)
    relay = RelayProcess(tmp_path, env)
    try:
        relay.start()
        wait_until(lambda: "has waited" in relay.log(), 10, "a warning about the event", 0.1)
        assert relay.stop() == 0
    finally:
        relay.close()
    (warning,) = [line for line in relay.log().splitlines() if "has waited" in line]
    assert f"event {event.id} (fresh.changed, aggregate k1)" in warning, warning
    assert f"topic {names.topic_prefix}.fresh does not exist" in warning, warning
    assert "stopped; 1 event not acknowledged" in stop_line(relay), relay.log()
    assert pending_inserts(outbox_db, names.slot, names.publication) == 1
