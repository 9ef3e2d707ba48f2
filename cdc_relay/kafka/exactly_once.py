"""Exactly once into Kafka: a transactional producer and a checkpoint kept in Kafka.

Events go to Kafka in Kafka transactions; each one also writes a checkpoint record (key: the
transactional id) to a compacted topic, so Kafka commits the events and the record saying
how far they reach atomically. The checkpoint names a position in the replication stream:
every unit of the stream (a PostgreSQL transaction, known by the LSN of its commit record, or
a non-transactional logical decoding message, by its own LSN; the stream holds them in
that order) up to ``position`` is in, and of the unit ``partial`` (a transaction split over
several Kafka transactions), the first ``partial_events`` events. Two units can share an LSN
(a non-transactional message ends where the next commit record starts), so a unit is named by
its LSN and its kind (:class:`Unit`), never by the LSN alone (invariant 11).

The slot is confirmed only after the Kafka commit (the tracker hears of each event's
acknowledgement at the commit). After a crash, replication resumes from the slot's confirmed
position, which may be behind the checkpoint: the relay skips what the checkpoint says is in.
``init_transactions`` fences any older producer with the same transactional id and aborts its
open transaction, so a relay that lost the slot cannot add anything a read_committed
consumer would see (ARCHITECTURE.md, "Exactly once").
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, NoReturn

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition
from confluent_kafka.admin import (  # type: ignore[attr-defined]
    AdminClient,
    ConfigResource,
    NewTopic,
)

from cdc_relay.errors import DeliveryError, KafkaUnavailableError, PreflightError, UsageError
from cdc_relay.kafka.refusals import is_culprit
from cdc_relay.kafka.sink import Acked, KafkaSink, Refused
from cdc_relay.lsn import Lsn, format_lsn
from cdc_relay.metrics import KAFKA_TRANSACTION_SECONDS, KAFKA_TRANSACTIONS

if TYPE_CHECKING:  # stages.py names the Checkpoint of this module in its Protocols
    from cdc_relay.relay import stages

log = logging.getLogger(__name__)

DEFAULT_CHECKPOINT_TOPIC = "cdc_relay.checkpoints"
_COMMIT_RETRIES = 10
# librdkafka's transaction.timeout.ms when the user sets none; the broker aborts a transaction
# open longer than that.
_TRANSACTION_TIMEOUT_MS = 60_000
_FATAL_REASON_WAIT = 2.0  # seconds to wait for the reason of a bare "Fatal error"


@dataclass(frozen=True)
class ExactlyOnce:
    """The settings of exactly-once mode."""

    transactional_id: str
    checkpoint_topic: str = DEFAULT_CHECKPOINT_TOPIC
    interval: float = 0.1  # seconds a Kafka transaction stays open at most
    max_events: int = 10_000  # events in one Kafka transaction at most


def check_interval(config: Mapping[str, str], interval: float) -> None:
    """Refuse a ``--transaction-interval`` that Kafka's transaction timeout cuts short: the
    coordinator aborts a transaction open longer than transaction.timeout.ms, and a relay
    whose every transaction outlives it would replay the same events forever. Half of the
    timeout leaves room for the commit itself."""
    raw = config.get("transaction.timeout.ms", str(_TRANSACTION_TIMEOUT_MS))
    try:
        timeout_ms = int(raw)
    except ValueError:
        return  # librdkafka refuses it itself, with its own words, when the producer starts
    if interval * 1000 > timeout_ms / 2:
        raise UsageError(
            f"--transaction-interval {interval:g} s is more than half of Kafka's "
            f"transaction.timeout.ms ({timeout_ms} ms), which aborts a transaction open that "
            f"long: use at most {timeout_ms / 2000:g} s, or raise transaction.timeout.ms with "
            "--kafka-config (the broker's transaction.max.timeout.ms caps it, 15 minutes by "
            "default)"
        )


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


class Skipper:
    """Which events of a replay the checkpoint says Kafka has already: call ``unit`` at each
    unit of the stream, then ``skip`` for each of its events."""

    def __init__(self, checkpoint: Checkpoint) -> None:
        self.checkpoint = checkpoint
        self._left = 0  # events of the current unit still to skip
        self._whole = False

    def unit(self, unit: Unit) -> None:
        ckpt = self.checkpoint
        self._whole = unit <= ckpt.position
        self._left = ckpt.partial_events if unit == ckpt.partial else 0

    def skip(self) -> bool:
        if self._whole:
            return True
        if self._left:
            self._left -= 1
            return True
        return False


class Committer:
    """Exactly once's part of the loop, beside its sink: where the stream is in its units
    (``unit_begins``, ``produced``, ``unit_ends``), what a replay skips (``skip``), the
    checkpoint each Kafka transaction commits with (``commit``), and how far the committed
    ones reach (``committed``), trusted on the server's timeline (``trust``)."""

    def __init__(self, eos: ExactlyOnce, sink: stages.TransactionalSink) -> None:
        self.eos = eos
        self.sink = sink
        self.committed = Checkpoint()
        self.timeline = 0  # the server's, for the checkpoints (0: not known, on a standby)
        self._skipper: Skipper | None = None
        self._last_full = NOWHERE  # the last unit whose events were all produced
        self._unit: Unit | None = None  # the open unit
        self._unit_events = 0  # its events produced (or skipped as already in Kafka)

    @property
    def replaying(self) -> bool:
        """Whether events may still be skipped as in Kafka already."""
        return self._skipper is not None

    def trust(self, checkpoint: Checkpoint, confirmed: Lsn) -> bool:
        """Hold ``checkpoint`` as what Kafka has, as far as the timeline allows
        (Checkpoint.trusted_on), and replay from it; False when the timeline cut it short."""
        self.committed = checkpoint.trusted_on(self.timeline, confirmed)
        self.restart()
        return self.committed == checkpoint

    def restart(self) -> None:
        """The stream starts again from the slot: what the committed transactions hold is
        skipped."""
        self._skipper = Skipper(self.committed)
        self._last_full, self._unit, self._unit_events = self.committed.position, None, 0

    def unit_begins(self, unit: Unit) -> None:
        """A unit of the stream starts (a transaction at its commit's LSN, or a
        non-transactional message at its own); a replay is over once past the checkpoint."""
        self._unit, self._unit_events = unit, 0
        skipper = self._skipper
        if skipper is None:
            return
        checkpoint = skipper.checkpoint
        if unit > checkpoint.position and unit > checkpoint.partial:
            self._skipper = None
        else:
            skipper.unit(unit)

    def skip(self) -> bool:
        """Whether the next event of the unit is in Kafka already (then counted: a
        checkpoint taken in this unit includes it)."""
        if self._skipper is not None and self._skipper.skip():
            self._unit_events += 1
            return True
        return False

    def produced(self, events: int = 1) -> None:
        """``events`` more of the unit were produced (negative: taken back)."""
        self._unit_events += events

    def unit_ends(self) -> None:
        """Every event of the open unit was produced (or skipped as in Kafka already)."""
        if self._unit is not None:
            self._last_full = self._unit
        self._unit, self._unit_events = None, 0

    def checkpoint(self) -> Checkpoint:
        """How far the events produced so far reach in the stream."""
        if self._unit is not None and self._unit_events:
            return Checkpoint(self._last_full, self._unit, self._unit_events, self.timeline)
        return Checkpoint(self._last_full, timeline=self.timeline)

    def due(self, force: bool = False) -> bool:
        """Whether to commit now: events are open and the transaction is old or large
        enough (or ``force``)."""
        sink = self.sink
        if not sink.events:
            return False
        return (
            force
            or sink.events >= self.eos.max_events
            or time.monotonic() - sink.opened >= self.eos.interval
        )

    def commit(self) -> None:
        """Commit the open Kafka transaction with its checkpoint (its events are acknowledged
        then, and the slot may be confirmed past them); may raise TransactionAborted."""
        checkpoint = self.checkpoint()
        self.sink.commit(checkpoint)
        self.committed = checkpoint


