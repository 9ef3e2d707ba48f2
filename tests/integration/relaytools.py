"""Helpers of the integration tests: run the relay as a process, write events, read Kafka,
and compare what was committed with what Kafka holds."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
from confluent_kafka import (
    OFFSET_BEGINNING,
    TIMESTAMP_NOT_AVAILABLE,
    Consumer,
    KafkaError,
    KafkaException,
    TopicPartition,
)
from confluent_kafka.admin import (
    AdminClient,
    AlterConfigOpType,
    ConfigEntry,
    ConfigResource,
    NewTopic,
)
from psycopg.rows import dict_row

from cdc_relay import schema
from cdc_relay.devstack.kafka import LocalKafka
from cdc_relay.events import Insert
from cdc_relay.lsn import parse as parse_lsn
from cdc_relay.outbox import write_event
from cdc_relay.postgres import pgoutput
from cdc_relay.postgres.messages import EmitGrants
from cdc_relay.postgres.slot import SlotSpec, setup

# -- the relay process ------------------------------------------------------------------------


class RelayProcess:
    """``cdc-relay stream`` (or another ``command``, such as ``poll``) as a child process,
    configured through CDC_RELAY_* variables, in the working directory ``cwd`` (ours if None;
    it may change between runs)."""

    def __init__(
        self, log_dir: Path, env: dict[str, str], name: str = "relay", command: str = "stream"
    ) -> None:
        self.log_dir = log_dir
        self.env = env
        self.name = name
        self.command = command
        self.cwd: Path | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self.runs = 0

    @property
    def log_path(self) -> Path:
        return self.log_dir / f"{self.name}-{self.runs}.log"

    def start(self) -> RelayProcess:
        self.runs += 1
        log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "cdc_relay", self.command],
            env={**os.environ, **self.env},
            cwd=self.cwd,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()
        return self

    def signal(self, signum: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(signum)

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        self.wait(10)

    def stop(self, timeout: float = 60) -> int:
        self.signal(signal.SIGTERM)
        return self.wait(timeout)

    def wait(self, timeout: float) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log(self) -> str:
        return "\n".join(
            (self.log_dir / f"{self.name}-{run}.log").read_text(errors="replace")
            for run in range(1, self.runs + 1)
        )

    def close(self) -> None:
        if self.alive():
            self.kill()


def relay_env(dsn: str, bootstrap: str, names: Any, **extra: str) -> dict[str, str]:
    env = {
        "CDC_RELAY_DSN": dsn,
        "CDC_RELAY_SLOT": names.slot,
        "CDC_RELAY_PUBLICATION": names.publication,
        "CDC_RELAY_KAFKA_BOOTSTRAP": bootstrap,
        "CDC_RELAY_TOPIC_TEMPLATE": names.topic_prefix + ".{aggregate_type}",
        "CDC_RELAY_STATUS_INTERVAL": "1",
        "CDC_RELAY_SHUTDOWN_TIMEOUT": "10",
    }
    env.update({f"CDC_RELAY_{k.upper()}": v for k, v in extra.items()})
    return env


def setup_slot(
    dsn: str,
    names: Any,
    plugin: str = "pgoutput",
    slot: str | None = None,
    table: str = "outbox_events",
) -> None:
    spec = SlotSpec(
        slot=slot or names.slot, publication=names.publication, table=table, plugin=plugin
    )
    setup(dsn, spec)


def writers_only(dsn: str, *writers: str) -> None:
    """Leave pg_logical_emit_message to ``writers`` and superusers (the tests' role) in the
    database of ``dsn``, as stream --messages requires: what its refusal says to run."""
    with psycopg.connect(dsn, autocommit=True, row_factory=dict_row) as conn:
        for statement in EmitGrants.read(conn, writers).statements():
            conn.execute(statement.encode())


def handover(dsn: str, bootstrap: str, names: Any) -> subprocess.CompletedProcess[str]:
    """``cdc-relay setup-slot --from-poller``, run to its end."""
    return subprocess.run(
        [sys.executable, "-m", "cdc_relay", "setup-slot", "--from-poller"],
        env={**os.environ, **relay_env(dsn, bootstrap, names)},
        capture_output=True,
        text=True,
        timeout=120,
    )


def install_poller(dsn: str) -> None:
    """What ``cdc-relay poll`` adds to the outbox: the NOTIFY trigger, the dead-letter view."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(schema.text("poller").encode())  # several statements: no parameters


def slot_row(dsn: str, slot: str) -> dict[str, Any]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        cur = conn.execute(
            "SELECT active, active_pid, confirmed_flush_lsn, "
            "pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn)::bigint AS retained "
            "FROM pg_replication_slots WHERE slot_name = %s",
            (slot,),
        )
        row = cur.fetchone()
        assert row is not None, f"slot {slot} is gone"
        return {"active": row[0], "active_pid": row[1], "confirmed": row[2], "retained": row[3]}


def scrape(port: int) -> dict[str, float]:
    """The /metrics page as {sample name with labels: value}."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


def wait_until(predicate: Any, timeout: float, what: str, interval: float = 0.2) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def wait_slot(dsn: str, slot: str, active: bool, timeout: float = 30) -> None:
    wait_until(
        lambda: slot_row(dsn, slot)["active"] == active,
        timeout,
        f"slot {slot} active={active}",
    )


def pending_inserts(dsn: str, slot: str, publication: str) -> int:
    """Outbox inserts the slot still holds (not confirmed), read without consuming them."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT data FROM pg_logical_slot_peek_binary_changes(%s, NULL, NULL, "
            "'proto_version', '1', 'publication_names', %s)",
            (slot, pgoutput.publication_names(publication)),
        ).fetchall()
    return sum(isinstance(pgoutput.decode(bytes(r[0])), Insert) for r in rows)


