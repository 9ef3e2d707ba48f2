"""Every kind of refusal a real broker returns, for each way the relays meet it.

Error classes, each made real: a batch refused for one oversized event (per-topic
``max.message.bytes``), a keyless event on a compacted topic, a topic that does not exist with
auto-creation off, a topic the authorizer denies; and the delivery timeout the relays refuse
to run with. For each: ``stream`` stopping at the culprit (halt), ``stream
--dead-letter-topic``, and ``poll``. What each relay must do is in docs/wire.md ("What lands
on Kafka"), docs/polling.md ("What the poller guarantees") and ARCHITECTURE.md (invariant 4,
never skip silently).

The module ends by printing the matrix (error class x mode x relay -> lost, reordered,
duplicates, outcome) and writing it to pytest's temporary directory.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import pytest
from confluent_kafka.admin import (
    AclBinding,
    AclBindingFilter,
    AclOperation,
    AclPermissionType,
    AdminClient,
    ResourcePatternType,
    ResourceType,
)
from relaytools import (
    Received,
    RelayProcess,
    Verdict,
    Writer,
    Written,
    check,
    consume,
    create_topics,
    handover,
    install_poller,
    pending_inserts,
    relay_env,
    set_topic_config,
    setup_slot,
    strict_broker,
    wait_until,
    writers_only,
)

from cdc_relay.devstack.kafka import LocalKafka
from cdc_relay.errors import UsageError
from cdc_relay.kafka.sink import producer_config

pytestmark = pytest.mark.integration

DOCS = Path(__file__).parents[2] / "docs"  # the documentation site's pages
ANONYMOUS = "User:ANONYMOUS"  # every client of a PLAINTEXT listener, the broker included
DEAD = "dead-letters"  # the dead-letter topic: <topic prefix>.dead-letters
POLL_OPTIONS = {
    "max_attempts": "3",
    "backoff_base": "0.05",
    "backoff_max": "0.2",
    "poll_interval": "0.5",
    "shutdown_timeout": "5",
}

# -- the matrix -------------------------------------------------------------------------------


@dataclass
class Row:
    error_class: str
    mode: str
    relay: str
    lost: int | None = None
    reordered: int | None = None
    duplicates: int | None = None
    outcome: str = ""


MATRIX: list[Row] = []


@contextlib.contextmanager
def matrix_row(error_class: str, mode: str, relay: str) -> Iterator[Row]:
    """A row of the matrix, filled in by the test; a failing test says so in it."""
    row = Row(error_class, mode, relay)
    MATRIX.append(row)
    try:
        yield row
    except BaseException as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:100]
        row.outcome = f"FAILED ({first})" + (f" after: {row.outcome}" if row.outcome else "")
        raise


def _cell(value: int | None) -> str:
    return "?" if value is None else str(value)


def format_matrix(rows: list[Row]) -> str:
    """One line per row, grouped by error class (in the order the classes first ran)."""
    classes = list(dict.fromkeys(r.error_class for r in rows))
    rows = sorted(rows, key=lambda r: classes.index(r.error_class))
    header = ("error class", "mode", "relay", "lost", "reordered", "dups", "outcome")
    table = [header] + [
        (
            r.error_class,
            r.mode,
            r.relay,
            _cell(r.lost),
            _cell(r.reordered),
            _cell(r.duplicates),
            r.outcome,
        )
        for r in rows
    ]
    widths = [max(len(line[i]) for line in table) for i in range(len(header) - 1)]
    lines = [
        " | ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=False))
        + " | "
        + line[-1]
        for line in table
    ]
    lines.insert(1, "-+-".join("-" * width for width in widths) + "-+-" + "-" * 7)
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module", autouse=True)
def _matrix(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[None]:
    yield
    if not MATRIX:
        return
    text = format_matrix(MATRIX)
    path = tmp_path_factory.mktemp("refusals") / "matrix.txt"
    path.write_text(text)
    # Past pytest's capture, so that it shows with a passing run too.
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
        print(f"\nrefusal matrix ({path}):\n{text}", flush=True)


# -- the brokers ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def strict_kafka(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalKafka]:
    """A broker that creates no topic on demand and runs KRaft's authorizer (relaytools'
    STRICT_KAFKA)."""
    broker = strict_broker(tmp_path_factory.mktemp("kafka_strict"))
    try:
        broker.start()
        yield broker
    finally:
        broker.cleanup(keep_logs=True)


def _acls(bootstrap: str, topic: str) -> list[Any]:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    found = admin.describe_acls(
        AclBindingFilter(
            ResourceType.TOPIC,
            topic,
            ResourcePatternType.LITERAL,
            None,
            None,
            AclOperation.ANY,
            AclPermissionType.ANY,
        )
    ).result(timeout=30)
    return list(found)


def deny_writes(bootstrap: str, topic: str) -> None:
    """WRITE denied on ``topic``; READ and DESCRIBE allowed, so consumers (and the check that
    the culprit is not there) still read it, and the broker answers the produce request."""
    bindings = [
        AclBinding(
            ResourceType.TOPIC,
            topic,
            ResourcePatternType.LITERAL,
            ANONYMOUS,
            "*",
            operation,
            permission,
        )
        for operation, permission in (
            (AclOperation.WRITE, AclPermissionType.DENY),
            (AclOperation.READ, AclPermissionType.ALLOW),
            (AclOperation.DESCRIBE, AclPermissionType.ALLOW),
        )
    ]
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for future in admin.create_acls(bindings).values():
        future.result(timeout=30)
    wait_until(lambda: len(_acls(bootstrap, topic)) == 3, 30, f"the ACLs of {topic}")


def drop_acls(bootstrap: str, topic: str) -> None:
    """Every ACL of ``topic`` gone: allowed again, as a topic without ACLs is."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    every = AclBindingFilter(
        ResourceType.TOPIC,
        topic,
        ResourcePatternType.LITERAL,
        None,
        None,
        AclOperation.ANY,
        AclPermissionType.ANY,
    )
    for future in admin.delete_acls([every]).values():
        future.result(timeout=30)
    wait_until(lambda: not _acls(bootstrap, topic), 30, f"no ACL left on {topic}")