def transactional_id(slot: str) -> str:
    """The default transactional id: one per slot, so a relay taking the slot over fences the
    one before it."""
    return f"cdc-relay-{slot}"


def ensure_topic(config: Mapping[str, str], topic: str, timeout: float) -> bool:
    """Create the checkpoint topic (compacted, one partition) unless it exists; True if it
    was created here."""
    admin = AdminClient({k: v for k, v in config.items() if not k.startswith("enable.")})
    try:
        metadata = admin.list_topics(timeout=timeout)
    except KafkaException as exc:
        why = _unreadable(config, topic, timeout, exc.args[0], [])
        raise KafkaUnavailableError(why) from None
    if topic in metadata.topics and metadata.topics[topic].error is None:
        return False
    futures = admin.create_topics(
        [NewTopic(topic, 1, -1, config={"cleanup.policy": "compact"})],
        request_timeout=timeout,
    )
    try:
        futures[topic].result(timeout=timeout)
    except KafkaException as exc:
        if exc.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
            raise KafkaUnavailableError(
                f"cannot create the checkpoint topic {topic}: {exc.args[0].str()}; create it "
                "with cleanup.policy=compact, or grant the relay's principal CREATE on it"
            ) from None
        return False
    return True


def read_checkpoint(config: Mapping[str, str], topic: str, key: str, timeout: float) -> Checkpoint:
    """The last committed checkpoint of ``key`` (read_committed); an empty one if none."""
    try:
        found = committed_checkpoint(config, topic, key, timeout)
    except NoCheckpointTopic:
        return Checkpoint()
    return found or Checkpoint()


