"""The benchmark's side of Kafka: topics stamped with LogAppendTime, how many messages they
hold, and reading every message back to check and time it."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from confluent_kafka import (
    OFFSET_BEGINNING,
    TIMESTAMP_LOG_APPEND_TIME,
    Consumer,
    IsolationLevel,
    KafkaError,
    KafkaException,
    TopicPartition,
)
from confluent_kafka.admin import AdminClient, NewTopic, OffsetSpec, TopicMetadata

PARTITIONS = 3


def create_topics(bootstrap: str, topics: Iterable[str]) -> None:
    """Create topics whose messages carry the broker's append time (LogAppendTime).

    The broker stamps each message as it appends it, with the clock the writer's commit times
    are read from: the end-to-end latency of every contestant is measured by the same clock.
    """
    admin = AdminClient({"bootstrap.servers": bootstrap})
    new = [
        NewTopic(topic, PARTITIONS, 1, config={"message.timestamp.type": "LogAppendTime"})
        for topic in topics
    ]
    for future in admin.create_topics(new, operation_timeout=30).values():
        future.result()
    # Created is not yet led: wait until every partition has a leader.
    deadline = time.monotonic() + 60
    while True:
        metadata = admin.list_topics(timeout=10).topics
        if all(_led(metadata.get(topic)) for topic in new_names(new)):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"topics {new_names(new)} have no leader 60 s after creation")
        time.sleep(0.1)


def new_names(topics: list[NewTopic]) -> list[str]:
    return [t.topic for t in topics]


def _led(topic: TopicMetadata | None) -> bool:
    return (
        topic is not None
        and topic.error is None
        and len(topic.partitions) == PARTITIONS
        and all(p.leader >= 0 and p.error is None for p in topic.partitions.values())
    )


def delete_topics(bootstrap: str, topics: Sequence[str]) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for future in admin.delete_topics(list(topics), operation_timeout=30).values():
        future.result()


class Watermarks:
    """How many messages some topics hold (sum of their partitions' high watermarks)."""

    def __init__(self, bootstrap: str, topics: Sequence[str]) -> None:
        self._consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "bench-meta"})
        self._partitions = [TopicPartition(t, p) for t in topics for p in range(PARTITIONS)]
        self._last = 0
        self._failing_since: float | None = None

    def count(self) -> int:
        """The count now; the previous one while the broker answers with errors, which it
        does for a moment after a topic is created (not leader for partition)."""
        try:
            self._last = sum(
                self._consumer.get_watermark_offsets(tp, timeout=10, cached=False)[1]
                for tp in self._partitions
            )
        except KafkaException:
            now = time.monotonic()
            self._failing_since = self._failing_since or now
            if now - self._failing_since > 60:
                raise
        else:
            self._failing_since = None
        return self._last

    def close(self) -> None:
        self._consumer.close()


@dataclass
class Deliveries:
    """Every message of some topics: the event id header and the broker's append time."""

    messages: int = 0
    first_append_ms: dict[str, int] = field(default_factory=dict)
    """Event id -> append time (ms) of its first delivery."""
    offsets: dict[tuple[str, int], tuple[int, int]] = field(default_factory=dict)
    """(topic, partition) -> the offsets of its first and last message."""
    other_timestamps: int = 0
    """Messages not stamped with LogAppendTime (a topic created by someone else)."""
    without_id: int = 0

    @property
    def duplicates(self) -> int:
        return self.messages - self.without_id - len(self.first_append_ms)