# -- the error classes ------------------------------------------------------------------------


def _big_payload() -> dict[str, str]:
    """About 160 kB of JSON that no compression shrinks under 100 kB (random base64)."""
    return {"blob": base64.b64encode(random.randbytes(120_000)).decode()}


@dataclass(frozen=True)
class Scenario:
    """One error class: the topics it needs, the culprit among innocents, and its fix."""

    name: str
    broker: str  # "session" (kafka_service) or "strict" (strict_kafka)
    innocent_type: str
    innocent_keys: tuple[str, ...]
    culprit: tuple[str, str | None, Callable[[], Any]]  # aggregate type, id, payload
    topics: dict[str, dict[str, str]]  # aggregate type -> topic configuration
    errors: tuple[str, ...]  # Kafka's error names, one of which the refusal carries
    reason: str  # in the text of Kafka's error, lowercase
    remedy: str  # in the relay's one-line error
    fix: str | None  # what the halt test does before restarting; None: dead-letter it
    # Kafka refuses the batch the culprit is in: its neighbours are refused with it.
    batch: bool = False
    kafka_config: str = ""
    denied: str | None = None  # aggregate type whose topic the authorizer denies

    def topic(self, prefix: str, aggregate_type: str) -> str:
        return f"{prefix}.{aggregate_type}"


SCENARIOS = {
    "too-large": Scenario(
        name="batch refused: 160 kB > topic max.message.bytes",
        broker="session",
        innocent_type="blob",
        innocent_keys=("k0", "k1", "k2", "k3", "k4", "k5"),
        culprit=("blob", "k0", _big_payload),
        topics={"blob": {"max.message.bytes": "100000"}},
        errors=("MSG_SIZE_TOO_LARGE",),
        reason="too large",
        remedy="raise max.message.bytes of the topic",
        fix="raise the topic's max.message.bytes",
        batch=True,
    ),
    "keyless-compacted": Scenario(
        name="keyless event on a compacted topic",
        broker="session",
        innocent_type="state",
        innocent_keys=("k1", "k2", "k3", "k4", "k5"),
        culprit=("state", None, lambda: {"keyless": True}),
        topics={"state": {"cleanup.policy": "compact"}},
        errors=("INVALID_RECORD",),
        reason="validate record",
        remedy="a compacted topic needs a key",
        fix=None,
        batch=True,
    ),
    "unknown-topic": Scenario(
        name="topic missing, auto-creation off",
        broker="strict",
        innocent_type="order",
        innocent_keys=("k0", "k1", "k2", "k3", "k4", "k5"),
        culprit=("fresh", "k0", lambda: {"new": "type"}),
        topics={"order": {}},
        errors=("UNKNOWN_TOPIC_OR_PART", "_UNKNOWN_TOPIC"),
        reason="unknown topic",
        remedy="create the topic",
        fix="create the topic",
        # librdkafka waits this long for a topic to appear before failing its messages
        # (default 30 s): shorter, to keep the run short.
        kafka_config="topic.metadata.propagation.max.ms=2000",
    ),
    "denied": Scenario(
        name="topic denied by an ACL (DENY WRITE)",
        broker="strict",
        innocent_type="order",
        innocent_keys=("k0", "k1", "k2", "k3", "k4", "k5"),
        culprit=("secret", "k0", lambda: {"top": "secret"}),
        topics={"order": {}, "secret": {}},
        errors=("TOPIC_AUTHORIZATION_FAILED",),
        reason="authorization failed",
        remedy="grant the relay's principal WRITE on the topic",
        fix="delete the ACL",
        denied="secret",
    ),
}


@pytest.fixture(params=list(SCENARIOS))
def scenario(request: pytest.FixtureRequest) -> Scenario:
    return SCENARIOS[request.param]


@pytest.fixture
def broker(request: pytest.FixtureRequest, scenario: Scenario) -> Any:
    """The scenario's broker; the strict one is started only when a scenario needs it."""
    name = "kafka_service" if scenario.broker == "session" else "strict_kafka"
    return request.getfixturevalue(name)


def prepare(
    scenario: Scenario,
    dsn: str,
    bootstrap: str,
    prefix: str,
    dead_letter_config: dict[str, str] | None = None,
) -> None:
    """The topics (3 partitions) and ACLs of the scenario, its dead-letter topic, and a
    NULL-able aggregate_id for the keyless event."""
    topics = {scenario.topic(prefix, t): config for t, config in scenario.topics.items()}
    create_topics(bootstrap, {**topics, f"{prefix}.{DEAD}": dead_letter_config or {}})
    if scenario.denied:
        deny_writes(bootstrap, scenario.topic(prefix, scenario.denied))
    if scenario.culprit[1] is None:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("ALTER TABLE outbox_events ALTER COLUMN aggregate_id DROP NOT NULL")


def apply_fix(scenario: Scenario, bootstrap: str, prefix: str) -> None:
    culprit_topic = scenario.topic(prefix, scenario.culprit[0])
    if scenario.fix == "raise the topic's max.message.bytes":
        set_topic_config(bootstrap, culprit_topic, "max.message.bytes", "1000000")
    elif scenario.fix == "create the topic":
        create_topics(bootstrap, {culprit_topic: {}})
    elif scenario.fix == "delete the ACL":
        drop_acls(bootstrap, culprit_topic)
    else:
        raise AssertionError(f"no fix for {scenario.name}")


