"""Exactly once's checkpoint, kept in Kafka: where it reaches in the replication stream
(``Unit``, ``Checkpoint``), the record each Kafka transaction writes of it to the compacted
checkpoint topic (key: the transactional id), and reading the last committed one back.

The record is JSON. Version 2 names each unit by its LSN and its kind; version 1 named a unit
by its LSN alone, and is read as reaching only the message a position may name
(Checkpoint.decode). A record of the relay's key it cannot read is an UnreadableCheckpoint.
How the relay commits the checkpoint and skips by it: exactly_once.py.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

from cdc_relay.errors import KafkaUnavailableError, PreflightError
from cdc_relay.kafka.topics import TopicSpec, client_settings, ensure
from cdc_relay.lsn import Lsn, format_lsn

MESSAGE = 0
"""A unit's kind: a non-transactional message, at the LSN where its WAL record ends."""
TRANSACTION = 1
"""A unit's kind: a transaction, at the LSN where its commit record starts."""
_KINDS = {"message": MESSAGE, "transaction": TRANSACTION}


class Unit(NamedTuple):
    """One unit of the replication stream, by its place (invariant 11).

    A non-transactional message is at the end of its WAL record, which is where the next
    record starts: when that is a commit record, the message and that transaction share the
    LSN. The message is decoded when its record is read, the transaction at its commit, so the
    stream holds the message first: at one LSN, MESSAGE sorts before TRANSACTION, and units
    compare in stream order."""

    lsn: Lsn
    kind: int = TRANSACTION

    def __str__(self) -> str:
        where = format_lsn(self.lsn)
        return f"the message at {where}" if self.kind == MESSAGE else f"the transaction at {where}"


NOWHERE = Unit(0, MESSAGE)
"""Before the first unit of any stream."""


@dataclass(frozen=True)
class Checkpoint:
    """How far the committed Kafka transactions reach in the replication stream, on which
    timeline of the server (0: not known, as in checkpoints written before it was recorded)."""

    position: Unit = NOWHERE
    partial: Unit = NOWHERE
    partial_events: int = 0
    timeline: int = 0

    def encode(self) -> bytes:
        names = {kind: name for name, kind in _KINDS.items()}
        return json.dumps(
            {
                "v": 2,
                "position": self.position.lsn,
                "position_kind": names[self.position.kind],
                "partial_position": self.partial.lsn,
                "partial_kind": names[self.partial.kind],
                "partial_events": self.partial_events,
                "timeline": self.timeline,
            }
        ).encode()

    @classmethod
    def decode(cls, value: bytes) -> Checkpoint:
        """A checkpoint record; one of version 1, which named a unit by its LSN alone, is read
        as reaching only the message a position may name: a transaction committing at that
        LSN is replayed (duplicates, once), never skipped unseen."""
        try:
            fields = json.loads(value)
            return cls(
                Unit(int(fields["position"]), _KINDS[fields.get("position_kind", "message")]),
                Unit(
                    int(fields["partial_position"]), _KINDS[fields.get("partial_kind", "message")]
                ),
                int(fields["partial_events"]),
                int(fields.get("timeline") or 0),
            )
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise UnreadableCheckpoint(
                f"a checkpoint record cannot be read ({type(exc).__name__}: {exc}): it was "
                "written by a newer cdc-relay or by something else; run the version that "
                "wrote it, or delete the record (its key is the transactional id) to replay "
                "from the slot (duplicates for read_committed consumers)"
            ) from None

    def trusted_on(self, timeline: int, confirmed: Lsn) -> Checkpoint:
        """What of this checkpoint a relay on ``timeline`` may skip, its slot confirmed up to
        ``confirmed``. Written on another timeline (the server was promoted, or the slot made
        anew after a promotion), its positions past the slot's may be the old primary's WAL,
        which the new one never had: skipping there would skip the new primary's own
        transactions. Nothing past the slot's position is skipped then; what Kafka had of it
        comes again (duplicates, never a loss). A transaction whose commit record starts at
        the slot's position comes after it (its end is past it): only a message ends there."""
        if not self.timeline or not timeline or self.timeline == timeline:
            return self
        if self.partial_events and self.partial.lsn <= confirmed:
            return Checkpoint(self.position, self.partial, self.partial_events, timeline)
        return Checkpoint(min(self.position, Unit(confirmed, MESSAGE)), timeline=timeline)

    def describe(self) -> str:
        """Where it reaches, for the log and ``status``."""
        text = format_lsn(self.position.lsn)
        if self.position.kind == MESSAGE and self.position != NOWHERE:
            text += " (a message)"
        if self.partial_events:
            text += f", and {self.partial_events} events of {self.partial}"
        return text