def read_all(bootstrap: str, topics: Sequence[str]) -> Deliveries:
    """Read every message the topics hold now, from the start."""
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"bench-read-{uuid.uuid4()}",
            "enable.auto.commit": False,
            "enable.partition.eof": True,
            "fetch.max.bytes": 64 * 1024 * 1024,
        }
    )
    deliveries = Deliveries()
    first = deliveries.first_append_ms
    try:
        ends = {}
        for topic in topics:
            for p in range(PARTITIONS):
                tp = TopicPartition(topic, p)
                high = consumer.get_watermark_offsets(tp, timeout=10, cached=False)[1]
                if high > 0:
                    ends[(topic, p)] = high
        consumer.assign([TopicPartition(t, p, 0) for t, p in ends])
        remaining = set(ends)
        progress = time.monotonic()
        while remaining:
            batch = consumer.consume(10_000, timeout=1)
            if batch:
                progress = time.monotonic()
            elif time.monotonic() - progress > 60:
                raise RuntimeError(f"reading the topics: no message for 60 s; left: {remaining}")
            for msg in batch:
                err = msg.error()
                if err is not None:
                    if err.code() == KafkaError._PARTITION_EOF:
                        remaining.discard((msg.topic(), msg.partition()))
                        continue
                    raise RuntimeError(f"reading {msg.topic()}: {err}")
                deliveries.messages += 1
                where, offset = (msg.topic() or "", msg.partition() or 0), msg.offset() or 0
                first_offset, _ = deliveries.offsets.get(where, (offset, offset))
                deliveries.offsets[where] = (first_offset, offset)
                kind, stamp = msg.timestamp()
                if kind != TIMESTAMP_LOG_APPEND_TIME:
                    deliveries.other_timestamps += 1
                event_id = next((v for k, v in msg.headers() or () if k == "id"), None)
                if event_id is None:
                    deliveries.without_id += 1
                    continue
                key = event_id.decode()
                if key not in first or stamp < first[key]:
                    first[key] = stamp
                if msg.offset() + 1 >= ends[(msg.topic(), msg.partition())]:
                    remaining.discard((msg.topic(), msg.partition()))
    finally:
        consumer.close()
    return deliveries


class CommitWatch:
    """When a transactional contestant's messages became readable, for its backlog: each
    partition's last stable offset (how far a read_committed consumer may read), asked every
    10 ms while the contestant runs (this machine's clock).

    Reading the backlog as it is committed (LiveReader) would run a second consumer of every
    message, and the broker's serving of it, on the cores the contestant drains with; these
    requests carry no message. A message at offset o is readable from the first answer whose
    last stable offset is past o (``readable_at``): 10 ms late at most, plus one request.
    """

    INTERVAL = 0.01
    SETTLED = 1.0
    """Seconds with no transaction open and nothing new before the backlog counts as drained
    (read back and checked after): the contestant commits within its idle time."""

    def __init__(self, bootstrap: str, topics: Sequence[str]) -> None:
        self._admin = AdminClient({"bootstrap.servers": bootstrap})
        self._partitions = [TopicPartition(t, p) for t in topics for p in range(PARTITIONS)]
        self.samples: list[tuple[float, dict[tuple[str, int], int]]] = []
        """(time.time(), (topic, partition) -> last stable offset), one per change."""
        self.longest_wait = 0.0
        """The longest time between two answers (s): how late a commit may have been seen."""
        self._answered = 0.0
        self._open = True  # a transaction holds back its last stable offset
        self._changed = time.monotonic()
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="bench-commit-watch", daemon=True)

    def start(self) -> CommitWatch:
        """Start asking; returns with the first answer in (nothing committed yet)."""
        self._thread.start()
        deadline = time.monotonic() + 60
        while not self.samples:
            if self._error is not None:
                raise self._error
            if time.monotonic() > deadline:
                raise RuntimeError("the broker did not answer a ListOffsets request in 60 s")
            time.sleep(self.INTERVAL)
        return self

    def count(self) -> int:
        """Messages readable now, commit markers included (a progress figure, not events)."""
        if self._error is not None:
            raise self._error
        return sum(self.samples[-1][1].values()) if self.samples else 0

    def settled(self) -> bool:
        """No transaction open, and nothing new for SETTLED s: with the count reached, the
        backlog is drained (the caller reads every message back to check each event)."""
        return not self._open and time.monotonic() - self._changed >= self.SETTLED

    def readable_at(self, topic: str, partition: int, offset: int) -> float:
        """When the message at ``offset`` was first seen readable (after an answer that
        said it was not)."""
        for i, (when, stable) in enumerate(self.samples):
            if stable.get((topic, partition), 0) > offset:
                if i == 0:
                    raise RuntimeError(f"{topic} [{partition}] offset {offset} readable at once")
                return when
        raise RuntimeError(f"{topic} [{partition}] offset {offset} was never seen readable")

    def _ask(self, isolation: IsolationLevel) -> dict[tuple[str, int], int]:
        futures = self._admin.list_offsets(
            {tp: OffsetSpec.latest() for tp in self._partitions},
            isolation_level=isolation,
            request_timeout=10,
        )
        return {(tp.topic, tp.partition): f.result().offset for tp, f in futures.items()}

    def _run(self) -> None:
        try:
            while not self._stop.wait(self.INTERVAL):
                try:
                    stable = self._ask(IsolationLevel.READ_COMMITTED)
                    when = time.time()
                    high = self._ask(IsolationLevel.READ_UNCOMMITTED)
                except KafkaException:
                    continue  # not leader for a moment after a topic is made: asked again
                if self.samples:
                    self.longest_wait = max(self.longest_wait, when - self._answered)
                self._answered = when
                if not self.samples or stable != self.samples[-1][1]:
                    self.samples.append((when, stable))
                    self._changed = time.monotonic()
                open_now = stable != high
                if open_now != self._open:
                    self._open = open_now
                    self._changed = time.monotonic()
        except BaseException as exc:  # noqa: BLE001 - raised by count, in the harness's thread
            self._error = exc

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)


