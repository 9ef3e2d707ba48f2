"""Exactly once's producer: a sink whose messages count as acknowledged when the Kafka
transaction holding them commits, with the checkpoint record saying how far they reach.

``initialise`` fences any older producer of the same transactional id (init_transactions
aborts its open transaction) and checks that the checkpoint topic can be written in a
transaction; ``commit`` writes the checkpoint and commits, or aborts and raises
TransactionAborted when Kafka refused a message of it (the relay replays from the checkpoint);
a producer fenced by another relay's says so, and nothing more goes out. An abort that Kafka
answers with INVALID_TXN_STATE (its coordinator holds no transaction of the producer open)
fails the producer for good in librdkafka, and a new one takes over (``_abort_failed``). What
the relay does around it: exactly_once.py.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Mapping
from typing import Any, NoReturn

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import (  # type: ignore[attr-defined]
    AdminClient,
    ConfigResource,
)

from cdc_relay.errors import DeliveryError, PreflightError
from cdc_relay.kafka.checkpoints import Checkpoint
from cdc_relay.kafka.exactly_once import TRANSACTION_TIMEOUT_MS, transaction_timeout_ms
from cdc_relay.kafka.outage import KAFKA
from cdc_relay.kafka.refusals import is_culprit
from cdc_relay.kafka.sink import Acked, KafkaSink, Refused
from cdc_relay.kafka.topics import Topics, client_settings
from cdc_relay.metrics import KAFKA_TRANSACTION_SECONDS, KAFKA_TRANSACTIONS

log = logging.getLogger(__name__)

_COMMIT_RETRIES = 10
_ROOM_WAIT = 0.05  # seconds serving reports before asking again for room in the queue
_QUEUE_FULL = (
    "the producer's queue stayed full of the open transaction's events while the checkpoint "
    "waited for room (Kafka did not acknowledge them)"
)
_FATAL_REASON_WAIT = 2.0  # seconds to wait for the reason of a bare "Fatal error"


class TransactionAborted(Exception):
    """The open transaction could not commit and was aborted: replay from the checkpoint."""


class TransactionalSink(KafkaSink):
    """A sink whose messages count as acknowledged when their Kafka transaction commits,
    with a checkpoint record in it; ``renew`` aborts the open transaction (and may leave a
    new producer to ``initialise``: ``initialised`` says)."""

    def __init__(
        self,
        config: Mapping[str, str],
        on_ack: Acked,
        on_refused: Refused,
        transactional_id: str,
        checkpoint_topic: str,
        timeout: float = 30.0,
        start_timeout: float = 30.0,
        topics: Topics | None = None,
    ) -> None:
        settings = {**config, "transactional.id": transactional_id}
        settings.pop("enable.gapless.guarantee", None)  # an aborted transaction does that job
        # librdkafka's five requests in flight, as before sink.REQUIRED pinned one: with one, an
        # event sent alone that Kafka refused lost its report in the commit, and the relay
        # took it for taken, replaying for ever (test_exactly_once.py, the dead-letter test:
        # failed 3 runs in 6). Whether an implicit ack can leave a message out of a committed
        # transaction is open (docs/exactly-once.md).
        settings.pop("max.in.flight.requests.per.connection", None)
        super().__init__(settings, on_ack, on_refused, relay="stream", topics=topics)
        self._topic = checkpoint_topic
        self._key = transactional_id.encode()
        self._timeout = timeout  # for a transaction to commit or abort
        # ... for its checkpoint record to find room in a full queue
        timeout_ms = transaction_timeout_ms(settings)
        self._room_wait = min(
            timeout * _COMMIT_RETRIES, (timeout_ms or TRANSACTION_TIMEOUT_MS) / 1000
        )
        self._start_timeout = start_timeout  # for a coordinator to set up transactions
        self._appended: list[Any] = []  # tokens of the open transaction Kafka appended
        self._purged: list[Any] = []  # tokens of the open transaction purged, not refused
        self._in_commit = False  # aborting the transaction whose commit failed
        # ... failed on Kafka's refusal of a message (its partition not added): no EndTxn
        # (commit) was sent, so nothing of it can be on Kafka
        self._refused_in_commit = False
        self._open = False
        self.events = 0  # events in the open transaction
        self.opened = 0.0  # when it began (monotonic)
        self.committed = 0
        self.aborted = 0
        self._initialised = False

    @property
    def initialised(self) -> bool:
        """Whether the producer is set up for transactions: not before ``initialise``, nor
        after an abort Kafka failed outside a commit left a new one (``_abort_failed``)."""
        return self._initialised

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
        # Refused for the transaction's state (a refusal served while the checkpoint waited
        # for room took it into librdkafka's abortable state, which takes no more messages):
        # the commit below is refused at once with the transaction's own error, flagged
        # abortable (no flush, no EndTxn(commit)), and aborted as such; "Erroneous state"
        # would hide whether Kafka refused a message, which decides what a failed abort means.
        self._produce_checkpoint(checkpoint.encode())
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
                    self._in_commit = True
                    self._refused_in_commit = is_culprit(err)
                    try:
                        self.renew()  # serves the reports of the purged messages
                    finally:
                        self._in_commit = self._refused_in_commit = False
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

    def _produce_checkpoint(self, record: bytes) -> None:
        """Add the checkpoint record to the open transaction. While the producer's queue is
        full (of the transaction's own events: a transaction of a backlog may hold more than
        the queue, and the broker answers slowly), serve delivery reports until there is
        room, within the commit's time and the transaction's (transaction.timeout.ms, past
        which the coordinator aborts it). The loop does not tick meanwhile, as it does not
        while commit_transaction flushes. A report served may be a refusal, after which
        librdkafka takes nothing more into the transaction (Local: Erroneous state): then the
        record is left out, and the commit says why."""
        deadline = time.monotonic() + self._room_wait
        while True:
            try:
                self._producer.produce(self._topic, record, self._key)
            except BufferError:
                if time.monotonic() >= deadline:
                    self._fail(KafkaError(KafkaError._QUEUE_FULL, _QUEUE_FULL))
                self.poll(_ROOM_WAIT)  # raises if the producer failed for good (fenced)
            except KafkaException as exc:
                if exc.args[0].code() != KafkaError._STATE:
                    self._fail(exc.args[0])
                return
            else:
                return

    def renew(self) -> None:
        """Abort the open transaction: nothing of it becomes visible; its messages are
        reported refused (purged), and a replay produces them again. An abort Kafka fails
        leaves a new producer, which outside a commit waits to be initialised."""
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
        """The abort failed: stop, unless Kafka answered it INVALID_TXN_STATE, which fails
        the producer for good (librdkafka makes it fatal) and says that the coordinator holds
        no transaction of this producer open: nothing of the one aborted is on Kafka. Its
        commit was never asked, or failed (a commit Kafka made is never reported abortable).
        librdkafka sends that abort when it cannot be sure Kafka did not take a partition of
        the transaction: an AddPartitionsToTxn refused by a topic not authorised, or answered
        CONCURRENT_TRANSACTIONS while the coordinator still writes the last commit's markers
        (for a few milliseconds after each commit, more on a loaded machine), whose retry the
        abort cancels. Then a new producer with the same transactional id takes over, whose
        init_transactions ends what is left, as a restarted relay's would. Inside a commit that
        failed on Kafka's refusal of a message (no EndTxn(commit) sent) the relay holds its
        slot and goes on (a culprit's dead letter next): initialised at once; inside any other
        failed commit, stop (the commit may be on Kafka).
        Otherwise (a lost connection, a rewind) the slot may be another relay's by now, which
        the new producer must not fence: the relay initialises it once it holds the slot
        again, and reads the checkpoint again (KafkaTransactions.resume)."""
        if not (err.fatal() and err.code() == KafkaError.INVALID_TXN_STATE):
            self._fail(err)
        if self._in_commit and not self._refused_in_commit:
            # The commit's abortable error may have come after its EndTxn(commit) reached
            # the coordinator (librdkafka: "the transaction will have failed locally but the
            # EndTxn(commit) may have succeeded"): then INVALID_TXN_STATE answers an abort of
            # a transaction Kafka committed, and a replay would publish it twice. Stop: the
            # restarted relay reads the checkpoint, which says.
            self._fail(err)
        old, self._producer = self._producer, self._new_producer()
        with contextlib.suppress(KafkaException):
            old.purge()
            # Serves the purged messages' reports, and the fatal error's (librdkafka's lines
            # too: they come before the one that says what the relay does about it).
            old.flush(0)
        self.failure = None  # the old producer's, which is gone
        log.warning(
            "Kafka failed the producer when aborting a transaction (%s): nothing of it is on "
            "Kafka; a new producer takes over%s",
            err.str(),
            "" if self._in_commit else " once the slot is held again",
            extra={"action": "producer_renewed"},
        )
        self._initialised = False
        if self._in_commit:
            self._call(self._producer.init_transactions, self._timeout)
            self._initialised = True

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
            if KAFKA.since is not None:  # an append Kafka took: it is back (as KafkaSink's)
                KAFKA.back()
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
    admin = AdminClient({**client_settings(config), "log_level": 0})
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
