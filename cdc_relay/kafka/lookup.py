"""Where one event is on Kafka, found without reading a topic whole: the topic and key say the
partition (murmur2, as the relay's ``murmur2_random`` producer puts a key), the event's time
the first offset to look at (``offsets_for_times``), then a bounded scan for its ``id``
header. Nothing is consumed for a group: partitions are assigned, never joined or committed.
``cdc-relay trace`` (cdc_relay.ops.trace) asks it, with what the database knows of the event.
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field

from confluent_kafka import (
    TIMESTAMP_LOG_APPEND_TIME,
    TIMESTAMP_NOT_AVAILABLE,
    Consumer,
    KafkaError,
    KafkaException,
    TopicPartition,
)

from cdc_relay.errors import KafkaUnavailableError

# -- where librdkafka's murmur2_random puts a key -----------------------------------------------


def murmur2(data: bytes) -> int:
    """Kafka's murmur2 hash of ``data`` (org.apache.kafka.common.utils.Utils.murmur2, which
    librdkafka's murmur2 partitioners copy), as an unsigned 32-bit number."""
    m, mask = 0x5BD1E995, 0xFFFFFFFF
    length = len(data)
    h = (0x9747B28C ^ length) & mask
    tail = length & ~3
    for i in range(0, tail, 4):
        k = int.from_bytes(data[i : i + 4], "little")
        k = (k * m) & mask
        k ^= k >> 24
        k = (k * m) & mask
        h = ((h * m) & mask) ^ k
    rest = length & 3
    if rest == 3:
        h ^= data[tail + 2] << 16
    if rest >= 2:
        h ^= data[tail + 1] << 8
    if rest >= 1:
        h ^= data[tail]
        h = (h * m) & mask
    h ^= h >> 13
    h = (h * m) & mask
    h ^= h >> 15
    return h


def partition_of(key: bytes, partitions: int) -> int:
    """The partition the producer's ``murmur2_random`` partitioner gives a key (a message
    without a key goes to a random one)."""
    return (murmur2(key) & 0x7FFFFFFF) % partitions


# -- where the event is --------------------------------------------------------------------


@dataclass
class Found:
    """Where the event landed on Kafka."""

    topic: str
    partition: int
    offset: int
    timestamp: dt.datetime | None
    timestamp_type: str  # "LogAppendTime" or "CreateTime"


@dataclass
class Search:
    """What was looked at on Kafka, and what was found."""

    topic: str | None = None
    partitions: list[int] = field(default_factory=list)
    scanned: int = 0
    since: dt.datetime | None = None
    found: Found | None = None
    problem: str | None = None  # why it was not looked for, or not everywhere


def find(
    config: Mapping[str, str],
    search: Search,
    topic: str,
    key: bytes | None,
    since: dt.datetime,
    event: str,
    timeout: float,
    max_messages: int,
) -> None:
    """Look for the message of ``event`` in ``topic`` from ``since``, with consumer settings
    ``config``: what was looked at and found goes in ``search``; KafkaUnavailableError when no
    broker answers within ``timeout`` seconds."""
    search.topic, search.since = topic, since
    consumer = Consumer(
        {
            **config,
            "group.id": f"cdc-relay-trace-{uuid.uuid4()}",  # assigned, never joined
            "enable.auto.commit": "false",
            "enable.partition.eof": "true",
        }
    )
    try:
        search.found = _scan(consumer, timeout, max_messages, search, topic, key, since, event)
    except KafkaException as exc:
        error = exc.args[0] if exc.args and isinstance(exc.args[0], KafkaError) else None
        if error is not None and error.code() in (
            KafkaError._TRANSPORT,
            KafkaError._ALL_BROKERS_DOWN,
            KafkaError._TIMED_OUT,
        ):
            raise KafkaUnavailableError(
                f"no Kafka broker answered within {timeout:g}s "
                f"({error.str()}); check --kafka-bootstrap"
            ) from None
        # e.g. a topic the relay has just created, whose partitions have no leader yet
        search.problem = f"Kafka answered {error.str() if error is not None else exc}"
    finally:
        consumer.close()


def _scan(
    consumer: Consumer,
    timeout: float,
    max_messages: int,
    search: Search,
    name: str,
    key: bytes | None,
    since: dt.datetime,
    event: str,
) -> Found | None:
    """The event in topic ``name``: in the key's partition (every one for no key), from the
    first offset at ``since``."""
    metadata = consumer.list_topics(name, timeout=timeout)
    topic = metadata.topics.get(name)
    if topic is None or topic.error is not None or not topic.partitions:
        search.problem = f"topic {name} does not exist"
        return None
    count = len(topic.partitions)
    search.partitions = [partition_of(key, count)] if key is not None else sorted(topic.partitions)
    since_ms = int(since.timestamp() * 1000)
    starts = consumer.offsets_for_times(
        [TopicPartition(name, p, since_ms) for p in search.partitions],
        timeout=timeout,
    )
    for start in starts:
        _, high = consumer.get_watermark_offsets(start, timeout=timeout)
        if start.offset < 0 or start.offset >= high:
            continue  # nothing appended since
        found = _scan_partition(consumer, timeout, max_messages, search, start, high, event)
        if found is not None:
            return found
    return None


def _scan_partition(
    consumer: Consumer,
    timeout: float,
    max_messages: int,
    search: Search,
    start: TopicPartition,
    high: int,
    event: str,
) -> Found | None:
    consumer.assign([start])
    wanted = event.encode()
    last = min(high, start.offset + max_messages) - 1
    if high - start.offset > max_messages:
        search.problem = (
            f"{high - start.offset} messages on partition {start.partition} since "
            f"{search.since}; scanned the first {max_messages} (--max-messages)"
        )
    while True:
        # poll, not consume(n): a batch waits for n messages, or for the whole timeout
        message = consumer.poll(timeout)
        if message is None:
            search.problem = f"partition {start.partition} did not answer in time"
            return None
        error = message.error()
        if error is not None:
            if error.code() == KafkaError._PARTITION_EOF:
                return None
            raise KafkaException(error)
        search.scanned += 1
        headers = message.headers() or []
        if ("id", wanted) in (headers.items() if isinstance(headers, dict) else headers):
            kind, milliseconds = message.timestamp()
            return Found(
                str(message.topic()),
                int(message.partition() or 0),
                int(message.offset() or 0),
                None
                if kind == TIMESTAMP_NOT_AVAILABLE
                else dt.datetime.fromtimestamp(milliseconds / 1000, dt.UTC),
                "LogAppendTime" if kind == TIMESTAMP_LOG_APPEND_TIME else "CreateTime",
            )
        if (message.offset() or 0) >= last:
            return None