class LiveReader:
    """A read_committed consumer reading the topics while the contestant runs, noting when it
    could first read each event (this machine's clock, the writer's).

    For a transactional contestant the broker's append time comes before the commit that makes
    a message readable, and the high watermarks count the transactions' commit markers: its
    deliveries are counted, and its latency measured, here instead.
    """

    def __init__(self, bootstrap: str, topics: Sequence[str]) -> None:
        self._consumer = Consumer(
            {
                "bootstrap.servers": bootstrap,
                "group.id": f"bench-live-{uuid.uuid4()}",
                "enable.auto.commit": False,
                "isolation.level": "read_committed",
                # A fetch returns as soon as there is anything: the wait is the latency's.
                "fetch.wait.max.ms": 5,
                "fetch.min.bytes": 1,
            }
        )
        self._consumer.assign(
            [TopicPartition(t, p, OFFSET_BEGINNING) for t in topics for p in range(PARTITIONS)]
        )
        self.first_read: dict[str, float] = {}
        """Event id -> when this consumer first read it (time.time())."""
        self.messages = 0
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="bench-live-reader", daemon=True)

    def start(self) -> LiveReader:
        self._thread.start()
        return self

    def count(self) -> int:
        """Distinct events read so far (Watermarks.count's counterpart)."""
        if self._error is not None:
            raise self._error
        return len(self.first_read)

    def _run(self) -> None:
        first = self.first_read
        try:
            while not self._stop.is_set():
                # A short timeout: the time taken is when the batch comes back, and a batch
                # that is not full may come back only at its timeout.
                batch = self._consumer.consume(10_000, timeout=0.005)
                now = time.time()
                for msg in batch:
                    err = msg.error()
                    if err is not None:
                        if err.code() != KafkaError._PARTITION_EOF:
                            self._error = RuntimeError(f"reading {msg.topic()}: {err}")
                            return
                        continue
                    self.messages += 1
                    event_id = next((v for k, v in msg.headers() or () if k == "id"), None)
                    if event_id is not None:
                        first.setdefault(event_id.decode(), now)
        except BaseException as exc:  # noqa: BLE001 - raised by count, in the harness's thread
            self._error = exc

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self._consumer.close()