@dataclass
class Workload:
    """What was committed, in commit order: the culprit, and what came before and after it."""

    first: list[Written]  # the transaction before the culprit's
    before: list[Written]  # that, and the culprit's own transaction up to it
    culprit: Written
    after: list[Written]  # the rest of the culprit's transaction, then later transactions
    same_transaction: list[Written] = field(default_factory=list)  # the culprit's neighbours

    @property
    def innocents(self) -> list[Written]:
        return self.before + self.after

    @property
    def committed(self) -> list[Written]:
        return [*self.before, self.culprit, *self.after]


def write_workload(scenario: Scenario, dsn: str) -> Workload:
    """One transaction of the innocents, then the culprit between innocents of keys k1..k5 in
    one transaction (written together: they share produce batches), then two more
    transactions of the innocents' keys."""
    kind = scenario.innocent_type
    keys = scenario.innocent_keys
    writer = Writer(dsn)
    try:
        first = writer.transaction([(kind, key, {"key": key, "n": 0}) for key in keys])
        culprit_type, culprit_id, payload = scenario.culprit
        middle = writer.transaction(
            [
                (kind, "k1", {"key": "k1", "n": 1}),
                (kind, "k2", {"key": "k2", "n": 1}),
                (culprit_type, culprit_id, payload()),
                (kind, "k3", {"key": "k3", "n": 1}),
                (kind, "k4", {"key": "k4", "n": 1}),
                (kind, "k5", {"key": "k5", "n": 1}),
            ]
        )
        later = [
            writer.transaction([(kind, key, {"key": key, "n": n}) for key in keys]) for n in (2, 3)
        ]
    finally:
        writer.close()
    return Workload(
        first=first,
        before=first + middle[:2],
        culprit=middle[2],
        after=middle[3:] + later[0] + later[1],
        same_transaction=middle[:2] + middle[3:],
    )


# -- what the tests read ----------------------------------------------------------------------


def stream_relay(
    tmp_path: Path, dsn: str, bootstrap: str, names: Any, scenario: Scenario, **extra: str
) -> RelayProcess:
    if scenario.kafka_config:
        extra["kafka_config"] = scenario.kafka_config
    return RelayProcess(tmp_path, relay_env(dsn, bootstrap, names, **extra), name="stream")


def poll_relay(
    tmp_path: Path,
    dsn: str,
    bootstrap: str,
    names: Any,
    scenario: Scenario | None = None,
    **options: str,
) -> RelayProcess:
    extra = {**POLL_OPTIONS, **options}
    if scenario is not None and scenario.kafka_config:
        extra["kafka_config"] = scenario.kafka_config
    env = relay_env(dsn, bootstrap, names, **extra)
    return RelayProcess(tmp_path, env, name="poll", command="poll")


def poller_workload(scenario: Scenario, dsn: str, bootstrap: str, prefix: str) -> Workload:
    """The scenario's topics, and its workload written to an outbox with the poller's schema."""
    install_poller(dsn)
    prepare(scenario, dsn, bootstrap, prefix)
    return write_workload(scenario, dsn)


def poll_until(
    relay: RelayProcess,
    settled: Callable[[], bool],
    what: str,
    workload: Workload,
    broker: Any,
    prefix: str,
) -> tuple[int, list[Received], Verdict]:
    """Run the poller until ``settled``; its exit code, what Kafka received of the
    workload's innocents under the topic ``prefix``, and the verdict on them."""
    try:
        relay.start()
        wait_until(settled, 60, what, 0.05)
        received = consume(broker.bootstrap, prefix, len(workload.innocents), 60, settle=1.5)
        code = relay.stop()
    finally:
        relay.close()
    return code, received, check(workload.innocents, received, prefix)


def query(dsn: str, sql: str, *params: Any) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute(sql, params).fetchall()


def _bytes(value: Any) -> bytes | None:
    return None if value is None else bytes(value)


def stored_dead_letters(dsn: str) -> list[tuple[Any, ...]]:
    """The stream's dead letters: (event_id, topic, key, value, error_code, headers)."""
    rows = query(
        dsn,
        "SELECT event_id, topic, key, value, error_code, headers "
        "FROM cdc_relay_dead_letters ORDER BY dead_at",
    )
    return [(r[0], r[1], _bytes(r[2]), _bytes(r[3]), r[4], r[5]) for r in rows]


@dataclass
class DeadLetterRun:
    """What a stream with a dead-letter topic did with a scenario's workload."""

    workload: Workload
    relay: RelayProcess
    main: list[Received]
    letters: list[Received]
    verdict: Verdict
    alive: bool
    code: int
    pending: int


def stream_with_dead_letters(
    tmp_path: Path,
    dsn: str,
    bootstrap: str,
    names: Any,
    scenario: Scenario,
    row: Row,
    dead_letter_config: dict[str, str] | None = None,
) -> DeadLetterRun:
    """Write the scenario's workload, stream it with a dead-letter topic until every event
    arrived, stop the relay; the matrix row filled in."""
    prefix = names.topic_prefix
    prepare(scenario, dsn, bootstrap, prefix, dead_letter_config)
    setup_slot(dsn, names)
    workload = write_workload(scenario, dsn)
    relay = stream_relay(
        tmp_path, dsn, bootstrap, names, scenario, dead_letter_topic=f"{prefix}.{DEAD}"
    )
    try:
        relay.start()
        received = consume(bootstrap, prefix, len(workload.committed), 60, settle=2)
        alive = relay.alive()
        code = relay.stop()
        pending = pending_inserts(dsn, names.slot, names.publication)
    finally:
        relay.close()
    main, letters = split(received, prefix)
    verdict = check(workload.innocents, main, prefix)
    row.lost, row.reordered, row.duplicates = (
        len(verdict.lost),
        len(verdict.out_of_order),
        verdict.duplicates,
    )
    row.outcome = (
        f"ran on: {len(letters)} letter(s) "
        f"({'with' if letters and letters[0].value else 'without'} value), "
        f"{len(stored_dead_letters(dsn))} in table; {pending} left in the slot"
    )
    print(verdict)
    return DeadLetterRun(workload, relay, main, letters, verdict, alive, code, pending)


