"""The LSN tracker: which WAL position is safe to confirm to PostgreSQL.

The rule (ARCHITECTURE.md, the LSN rule): confirm the end LSN of the newest transaction whose
events, and those of every earlier transaction, Kafka has acknowledged. With nothing in
flight, the position of the last keepalive may be confirmed, so an idle outbox never pins WAL.

State is one small record per open or unacknowledged transaction holding a count, never the
events themselves, so memory does not grow with transaction size.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from cdc_relay.lsn import Lsn


class Transaction:
    """The tracker's handle on one transaction; delivery reports hold it as their token."""

    __slots__ = ("commit_time_us", "committed", "end_lsn", "forgotten", "pending")

    def __init__(self, commit_time_us: int = 0) -> None:
        self.commit_time_us = commit_time_us  # for latency metrics, not for the LSN rule
        self.pending = 0
        self.committed = False
        self.forgotten = False
        self.end_lsn: Lsn = 0


class LsnTracker:
    """Follows transactions in stream order and acknowledgements in any order."""

    def __init__(self, confirmed: Lsn = 0) -> None:
        self._confirmed = confirmed
        self._transactions: deque[Transaction] = deque()
        self._in_flight = 0

    @property
    def safe_lsn(self) -> Lsn:
        """The highest position whose every event Kafka has acknowledged."""
        return self._confirmed

    @property
    def in_flight(self) -> int:
        """Events sent to Kafka and not yet acknowledged."""
        return self._in_flight

    @property
    def idle(self) -> bool:
        """No transaction open or waiting for acknowledgements."""
        return not self._transactions

    def begin(self, commit_time_us: int = 0) -> Transaction:
        """A transaction starts in the replication stream."""
        transaction = Transaction(commit_time_us)
        self._transactions.append(transaction)
        return transaction

    def sent(self, transaction: Transaction) -> None:
        """One event of ``transaction`` went to the producer."""
        transaction.pending += 1
        self._in_flight += 1

    def acked(self, transaction: Transaction) -> None:
        """Kafka acknowledged one event of ``transaction``."""
        if transaction.forgotten:
            return
        transaction.pending -= 1
        self._in_flight -= 1
        if transaction.pending == 0 and transaction.committed:
            self._advance()

    def commit(self, transaction: Transaction, end_lsn: Lsn) -> None:
        """The stream's Commit for ``transaction`` arrived."""
        transaction.end_lsn = end_lsn
        transaction.committed = True
        if transaction.pending == 0:
            self._advance()

    def keepalive(self, wal_end: Lsn) -> None:
        """The server reports ``wal_end``: everything before it was sent to us."""
        if not self._transactions and wal_end > self._confirmed:
            self._confirmed = wal_end

    def rebase(self, confirmed: Lsn) -> None:
        """The stream starts again from ``confirmed``, the slot's position on a server whose
        history past it may differ from what was acknowledged (a promoted standby); call
        after ``reset``."""
        self._confirmed = confirmed

    def reset(self) -> None:
        """Forget open and unacknowledged transactions (the stream restarts from ``safe_lsn``).

        Reports that still arrive for forgotten transactions change nothing.
        """
        for transaction in self._transactions:
            transaction.forgotten = True
        self._transactions.clear()
        self._in_flight = 0

    def _advance(self) -> None:
        transactions = self._transactions
        while transactions and transactions[0].committed and transactions[0].pending == 0:
            end_lsn = transactions.popleft().end_lsn
            if end_lsn > self._confirmed:
                self._confirmed = end_lsn


class Acknowledgements:
    """The stream's checkpointer (pipeline.Checkpointer): each delivery report moves the
    tracker. Beside it, the ids of the events sent and not acknowledged (``unacknowledged``,
    which the sender adds to: the stop line counts them, as neither the tracker, which forgets
    them on a rewind, nor the producer, once Kafka refused them, still does), the
    acknowledgements not yet counted in the published metric (``take``), and the latency
    from a transaction's commit to the acknowledgement of its last event (``latency``, on
    ``clock``: the relay's, which the simulation makes virtual). Here, in the compiled hot
    path, not in the relay's loop: it runs once per event."""

    def __init__(
        self,
        tracker: LsnTracker,
        latency: Callable[[float], None],
        clock: Callable[[], float],
    ) -> None:
        self._tracker = tracker
        self._latency = latency
        self._clock = clock  # the wall clock, as the commit's timestamp is
        self.unacknowledged: set[str] = set()
        self._count = 0

    def acked(self, token: tuple[Transaction, str]) -> None:
        transaction = token[0]
        self._tracker.acked(transaction)
        self.unacknowledged.discard(token[1])
        self._count += 1
        if transaction.committed and not transaction.pending and not transaction.forgotten:
            # Once per transaction: its commit to the acknowledgement of its last event.
            self._latency(max(0.0, self._clock() - transaction.commit_time_us / 1e6))

    def take(self) -> int:
        """The acknowledgements since the last call (a Prometheus counter's inc() takes a
        lock: it is added to once per status update, not per event)."""
        count, self._count = self._count, 0
        return count
