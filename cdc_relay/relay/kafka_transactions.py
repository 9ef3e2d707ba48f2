"""Exactly once on the stream (``--exactly-once``; cdc_relay.kafka.exactly_once says how): the
transactional sink the relay produces through, its start (older relays of the transactional id
fenced, the checkpoint of how far they committed read from the checkpoint store and trusted as
far as the server's timeline allows, and again on a new timeline), and its commits: when a
transaction is old or large enough, and around an event sent alone; and, with the slot held
again, the start of a producer the sink made anew. Where the stream is in its units and what
a replay skips is the Committer's (records.Records tells it)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from cdc_relay.kafka.checkpoints import Checkpoint
from cdc_relay.kafka.exactly_once import (
    Committer,
    ExactlyOnce,
    check_interval,
)
from cdc_relay.kafka.sink import Acked, Refused, topics_of
from cdc_relay.kafka.transactional import TransactionAborted, TransactionalSink
from cdc_relay.lsn import Lsn, format_lsn
from cdc_relay.metrics import Health
from cdc_relay.postgres.replication import ConnectionLost
from cdc_relay.relay import stages
from cdc_relay.relay.pipeline import Pipeline, Rewind
from cdc_relay.relay.rewinds import Rewinds
from cdc_relay.relay.stages import CheckpointStore, OpenTransactions
from cdc_relay.relay.stream_settings import StreamSettings

# The stream relay's lines, under one logger whichever of its parts writes them.
log = logging.getLogger("cdc_relay.relay.stream")


def transactional_sink(
    settings: StreamSettings,
    eos: ExactlyOnce,
    open_transactions: OpenTransactions | None,
    acked: Acked,
    refused: Refused,
) -> stages.TransactionalSink:
    """The sink of exactly once: one injected (``open_transactions``), or Kafka's."""
    if open_transactions is not None:
        return open_transactions(acked, refused)
    # Kafka's, whose transactions time out
    check_interval(settings.kafka_config, eos.interval)
    return TransactionalSink(
        settings.kafka_config,
        on_ack=acked,
        on_refused=refused,
        transactional_id=eos.transactional_id,
        checkpoint_topic=eos.checkpoint_topic,
        start_timeout=settings.kafka_timeout,
        topics=topics_of(settings.kafka_config, settings.topic_creation),
    )