# -- writing events ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Written:
    id: str
    aggregate_type: str
    aggregate_id: str
    event_type: str
    payload: bytes  # as PostgreSQL's jsonb prints it
    after_commit_lsn: int  # pg_current_wal_lsn() just after COMMIT: >= the commit's end
    committed_at: float  # time.monotonic()


Events = Sequence[tuple[str, str, dict[str, Any]]]


class Writer:
    """Writes outbox events in transactions, like an application, and records what committed.

    With ``reconnect``, a lost connection (the server restarting, the network failing) is
    retried until the server is back, and a transaction whose COMMIT went unanswered is looked
    up: recorded if it committed, written again if not. What is recorded is what committed.
    """

    def __init__(self, dsn: str, name: str = "w", reconnect: bool = False) -> None:
        self.dsn = dsn
        self.name = name
        self.reconnect = reconnect
        self.written: list[Written] = []
        self._conn = psycopg.connect(dsn)

    def transaction(self, events: Events, delete_after: bool = False) -> list[Written]:
        """One transaction of (aggregate_type, aggregate_id, payload) events."""
        ids = [str(uuid.uuid4()) for _ in events]
        unsure = False  # whether a failed attempt may have committed
        while True:
            try:
                if unsure and (stored := self._stored(ids)):
                    return self._record(events, ids, stored, self._wal_lsn())
                return self._transaction(events, ids, delete_after)
            except psycopg.OperationalError:
                if not self.reconnect or delete_after:  # deleted rows cannot be looked up
                    raise
                unsure = True
                self._reconnect()

    def _transaction(self, events: Events, ids: list[str], delete_after: bool) -> list[Written]:
        conn = self._conn
        with conn.transaction():
            for event_id, (aggregate_type, aggregate_id, payload) in zip(ids, events, strict=True):
                write_event(
                    conn,
                    aggregate_type=aggregate_type,
                    aggregate_id=aggregate_id,
                    event_type=f"{aggregate_type}.changed",
                    payload=payload,
                    event_id=uuid.UUID(event_id),
                )
            rows = conn.execute(
                "SELECT id::text, payload::text FROM outbox_events WHERE id = ANY(%s::uuid[])",
                (ids,),
            ).fetchall()
            if delete_after:
                conn.execute("DELETE FROM outbox_events WHERE id = ANY(%s::uuid[])", (ids,))
        after = self._wal_lsn()
        return self._record(events, ids, dict(rows), after)

    def _wal_lsn(self) -> str:
        """The server's WAL position now: past the end of every commit it acknowledged."""
        row = self._conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()
        self._conn.commit()
        assert row is not None
        return str(row[0])

    def _stored(self, ids: list[str]) -> dict[str, str]:
        """The payloads of the events of ``ids`` that are in the table (all or none)."""
        rows = self._conn.execute(
            "SELECT id::text, payload::text FROM outbox_events WHERE id = ANY(%s::uuid[])", (ids,)
        ).fetchall()
        self._conn.commit()
        return dict(rows)

    def _reconnect(self, timeout: float = 120) -> None:
        self._conn.close()
        deadline = time.monotonic() + timeout
        while True:
            try:
                self._conn = psycopg.connect(self.dsn, connect_timeout=2)
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
            else:
                return

    def _record(
        self, events: Events, ids: list[str], stored: dict[str, str], after: str
    ) -> list[Written]:
        now = time.monotonic()
        batch = [
            Written(
                id=i,
                aggregate_type=a_type,
                aggregate_id=a_id,
                event_type=f"{a_type}.changed",
                payload=stored[i].encode(),
                after_commit_lsn=parse_lsn(after),
                committed_at=now,
            )
            for i, (a_type, a_id, _) in zip(ids, events, strict=True)
        ]
        self.written.extend(batch)
        return batch

    def close(self) -> None:
        self._conn.close()