class KafkaCheckpoints:
    """The checkpoint store (cdc_relay.relay.stages.CheckpointStore) of ``transactional_id``: the
    compacted topic its transactions write their checkpoints to."""

    def __init__(self, config: Mapping[str, str], topic: str, transactional_id: str) -> None:
        self._config = config
        self._topic = topic
        self._key = transactional_id

    def prepare(self, timeout: float) -> None:
        ensure_topic(self._config, self._topic, timeout)

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
            **_client_settings(config),
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
        try:
            metadata = consumer.list_topics(topic, timeout=left()).topics[topic]
        except KafkaException as exc:
            raise KafkaUnavailableError(
                _unreadable(config, topic, timeout, exc.args[0], errors)
            ) from None
        if metadata.error is not None:
            if metadata.error.code() == KafkaError.UNKNOWN_TOPIC_OR_PART:
                raise NoCheckpointTopic(
                    f"the checkpoint topic {topic} does not exist; stream --exactly-once or "
                    "setup-slot --exactly-once creates it"
                )
            raise KafkaUnavailableError(_unreadable(config, topic, timeout, metadata.error, errors))
        try:
            assigned = []
            ends = {}
            for partition in metadata.partitions:
                low, high = consumer.get_watermark_offsets(
                    TopicPartition(topic, partition), timeout=left()
                )
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


def _client_settings(config: Mapping[str, str]) -> dict[str, str]:
    """What a consumer or admin client takes of the producer's settings: where and how to
    connect."""
    return {
        k: v
        for k, v in config.items()
        if k.startswith(("bootstrap.", "security.", "ssl.", "sasl.", "client."))
    }


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


@dataclass(frozen=True)
class CheckpointStatus:
    """What ``cdc-relay status`` says of a slot streamed with --exactly-once."""

    transactional_id: str
    topic: str
    checkpoint: Checkpoint | None  # None: no committed record, or Kafka did not say
    problem: str | None = None  # why Kafka did not say
    absent: str | None = None  # why there is no checkpoint, when it is not for lack of commits

    def as_json(self) -> dict[str, Any]:
        ckpt = self.checkpoint
        return {
            "transactional_id": self.transactional_id,
            "topic": self.topic,
            "position": format_lsn(ckpt.position.lsn) if ckpt else None,
            "partial_position": format_lsn(ckpt.partial.lsn)
            if ckpt and ckpt.partial_events
            else None,
            "partial_events": ckpt.partial_events if ckpt else None,
            "problem": self.problem or self.absent,
            "summary": self.describe(),
        }

    def describe(self) -> str:
        """One line for the status table."""
        of = f"(transactional id {self.transactional_id}, topic {self.topic})"
        ckpt = self.checkpoint
        if self.problem is not None:
            return f"unknown {of}: {self.problem}"
        if ckpt is None:
            why = self.absent or "no Kafka transaction with this id has committed yet"
            return f"none {of}: {why}"
        return f"{ckpt.describe()} {of}"