def split(received: list[Received], prefix: str) -> tuple[list[Received], list[Received]]:
    """(messages on the main topics, messages on the dead-letter topic)."""
    dead = f"{prefix}.{DEAD}"
    return [r for r in received if r.topic != dead], [r for r in received if r.topic == dead]


def position(r: Received) -> tuple[str, int, int]:
    return (r.topic, r.partition, r.offset)


def duplicated(received: list[Received]) -> set[str]:
    return {event_id for event_id, n in Counter(r.id for r in received).items() if n > 1}


def last_line(relay: RelayProcess) -> str:
    lines = relay.log().strip().splitlines()
    return lines[-1] if lines else ""


def assert_letter(
    letter: Received, culprit: Written, scenario: Scenario, prefix: str, with_value: bool = True
) -> None:
    """The dead-letter message: the culprit's key and headers, the reasons, its payload
    (unless the dead-letter topic refuses it too: then only the table has it)."""
    headers = dict(letter.headers)
    assert letter.key == (culprit.aggregate_id.encode() if culprit.aggregate_id else None)
    assert headers["id"] == culprit.id.encode()
    assert headers["event_type"] == culprit.event_type.encode()
    assert headers["error_code"].decode() in scenario.errors, headers
    assert scenario.reason in headers["error"].decode().lower(), headers
    assert headers["original_topic"] == scenario.topic(prefix, culprit.aggregate_type).encode()
    assert headers["payload_bytes"] == str(len(culprit.payload)).encode()
    if with_value:
        # The dead-letter topic has the broker's default limits: the payload fits, as stored.
        assert headers["payload_in"] == b"value cdc_relay_dead_letters"
        assert letter.value == culprit.payload
    else:
        assert headers["payload_in"] == b"cdc_relay_dead_letters"
        assert letter.value is None


def assert_stored(dsn: str, culprit: Written, scenario: Scenario, prefix: str) -> None:
    """The culprit, and nothing else, in cdc_relay_dead_letters, with its content."""
    stored = stored_dead_letters(dsn)
    assert [row[0] for row in stored] == [culprit.id]
    (event_id, topic, key, value, error_code, headers) = stored[0]
    assert topic == scenario.topic(prefix, culprit.aggregate_type)
    assert key == (culprit.aggregate_id.encode() if culprit.aggregate_id else None)
    assert value == culprit.payload
    assert error_code in scenario.errors
    assert headers["id"] == event_id


def assert_delivered(verdict: Verdict) -> None:
    assert verdict.lost == [], verdict
    assert verdict.mismatched == [], verdict
    assert verdict.out_of_order == [], verdict


def assert_shared_batches(scenario: Scenario, workload: Workload, main: list[Received]) -> None:
    """The culprit's neighbours shared its partition, hence its produce batch (the
    workload's keys are chosen for it; a changed partitioner would make the test weaker)."""
    topic_of = {r.id: (r.topic, r.partition) for r in main}
    neighbours = {topic_of[w.id] for w in workload.same_transaction if w.id in topic_of}
    if scenario.culprit[1] is None:  # a random partition: every partition has a neighbour
        topics = {topic for topic, _ in neighbours}
        assert len(neighbours) == 3 * len(topics), neighbours
    elif scenario.innocent_type == scenario.culprit[0]:
        culprit_key = workload.culprit.aggregate_id
        key_partitions = {
            topic_of[w.id] for w in workload.innocents if w.aggregate_id == culprit_key
        }
        assert key_partitions & neighbours, (key_partitions, neighbours)


def refused_together(log: str) -> list[int]:
    """How many events each rewind of the stream found refused."""
    return [int(n) for n in re.findall(r"Kafka refused (\d+) events? ", log)]


def assert_isolated(scenario: Scenario, log: str) -> None:
    """The stream replayed to isolate the culprit; for a batch refusal, among neighbours."""
    counts = refused_together(log)
    assert counts, "no rewind in the log"
    if scenario.batch:
        assert max(counts) >= 2, counts


def assert_only_writes_denied(broker: Any, scenario: Scenario, prefix: str) -> None:
    """The authorizer denied nothing but the relay's writes to the denied topic: the broker
    itself, consumers and the dead-letter topic worked (all are User:ANONYMOUS)."""
    if scenario.denied is None:
        return
    denied = [line for line in broker.log_path.read_text().splitlines() if " is Denied " in line]
    topic = scenario.topic(prefix, scenario.denied)
    assert any(f"Topic:LITERAL:{topic} " in line for line in denied), denied
    strays = [
        line
        for line in denied
        if "operation = WRITE " not in line
        or f".{scenario.denied} for request = Produce" not in line
    ]
    assert strays == [], strays


# -- stream, halting at the culprit -----------------------------------------------------------


