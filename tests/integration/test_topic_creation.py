"""--create-topics against a broker that creates no topic on demand (relaytools.strict_broker,
as test_refusals runs), with a SCRAM listener for a principal that may not create topics.

- a new aggregate type mid-stream gets its topic made as asked (partitions, replication
  factor, settings, described back with the AdminClient), on ``stream`` and on ``poll``, and
  no event is lost or dead-lettered;
- two relays making the same topic at once both go on, and there is one topic;
- a denied creation stops the relay in one line, nothing past the event confirmed (slot,
  processed_at), and a run with the right delivers everything;
- a topic Kafka has with another partition count is used as it is, with one warning;
- setup-slot --create-topics makes the dead-letter and the checkpoint topics, and an invalid
  setting or replication factor is one line;
- an aggregate type that names one of Kafka's internal topics (``__...``) is refused, not made;
- (open, xfail) a topic deleted while the relay runs is made again, its events not
  dead-lettered.

docs/wire.md ("Topics: --create-topics") and ARCHITECTURE.md ("Topics made before their first
event") say what the relay does.
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest
from confluent_kafka.admin import (
    AclBinding,
    AclOperation,
    AclPermissionType,
    AdminClient,
    ConfigResource,
    ResourcePatternType,
    ResourceType,
)
from relaytools import (
    RelayProcess,
    Writer,
    Written,
    check,
    consume,
    create_topics,
    install_poller,
    pending_inserts,
    relay_env,
    setup_slot,
    strict_broker,
    wait_until,
)

from cdc_relay.devstack import LOOPBACK, free_ports
from cdc_relay.devstack.kafka import LocalKafka

pytestmark = pytest.mark.integration

NO_CREATE = "nocreate"  # a SCRAM principal that may do everything but create topics
POLL_OPTIONS = {"poll_interval": "0.5", "shutdown_timeout": "5"}
TOPIC_SETTINGS = {"retention.ms": "123456789", "max.message.bytes": "2000000"}
SECONDS = 60


@dataclass(frozen=True)
class Broker:
    kafka: LocalKafka
    bootstrap: str
    """PLAINTEXT: User:ANONYMOUS, a super user (the tests, and a relay with every right)."""
    sasl: str
    """SCRAM-SHA-512 without TLS, for NO_CREATE with ``password``."""
    password: str


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Broker]:
    plaintext, controller, sasl = free_ports(3)
    ports = {"PLAINTEXT": plaintext, "CONTROLLER": controller, "SASL_PLAINTEXT": sasl}
    listeners = ",".join(f"{name}://{LOOPBACK}:{port}" for name, port in ports.items())
    password = secrets.token_hex(8)
    kafka = strict_broker(
        tmp_path_factory.mktemp("kafka_creation"),
        {
            "listeners": listeners,
            "advertised.listeners": listeners,
            "listener.security.protocol.map": "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT,"
            "SASL_PLAINTEXT:SASL_PLAINTEXT",
            "sasl.enabled.mechanisms": "SCRAM-SHA-512",
            "listener.name.sasl_plaintext.scram-sha-512.sasl.jaas.config": (
                "org.apache.kafka.common.security.scram.ScramLoginModule required;"
            ),
            # the tests and the broker itself: the ACLs below are NO_CREATE's alone
            "super.users": "User:ANONYMOUS",
            "offsets.topic.num.partitions": "1",
        },
        port=plaintext,
        controller_port=controller,
        format_args=["--add-scram", f"SCRAM-SHA-512=[name={NO_CREATE},password={password}]"],
    )
    try:
        kafka.start()
        bootstrap = f"{LOOPBACK}:{plaintext}"
        _no_create_acls(bootstrap)
        yield Broker(kafka, bootstrap, f"{LOOPBACK}:{sasl}", password)
    finally:
        kafka.cleanup(keep_logs=True)


def _no_create_acls(bootstrap: str) -> None:
    """NO_CREATE may do everything (ALL on every topic, group, transactional id and the
    cluster) but create topics: CREATE denied on the cluster and on every topic."""
    principal = f"User:{NO_CREATE}"
    resources = [
        (ResourceType.TOPIC, "*"),
        (ResourceType.GROUP, "*"),
        (ResourceType.TRANSACTIONAL_ID, "*"),
        (ResourceType.BROKER, "kafka-cluster"),
    ]
    bindings = [
        AclBinding(
            kind,
            name,
            ResourcePatternType.LITERAL,
            principal,
            "*",
            AclOperation.ALL,
            AclPermissionType.ALLOW,
        )
        for kind, name in resources
    ] + [
        AclBinding(
            kind,
            name,
            ResourcePatternType.LITERAL,
            principal,
            "*",
            AclOperation.CREATE,
            AclPermissionType.DENY,
        )
        for kind, name in ((ResourceType.TOPIC, "*"), (ResourceType.BROKER, "kafka-cluster"))
    ]
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for future in admin.create_acls(bindings).values():
        future.result(timeout=30)


def no_create_client(broker: Broker) -> dict[str, str]:
    """The relay's environment as NO_CREATE, on the SCRAM listener."""
    return {
        "CDC_RELAY_KAFKA_BOOTSTRAP": broker.sasl,
        "CDC_RELAY_KAFKA_CONFIG": "security.protocol=SASL_PLAINTEXT "
        f"sasl.mechanisms=SCRAM-SHA-512 sasl.username={NO_CREATE}",
        "CDC_RELAY_KAFKA_SASL_PASSWORD": broker.password,
    }


