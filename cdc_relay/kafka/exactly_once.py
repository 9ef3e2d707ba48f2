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

Here: the mode's settings, its part of the loop (``Committer``: where the stream is in its
units, what a replay skips, when to commit) and what ``status`` says of it. The checkpoint
and its record in Kafka: checkpoints.py; the transactional producer: transactional.py.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Protocol

from cdc_relay.errors import KafkaUnavailableError, UsageError
from cdc_relay.kafka.checkpoints import (
    NOWHERE,
    Checkpoint,
    NoCheckpointTopic,
    Unit,
    UnreadableCheckpoint,
    committed_checkpoint,
)
from cdc_relay.lsn import Lsn, format_lsn

DEFAULT_CHECKPOINT_TOPIC = "cdc_relay.checkpoints"
# librdkafka's transaction.timeout.ms when the user sets none; the broker aborts a transaction
# open longer than that.
TRANSACTION_TIMEOUT_MS = 60_000
# Seconds a Kafka transaction may stay open while the relay drains a backlog, at most a tenth
# of transaction.timeout.ms (fitted): the rest is left to its commit, which flushes the queue.
BACKLOG_INTERVAL = 0.5


@dataclass(frozen=True)
class ExactlyOnce:
    """The settings of exactly-once mode."""

    transactional_id: str
    checkpoint_topic: str = DEFAULT_CHECKPOINT_TOPIC
    interval: float = 0.1  # seconds a Kafka transaction stays open at most, keeping up
    max_events: int = 50_000  # events in one Kafka transaction at most
    backlog_interval: float = BACKLOG_INTERVAL  # ... while the relay drains a backlog

    @property
    def idle_after(self) -> float:
        """Seconds a Kafka transaction stays open at least once the relay has read all the
        server sent: a quarter of ``interval``. Committing at once would make a commit of
        every few events at a moderate rate, each a round of requests to the broker; waiting
        the whole interval would only add to the events' latency."""
        return self.interval / 4

    @property
    def backlog_after(self) -> float:
        """Seconds a Kafka transaction stays open at most while the relay drains a backlog
        (it had not read all the server sent at any look since the transaction began):
        ``backlog_interval``, or ``interval`` if longer. The events wait behind the backlog
        anyway; each commit is a round of requests (the producer's flush, EndTxn, a marker per
        partition) during which the relay reads nothing, so fewer, larger transactions drain
        it sooner (bench/README.md, "Exactly once drains in larger transactions")."""
        return max(self.interval, self.backlog_interval)


def transaction_timeout_ms(config: Mapping[str, str]) -> int | None:
    """The producer's transaction.timeout.ms; None when not a number (librdkafka refuses it
    itself, with its own words, when the producer starts)."""
    try:
        return int(config.get("transaction.timeout.ms", str(TRANSACTION_TIMEOUT_MS)))
    except ValueError:
        return None


def fitted(eos: ExactlyOnce, config: Mapping[str, str]) -> ExactlyOnce:
    """``eos`` with its backlog interval at most a tenth of the producer's
    transaction.timeout.ms: a transaction of a backlog then leaves most of the timeout to its
    commit, which flushes up to a full queue (a 1 s timeout: 0.1 s, as the interval)."""
    timeout_ms = transaction_timeout_ms(config)
    if timeout_ms is None or eos.backlog_interval * 10_000 <= timeout_ms:
        return eos
    return replace(eos, backlog_interval=timeout_ms / 10_000)


def check_interval(config: Mapping[str, str], interval: float) -> None:
    """Refuse a ``--transaction-interval`` that Kafka's transaction timeout cuts short: the
    coordinator aborts a transaction open longer than transaction.timeout.ms, and a relay
    whose every transaction outlives it would replay the same events forever. Half of the
    timeout leaves room for the commit itself."""
    timeout_ms = transaction_timeout_ms(config)
    if timeout_ms is not None and interval * 1000 > timeout_ms / 2:
        raise UsageError(
            f"--transaction-interval {interval:g} s is more than half of Kafka's "
            f"transaction.timeout.ms ({timeout_ms} ms), which aborts a transaction open that "
            f"long: use at most {timeout_ms / 2000:g} s, or raise transaction.timeout.ms with "
            "--kafka-config (the broker's transaction.max.timeout.ms caps it, 15 minutes by "
            "default)"
        )


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


class Transactions(Protocol):
    """A producer's Kafka transactions, as exactly once drives them: set up at start, the open
    one's size and age, and its commit with a checkpoint (transactional.TransactionalSink is
    Kafka's; cdc_relay.relay.stages.TransactionalSink is the whole sink the stream takes)."""

    @property
    def events(self) -> int:
        """Messages in the open transaction."""

    @property
    def opened(self) -> float:
        """When the open transaction began (time.monotonic)."""

    @property
    def initialised(self) -> bool:
        """Whether ``initialise`` has set the producer up: not yet, or a new producer took
        over from one Kafka failed in an abort (transactional.TransactionalSink._abort_failed)
        and waits for the relay to hold its slot again."""

    def initialise(self) -> None:
        """Fence older producers of the transactional id; their open transaction is aborted."""

    def commit(self, checkpoint: Checkpoint) -> None:
        """Commit the open transaction with ``checkpoint``, then report its messages
        acknowledged; raise TransactionAborted when Kafka aborted it instead."""


class Committer:
    """Exactly once's part of the loop, beside its sink: where the stream is in its units
    (``unit_begins``, ``produced``, ``unit_ends``), what a replay skips (``skip``), the
    checkpoint each Kafka transaction commits with (``commit``), and how far the committed
    ones reach (``committed``), trusted on the server's timeline (``trust``)."""

    def __init__(self, eos: ExactlyOnce, sink: Transactions) -> None:
        self.eos = eos
        self.sink = sink
        self.committed = Checkpoint()
        self.timeline = 0  # the server's, for the checkpoints (0: not known, on a standby)
        self._skipper: Skipper | None = None
        self._last_full = NOWHERE  # the last unit whose events were all produced
        self._unit: Unit | None = None  # the open unit
        self._unit_events = 0  # its events produced (or skipped as already in Kafka)
        self._kept_up_in = -1.0  # the ``opened`` of the last transaction the relay idled in

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

    def due(self, force: bool = False, idle: bool = False) -> bool:
        """Whether to commit now: events are open and the transaction is old or large
        enough (or ``force``); ``idle`` (the relay has read all the server sent): old enough
        for that (ExactlyOnce.idle_after). Old enough is ``interval`` if the relay idled at
        any look since the transaction began, else it drains a backlog: ``backlog_after``."""
        sink = self.sink
        if not sink.events:
            return False
        eos = self.eos
        if idle:
            self._kept_up_in = sink.opened
        age = time.monotonic() - sink.opened
        longest = eos.interval if self._kept_up_in == sink.opened else eos.backlog_after
        return (
            force
            or sink.events >= eos.max_events
            or age >= longest
            or (idle and age >= eos.idle_after)
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
