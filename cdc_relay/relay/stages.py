"""The stages the pipeline is wired from, as the loop uses them.

pipeline.Pipeline runs a ``Feed`` (the source: a replication slot's stream, stream.py; a poll
worker's claims, poller.py), routes each event into a ``Sink`` (sink.py), and hands each
delivery report to a ``Checkpointer`` (the LSN tracker; a claimed batch, batch.py) or to a
``RefusalPolicy`` (rewinds.Rewinds, deadletter.DeadLetterRefusals around it; batch.Batch),
which the Kafka side declares (cdc_relay.kafka.refusals).

Beneath the feeds: the stream takes the replication ``Source`` (replication.py), the
dead-letter store (``DeadLetterStore``, declared beside the real one in deadletter.py), and
for exactly once the transactional sink (transactional.py) and the checkpoint store
(checkpoints.py); the poller takes the outbox as its source and its
checkpoint at once: a worker claims rows and marks them in one transaction (``Claims``, of an
``OutboxStore``; store.py has the real ones). Each is injected, the real one by default, and
unit tests give in-memory ones (tests/unit/test_pipeline.py, test_stream_loop.py,
test_stream_loop_eos.py, test_poll_loop.py).

Narrow on purpose: exactly what the loop calls, no more; ``mypy --strict`` proves that the
real classes satisfy them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import Any, Protocol

from confluent_kafka import KafkaError

from cdc_relay.kafka.checkpoints import Checkpoint
from cdc_relay.kafka.deadletter import DeadLetterStore
from cdc_relay.kafka.exactly_once import Transactions
from cdc_relay.kafka.routing import Message
from cdc_relay.kafka.sink import Acked, Refused
from cdc_relay.lsn import Lsn
from cdc_relay.postgres.replication import ConnectionLost, Keepalive, XLogData
from cdc_relay.postgres.store import Outbox, OutboxRow


class Feed(Protocol):
    """A relay's source as the loop runs it (pipeline.Pipeline.run): it reads from where the
    events are and hands each one to the pipeline (``Pipeline.publish``). stream.StreamRelay
    reads a replication slot; worker.Worker claims rows."""

    @property
    def stopped(self) -> bool:
        """A stop was asked for (or the feed reached its end): the loop ends."""

    def pump(self) -> None:
        """Read and publish until stopped; raise ConnectionLost when the source's connection
        is gone, pipeline.Rewind when the refusal policy calls for a replay."""

    def recover(self, exc: ConnectionLost) -> None:
        """After a lost connection: settle what is in flight, reconnect (with a back-off)."""

    def rewind(self) -> None:
        """Start again from the checkpoint: what was read and not confirmed comes again."""

    def shutdown(self) -> None:
        """The graceful stop: wait (bounded) for Kafka's reports, checkpoint, close."""


class Checkpointer(Protocol):
    """What a delivery report moves: the LSN tracker's position (stream), or a claimed
    batch's marks (poll). ``acked`` is called while the sink serves its reports."""

    def acked(self, token: Any) -> None:
        """Kafka acknowledged the message of ``token``."""


class Source(Protocol):
    """A logical replication stream. ``start``, ``read`` and ``send_status`` raise
    ConnectionLost when the connection is gone; ``start`` raises SlotInUseError while another
    process holds the slot, and PreflightError when the slot is gone or unusable."""

    def start(self, slot: str, start_lsn: Lsn, options: Mapping[str, str]) -> None:
        """Stream ``slot`` from max(``start_lsn``, its confirmed position)."""

    def read(self, timeout: float) -> XLogData | Keepalive | None:
        """The next message, or None if none came within ``timeout`` seconds."""

    def read_now(self) -> XLogData | Keepalive | None:
        """The next message if it has come already, without waiting; None otherwise."""

    @property
    def caught_up(self) -> bool:
        """The last ``read`` found nothing waiting, neither whole in the client's buffer nor on
        the socket: the relay had read all the server sent, and waited for more."""

    def send_status(self, written: Lsn, flushed: Lsn) -> None:
        """Standby status update: ``flushed`` becomes the slot's confirmed position."""

    def close(self) -> None:
        """End the stream; the slot is free at once."""


class Sink(Protocol):
    """Produces routed messages; reports each with the caller's token to the ``on_ack`` and
    ``on_refused`` it was made with (cdc_relay.kafka.sink.KafkaSink says when)."""

    @property
    def connected(self) -> bool:
        """A broker connection is up (readiness)."""

    @property
    def broken(self) -> bool:
        """It stopped after a refused batch (the gapless guarantee)."""

    def offer(self, message: Message, token: Any) -> bool:
        """Hand over ``message``; False when the queue is full (poll, then offer again)."""

    def poll(self, timeout: float) -> None:
        """Serve delivery reports; raise DeliveryError if the sink failed for good."""

    def settle(self, timeout: float) -> None:
        """Serve delivery reports until none is outstanding, for up to ``timeout`` seconds."""

    def in_flight(self) -> int:
        """Messages handed over and not yet reported."""

    def missing(self, topic: str, err: KafkaError) -> bool:
        """Whether ``err`` says that Kafka does not have ``topic`` and the sink makes its
        topics (--create-topics): then no event's fault, and the topic is checked again (and
        made) before its next event."""

    def renew(self) -> None:
        """Drop what it holds (each gets its refusal report) and start afresh."""

    def check_reachable(self, timeout: float) -> None:
        """Raise KafkaUnavailableError, with a remedy, when no broker answers."""

    def close(self) -> int:
        """Close; return how many messages were still unacknowledged."""