# -- what the tests read -----------------------------------------------------------------------


@dataclass(frozen=True)
class Described:
    partitions: int
    replication_factor: int
    config: dict[str, str]


def describe(bootstrap: str, topic: str) -> Described:
    """What Kafka says of ``topic``: its partitions, their replicas, the settings asked."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    metadata = admin.list_topics(topic, timeout=30).topics[topic]
    assert metadata.error is None, metadata.error
    factors = {len(p.replicas) for p in metadata.partitions.values()}
    assert len(factors) == 1, factors
    resource = ConfigResource(ConfigResource.Type.TOPIC, topic)
    entries = admin.describe_configs([resource])[resource].result(timeout=30)
    return Described(
        len(metadata.partitions),
        factors.pop(),
        {name: entry.value for name, entry in entries.items()},
    )


def topics_of(bootstrap: str, prefix: str) -> set[str]:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    return {t for t in admin.list_topics(timeout=30).topics if t.startswith(prefix + ".")}


def creation_env(**more: str) -> dict[str, str]:
    return {
        "CDC_RELAY_CREATE_TOPICS": "true",
        "CDC_RELAY_TOPIC_PARTITIONS": "5",
        "CDC_RELAY_TOPIC_REPLICATION_FACTOR": "1",
        "CDC_RELAY_TOPIC_CONFIG": " ".join(f"{k}={v}" for k, v in TOPIC_SETTINGS.items()),
        **{f"CDC_RELAY_{k.upper()}": v for k, v in more.items()},
    }


def write(dsn: str, *transactions: list[tuple[str, str]]) -> list[Written]:
    """Each transaction: (aggregate type, aggregate id) events."""
    writer = Writer(dsn)
    try:
        return [
            event
            for events in transactions
            for event in writer.transaction([(kind, key, {"key": key}) for kind, key in events])
        ]
    finally:
        writer.close()


def unprocessed(dsn: str) -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT count(*) FROM outbox_events WHERE processed_at IS NULL")
        return int(row.fetchone()[0])  # type: ignore[index]


def last_line(relay: RelayProcess) -> str:
    lines = relay.log().strip().splitlines()
    return lines[-1] if lines else ""


def assert_made_as_asked(bootstrap: str, topic: str, partitions: int) -> Described:
    made = describe(bootstrap, topic)
    assert made.partitions == partitions, made
    assert made.replication_factor == 1, made
    for key, value in TOPIC_SETTINGS.items():
        assert made.config[key] == value, (key, made.config[key])
    print(
        f"{topic}: {made.partitions} partitions, replication factor "
        f"{made.replication_factor}, " + ", ".join(f"{k}={made.config[k]}" for k in TOPIC_SETTINGS)
    )
    return made


# -- a new aggregate type mid-stream -------------------------------------------------------------


def test_stream_makes_the_topic_of_a_new_aggregate_type_mid_stream(
    tmp_path: Path, outbox_db: str, broker: Broker, names: Any
) -> None:
    prefix = names.topic_prefix
    dead = f"{prefix}.dead-letters"
    create_topics(broker.bootstrap, {dead: {}})
    setup_slot(outbox_db, names)
    env = relay_env(outbox_db, broker.bootstrap, names) | creation_env(
        topic_partitions_for=f"{prefix}.customer=2", dead_letter_topic=dead
    )
    relay = RelayProcess(tmp_path, env).start()
    try:
        first = write(outbox_db, [("order", "o1"), ("order", "o2")])
        received = consume(broker.bootstrap, prefix, 2, SECONDS, settle=0.5)
        assert {r.id for r in received} == {w.id for w in first}, relay.log()[-3000:]
        # Mid-stream, two types Kafka has no topic for, beside the one it has.
        later = write(
            outbox_db,
            [("order", "o1"), ("customer", "c1"), ("invoice", "i1"), ("customer", "c1")],
            [("invoice", "i2"), ("order", "o2")],
        )
        written = first + later
        received = consume(broker.bootstrap, prefix, len(written), SECONDS, settle=2)
        assert relay.alive(), relay.log()[-3000:]
        assert relay.stop() == 0, relay.log()[-3000:]
    finally:
        relay.close()
    verdict = check(written, [r for r in received if r.topic != dead], prefix)
    assert not verdict.lost and not verdict.out_of_order and not verdict.mismatched, verdict
    assert not [r for r in received if r.topic == dead], "an event went to the dead letters"
    assert pending_inserts(outbox_db, names.slot, names.publication) == 0
    assert_made_as_asked(broker.bootstrap, f"{prefix}.order", 5)
    assert_made_as_asked(broker.bootstrap, f"{prefix}.invoice", 5)
    assert_made_as_asked(broker.bootstrap, f"{prefix}.customer", 2)
    log = relay.log()
    for kind, partitions in (("order", 5), ("customer", 2), ("invoice", 5)):
        assert (
            f"created topic {prefix}.{kind} ({partitions} partitions, replication factor 1, "
            "max.message.bytes=2000000, retention.ms=123456789)"
        ) in log, log[-3000:]
    assert "Traceback" not in log


def test_poll_makes_the_topic_of_a_new_aggregate_type(
    tmp_path: Path, outbox_db: str, broker: Broker, names: Any
) -> None:
    prefix = names.topic_prefix
    install_poller(outbox_db)
    env = relay_env(outbox_db, broker.bootstrap, names, **POLL_OPTIONS) | creation_env(workers="2")
    relay = RelayProcess(tmp_path, env, name="poll", command="poll").start()
    try:
        first = write(outbox_db, [("order", "o1")], [("order", "o2")])
        consume(broker.bootstrap, prefix, 2, SECONDS, settle=0.5)
        later = write(outbox_db, [("customer", "c1"), ("order", "o1")], [("customer", "c2")])
        written = first + later
        received = consume(broker.bootstrap, prefix, len(written), SECONDS, settle=2)
        wait_until(lambda: unprocessed(outbox_db) == 0, 30, "every row processed")
        assert relay.alive(), relay.log()[-3000:]
        assert relay.stop() == 0, relay.log()[-3000:]
    finally:
        relay.close()
    verdict = check(written, received, prefix)
    assert not verdict.lost and not verdict.out_of_order and not verdict.mismatched, verdict
    with psycopg.connect(outbox_db) as conn:
        dead = conn.execute("SELECT count(*) FROM outbox_dead_letters").fetchone()
    assert dead == (0,)
    assert_made_as_asked(broker.bootstrap, f"{prefix}.order", 5)
    assert_made_as_asked(broker.bootstrap, f"{prefix}.customer", 5)
    assert relay.log().count(f"created topic {prefix}.customer (") == 1, relay.log()[-3000:]


# -- two relays at once --------------------------------------------------------------------------


def test_two_relays_making_the_same_topics_at_once_both_go_on(
    tmp_path: Path, outbox_db: str, broker: Broker, names: Any
) -> None:
    """Two pollers start on a backlog of new aggregate types: each lists Kafka, finds no topic
    and asks for it, both within milliseconds. Whichever Kafka made, the other hears
    TOPIC_ALREADY_EXISTS (or finds it listed): both go on, one topic each."""
    prefix = names.topic_prefix
    install_poller(outbox_db)
    kinds = [f"type{n}" for n in range(8)]
    written = write(outbox_db, *[[(kind, f"{kind}-{k}")] for k in range(6) for kind in kinds])
    env = relay_env(outbox_db, broker.bootstrap, names, **POLL_OPTIONS) | creation_env()
    relays = [RelayProcess(tmp_path, env, name=f"poll{n}", command="poll") for n in range(2)]
    try:
        for relay in relays:
            relay.start()
        received = consume(broker.bootstrap, prefix, len(written), SECONDS, settle=2)
        wait_until(lambda: unprocessed(outbox_db) == 0, 30, "every row processed")
        for relay in relays:
            assert relay.alive(), relay.log()[-3000:]
            assert relay.stop() == 0, relay.log()[-3000:]
    finally:
        for relay in relays:
            relay.close()
    verdict = check(written, received, prefix)
    assert not verdict.lost and not verdict.out_of_order and not verdict.mismatched, verdict
    assert topics_of(broker.bootstrap, prefix) == {f"{prefix}.{kind}" for kind in kinds}
    for kind in kinds:
        assert describe(broker.bootstrap, f"{prefix}.{kind}").partitions == 5
    logs = [relay.log() for relay in relays]
    made = sum(log.count("created topic ") for log in logs)
    found = sum(log.count("(another client made it meanwhile)") for log in logs)
    print(f"{made} topics created, {found} found made by the other relay")
    assert made == len(kinds), logs  # Kafka made each once, for one of them
    assert "Traceback" not in "".join(logs)


def test_two_sinks_asking_for_one_topic_both_hear_success(
    broker: Broker, names: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """The race made certain: both relays listed Kafka before either asked (their listing is
    the same stale one), so both ask; Kafka makes the topic for one and answers the other
    TOPIC_ALREADY_EXISTS, which is success."""
    from cdc_relay.kafka.routing import Message
    from cdc_relay.kafka.sink import KafkaSink, producer_config, topics_of
    from cdc_relay.kafka.topics import TopicSpec

    topic = f"{names.topic_prefix}.raced"
    config = producer_config(broker.bootstrap, {})
    acked: list[str] = []
    sinks = [
        KafkaSink(
            config,
            on_ack=acked.append,
            on_refused=lambda token, err: pytest.fail(f"{token} refused: {err}"),
            topics=topics_of(config, TopicSpec(partitions=4)),
        )
        for _ in range(2)
    ]
    before = sinks[0]._list_topics()
    assert before is not None and topic not in before
    for sink in sinks:
        sink._list_topics = lambda: before  # type: ignore[method-assign]
    message = Message(topic, b"k", b"{}", [("id", b"x")])
    offered = [False, False]
    deadline = time.monotonic() + 30
    with caplog.at_level(logging.INFO, logger="cdc_relay.kafka.topics"):
        while not all(offered) and time.monotonic() < deadline:
            for n, sink in enumerate(sinks):
                if not offered[n]:
                    offered[n] = sink.offer(message, f"sink{n}")
            time.sleep(0.01)
    assert all(offered)
    said = sorted(r.getMessage() for r in caplog.records)
    assert said == [
        f"created topic {topic} (4 partitions, the broker's replication factor)",
        f"topic {topic} exists (another client made it meanwhile): used as it is",
    ], said
    for sink in sinks:
        sink.settle(30)
        assert sink.close() == 0
    assert sorted(acked) == ["sink0", "sink1"]
    assert describe(broker.bootstrap, topic).partitions == 4


# -- a denied creation ---------------------------------------------------------------------------


def test_a_denied_creation_stops_stream_in_one_line_and_a_run_with_the_right_loses_nothing(
    tmp_path: Path, outbox_db: str, broker: Broker, names: Any
) -> None:
    prefix = names.topic_prefix
    dead = f"{prefix}.dead-letters"
    create_topics(broker.bootstrap, {f"{prefix}.order": {}, dead: {}})
    setup_slot(outbox_db, names)
    env = (
        relay_env(outbox_db, broker.bootstrap, names)
        | creation_env(dead_letter_topic=dead)
        | no_create_client(broker)
    )
    relay = RelayProcess(tmp_path, env)
    try:
        relay.start()
        first = write(outbox_db, [("order", "o1")])
        consume(broker.bootstrap, prefix, 1, SECONDS, settle=0.5)
        refused = write(outbox_db, [("order", "o2"), ("customer", "c1")], [("order", "o3")])
        assert relay.wait(SECONDS) == 1, relay.log()[-3000:]
        last = last_line(relay)
        assert last.startswith(
            f"cdc-relay: error: Kafka refused to create topic {prefix}.customer ("
        ), last
        assert (
            "grant the relay's principal CREATE on the topic (or on the cluster) and "
            "DESCRIBE_CONFIGS on it, or create the topic yourself; nothing from its first "
            "event on was confirmed"
        ) in last, last
        assert "Traceback" not in relay.log()
        # Nothing from the refused event's transaction on confirmed; no dead letter.
        assert pending_inserts(outbox_db, names.slot, names.publication) == 3
        with psycopg.connect(outbox_db) as conn:
            letters = conn.execute("SELECT count(*) FROM cdc_relay_dead_letters").fetchone()
        assert letters == (0,)
        assert f"{prefix}.customer" not in topics_of(broker.bootstrap, prefix)

        # The same relay, given the right (the PLAINTEXT listener's super user).
        relay.env.update(
            {"CDC_RELAY_KAFKA_BOOTSTRAP": broker.bootstrap, "CDC_RELAY_KAFKA_CONFIG": ""}
        )
        relay.start()
        written = first + refused
        received = consume(broker.bootstrap, prefix, len(written), SECONDS, settle=2)
        assert relay.stop() == 0, relay.log()[-3000:]
    finally:
        relay.close()
    verdict = check(written, [r for r in received if r.topic != dead], prefix)
    assert not verdict.lost and not verdict.out_of_order and not verdict.mismatched, verdict
    assert not [r for r in received if r.topic == dead]
    assert pending_inserts(outbox_db, names.slot, names.publication) == 0
    print(f"denied: {last}\nafter the re-run with the right: {verdict}")


def test_a_denied_creation_stops_poll_with_its_rows_unprocessed(
    tmp_path: Path, outbox_db: str, broker: Broker, names: Any
) -> None:
    prefix = names.topic_prefix
    install_poller(outbox_db)
    env = (
        relay_env(outbox_db, broker.bootstrap, names, **POLL_OPTIONS)
        | creation_env()
        | no_create_client(broker)
    )
    relay = RelayProcess(tmp_path, env, name="poll", command="poll")
    written = write(outbox_db, [("customer", "c1")], [("customer", "c2")])
    try:
        relay.start()
        assert relay.wait(SECONDS) == 1, relay.log()[-3000:]
        last = last_line(relay)
        assert last.startswith(
            f"cdc-relay: error: Kafka refused to create topic {prefix}.customer ("
        ), last
        assert unprocessed(outbox_db) == 2
        with psycopg.connect(outbox_db) as conn:
            attempts = conn.execute("SELECT max(attempts) FROM outbox_events").fetchone()
            dead = conn.execute("SELECT count(*) FROM outbox_dead_letters").fetchone()
        assert dead == (0,)
        assert attempts == (0,), "a refused creation is no failed attempt of the row"

        relay.env.update(
            {"CDC_RELAY_KAFKA_BOOTSTRAP": broker.bootstrap, "CDC_RELAY_KAFKA_CONFIG": ""}
        )
        relay.start()
        received = consume(broker.bootstrap, prefix, len(written), SECONDS, settle=1)
        wait_until(lambda: unprocessed(outbox_db) == 0, 30, "every row processed")
        assert relay.stop() == 0, relay.log()[-3000:]
    finally:
        relay.close()
    verdict = check(written, received, prefix)
    assert not verdict.lost and not verdict.out_of_order and not verdict.mismatched, verdict


# -- a stop while the topic waits ----------------------------------------------------------------


def test_a_stop_while_a_new_topic_waits_for_a_stalled_kafka_is_prompt_and_loses_nothing(
    tmp_path: Path, outbox_db: str, broker: Broker, names: Any
) -> None:
    """The broker stalls (SIGSTOP) just before a new aggregate type's first event: the relay
    cannot learn whether the topic exists, so the event waits (never sent to a topic a broker
    without auto-creation would refuse); SIGTERM still stops it at once, exit 0, with nothing
    confirmed past the event; once the broker is back a restart makes the topic."""
    prefix = names.topic_prefix
    setup_slot(outbox_db, names)
    env = relay_env(outbox_db, broker.bootstrap, names) | creation_env()
    relay = RelayProcess(tmp_path, env).start()
    pid = broker.kafka.pid
    assert pid is not None
    try:
        first = write(outbox_db, [("order", "o1")])
        consume(broker.bootstrap, prefix, 1, SECONDS, settle=0.5)
        os.kill(pid, signal.SIGSTOP)
        try:
            waiting = write(outbox_db, [("customer", "c1")])
            time.sleep(5)
            assert relay.alive(), relay.log()[-3000:]
            started = time.monotonic()
            code = relay.stop(60)
            took = time.monotonic() - started
        finally:
            os.kill(pid, signal.SIGCONT)
        assert code == 0, relay.log()[-3000:]
        # Nothing was sent to wait for (an event sent to the stalled broker would hold the stop
        # for --shutdown-timeout, 10 s in relay_env), and the wait for the topic ends at once.
        assert took < 5, f"the stop took {took:.1f} s"
        print(f"stopped in {took:.1f} s while the topic waited")
        assert pending_inserts(outbox_db, names.slot, names.publication) == 1
        relay.start()
        written = first + waiting
        received = consume(broker.bootstrap, prefix, len(written), SECONDS, settle=1)
        assert relay.stop() == 0, relay.log()[-3000:]
        log = relay.log()  # the restarted relay's too: what it saw of the broker resumed
    finally:
        relay.close()
    verdict = check(written, received, prefix)
    assert not verdict.lost and not verdict.mismatched, f"{verdict}\n{log[-5000:]}"
    assert_made_as_asked(broker.bootstrap, f"{prefix}.customer", 5)


# -- a topic Kafka has -----------------------------------------------------------------------------


def test_a_topic_of_another_partition_count_is_used_with_one_warning(
    tmp_path: Path, outbox_db: str, broker: Broker, names: Any
) -> None:
    prefix = names.topic_prefix
    create_topics(broker.bootstrap, {f"{prefix}.order": {}}, partitions=2)
    setup_slot(outbox_db, names)
    env = relay_env(outbox_db, broker.bootstrap, names) | creation_env()
    relay = RelayProcess(tmp_path, env).start()
    try:
        written = write(outbox_db, [("order", "o1"), ("order", "o2")], [("order", "o3")])
        received = consume(broker.bootstrap, prefix, len(written), SECONDS, settle=1)
        assert relay.stop() == 0, relay.log()[-3000:]
    finally:
        relay.close()
    verdict = check(written, received, prefix)
    assert not verdict.lost and not verdict.mismatched, verdict
    assert describe(broker.bootstrap, f"{prefix}.order").partitions == 2
    warnings = [line for line in relay.log().splitlines() if "partitions, not the" in line]
    assert len(warnings) == 1, relay.log()[-3000:]
    assert (
        f"topic {prefix}.order exists with 2 partitions, not the 5 asked: used as it is "
        "(adding partitions moves keys to other partitions, so the relay never changes a topic)"
    ) in warnings[0]
    assert "created topic" not in relay.log()


# -- setup-slot ----------------------------------------------------------------------------------


def setup_slot_command(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cdc_relay", "setup-slot", *args],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_setup_slot_makes_the_dead_letter_and_checkpoint_topics(
    outbox_db: str, broker: Broker, names: Any
) -> None:
    prefix = names.topic_prefix
    dead, checkpoints = f"{prefix}.dead-letters", f"{prefix}.checkpoints"
    env = relay_env(outbox_db, broker.bootstrap, names) | creation_env(
        dead_letter_topic=dead, checkpoint_topic=checkpoints
    )
    result = setup_slot_command(env, "--exactly-once")
    assert result.returncode == 0, result.stderr
    assert f"created checkpoint topic {checkpoints} (cleanup.policy=compact)" in result.stdout
    assert (
        f"created dead-letter topic {dead} (5 partitions, replication factor 1, "
        "max.message.bytes=2000000, retention.ms=123456789)"
    ) in result.stdout, result.stdout
    assert_made_as_asked(broker.bootstrap, dead, 5)
    made = describe(broker.bootstrap, checkpoints)
    assert (made.partitions, made.replication_factor) == (1, 1)
    assert made.config["cleanup.policy"] == "compact"
    assert made.config["retention.ms"] == TOPIC_SETTINGS["retention.ms"]
    again = setup_slot_command(env, "--exactly-once")
    assert again.returncode == 0, again.stderr
    assert f"exists: dead-letter topic {dead}" in again.stdout
    assert f"exists: checkpoint topic {checkpoints}" in again.stdout


@pytest.mark.parametrize(
    ("options", "says"),
    [
        (
            {"topic_config": "no.such.setting=1"},
            "fix --topic-partitions, --topic-replication-factor or --topic-config",
        ),
        (
            {"topic_replication_factor": "3"},
            "(a replication factor may not exceed the brokers)",
        ),
    ],
)
def test_setup_slot_refuses_what_kafka_would_not_make_in_one_line(
    outbox_db: str, broker: Broker, names: Any, options: dict[str, str], says: str
) -> None:
    dead = f"{names.topic_prefix}.dead-letters"
    env = relay_env(outbox_db, broker.bootstrap, names) | creation_env(
        dead_letter_topic=dead, **options
    )
    result = setup_slot_command(env)
    assert result.returncode == 1, result.stdout + result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"cdc-relay: error: Kafka would not create topic {dead} with "), line
    assert says in line, line
    print(line)
    assert dead not in topics_of(broker.bootstrap, names.topic_prefix)


# -- what an adversarial review found ------------------------------------------------------------


def test_an_aggregate_type_naming_an_internal_topic_is_refused_not_made(
    tmp_path: Path, outbox_db: str, broker: Broker, names: Any
) -> None:
    """With --topic-template '{aggregate_type}' a writer names the topic. A broker creates
    __consumer_offsets or __transaction_state on request before anything used them, with the
    settings asked (not compacted: the groups' offsets then go at retention.ms). The relay
    makes no topic named ``__...``: the event is refused (here set aside as a dead letter),
    the events around it go out, and Kafka has no such topic."""
    prefix = names.topic_prefix
    dead = f"{prefix}.dead-letters"
    internal = f"__{prefix}"
    create_topics(broker.bootstrap, {dead: {}})
    setup_slot(outbox_db, names)
    env = relay_env(outbox_db, broker.bootstrap, names) | creation_env(
        topic_template="{aggregate_type}", dead_letter_topic=dead
    )
    relay = RelayProcess(tmp_path, env).start()
    try:
        written = write(outbox_db, [(f"{prefix}.order", "o1"), (internal, "x1")])
        written += write(outbox_db, [(f"{prefix}.order", "o2")])
        received = consume(broker.bootstrap, prefix, 3, SECONDS, settle=1)
        assert relay.alive(), relay.log()[-3000:]
        assert relay.stop() == 0, relay.log()[-3000:]
    finally:
        relay.close()
    log = relay.log()
    assert (
        internal
        not in AdminClient({"bootstrap.servers": broker.bootstrap}).list_topics(timeout=30).topics
    ), log[-3000:]
    orders = [r for r in received if r.topic == f"{prefix}.order"]
    assert sorted(r.id for r in orders) == sorted([written[0].id, written[2].id]), log[-3000:]
    letters = [r for r in received if r.topic == dead]
    assert len(letters) == 1, log[-3000:]
    assert dict(letters[0].headers)["original_topic"] == internal.encode()
    assert f"topic {internal} is not made by --create-topics" in log
    assert "Traceback" not in log


def test_a_topic_deleted_while_stream_runs_is_made_again_and_nothing_is_dead_lettered(
    tmp_path: Path, outbox_db: str, broker: Broker, names: Any
) -> None:
    """Someone deletes a topic the relay sends to (a cleanup, a mistake). Its next events
    are refused by the client ("unknown topic"); with --create-topics the relay makes the
    topic again and sends them, in order: a missing topic is never an event's fault, so no
    dead letter."""
    prefix = names.topic_prefix
    dead = f"{prefix}.dead-letters"
    create_topics(broker.bootstrap, {dead: {}})
    setup_slot(outbox_db, names)
    # The producer gives a deleted topic's events up after this (30 s by default).
    env = relay_env(outbox_db, broker.bootstrap, names) | creation_env(
        dead_letter_topic=dead, kafka_config="topic.metadata.propagation.max.ms=5000"
    )
    relay = RelayProcess(tmp_path, env).start()
    admin = AdminClient({"bootstrap.servers": broker.bootstrap})
    try:
        first = write(outbox_db, [("order", "o1"), ("order", "o2")])
        consume(broker.bootstrap, prefix, 2, SECONDS, settle=0.5)
        admin.delete_topics([f"{prefix}.order"])[f"{prefix}.order"].result(timeout=30)
        wait_until(
            lambda: f"{prefix}.order" not in admin.list_topics(timeout=10).topics,
            30,
            "the topic deleted",
        )
        later = write(outbox_db, [("order", "o1")], [("order", "o2"), ("order", "o1")])
        received = consume(broker.bootstrap, prefix, len(later), 90, settle=2)
        assert relay.alive(), relay.log()[-3000:]
        assert relay.stop() == 0, relay.log()[-3000:]
    finally:
        relay.close()
    log = relay.log()
    assert not [r for r in received if r.topic == dead], log[-4000:]
    verdict = check(later, received, prefix)
    assert not verdict.lost and not verdict.out_of_order and not verdict.mismatched, (
        verdict,
        log[-4000:],
    )
    assert first  # sent before the deletion, gone with the topic
    assert log.count(f"created topic {prefix}.order (") == 2, log[-4000:]  # and again