@dataclass
class Load:
    """Writers in threads, each owning ``aggregates`` ids of each type, until stopped; with
    ``reconnect`` they ride out a lost connection (see ``Writer``)."""

    dsn: str
    writers: int = 3
    pause: float = 0.002
    aggregates: int = 7
    reconnect: bool = False
    written: list[Written] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    errors: list[BaseException] = field(default_factory=list)

    def start(self) -> Load:
        for n in range(self.writers):
            thread = threading.Thread(target=self._run, args=(n,), daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def _run(self, n: int) -> None:
        writer = Writer(self.dsn, name=f"w{n}", reconnect=self.reconnect)
        i = 0
        try:
            while not self._stop.is_set():
                size = 1 + i % 5
                events = [
                    (
                        ("order", "customer")[j % 2],
                        f"w{n}-a{(i + j) % self.aggregates}",
                        {"w": n, "i": i, "j": j},
                    )
                    for j in range(size)
                ]
                self.written.extend(writer.transaction(events))
                i += 1
                time.sleep(self.pause)
        except BaseException as exc:  # noqa: BLE001 - reported by stop()
            self.errors.append(exc)
        finally:
            writer.close()

    def stop(self) -> list[Written]:
        self._stop.set()
        for thread in self._threads:
            thread.join(30)
        assert not self.errors, self.errors
        return self.written


# -- reading Kafka ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Received:
    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, bytes], ...]
    timestamp: float | None = None  # the message's timestamp, seconds since the epoch

    @property
    def id(self) -> str:
        return dict(self.headers)["id"].decode()