class UnreadableCheckpoint(PreflightError):
    """The checkpoint topic holds a record of this relay's key that it cannot read."""


def ensure_topic(
    config: Mapping[str, str], topic: str, timeout: float, spec: TopicSpec | None = None
) -> bool:
    """Create the checkpoint topic (compacted, one partition; the replication factor and
    settings of ``spec``, --create-topics') unless it exists; True if it was created here.
    The same creation as every topic's (topics.ensure)."""
    return ensure(config, topic, (spec or TopicSpec()).checkpoints(), timeout)


def read_checkpoint(config: Mapping[str, str], topic: str, key: str, timeout: float) -> Checkpoint:
    """The last committed checkpoint of ``key`` (read_committed); an empty one if none."""
    try:
        found = committed_checkpoint(config, topic, key, timeout)
    except NoCheckpointTopic:
        return Checkpoint()
    return found or Checkpoint()


class KafkaCheckpoints:
    """The checkpoint store (cdc_relay.relay.stages.CheckpointStore) of ``transactional_id``: the
    compacted topic its transactions write their checkpoints to, made as ``spec`` says
    (--create-topics) when it is missing."""

    def __init__(
        self,
        config: Mapping[str, str],
        topic: str,
        transactional_id: str,
        spec: TopicSpec | None = None,
    ) -> None:
        self._config = config
        self._topic = topic
        self._key = transactional_id
        self._spec = spec

    def prepare(self, timeout: float) -> None:
        ensure_topic(self._config, self._topic, timeout, self._spec)

    def read(self, timeout: float) -> Checkpoint:
        return read_checkpoint(self._config, self._topic, self._key, timeout)


class NoCheckpointTopic(KafkaUnavailableError):
    """The checkpoint topic does not exist: nothing was ever committed through it."""


def committed_checkpoint(
    config: Mapping[str, str], topic: str, key: str, timeout: float
) -> Checkpoint | None:
    """The last checkpoint record of ``key`` in committed Kafka transactions (read with
    read_committed), None if there is none; within ``timeout`` seconds in all, else
    KafkaUnavailableError (NoCheckpointTopic when the topic does not exist)."""
    deadline = time.monotonic() + timeout
    errors: list[KafkaError] = []
    consumer = Consumer(
        {
            **client_settings(config),
            "group.id": f"cdc-relay-checkpoint-{key}",
            "enable.auto.commit": False,
            "isolation.level": "read_committed",
            "enable.partition.eof": True,
            # an unreachable broker is said once, in the exception, not logged line by line
            "error_cb": errors.append,
            "log_level": 0,
        }
    )

    def left() -> float:
        return max(0.1, deadline - time.monotonic())

    found = None
    try:
        while True:
            try:
                metadata = consumer.list_topics(topic, timeout=left()).topics[topic]
            except KafkaException as exc:
                raise KafkaUnavailableError(
                    _unreadable(config, topic, timeout, exc.args[0], errors)
                ) from None
            if metadata.error is None or metadata.error.code() not in _ELECTING:
                break
            if not _paused(deadline):
                break
        if metadata.error is not None:
            if metadata.error.code() == KafkaError.UNKNOWN_TOPIC_OR_PART:
                raise NoCheckpointTopic(
                    f"the checkpoint topic {topic} does not exist; stream --exactly-once or "
                    "setup-slot --exactly-once creates it"
                )
            raise KafkaUnavailableError(_unreadable(config, topic, timeout, metadata.error, errors))
        assigned = []
        ends = {}
        try:
            for partition in metadata.partitions:
                low, high = _watermarks(consumer, TopicPartition(topic, partition), deadline)
                if high > low:
                    assigned.append(TopicPartition(topic, partition, low))
                    ends[partition] = high
        except KafkaException as exc:
            raise KafkaUnavailableError(
                _unreadable(config, topic, timeout, exc.args[0], errors)
            ) from None
        consumer.assign(assigned)
        while ends:
            if time.monotonic() > deadline:
                raise KafkaUnavailableError(
                    f"could not read the checkpoint topic {topic} within {timeout:g}s"
                )
            msg = consumer.poll(min(0.5, left()))
            if msg is None:
                continue
            error, partition = msg.error(), msg.partition() or 0
            if error is not None:
                if error.code() == KafkaError._PARTITION_EOF:
                    # The end as the watermarks gave it; an end met below it is a leader's
                    # that lags the one asked (leadership moved): the last record is still
                    # to come.
                    if (msg.offset() or 0) >= ends.get(partition, 0):
                        ends.pop(partition, None)
                    continue
                if error.code() == KafkaError.GROUP_AUTHORIZATION_FAILED:
                    # The client insists on a group, whose coordinator it looks up; the reader
                    # uses none (assigned partitions, offsets from the watermarks): no ACL on
                    # it is needed.
                    continue
                raise KafkaUnavailableError(_unreadable(config, topic, timeout, error, errors))
            value = msg.value()
            if msg.key() == key.encode() and value:
                found = Checkpoint.decode(value)
            if (msg.offset() or 0) + 1 >= ends.get(partition, 0):
                ends.pop(partition, None)
    finally:
        consumer.close()
    return found