def test_stream_stops_at_the_culprit_and_resumes_from_it_after_the_fix(
    tmp_path: Path, outbox_db: str, names: Any, scenario: Scenario, broker: Any
) -> None:
    prefix = names.topic_prefix
    with matrix_row(scenario.name, "halt, then fix", "stream") as row:
        prepare(scenario, outbox_db, broker.bootstrap, prefix)
        setup_slot(outbox_db, names)
        workload = write_workload(scenario, outbox_db)
        relay = stream_relay(tmp_path, outbox_db, broker.bootstrap, names, scenario)
        try:
            relay.start()
            code = relay.wait(90)
            last = last_line(relay)
            pending = pending_inserts(outbox_db, names.slot, names.publication)
            at_stop = consume(broker.bootstrap, prefix, len(workload.before), 30, settle=1.5)
            halted = check(workload.committed, at_stop, prefix)
            row.outcome = f"exit {code}, {pending} inserts left in the slot"

            assert code == 1, relay.log()[-4000:]
            assert last.startswith(
                f"cdc-relay: error: Kafka refused event {workload.culprit.id} "
                f"({workload.culprit.event_type}, aggregate "
            ), last
            assert scenario.reason in last.lower(), last
            assert scenario.remedy in last, last
            assert "Traceback" not in relay.log()
            # Everything before the culprit is on Kafka, as stored and in order...
            assert not set(halted.lost) & {w.id for w in workload.before}, halted
            assert halted.mismatched == [], halted
            assert halted.out_of_order == [], halted
            # ...the culprit is not, and nothing from its transaction on is confirmed.
            assert workload.culprit.id not in {r.id for r in at_stop}
            assert pending == len(workload.committed) - len(workload.first)
            assert stored_dead_letters(outbox_db) == []  # no innocent (nor the culprit) either
            assert_isolated(scenario, relay.log())

            if scenario.fix is not None:
                apply_fix(scenario, broker.bootstrap, prefix)
                row.outcome += f"; {scenario.fix}, restart"
                expected = workload.committed
            else:  # nothing makes Kafka take it: dead-letter it
                relay.env["CDC_RELAY_DEAD_LETTER_TOPIC"] = f"{prefix}.{DEAD}"
                row.outcome += "; restart with --dead-letter-topic"
                expected = workload.innocents
            relay.start()
            received = consume(broker.bootstrap, prefix, len(workload.committed), 60, settle=2)
            code = relay.stop()
            pending = pending_inserts(outbox_db, names.slot, names.publication)
        finally:
            relay.close()
        main, letters = split(received, prefix)
        verdict = check(expected, main, prefix)
        twice = duplicated(main)
        delivered = {r.id for r in at_stop}
        seen = {position(r) for r in at_stop}
        again = Counter(r.id for r in main if position(r) not in seen)  # since the restart
        row.lost, row.reordered, row.duplicates = (
            len(verdict.lost),
            len(verdict.out_of_order),
            verdict.duplicates,
        )
        row.outcome += f": exit {code}, {pending} left in the slot"
        print(verdict)

        assert code == 0, relay.log()[-4000:]
        assert pending == 0
        assert_delivered(verdict)
        # What the slot had confirmed is not published again...
        assert not {w.id for w in workload.first} & set(again), again
        if scenario.fix is not None:
            # ...and with nothing refused after the fix there is no replay: each event once
            # from the restart on, so only those that reached Kafka before the stop twice.
            assert max(again.values()) == 1, again
            assert twice <= delivered, twice - delivered
        else:
            # ...and the culprit, refused again among others, replays its neighbours once.
            assert max(again.values()) <= 2, again
        assert_shared_batches(scenario, workload, main)
        assert "Traceback" not in relay.log()
        if scenario.fix is None:
            assert [r.id for r in letters] == [workload.culprit.id]
            assert workload.culprit.id not in {r.id for r in main}
            assert_letter(letters[0], workload.culprit, scenario, prefix)
            assert_stored(outbox_db, workload.culprit, scenario, prefix)
            row.outcome += ", culprit dead-lettered"
        else:
            assert letters == []
            assert stored_dead_letters(outbox_db) == []
            row.outcome += ", culprit delivered"
        assert_only_writes_denied(broker, scenario, prefix)


# -- stream with a dead-letter topic ----------------------------------------------------------


def test_stream_dead_letters_exactly_the_culprit_and_goes_on(
    tmp_path: Path, outbox_db: str, names: Any, scenario: Scenario, broker: Any
) -> None:
    prefix = names.topic_prefix
    with matrix_row(scenario.name, "dead-letter topic", "stream") as row:
        run = stream_with_dead_letters(tmp_path, outbox_db, broker.bootstrap, names, scenario, row)
        workload, relay, main, letters = run.workload, run.relay, run.main, run.letters

        assert run.alive, relay.log()[-4000:]
        assert run.code == 0, relay.log()[-4000:]
        assert run.pending == 0
        assert [r.id for r in letters] == [workload.culprit.id]
        assert_letter(letters[0], workload.culprit, scenario, prefix)
        assert_stored(outbox_db, workload.culprit, scenario, prefix)
        assert workload.culprit.id not in {r.id for r in main}
        assert_delivered(run.verdict)
        assert_shared_batches(scenario, workload, main)
        # The replay that isolates the culprit sends its neighbours again, once at most.
        assert max(Counter(r.id for r in main).values()) <= 2
        assert_isolated(scenario, relay.log())
        assert_only_writes_denied(broker, scenario, prefix)
        assert "event sent to the dead-letter topic" in relay.log()
        assert "Traceback" not in relay.log()


def _emit_transaction(dsn: str, events: list[tuple[str, str, Any, bool]]) -> list[Written]:
    """One transaction of events, each a row or (with True) a logical decoding message
    written with outbox_emit() (schema outbox); what each is, as stored or as printed."""
    written = []
    with psycopg.connect(dsn) as conn, conn.transaction():
        for aggregate_type, aggregate_id, payload, as_message in events:
            event_id = str(uuid.uuid4())
            text = json.dumps(payload)
            if as_message:
                conn.execute(
                    "SELECT outbox_emit(%s, %s, %s, %s::jsonb, %s::uuid)",
                    (aggregate_type, aggregate_id, f"{aggregate_type}.changed", text, event_id),
                )
            else:
                conn.execute(
                    "INSERT INTO outbox_events (id, aggregate_type, aggregate_id, event_type, "
                    "payload) VALUES (%s, %s, %s, %s, %s::jsonb)",
                    (event_id, aggregate_type, aggregate_id, f"{aggregate_type}.changed", text),
                )
            ((printed,),) = conn.execute("SELECT %s::jsonb::text", (text,)).fetchall()
            written.append(
                Written(
                    id=event_id,
                    aggregate_type=aggregate_type,
                    aggregate_id=aggregate_id,
                    event_type=f"{aggregate_type}.changed",
                    payload=printed.encode(),
                    after_commit_lsn=0,
                    committed_at=0.0,
                )
            )
    return written