def checkpoint_status(
    config: Mapping[str, str], eos: ExactlyOnce, timeout: float
) -> CheckpointStatus:
    """The committed checkpoint of ``eos``'s transactional id, or why it cannot be read;
    within about ``timeout`` seconds, never raising for Kafka's sake."""
    try:
        found = committed_checkpoint(config, eos.checkpoint_topic, eos.transactional_id, timeout)
    except NoCheckpointTopic as exc:
        return CheckpointStatus(eos.transactional_id, eos.checkpoint_topic, None, absent=str(exc))
    except (KafkaUnavailableError, UnreadableCheckpoint) as exc:
        return CheckpointStatus(eos.transactional_id, eos.checkpoint_topic, None, str(exc))
    return CheckpointStatus(eos.transactional_id, eos.checkpoint_topic, found)


class TransactionAborted(Exception):
    """The open transaction could not commit and was aborted: replay from the checkpoint."""


class TransactionalSink(KafkaSink):
    """A sink whose messages count as acknowledged when their Kafka transaction commits,
    with a checkpoint record in it; ``renew`` aborts the open transaction."""

    def __init__(
        self,
        config: Mapping[str, str],
        on_ack: Acked,
        on_refused: Refused,
        transactional_id: str,
        checkpoint_topic: str,
        timeout: float = 30.0,
        start_timeout: float = 30.0,
    ) -> None:
        settings = {**config, "transactional.id": transactional_id}
        settings.pop("enable.gapless.guarantee", None)  # an aborted transaction does that job
        super().__init__(settings, on_ack, on_refused, relay="stream")
        self._topic = checkpoint_topic
        self._key = transactional_id.encode()
        self._timeout = timeout  # for a transaction to commit or abort
        self._start_timeout = start_timeout  # for a coordinator to set up transactions
        self._appended: list[Any] = []  # tokens of the open transaction Kafka appended
        self._purged: list[Any] = []  # tokens of the open transaction purged, not refused
        self._refused_in_commit = False  # the commit failed on a refusal of one message
        self._open = False
        self.events = 0  # events in the open transaction
        self.opened = 0.0  # when it began (monotonic)
        self.committed = 0
        self.aborted = 0
        self._initialised = False

    def initialise(self) -> None:
        """Fence older producers of this transactional id and abort their open transaction."""
        try:
            self._producer.init_transactions(self._start_timeout)
        except KafkaException as exc:
            err = exc.args[0]
            if err.code() == KafkaError._TIMED_OUT or (err.retriable() and not _fenced(err)):
                # No transaction coordinator answered in time: say why, if the brokers tell.
                raise PreflightError(
                    transactions_unavailable(self._config, self._key.decode(), self._start_timeout)
                ) from None
            self._fail(err)
        self._initialised = True
        self._probe()

    def _probe(self) -> None:
        """Preflight: whether the relay may write the checkpoint topic in a transaction.
        Every commit carries a checkpoint record: refused, no transaction could ever commit
        (the broker refuses it when the transaction adds the topic, naming no topic). So a
        first transaction holds a record there alone, and is aborted: nothing of it is ever
        visible, and a crash leaves it to the next relay's init_transactions to abort."""
        failed: list[KafkaError] = []

        def delivered(err: KafkaError | None, _: Any) -> None:
            if err is not None:
                failed.append(err)

        self._call(self._producer.begin_transaction)
        try:
            self._producer.produce(self._topic, b"", self._key, on_delivery=delivered)
            self._producer.flush(self._timeout)
            self._producer.abort_transaction(self._timeout)
        except KafkaException as exc:
            failed.append(exc.args[0])
        if not failed:
            return
        for err in failed:
            if self.failure is not None or _fenced(err) or err.retriable():
                self._fail(err)  # fenced, or the broker away: not about the topic
        # Refused, the record is purged and the abort fails; Kafka's words name no topic.
        reasons = "; ".join(dict.fromkeys(err.str() for err in failed))
        raise DeliveryError(
            f"the relay cannot write its checkpoint topic {self._topic} in a transaction "
            f"({reasons}); grant the relay's principal WRITE on that topic"
        )

    def offer(self, message: Any, token: Any) -> bool:
        if self.failure is not None:  # fenced, or failed for good: nothing more goes out
            raise self.failure
        if not self._open:
            self._call(self._producer.begin_transaction)
            self._open = True
            self.opened = time.monotonic()
            self._purged = []
        accepted = super().offer(message, token)
        if accepted:
            self.events += 1
        return accepted

    def commit(self, checkpoint: Checkpoint) -> None:
        """Commit the open transaction with ``checkpoint``; then its messages are acked."""
        if not self._open:
            return
        try:
            self._producer.produce(self._topic, checkpoint.encode(), self._key)
        except KafkaException as exc:
            self._fail(exc.args[0])
        for attempt in range(_COMMIT_RETRIES):
            try:
                self._producer.commit_transaction(self._timeout)
                break
            except KafkaException as exc:
                err = exc.args[0]
                if err.retriable() and attempt + 1 < _COMMIT_RETRIES:
                    continue
                if err.txn_requires_abort():
                    # Kafka refused a message of it (its report came during the commit's
                    # flush): abort, and let the caller replay.
                    events = self.events
                    self._refused_in_commit = is_culprit(err)
                    try:
                        self.renew()  # serves the reports of the purged messages
                    finally:
                        self._refused_in_commit = False
                    if events == 1 and len(self._purged) == 1 and is_culprit(err):
                        # A message alone in its transaction, purged because Kafka refused
                        # to add its partition (a topic not authorised): the refusal is its
                        # own, and it is told so (its report said only "purged").
                        self._on_refused(self._purged[0], err)
                    raise TransactionAborted(err.str()) from None
                self._fail(err)
        self._open = False
        self.events = 0
        self.committed += 1
        KAFKA_TRANSACTIONS.labels(outcome="committed").inc()
        KAFKA_TRANSACTION_SECONDS.observe(time.monotonic() - self.opened)
        tokens, self._appended = self._appended, []
        for token in tokens:
            self._on_ack(token)

    def renew(self) -> None:
        """Abort the open transaction: nothing of it becomes visible; its messages are
        reported refused (purged), and a replay produces them again."""
        if self._open:
            try:
                self._producer.abort_transaction(self._timeout)
            except KafkaException as exc:
                self._abort_failed(exc.args[0])
            self.aborted += 1
            KAFKA_TRANSACTIONS.labels(outcome="aborted").inc()
        self._producer.flush(0)
        self._appended = []
        self._open = False
        self.events = 0
        self.broken = False

    def _abort_failed(self, err: KafkaError) -> None:
        """The abort failed: stop, unless the producer is failed by Kafka refusing to end a
        transaction whose partitions it refused to add (a topic not authorised, refused
        during the commit): then a new producer with the same transactional id takes over,
        whose init_transactions ends what is left of it, as a restarted relay's would. Only
        then: a new producer fences any other (a relay that took over would be stopped)."""
        refused = self._refused_in_commit
        if not (refused and err.fatal() and err.code() == KafkaError.INVALID_TXN_STATE):
            self._fail(err)
        log.warning(
            "Kafka failed the producer when aborting a transaction (%s); starting a new one",
            err.str(),
            extra={"action": "producer_renewed"},
        )
        old, self._producer = self._producer, self._new_producer()
        with contextlib.suppress(KafkaException):
            old.purge()
            old.flush(0)  # serves the purged messages' reports, and the fatal error's
        self.failure = None  # the old producer's, which is gone
        self._call(self._producer.init_transactions, self._timeout)

    def close(self) -> int:
        left = self.events
        if self._open:
            try:
                self._producer.abort_transaction(5.0)
            except KafkaException:
                pass  # fenced or gone: nothing of it is visible either way
        with contextlib.suppress(KafkaException):  # a failed producer raises its error again
            self._producer.flush(0)
        return left

    def _delivered(self, token: Any, err: KafkaError | None, _: Any) -> None:
        if err is None:
            self.connected = True
            self._appended.append(token)  # acknowledged when the transaction commits
        else:
            if err.code() in (KafkaError._PURGE_QUEUE, KafkaError._PURGE_INFLIGHT):
                self._purged.append(token)
            self._on_refused(token, err)

    def _on_fatal(self, err: KafkaError) -> None:
        if self.failure is None and _fenced(err):
            self.failure = _fenced_error()
        super()._on_fatal(err)

    def _call(self, method: Any, *args: Any) -> None:
        try:
            method(*args)
        except KafkaException as exc:
            self._fail(exc.args[0])

    def _fail(self, err: KafkaError) -> NoReturn:
        if self.failure is None and err.code() == KafkaError._FATAL:
            self._fatal_reason()
        if self.failure is None and _fenced(err):
            self.failure = _fenced_error()  # every later call says so too
        if self.failure is not None:  # the client said why first
            raise self.failure
        if err.code() == KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED:
            # IDEMPOTENT_WRITE on the cluster is not asked for: a broker authorises a
            # transactional producer by its transactional id alone.
            raise DeliveryError(
                f"Kafka refused the transactional id: {err.str()}; grant the relay's principal "
                f"WRITE and DESCRIBE on transactional id {self._key.decode()}"
            )
        raise DeliveryError(
            f"Kafka transaction failed: {err.str()}; restart the relay: it resumes after the "
            "last committed checkpoint"
        )

    def _fatal_reason(self) -> None:
        """Find why the producer failed when Kafka said only "Fatal error" (fenced, most
        often), into ``failure``. A transactional call on a failed producer answers with the
        error that failed it; poll raises it too, once its event is queued (which may come
        later than the bare error: hence the short wait)."""
        try:
            self._producer.abort_transaction(1.0)
        except KafkaException as exc:
            if exc.args[0].fatal():
                self._on_fatal(exc.args[0])
        deadline = time.monotonic() + _FATAL_REASON_WAIT
        while self.failure is None and time.monotonic() < deadline:
            try:
                self._producer.poll(0.05)
            except KafkaException as exc:  # the fatal error itself, not a callback's
                self._on_fatal(exc.args[0])


