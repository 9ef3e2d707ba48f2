"""librdkafka's transactional producer and Kafka's transaction coordinator, in memory: the
real exactly-once sink (cdc_relay.kafka.transactional.TransactionalSink) runs on ``Producer``
(patched in for confluent_kafka's), so the loop's unit tests meet librdkafka's transactional
state machine, not a stand-in for the sink.

What is modelled, and where it comes from (librdkafka's src/rdkafka_txnmgr.c, Kafka's
TransactionCoordinator; the introduction to librdkafka, "Transactional Producer"):

- The coordinator keeps one transaction per transactional id: Empty, Ongoing (partitions
  added), PrepareCommit or PrepareAbort (decided: EndTxn answered, the markers not written
  yet), CompleteCommit or CompleteAbort (markers written). AddPartitionsToTxn during a
  Prepare* state is answered CONCURRENT_TRANSACTIONS. EndTxn is answered as Kafka's
  ``endTransaction`` does: Ongoing -> Prepare*; a retry of the same decision NONE (Complete*)
  or CONCURRENT_TRANSACTIONS (Prepare*); any other state (Empty, or the other decision)
  INVALID_TXN_STATE. A producer of an older epoch is answered PRODUCER_FENCED.
- The client registers each new partition of a transaction with AddPartitionsToTxn before
  it sends a message there. Every AddPartitionsToTxn sent counts toward ``txn_req_cnt``, and
  stays counted when it failed with an error after which "we can't be sure if the request
  was received by the broker or not" (CONCURRENT_TRANSACTIONS among them): the partitions
  go back to pending and are sent again 20 ms later. ``abort_transaction`` clears the
  pending partitions, purges the queue (each message reported _PURGE_QUEUE), and sends
  EndTxn(abort) unless ``txn_req_cnt`` is 0 ("No partitions registered: not sending
  EndTxn"); ``commit_transaction`` flushes first, then does the same with EndTxn(commit).
  INVALID_TXN_STATE or PRODUCER_FENCED from the coordinator is fatal: every later call
  raises it, and the next poll or flush raises it once (confluent-kafka raises a fatal
  error instead of calling error_cb). A fatal producer is done: a new one must be made.
- ``init_transactions`` fences older producers: the epoch goes up, an Ongoing transaction is
  aborted, a prepared one is completed first.

Time passes only when the client waits: in ``flush`` or ``poll`` with a timeout, and in the
transactional calls, which wait for the coordinator's answers. Then the coordinator writes
the markers of the transaction it prepared, and the AddPartitionsToTxn retried after
CONCURRENT_TRANSACTIONS goes out. What the client sends while not waiting (the
AddPartitionsToTxn of the first message of the transaction after a commit) meets the
coordinator as the commit left it, markers not written: on a loaded machine, what a real
broker answers for a few milliseconds after each commit, and librdkafka then retries.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from confluent_kafka import KafkaError, KafkaException

from cdc_relay.kafka.checkpoints import Checkpoint
from cdc_relay.kafka.routing import Message

EMPTY, ONGOING = "Empty", "Ongoing"
PREPARE_COMMIT, PREPARE_ABORT = "PrepareCommit", "PrepareAbort"
COMPLETE_COMMIT, COMPLETE_ABORT = "CompleteCommit", "CompleteAbort"

PARTITIONS = 3  # of every topic

_INVALID_TXN_STATE = "Broker: Producer attempted a transactional operation in an invalid state"
_FENCED = (
    "Broker: There is a newer producer with the same transactionalId which fences the current one"
)


class Coordinator:
    """The transaction coordinator of one transactional id, committing into ``kafka``
    (test_stream_loop_eos.Kafka: what read_committed consumers see, the checkpoint, the
    epoch). ``answers`` lists each request and its answer, for the tests to read."""

    def __init__(self, kafka: Any, checkpoint_topic: str) -> None:
        self.kafka = kafka
        self.checkpoint_topic = checkpoint_topic
        self.state = EMPTY
        self.partitions: set[tuple[str, int]] = set()
        self.data: list[Message] = []  # appended to the open transaction
        self.answers: list[tuple[str, str]] = []  # (request, answer)
        self.on_init: Callable[[], object] = lambda: None  # at each init_transactions

    def _answer(self, request: str, code: int) -> int:
        self.answers.append((request, KafkaError(code).name()))
        return code

    def write_markers(self) -> None:
        """The markers of a decided transaction are written: time passed."""
        if self.state == PREPARE_COMMIT:
            self.state = COMPLETE_COMMIT
        elif self.state == PREPARE_ABORT:
            self.state = COMPLETE_ABORT

    def init_producer_id(self) -> int:
        """A producer's init_transactions: the epoch goes up, fencing older producers; their
        Ongoing transaction is aborted, a decided one completed first."""
        self.on_init()
        self.write_markers()
        if self.state == ONGOING:
            self.data, self.partitions = [], set()
        self.state = EMPTY
        self.kafka.epoch += 1
        self._answer("InitProducerId", KafkaError.NO_ERROR)
        return int(self.kafka.epoch)

    def add_partitions(self, epoch: int, partitions: set[tuple[str, int]]) -> int:
        request = "AddPartitionsToTxn"
        if epoch != self.kafka.epoch:
            return self._answer(request, KafkaError.PRODUCER_FENCED)
        if self.state in (PREPARE_COMMIT, PREPARE_ABORT):
            return self._answer(request, KafkaError.CONCURRENT_TRANSACTIONS)
        if self.state != ONGOING:
            self.state, self.partitions = ONGOING, set()
        self.partitions |= partitions
        return self._answer(request, KafkaError.NO_ERROR)

    def append(self, epoch: int, partition: tuple[str, int], message: Message) -> int:
        """A produce request's batch: only to a partition of the open transaction."""
        assert partition in self.partitions and self.state == ONGOING, "sent before registered"
        if epoch != self.kafka.epoch:
            return KafkaError.PRODUCER_FENCED
        self.data.append(message)
        return KafkaError.NO_ERROR

    def end_txn(self, epoch: int, commit: bool) -> int:
        request = f"EndTxn({'commit' if commit else 'abort'})"
        if epoch != self.kafka.epoch:
            return self._answer(request, KafkaError.PRODUCER_FENCED)
        state = self.state
        if state == ONGOING:
            data, self.data, self.partitions = self.data, [], set()
            if commit:
                self._commit(data)
            self.state = PREPARE_COMMIT if commit else PREPARE_ABORT
            return self._answer(request, KafkaError.NO_ERROR)
        if state in (COMPLETE_COMMIT, COMPLETE_ABORT) and commit == (state == COMPLETE_COMMIT):
            return self._answer(request, KafkaError.NO_ERROR)
        if state in (PREPARE_COMMIT, PREPARE_ABORT) and commit == (state == PREPARE_COMMIT):
            return self._answer(request, KafkaError.CONCURRENT_TRANSACTIONS)
        return self._answer(request, KafkaError.INVALID_TXN_STATE)  # Empty, or the other one

    def _commit(self, data: list[Message]) -> None:
        """Decided: read_committed consumers see it once the markers are written, which the
        broker does whatever the client does next."""
        kafka = self.kafka
        events = [m for m in data if m.topic != self.checkpoint_topic]
        kafka.visible.extend(events)
        kafka.transactions.append(len(events))
        records = [m for m in data if m.topic == self.checkpoint_topic and m.value]
        if records:
            kafka.checkpoint = Checkpoint.decode(records[-1].value or b"")