def test_a_refused_logical_message_is_dead_lettered_with_its_content(
    tmp_path: Path, outbox_db: str, names: Any, kafka_service: Any
) -> None:
    scenario = SCENARIOS["too-large"]
    prefix = names.topic_prefix
    with matrix_row(scenario.name + " (logical message)", "dead-letter topic", "stream") as row:
        prepare(scenario, outbox_db, kafka_service.bootstrap, prefix)
        setup_slot(outbox_db, names)
        writers_only(outbox_db)  # stream --messages, once only writers may emit messages
        first = _emit_transaction(outbox_db, [("blob", k, {"n": 0}, False) for k in ("k0", "k1")])
        middle = _emit_transaction(
            outbox_db,
            [
                ("blob", "k1", {"n": 1}, True),
                ("blob", "k0", _big_payload(), True),
                ("blob", "k2", {"n": 1}, False),
            ],
        )
        later = _emit_transaction(outbox_db, [("blob", k, {"n": 2}, True) for k in ("k0", "k1")])
        culprit = middle[1]
        innocents = first + middle[:1] + middle[2:] + later
        relay = stream_relay(
            tmp_path,
            outbox_db,
            kafka_service.bootstrap,
            names,
            scenario,
            dead_letter_topic=f"{prefix}.{DEAD}",
            messages="true",
        )
        try:
            relay.start()
            received = consume(kafka_service.bootstrap, prefix, len(innocents) + 1, 60, settle=2)
            code = relay.stop()
        finally:
            relay.close()
        main, letters = split(received, prefix)
        verdict = check(innocents, main, prefix)
        row.lost, row.reordered, row.duplicates = (
            len(verdict.lost),
            len(verdict.out_of_order),
            verdict.duplicates,
        )
        stored = stored_dead_letters(outbox_db)
        row.outcome = f"ran on: {len(letters)} letter(s), {len(stored)} in table, content kept"
        print(verdict)

        assert code == 0, relay.log()[-4000:]
        assert [r.id for r in letters] == [culprit.id]
        assert_letter(letters[0], culprit, scenario, prefix)
        # No row holds a logical message: the table is where its content lives on.
        assert_stored(outbox_db, culprit, scenario, prefix)
        (_, _, key, value, _, headers) = stored[0]
        assert (key, value) == (b"k0", culprit.payload)
        assert json.loads(value)["blob"] and len(value) > 150_000
        assert headers["event_type"] == "blob.changed"
        assert headers["aggregate_type"] == "blob"
        assert_delivered(verdict)
        assert "Traceback" not in relay.log()


def test_a_payload_the_dead_letter_topic_refuses_too_stays_in_the_table(
    tmp_path: Path, outbox_db: str, names: Any, kafka_service: Any
) -> None:
    scenario = SCENARIOS["too-large"]
    prefix = names.topic_prefix
    mode = "dead-letter topic as small"
    with matrix_row(scenario.name, mode, "stream") as row:
        run = stream_with_dead_letters(
            tmp_path,
            outbox_db,
            kafka_service.bootstrap,
            names,
            scenario,
            row,
            dead_letter_config=scenario.topics["blob"],
        )
        workload, relay, letters = run.workload, run.relay, run.letters

        assert run.code == 0, relay.log()[-4000:]
        assert run.pending == 0
        assert [r.id for r in letters] == [workload.culprit.id]
        assert_letter(letters[0], workload.culprit, scenario, prefix, with_value=False)
        assert_stored(outbox_db, workload.culprit, scenario, prefix)
        assert_delivered(run.verdict)
        assert "Traceback" not in relay.log()


# -- poll -------------------------------------------------------------------------------------


def _poller_section() -> str:
    text = (DOCS / "polling.md").read_text()
    start = text.index("## The polling relay")
    end = text.find("\n## ", start + 1)
    return " ".join(text[start : end if end > 0 else None].split())  # lines unwrapped


def _culprit_state(dsn: str, culprit_id: str) -> tuple[bool, int]:
    """(whether the culprit is a dead letter, how many later rows of its aggregate are
    processed), read in one snapshot."""
    ((dead, overtaking),) = query(
        dsn,
        "SELECT c.retry_after = 'infinity', (SELECT count(*) FROM outbox_events l "
        "  WHERE l.aggregate_type = c.aggregate_type AND l.aggregate_id = c.aggregate_id "
        "  AND l.seq > c.seq AND l.processed_at IS NOT NULL) "
        "FROM outbox_events c WHERE c.id = %s",
        culprit_id,
    )
    return bool(dead), int(overtaking)