TRANSACTION_LOG = "__transaction_state"


def transactions_unavailable(config: Mapping[str, str], tid: str, waited: float) -> str:
    """Why Kafka set up no transaction for ``tid`` within ``waited`` seconds, with what to do:
    the brokers' transaction log settings against their number when they tell, else the
    likely causes."""
    generic = (
        f"Kafka did not set up transactions for transactional id {tid} within {waited:g}s: no "
        f"transaction coordinator answered (a broker creates {TRANSACTION_LOG} on first use, and "
        "cannot when transaction.state.log.replication.factor exceeds the number of brokers or "
        "transaction.state.log.min.isr the replicas in sync); check the brokers' settings and "
        "logs, then start the relay again, or run it without --exactly-once"
    )
    admin = AdminClient({**_client_settings(config), "log_level": 0})
    try:
        metadata = admin.list_topics(timeout=5)
        brokers = len(metadata.brokers)
        if TRANSACTION_LOG in metadata.topics and metadata.topics[TRANSACTION_LOG].error is None:
            return generic  # the log exists: not a matter of its settings
        resource = ConfigResource(ConfigResource.Type.BROKER, str(next(iter(metadata.brokers))))
        entries = admin.describe_configs([resource], request_timeout=5)[resource].result(5)
        factor = int(entries["transaction.state.log.replication.factor"].value)
    except (KafkaException, KeyError, StopIteration, ValueError):
        return generic  # not allowed to describe the broker's settings, or not told
    if factor <= brokers:
        return generic
    return (
        f"Kafka cannot run transactions: the brokers' transaction.state.log.replication.factor "
        f"is {factor} and the cluster has {brokers} broker{'s' if brokers != 1 else ''}, so "
        f"{TRANSACTION_LOG} cannot be created; set transaction.state.log.replication.factor "
        f"(and transaction.state.log.min.isr) to at most {brokers} in the brokers' settings and "
        "restart them, or add brokers, or run the relay without --exactly-once"
    )


def _fenced(err: KafkaError) -> bool:
    return err.code() in (
        KafkaError._FENCED,
        KafkaError.PRODUCER_FENCED,
        KafkaError.INVALID_PRODUCER_EPOCH,
    )


def _fenced_error() -> DeliveryError:
    return DeliveryError(
        "another relay took over this slot's Kafka transactions (a producer with the same "
        "transactional id fenced this one); nothing this relay had not committed becomes "
        "visible; stopping"
    )