def consume(
    bootstrap: str,
    topic_prefix: str,
    expected: int,
    timeout: float = 120,
    settle: float = 3.0,
) -> list[Received]:
    """Every message on the test's topics, in partition order; waits for ``expected`` of them
    (ids, duplicates included), then ``settle`` seconds more to catch duplicates.

    It reads what Kafka holds, not what a consumer group is handed: each partition of each
    topic named ``<prefix>.*`` is assigned from its first offset as soon as the metadata shows
    it (looked at every second). A group subscribed by pattern rebalances each time a topic
    appears, and a message fetched across one of those rebalances was, now and then, never
    delivered (46 of 50, 4,851 of 4,852), which read as an event lost by the relay."""
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"check-{uuid.uuid4()}",  # never joined: partitions are assigned
            "auto.offset.reset": "earliest",  # where an offset is out of range, if ever
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
        }
    )
    pattern = re.compile(f"^{re.escape(topic_prefix)}[.].*")
    assigned: set[tuple[str, int]] = set()
    received: list[Received] = []
    ids: set[str] = set()
    positions: set[tuple[str, int, int]] = set()
    deadline = time.monotonic() + timeout
    settle_until: float | None = None
    next_look = 0.0
    try:
        while True:
            now = time.monotonic()
            if settle_until is not None and now > settle_until:
                break
            if now > deadline:
                break
            if now >= next_look:
                next_look = now + 1.0
                new = _new_partitions(consumer, pattern, assigned)
                if new:
                    consumer.incremental_assign(new)
                    assigned.update((tp.topic, tp.partition) for tp in new)
            msg = consumer.poll(0.5)
            if msg is None:
                continue
            if msg.error():
                if msg.error().code() in (
                    KafkaError._PARTITION_EOF,
                    KafkaError.UNKNOWN_TOPIC_OR_PART,
                ):
                    continue
                raise AssertionError(f"consumer error: {msg.error()}")
            position = (msg.topic(), msg.partition(), msg.offset())
            if position in positions:
                continue  # fetched twice: the same message, not a duplicate
            positions.add(position)
            item = Received(
                topic=msg.topic(),
                partition=msg.partition(),
                offset=msg.offset(),
                key=msg.key(),
                value=msg.value(),
                headers=tuple(msg.headers() or ()),
                timestamp=_seconds(msg.timestamp()),
            )
            received.append(item)
            ids.add(item.id)
            if len(ids) >= expected and settle_until is None:
                settle_until = time.monotonic() + settle
    finally:
        consumer.close()
    return received


def find_on_kafka(bootstrap: str, topic_prefix: str, ids: Iterable[str]) -> dict[str, Any]:
    """Where Kafka holds each of ``ids`` (topic, partition, offset), read partition by partition
    up to its high watermark; and each partition's watermarks. A diagnosis of a test that
    missed events: whether Kafka has them."""
    wanted = set(ids)
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"find-{uuid.uuid4()}",
            "enable.auto.commit": False,
        }
    )
    found: dict[str, Any] = {}
    try:
        pattern = re.compile(f"^{re.escape(topic_prefix)}[.].*")
        for tp in _new_partitions(consumer, pattern, set()):
            low, high = consumer.get_watermark_offsets(tp, timeout=10)
            found[f"{tp.topic}[{tp.partition}]"] = (low, high)
            if high <= low:
                continue
            consumer.assign([TopicPartition(tp.topic, tp.partition, low)])
            while True:
                msg = consumer.poll(5)
                if msg is None or msg.error():
                    break
                event = dict(msg.headers() or ()).get("id", b"").decode()
                if event in wanted:
                    found[event] = (msg.topic(), msg.partition(), msg.offset())
                if msg.offset() >= high - 1:
                    break
    finally:
        consumer.close()
    found["messages"] = sum(v[1] - v[0] for key, v in found.items() if "[" in key)
    return found


def _new_partitions(
    consumer: Consumer, pattern: re.Pattern[str], assigned: set[tuple[str, int]]
) -> list[TopicPartition]:
    """The partitions of the topics ``pattern`` names that are not read yet, from offset 0;
    none while the broker does not answer (a test that stopped it)."""
    try:
        topics = consumer.list_topics(timeout=5).topics
    except KafkaException:
        return []
    return [
        TopicPartition(name, partition, OFFSET_BEGINNING)
        for name, topic in topics.items()
        if pattern.match(name) and topic.error is None
        for partition in topic.partitions
        if (name, partition) not in assigned
    ]


def _seconds(timestamp: tuple[int, int]) -> float | None:
    kind, milliseconds = timestamp
    return None if kind == TIMESTAMP_NOT_AVAILABLE else milliseconds / 1000


def partitions_of(bootstrap: str, topic: str) -> list[TopicPartition]:
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "meta"})
    try:
        meta = consumer.list_topics(topic, timeout=10)
        return [TopicPartition(topic, p) for p in meta.topics[topic].partitions]
    finally:
        consumer.close()