def test_poll_makes_the_culprit_a_dead_letter_and_publishes_every_other_row(
    tmp_path: Path, outbox_db: str, names: Any, scenario: Scenario, broker: Any
) -> None:
    prefix = names.topic_prefix
    with matrix_row(scenario.name, "backoff, dead letter", "poll") as row:
        workload = poller_workload(scenario, outbox_db, broker.bootstrap, prefix)
        culprit = workload.culprit
        waiting = [
            w
            for w in workload.after
            if (w.aggregate_type, w.aggregate_id) == (culprit.aggregate_type, culprit.aggregate_id)
            and culprit.aggregate_id is not None
        ]
        overtaken = 0  # looks that saw a later row of the culprit's aggregate go first

        def settled() -> bool:
            nonlocal overtaken
            dead, processed_later = _culprit_state(outbox_db, culprit.id)
            if processed_later and not dead:
                overtaken += 1
            ((left,),) = query(
                outbox_db, "SELECT count(*) FROM outbox_events WHERE processed_at IS NULL"
            )
            return dead and left == 1

        relay = poll_relay(tmp_path, outbox_db, broker.bootstrap, names, scenario)
        code, received, verdict = poll_until(
            relay,
            settled,
            "the culprit to be a dead letter, the rest published",
            workload,
            broker,
            prefix,
        )
        dead = query(outbox_db, "SELECT id::text, attempts, last_error FROM outbox_dead_letters")
        retried = {
            event_id
            for (event_id,) in query(
                outbox_db,
                "SELECT id::text FROM outbox_events WHERE attempts > 0 AND id <> %s::uuid",
                culprit.id,
            )
        }
        row.lost, row.reordered, row.duplicates = (
            len(verdict.lost),
            len(verdict.out_of_order),
            verdict.duplicates,
        )
        row.outcome = f"{len(dead)} dead letter(s)" + (
            f" after {dead[0][1]} attempts" if dead else ""
        )
        row.outcome += f"; {len(retried)} innocents refused with it, then delivered"
        if waiting:
            row.outcome += f"; {len(waiting)} later rows of its aggregate " + (
                "overtook it" if overtaken else "waited until it was dead"
            )
        print(verdict)

        assert code == 0, relay.log()[-4000:]
        assert [(d[0], d[1]) for d in dead] == [(culprit.id, 3)], dead
        assert any(error in dead[0][2] for error in scenario.errors), dead
        listed = subprocess.run(
            [
                sys.executable,
                "-m",
                "cdc_relay",
                "dead-letters",
                "list",
                "--dsn",
                outbox_db,
                "--json",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert listed.returncode == 0, listed.stderr
        ((entry,),) = [json.loads(listed.stdout)]
        assert entry["id"] == culprit.id
        assert any(error in entry["last_error"] for error in scenario.errors), entry
        assert culprit.id not in {r.id for r in received}
        assert_delivered(verdict)
        # Twice only a row refused with the culprit (its message purged in flight may have
        # reached the broker) and sent again.
        assert duplicated(received) <= retried, (duplicated(received) - retried, verdict)
        assert "Traceback" not in relay.log()
        if scenario.batch:
            assert retried  # the batch-level refusal reached innocent rows too
        assert_only_writes_denied(broker, scenario, prefix)
        # Later rows of the culprit's aggregate waited behind it until it was a dead letter,
        # as the poller's section of docs/polling.md says.
        assert overtaken == 0
        section = _poller_section()
        assert "the later rows of its aggregate wait for it" in section
        assert "Once the row is a dead letter, its aggregate goes on without it" in section


@pytest.mark.parametrize("scenario", ["too-large"], indirect=True)
def test_poll_with_one_attempt_dead_letters_only_the_culprit_of_a_refused_batch(
    tmp_path: Path, outbox_db: str, names: Any, scenario: Scenario, broker: Any
) -> None:
    # --max-attempts 1: a row fails once and is dead, but Kafka refused the culprit's whole
    # batch, innocents with it. Only a row refused alone (or by the client) is known to be
    # the culprit: the innocents go again alone, and are delivered.
    prefix = names.topic_prefix
    with matrix_row(scenario.name, "one attempt, dead letter", "poll") as row:
        workload = poller_workload(scenario, outbox_db, broker.bootstrap, prefix)
        culprit = workload.culprit

        def settled() -> bool:
            ((dead, left),) = query(
                outbox_db,
                "SELECT count(*) FILTER (WHERE retry_after = 'infinity'), "
                "count(*) FILTER (WHERE processed_at IS NULL) FROM outbox_events",
            )
            return bool(dead) and left == dead

        relay = poll_relay(tmp_path, outbox_db, broker.bootstrap, names, scenario, max_attempts="1")
        code, _, verdict = poll_until(
            relay, settled, "every row published or a dead letter", workload, broker, prefix
        )
        dead = query(outbox_db, "SELECT id::text, attempts FROM outbox_dead_letters")
        retried = query(
            outbox_db,
            "SELECT count(*) FROM outbox_events WHERE attempts > 0 AND id <> %s::uuid",
            culprit.id,
        )[0][0]
        row.lost, row.reordered, row.duplicates = (
            len(verdict.lost),
            len(verdict.out_of_order),
            verdict.duplicates,
        )
        row.outcome = f"{len(dead)} dead letter(s); {retried} innocents refused with it"
        print(verdict)

        assert code == 0, relay.log()[-4000:]
        assert retried  # innocents were refused with the culprit's batch
        # Its first refusal, in the batch, was not known to be its own; the second, alone, was.
        assert dead == [(culprit.id, 2)], dead
        assert_delivered(verdict)
        assert "with other rows" in relay.log()


@pytest.mark.parametrize("scenario", ["too-large"], indirect=True)
def test_a_handover_stopped_by_a_refused_batch_names_the_culprit_not_a_neighbour(
    outbox_db: str, names: Any, scenario: Scenario, broker: Any
) -> None:
    prefix = names.topic_prefix
    workload = poller_workload(scenario, outbox_db, broker.bootstrap, prefix)
    culprit = workload.culprit

    result = handover(outbox_db, broker.bootstrap, names)

    # Kafka refused the culprit's batch, its neighbours with it: the first row refused was a
    # neighbour (key k0, written before it), and the error named it until the suspects were
    # sent again alone.
    assert result.returncode == 1, result.stderr
    print(result.stderr)
    line = result.stderr.strip().splitlines()[-1]
    assert f"Kafka refused event {culprit.id}" in line, line
    assert "MSG_SIZE_TOO_LARGE" in line
    assert "the handover was undone (no slot was created" in line
    # This database's: the server is the session's, other tests' slots are in theirs.
    ((slots,),) = query(
        outbox_db,
        "SELECT count(*) FROM pg_replication_slots WHERE database = current_database()",
    )
    assert slots == 0
    # What went through was marked processed; the culprit and what waits behind it were not.
    unprocessed = {
        row_id
        for (row_id,) in query(
            outbox_db, "SELECT id::text FROM outbox_events WHERE processed_at IS NULL"
        )
    }
    assert culprit.id in unprocessed
    received = consume(broker.bootstrap, prefix, 1, 10, settle=1.5)
    assert {r.id for r in received}.isdisjoint(unprocessed)
    assert culprit.id not in {r.id for r in received}


# -- the delivery timeout ---------------------------------------------------------------------


@pytest.mark.parametrize("command", ["stream", "poll"])
def test_a_delivery_timeout_is_refused_at_start(
    tmp_path: Path, outbox_db: str, names: Any, kafka_service: Any, command: str
) -> None:
    with matrix_row("message.timeout.ms / delivery.timeout.ms", "start-up", command) as row:
        setup_slot(outbox_db, names)
        install_poller(outbox_db)
        writer = Writer(outbox_db)
        writer.transaction([("order", "t", {"n": 1})])
        writer.close()
        properties = tmp_path / "kafka.properties"
        properties.write_text("linger.ms=5\ndelivery.timeout.ms: 120000\n")
        base = [
            sys.executable,
            "-m",
            "cdc_relay",
            command,
            "--dsn",
            outbox_db,
            "--kafka-bootstrap",
            kafka_service.bootstrap,
        ]
        if command == "stream":
            base += ["--slot", names.slot, "--publication", names.publication]
        ways: list[tuple[str, list[str], dict[str, str]]] = [
            ("message.timeout.ms", ["--kafka-config", "message.timeout.ms=5000"], {}),
            ("delivery.timeout.ms", ["--kafka-config", "delivery.timeout.ms=5000"], {}),
            ("message.timeout.ms", [], {"CDC_RELAY_KAFKA_CONFIG": "message.timeout.ms=300000"}),
            ("delivery.timeout.ms", ["--kafka-config-file", str(properties)], {}),
        ]
        results = [
            (
                setting,
                subprocess.run(
                    base + args,
                    capture_output=True,
                    text=True,
                    timeout=60,
                    env={**os.environ, **env},
                ),
            )
            for setting, args, env in ways
        ]
        codes = sorted({done.returncode for _, done in results})
        row.outcome = f"exit {codes}, one line naming the setting; nothing relayed"
        if command == "stream":
            left = pending_inserts(outbox_db, names.slot, names.publication)
        else:
            ((left,),) = query(
                outbox_db, "SELECT count(*) FROM outbox_events WHERE processed_at IS NULL"
            )
        row.lost = 0 if left == 1 else None  # still waiting in the slot or the table
        row.reordered = row.duplicates = 0  # nothing was relayed

        for setting, done in results:
            message = done.stderr.strip()
            assert done.returncode == 2, (setting, done.stderr)
            assert "\n" not in message, message
            assert "Traceback" not in done.stderr + done.stdout
            assert message.startswith("cdc-relay: error: "), message
            assert setting in message, message
            assert "cdc-relay needs message.timeout.ms=0: remove the setting" in message
        assert left == 1  # nothing was read or relayed


def test_the_docs_advise_no_kafka_setting_the_relays_refuse() -> None:
    """Every ``--kafka-config key=value`` the documentation's pages show (as an option, or in
    a configuration file's ``kafka-config = [...]``) is one the relays start with."""
    text = "\n".join(page.read_text() for page in sorted(DOCS.rglob("*.md")))
    advised = re.findall(r"--kafka-config ([\w.]+)=([^\s`]+)", text)
    for listed in re.findall(r"^kafka-config = \[(.*)\]$", text, re.M):
        advised += re.findall(r'"([\w.]+)=([^"]*)"', listed)
    assert advised, "no --kafka-config setting found in the pages: the pattern no longer matches"
    refused = []
    for key, value in advised:
        try:
            producer_config("127.0.0.1:9092", {key: value})
        except UsageError as exc:
            refused.append(f"{key}={value}: {exc}")
    assert refused == []


def test_poll_waits_out_a_stopped_broker_and_delivers_everything(
    tmp_path: Path, outbox_db: str, names: Any, kafka_service: Any
) -> None:
    """No timeout: the rows wait for the broker, no attempt is spent, nothing is dead."""
    prefix = names.topic_prefix
    with matrix_row("broker stopped (no delivery timeout)", "wait", "poll") as row:
        install_poller(outbox_db)
        relay = poll_relay(tmp_path, outbox_db, kafka_service.bootstrap, names)
        writer = Writer(outbox_db)
        try:
            relay.start()
            writer.transaction([("order", "before", {"n": 0})])
            consume(kafka_service.bootstrap, prefix, expected=1, timeout=30, settle=0)
            kafka_service.stop()
            try:
                for i in range(20):
                    writer.transaction([("order", f"down{i % 4}", {"n": i})])
                # Longer than the 5 s timeout the relays refuse: no row may have failed.
                time.sleep(8)
            finally:
                alive = relay.alive()
                state = query(
                    outbox_db,
                    "SELECT count(*), coalesce(max(attempts), 0) FROM outbox_events "
                    "WHERE processed_at IS NULL",
                )
                kafka_service.start()
            received = consume(kafka_service.bootstrap, prefix, len(writer.written), 90, settle=2)
            relay.signal(signal.SIGTERM)
            code = relay.wait(60)
        finally:
            writer.close()
            relay.close()
        verdict = check(writer.written, received, prefix)
        dead = query(outbox_db, "SELECT id FROM outbox_dead_letters")
        row.lost, row.reordered, row.duplicates = (
            len(verdict.lost),
            len(verdict.out_of_order),
            verdict.duplicates,
        )
        row.outcome = f"waited ({state[0][0]} rows held, max attempts {state[0][1]}), then all"
        print(verdict)

        assert alive, relay.log()[-4000:]
        assert state == [(20, 0)]
        assert code == 0, relay.log()[-4000:]
        assert dead == []
        assert_delivered(verdict)
        assert query(
            outbox_db, "SELECT count(*) FROM outbox_events WHERE processed_at IS NULL"
        ) == [(0,)]
        assert "Traceback" not in relay.log()