_NOT_YET = frozenset(
    {
        KafkaError.NOT_LEADER_FOR_PARTITION,
        KafkaError.LEADER_NOT_AVAILABLE,
        KafkaError.UNKNOWN_TOPIC_OR_PART,
        KafkaError.OFFSET_NOT_AVAILABLE,
        KafkaError.FENCED_LEADER_EPOCH,
        KafkaError.UNKNOWN_LEADER_EPOCH,
        KafkaError._TRANSPORT,
    }
)
"""What a partition's watermarks may be answered while its leader is being elected or moves
(a topic made a moment ago, a broker restarted): asked again while the deadline leaves time.
By code: confluent-kafka's errors of this call never say ``retriable()``."""

_ELECTING = frozenset({KafkaError.LEADER_NOT_AVAILABLE, KafkaError.NOT_LEADER_FOR_PARTITION})
"""What a topic's metadata may say while its partitions' leaders are being elected: asked
again while the deadline leaves time."""


def _watermarks(consumer: Consumer, partition: TopicPartition, deadline: float) -> tuple[int, int]:
    """The low and high watermarks (read_committed: the last stable offset) of ``partition``,
    asked again while Kafka answers with an error in _NOT_YET and the deadline leaves time;
    KafkaException otherwise."""
    while True:
        try:
            low, high = consumer.get_watermark_offsets(
                partition, timeout=max(0.1, deadline - time.monotonic())
            )
        except KafkaException as exc:
            err: KafkaError = exc.args[0]
            waitable = err.code() in _NOT_YET or err.retriable()
            if not waitable or not _paused(deadline):
                raise
        else:
            return low, high


def _paused(deadline: float, pause: float = 0.2) -> bool:
    """Wait ``pause`` seconds before asking Kafka again, if the deadline leaves time for it;
    False (no wait) if it does not."""
    if time.monotonic() + pause >= deadline:
        return False
    time.sleep(pause)
    return True


def _unreadable(
    config: Mapping[str, str],
    topic: str,
    timeout: float,
    err: KafkaError,
    errors: list[KafkaError],
) -> str:
    if err.code() == KafkaError.TOPIC_AUTHORIZATION_FAILED:
        return (
            f"Kafka refused to let the relay read the checkpoint topic {topic}: {err.str()}; "
            "grant its principal READ and DESCRIBE on that topic"
        )
    where = config.get("bootstrap.servers", "?")
    reasons = [e.str() for e in errors if e.code() != KafkaError._ALL_BROKERS_DOWN]
    reason = reasons[-1] if reasons else err.str()
    return (
        f"no Kafka broker answered at {where} within {timeout:g}s ({reason}); check "
        "--kafka-bootstrap and that the broker is running"
    )