class Report(SimpleNamespace):
    """What a delivery report hands the callback for the message."""

    def topic(self) -> str:
        return str(self.message.topic)


@dataclass
class _Queued:
    message: Message
    partition: tuple[str, int]
    report: Callable[[KafkaError | None, Any], None] | None


@dataclass
class Producer:
    """One librdkafka transactional producer (confluent_kafka.Producer's methods that the
    sink calls) on ``coordinator``; ``config`` as confluent_kafka.Producer takes it."""

    coordinator: Coordinator
    config: dict[str, Any]
    state: str = "Init"  # librdkafka's txn_state: Init, Ready, InTransaction, AbortableError
    epoch: int = -1
    txn_req_cnt: int = 0  # AddPartitionsToTxn sent in this transaction, maybe received
    registered: set[tuple[str, int]] = field(default_factory=set)
    pending: set[tuple[str, int]] = field(default_factory=set)  # to register
    retry: bool = False  # AddPartitionsToTxn to send again once 20 ms passed
    queue: list[_Queued] = field(default_factory=list)  # produced, not sent
    reports: list[tuple[_Queued, KafkaError | None]] = field(default_factory=list)
    dr_fails: int = 0
    fatal: KafkaError | None = None
    fatal_told: bool = False  # raised once from poll or flush

    # -- the transactional API

    def init_transactions(self, timeout: float = -1) -> None:
        self._require("Init")
        self.epoch = self.coordinator.init_producer_id()
        self.state = "Ready"

    def begin_transaction(self) -> None:
        self._require("Ready")
        self.state = "InTransaction"
        self.txn_req_cnt, self.dr_fails, self.retry = 0, 0, False
        self.registered, self.pending = set(), set()

    def commit_transaction(self, timeout: float = -1) -> None:
        if self.fatal is None and self.state == "AbortableError":
            # begin_commit refuses at once with the transaction's error, flagged abortable
            raise KafkaException(
                KafkaError(KafkaError._INCONSISTENT, "transaction failed", txn_requires_abort=True)
            )
        self._require("InTransaction")
        self._wait()  # commit flushes first
        self._serve()
        if self.dr_fails:
            self.state = "AbortableError"
            raise KafkaException(
                KafkaError(
                    KafkaError._INCONSISTENT,
                    f"{self.dr_fails} message(s) failed delivery",
                    txn_requires_abort=True,
                )
            )
        self._end(commit=True)

    def abort_transaction(self, timeout: float = -1) -> None:
        self._require("InTransaction", "AbortableError")
        self.pending, self.retry = set(), False  # begin_abort: pending partitions cleared
        self.purge()
        self._wait()  # the purged messages' reports are served, in-flight ones waited for
        self._serve()
        self._end(commit=False)

    def _end(self, commit: bool) -> None:
        if not self.txn_req_cnt:  # "No partitions registered: not sending EndTxn"
            self.state = "Ready"
            return
        while True:
            code = self.coordinator.end_txn(self.epoch, commit)
            if code != KafkaError.CONCURRENT_TRANSACTIONS:
                break
            self._wait()  # retried
        if code == KafkaError.NO_ERROR:
            self.state = "Ready"
            return
        self._fatal(code, "Failed to end transaction")

    # -- producing

    def produce(
        self,
        topic: str,
        value: bytes | None = None,
        key: bytes | None = None,
        partition: int = -1,
        callback: Callable[[KafkaError | None, Any], None] | None = None,
        on_delivery: Callable[[KafkaError | None, Any], None] | None = None,
        timestamp: int = 0,
        headers: list[tuple[str, bytes]] | None = None,
    ) -> None:
        if self.fatal is not None:
            raise KafkaException(KafkaError(KafkaError._FATAL, self.fatal.str(), fatal=True))
        if self.state != "InTransaction":
            raise KafkaException(KafkaError(KafkaError._STATE, f"not in state {self.state}"))
        where = (topic, zlib.crc32(key) % PARTITIONS if key else 0)
        if where not in self.registered and where not in self.pending:
            self.pending.add(where)
            if not self.retry:
                self._register()  # at once: librdkafka schedules it as soon as possible
        self.queue.append(
            _Queued(Message(topic, key, value, headers or []), where, callback or on_delivery)
        )

    def _register(self) -> None:
        if not self.pending:
            return
        self.txn_req_cnt += 1
        code = self.coordinator.add_partitions(self.epoch, set(self.pending))
        if code == KafkaError.NO_ERROR:
            self.registered |= self.pending
            self.pending, self.retry = set(), False
        elif code == KafkaError.CONCURRENT_TRANSACTIONS:
            self.retry = True  # still counted: "we can't be sure" it was not received
        else:
            self._fatal(code, "Failed to add partitions to transaction", raise_=False)

    def _send(self) -> None:
        """Send what may go (its partition registered), each reported at once."""
        kept: list[_Queued] = []
        for queued in self.queue:
            if self.fatal is None and queued.partition in self.registered:
                code = self.coordinator.append(self.epoch, queued.partition, queued.message)
                self.reports.append((queued, None if code == 0 else KafkaError(code)))
            else:
                kept.append(queued)
        self.queue = kept

    def _wait(self) -> None:
        """Time passes: the coordinator writes its markers, a retry due goes out, and what
        may be sent is sent."""
        self.coordinator.write_markers()
        if self.retry and self.state == "InTransaction":
            self._register()
        self._send()

    def _serve(self) -> int:
        reports, self.reports = self.reports, []
        for queued, err in reports:
            if err is not None:
                self.dr_fails += 1
            if queued.report is not None:
                queued.report(err, Report(message=queued.message))
        return len(reports)

    def poll(self, timeout: float = -1) -> int:
        if timeout:
            self._wait()
        else:
            self._send()
        served = self._serve()
        self._tell_fatal()
        return served

    def flush(self, timeout: float = -1) -> int:
        if timeout:
            self._wait()
        else:
            self._send()
        self._serve()
        self._tell_fatal()
        return len(self)

    def purge(self, in_queue: bool = True, in_flight: bool = True, blocking: bool = True) -> None:
        purged, self.queue = self.queue, []
        self.reports.extend((q, KafkaError(KafkaError._PURGE_QUEUE)) for q in purged)

    def __len__(self) -> int:
        return len(self.queue) + len(self.reports)

    def list_topics(self, topic: str | None = None, timeout: float = -1) -> Any:
        return SimpleNamespace(topics={})

    # -- errors

    def _require(self, *states: str) -> None:
        if self.fatal is not None:
            raise KafkaException(self.fatal)
        if self.state not in states:
            raise KafkaException(
                KafkaError(KafkaError._STATE, f"Operation not valid in state {self.state}")
            )

    def _fatal(self, code: int, what: str, raise_: bool = True) -> None:
        reason = _FENCED if code == KafkaError.PRODUCER_FENCED else _INVALID_TXN_STATE
        if code == KafkaError.PRODUCER_FENCED:
            code = KafkaError._FENCED
        self.fatal = KafkaError(code, f"{what}: {reason}", fatal=True)
        self.state = "FatalError"
        if raise_:
            raise KafkaException(self.fatal)

    def _tell_fatal(self) -> None:
        if self.fatal is not None and not self.fatal_told:
            self.fatal_told = True
            raise KafkaException(self.fatal)


def producers(
    coordinator: Coordinator,
) -> tuple[Callable[[dict[str, Any]], Producer], list[Producer]]:
    """What to patch in for confluent_kafka.Producer, and the producers it made."""
    made: list[Producer] = []

    def make(config: dict[str, Any]) -> Producer:
        made.append(Producer(coordinator, config))
        return made[-1]

    return make, made