class KafkaTransactions:
    """What exactly once adds to the stream relay, beside the Committer (``eos``): its start
    from the checkpoint store, and the commits, which serve the pipeline's reports first (a
    refusal among them rewinds the stream instead, ``rewinds``)."""

    def __init__(
        self,
        eos: Committer,
        checkpoints: CheckpointStore,
        pipeline: Pipeline,
        rewinds: Rewinds,
        health: Health,
    ) -> None:
        self.eos = eos
        self._checkpoints = checkpoints
        self._pipeline = pipeline
        self._rewinds = rewinds
        self._health = health
        self._confirmed: Lsn = 0  # the slot's position the checkpoint was last trusted at

    def start(self, timeout: float, confirmed: Lsn, keep_alive: Callable[[], None]) -> None:
        """Fence older relays of this transactional id, read how far they committed from the
        checkpoint store, trusted as of the slot's position ``confirmed``: the stream skips
        that. ``keep_alive`` tells the walsender meanwhile that the relay is there."""
        eos, checkpoints = self.eos, self._checkpoints
        found: list[Checkpoint] = []
        failed: list[BaseException] = []

        def start() -> None:
            try:
                checkpoints.prepare(timeout)
                eos.sink.initialise()
                found.append(checkpoints.read(timeout))
            except BaseException as exc:  # noqa: BLE001 - raised below, in the relay's thread
                failed.append(exc)

        # Kafka may take seconds (the coordinator finishing the fenced relay's transaction);
        # meanwhile the walsender hears from us, confirming nothing.
        worker = threading.Thread(target=start, name="exactly-once-start", daemon=True)
        worker.start()
        while worker.is_alive():
            worker.join(0.2)
            self._health.beat()
            keep_alive()
        if failed:
            raise failed[0]
        self.trust(found[0], confirmed)
        committed = eos.committed
        log.info(
            "exactly once: transactional id %s; Kafka holds the stream up to %s",
            eos.eos.transactional_id,
            committed.describe(),
            extra={"action": "checkpoint", "lsn": format_lsn(committed.position.lsn)},
        )

    def trust(self, checkpoint: Checkpoint, confirmed: Lsn) -> None:
        """Hold ``checkpoint`` as what Kafka has, as far as the server's timeline allows
        (Checkpoint.trusted_on): the replay skips that."""
        eos = self.eos
        self._confirmed = confirmed
        if not eos.trust(checkpoint, confirmed):
            log.warning(
                "exactly once: the checkpoint of %s was written on timeline %d and the server "
                "is on timeline %d (promoted since): past the slot's position %s it may name "
                "WAL the old primary had and this one never did, so nothing past it is skipped; "
                "events Kafka already had from there are published again",
                eos.eos.transactional_id,
                checkpoint.timeline,
                eos.timeline,
                format_lsn(confirmed),
                extra={"action": "checkpoint_other_timeline"},
            )

    def resume(self, timeout: float, keep_alive: Callable[[], None]) -> None:
        """With the slot held again, after a lost connection or a rewind: a producer the sink
        made anew meanwhile (Kafka failed the abort of the old one's transaction:
        transactional.TransactionalSink._abort_failed) starts as at the relay's start. It
        fences older producers only now: before, the slot may have been another relay's,
        which it must not stop. And the checkpoint is read again: another relay may have
        held the slot and committed meanwhile, fencing the old producer, which would have
        stopped this relay; the replay skips what Kafka holds, as after a restart. Nothing
        when the sink's producer is the one started."""
        if self.eos.sink.initialised:
            return
        self.start(timeout, self._confirmed, keep_alive)

    def trust_again(self, confirmed: Lsn) -> None:
        """On a new timeline: the checkpoints carry it (timeline.Timeline notes it), and the
        checkpoint held is trusted on it as at start, the slot there at ``confirmed``."""
        self.trust(self.eos.committed, confirmed)

    def read_timeout(self, longest: float) -> float:
        """How long a read of the stream may wait for the server, at most ``longest``: while
        a Kafka transaction is open, no longer than it may stay open once the stream idles."""
        eos = self.eos
        return min(longest, eos.eos.idle_after) if eos.sink.events else longest

    def commit(self, force: bool = False, stopping: bool = False, idle: bool = False) -> None:
        """Commit when the transaction is old or large enough (or ``force``), or, ``idle``
        (the relay has read all the server sent), old enough that waiting for more would only
        add to its events' latency (exactly_once.Committer.due); ``stopping``: in the
        graceful stop, where a refusal no longer rewinds."""
        eos = self.eos
        if not eos.due(force, idle):
            return
        if stopping:
            # No rewind while stopping: a refusal reported by now keeps the transaction from
            # committing, and the stop goes on (the replay after a restart meets it again).
            self._pipeline.sink.poll(0)
            if self._rewinds.pending:
                return
        else:
            self._pipeline.serve(0)  # a refusal reported by now rewinds instead
        try:
            eos.commit()
        except TransactionAborted as exc:
            if stopping:
                return  # no rewind while stopping: the replay after a restart meets it again
            if self._rewinds.pending:
                raise Rewind from None
            raise ConnectionLost(f"Kafka aborted the transaction ({exc}); replaying") from None

    def commit_alone(self) -> None:
        """Commit the event sent alone at once. The checkpoint committed with it counts it
        (the event, or its dead letter standing for it): a replay after a crash must skip it,
        not publish it again. records.Records counts it for good once it returns; aborted, it
        is not counted."""
        eos = self.eos
        eos.produced()
        try:
            eos.commit()
        except TransactionAborted:
            pass  # its report came with Kafka's answer
        finally:
            eos.produced(-1)