# -- the checker ------------------------------------------------------------------------------


@dataclass
class Verdict:
    written: int
    received: int
    lost: list[str]
    duplicates: int
    out_of_order: list[str]
    mismatched: list[str]

    def __str__(self) -> str:
        return (
            f"written={self.written} received={self.received} lost={len(self.lost)} "
            f"duplicates={self.duplicates} out_of_order={len(self.out_of_order)} "
            f"mismatched={len(self.mismatched)}"
        )


def check(written: Iterable[Written], received: list[Received], topic_prefix: str) -> Verdict:
    """Compare what committed with what Kafka holds: lost, duplicated, reordered, altered."""
    written = list(written)
    by_id = {w.id: w for w in written}
    counts = Counter(r.id for r in received)
    lost = [w.id for w in written if w.id not in counts]
    duplicates = sum(n - 1 for n in counts.values())

    mismatched = []
    for r in received:
        w = by_id.get(r.id)
        expected = None
        if w is not None:
            expected = (
                f"{topic_prefix}.{w.aggregate_type}",
                w.aggregate_id.encode(),
                w.payload,
                (
                    ("id", w.id.encode()),
                    ("event_type", w.event_type.encode()),
                    ("aggregate_type", w.aggregate_type.encode()),
                ),
            )
        if expected != (r.topic, r.key, r.value, r.headers):
            mismatched.append(r.id)

    # Order per aggregate: the first delivery of each event, in partition order, must follow
    # commit order (duplicates after a crash replay a suffix and are skipped here).
    commit_rank = {w.id: n for n, w in enumerate(written)}
    per_aggregate: dict[tuple[str, str], list[int]] = defaultdict(list)
    seen: set[str] = set()
    for r in sorted(received, key=lambda r: (r.topic, r.partition, r.offset)):
        if r.id in seen or r.id not in by_id:
            continue
        seen.add(r.id)
        w = by_id[r.id]
        per_aggregate[(w.aggregate_type, w.aggregate_id)].append(commit_rank[r.id])
    out_of_order = [
        f"{k[0]}/{k[1]}" for k, ranks in per_aggregate.items() if ranks != sorted(ranks)
    ]
    return Verdict(
        written=len(written),
        received=len(received),
        lost=lost,
        duplicates=duplicates,
        out_of_order=out_of_order,
        mismatched=mismatched,
    )


# -- topics -----------------------------------------------------------------------------------

STRICT_KAFKA = {
    "auto.create.topics.enable": "false",
    "authorizer.class.name": "org.apache.kafka.metadata.authorizer.StandardAuthorizer",
    "allow.everyone.if.no.acl.found": "true",
}
"""A broker as production runs one: it creates no topic on demand, and runs KRaft's authorizer
(everything is allowed where no ACL is found: the broker itself is User:ANONYMOUS too)."""


def strict_broker(
    base_dir: Path, properties: dict[str, str] | None = None, **more: Any
) -> LocalKafka:
    """A broker (not started) of STRICT_KAFKA's settings, and ``properties`` besides; ``more``:
    LocalKafka's other arguments (ports, format_args)."""
    return LocalKafka(base_dir, properties={**STRICT_KAFKA, **(properties or {})}, **more)


def create_topics(bootstrap: str, topics: dict[str, dict[str, str]], partitions: int = 3) -> None:
    """Create each topic (name -> topic configuration) with ``partitions`` partitions."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    new = [NewTopic(name, partitions, 1, config=config) for name, config in topics.items()]
    for future in admin.create_topics(new, request_timeout=30).values():
        future.result(timeout=30)


def set_topic_config(bootstrap: str, topic: str, name: str, value: str) -> None:
    """Set one configuration of a topic (incremental: the others stay as they are)."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    entry = ConfigEntry(name, value, incremental_operation=AlterConfigOpType.SET)
    resource = ConfigResource(ConfigResource.Type.TOPIC, topic, incremental_configs=[entry])
    for future in admin.incremental_alter_configs([resource]).values():
        future.result(timeout=30)