class TransactionalSink(Sink, Transactions, Protocol):
    """A sink whose messages count as acknowledged when the Kafka transaction holding them
    commits, with the checkpoint of how far they reach (cdc_relay.kafka.exactly_once says how);
    ``renew`` aborts the open transaction, whose messages are then reported refused or
    forgotten, never acknowledged."""


class CheckpointStore(Protocol):
    """Where the checkpoints of the committed transactions are read from at start (the
    compacted checkpoint topic; the transactional sink writes them, inside each transaction)."""

    def prepare(self, timeout: float) -> None:
        """Make the store ready to be written (create the topic); raise with a remedy if not."""

    def read(self, timeout: float) -> Checkpoint:
        """The last committed checkpoint; an empty one when none was ever committed."""


class Claims(Protocol):
    """One poll worker's hold on the outbox: the source (claims) and the checkpointer (marks)
    of the poll loop, which are one transaction. Every method but ``transaction`` and ``close``
    runs inside ``transaction``; each raises psycopg's DatabaseError as PostgreSQL refuses
    (the loop decides what it means: store.kind)."""

    def open(self) -> None:
        """Connect if not connected (``transaction`` does too); a new connection takes the
        outbox's advisory lock first."""

    def transaction(self) -> AbstractContextManager[object]:
        """One cycle: committed when it ends, rolled back (claims released, nothing marked)
        when it raises. A new connection takes the outbox's advisory lock first."""

    def claim_aggregates(self, limit: int, shard: int, shards: int, skip: list[int]) -> list[int]:
        """Lock the aggregates of the next ``limit`` due rows of worker ``shard`` of ``shards``
        (none another poller holds, none of ``skip``); their lock keys."""

    def claim(self, limit: int, keys: list[int]) -> list[OutboxRow]:
        """The next due rows of the aggregates of ``keys``, in queue order; a row another
        transaction locks is skipped, not waited for."""

    def claim_skipped(self, keys: list[int], last: int, ids: list[str]) -> dict[int, int]:
        """For each aggregate of ``keys``: the first due row before ``last`` that the claim
        (``ids``) did not return, by its ``seq``."""

    def published_after(self, ids: list[str]) -> dict[str, int]:
        """Of the claimed rows ``ids``, those a later row (higher seq) of their aggregate was
        published before: by id, that row's seq (empty when that cannot be looked up)."""

    def lost(self) -> bool:
        """Whether PostgreSQL has ended the session (terminated it, timed it out) or the
        connection broke, as far as can be told without a round trip: the claim is released."""

    def mark_processed(self, ids: list[str]) -> None:
        """The rows Kafka acknowledged are done."""

    def mark_failed(
        self,
        ids: list[str],
        errors: list[str],
        delays: list[float],
        own: list[bool],
        max_attempts: int,
    ) -> dict[str, dict[str, Any]]:
        """One more attempt for each refused row, due again after its delay; one out of
        attempts whose failure was its ``own`` becomes a dead letter. By id: ``attempts``, and
        ``dead`` for a dead letter."""

    def close(self) -> None:
        """Drop the connection (after a lost one, and at the end); the next transaction makes
        a new one."""


class OutboxStore(Protocol):
    """The outbox table of ``poll`` (cdc_relay.postgres.store.PgStore)."""

    @property
    def outbox(self) -> Outbox:
        """The table, as resolved at start."""

    def claims(self) -> Claims:
        """A worker's own claims (its own connection)."""

    def pending_counts(self) -> dict[str, int] | None:
        """``unprocessed`` rows and ``dead_letters`` among them; None when it cannot say."""


# The factories ``StreamRelay`` takes: a source from the DSN (not started yet), a sink from
# its two report callbacks, a dead-letter store from the DSN, the slot and the topic; for
# exactly once, a transactional sink from the report callbacks, and the checkpoint store.
OpenSource = Callable[[str], Source]
OpenSink = Callable[[Acked, Refused], Sink]
OpenDeadLetters = Callable[[str, str, str], DeadLetterStore]
OpenTransactions = Callable[[Acked, Refused], TransactionalSink]
# What exactly once asks the server on reconnecting, from the DSN and the slot: its timeline
# and the slot's confirmed position there (None: no such slot); connection.timeline_of.
ReadTimeline = Callable[[str, str], tuple[int, Lsn | None]]
# What ``PollRelay`` takes: the store of the outbox from the connection string and the table.
OpenStore = Callable[[str, Outbox], OutboxStore]
