"""The poller's outbox in memory (cdc_relay.relay.stages.OutboxStore and Claims): no database.

It keeps the rows as the outbox table does and answers the claim's queries as
sql/queries.sql says they behave (claim_aggregates, claim, claim_skipped, mark_processed,
mark_failed, pending_counts): a row is due while unprocessed and not waiting out a backoff;
a row behind a waiting one of its aggregate is not due; a dead letter (``retry_after`` at
infinity) waits for good and holds nothing back; an aggregate is locked by one transaction
at a time (its key: hashtext of type/id, as PostgreSQL's); a row another transaction locks
is skipped, not waited for. A transaction's marks take effect when it commits, and none when
it raises. Time is the store's ``clock`` (time.monotonic, unless the test moves it). The test
may make any query fail with a psycopg error, once, as PostgreSQL would, and end every
session (``end_sessions``: terminated, timed out), which releases its claims.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import psycopg

from cdc_relay.postgres.shards import hashtext
from cdc_relay.postgres.store import Outbox, OutboxRow
from cdc_relay.postgres.tables import OutboxTable

JSONB_OID = 3802


def key_of(aggregate_type: str, aggregate_id: str) -> int:
    return hashtext(f"{aggregate_type}/{aggregate_id}".encode())


@dataclass
class Row:
    seq: int
    id: str
    aggregate_type: str
    aggregate_id: str
    payload: bytes | None
    attempts: int = 0
    retry_after: float | None = None  # MemoryOutbox.clock(); math.inf: a dead letter
    processed: bool = False
    last_error: str | None = None
    marks: list[str] = field(default_factory=list)  # "processed", "failed": committed marks
    payload_type: int = JSONB_OID  # what pg_typeof says of it (the column retyped: another)

    @property
    def key(self) -> int:
        return key_of(self.aggregate_type, self.aggregate_id)

    @property
    def dead(self) -> bool:
        return not self.processed and self.retry_after == math.inf

    def due(self, now: float) -> bool:
        return not self.processed and (self.retry_after is None or self.retry_after <= now)

    def waits(self, now: float) -> bool:
        """Waiting out a backoff (a dead letter does not count: it holds nothing back)."""
        return (
            not self.processed
            and self.retry_after is not None
            and now < self.retry_after < math.inf
        )


class MemoryOutbox:
    """The outbox table (OutboxStore)."""

    def __init__(self) -> None:
        self.outbox = Outbox(OutboxTable(16384, "public", "outbox_events", False), JSONB_OID, False)
        self.rows: list[Row] = []
        self.lock = threading.RLock()
        self.locked_rows: set[str] = set()  # row ids another transaction holds (FOR UPDATE)
        self.other_pollers: set[int] = set()  # aggregate keys another process's poller holds
        self.advisory: dict[int, MemoryClaims] = {}  # aggregate keys locked by our workers
        self.fail: dict[str, list[BaseException]] = {}  # query name -> errors to raise, in turn
        self.connections = 0  # connections made (each takes the outbox's advisory lock)
        self.commits = 0
        self.rollbacks = 0
        self.claimed: list[list[str]] = []  # the ids of each claim that returned rows
        # The test's look before each claim, told the aggregates that claim walks past.
        self.before_claim: Callable[[list[int]], object] = lambda skip: None
        # now() in the queries, and retry_after: read late, so a test's patched time is it.
        self.clock: Callable[[], float] = lambda: time.monotonic()
        self.sessions: list[MemoryClaims] = []  # every worker's claims

    def add(
        self,
        aggregate: str,
        n: int = 1,
        payload: bytes | None = b"{}",
        aggregate_type: str = "order",
    ) -> list[str]:
        """``n`` new rows of aggregate ``aggregate`` (of ``aggregate_type``); their ids."""
        ids = []
        with self.lock:
            for _ in range(n):
                seq = len(self.rows) + 1
                ids.append(f"00000000-0000-0000-0000-{seq:012d}")
                self.rows.append(Row(seq, ids[-1], aggregate_type, aggregate, payload))
        return ids

    def row(self, row_id: str) -> Row:
        return next(r for r in self.rows if r.id == row_id)

    def claims(self) -> MemoryClaims:
        claims = MemoryClaims(self)
        self.sessions.append(claims)
        return claims

    def end_sessions(self) -> None:
        """PostgreSQL ends every session now (pg_terminate_backend, a timeout): their claims are
        released, and each one's next query fails; ``lost`` says so without one."""
        with self.lock:
            for claims in self.sessions:
                if claims.connected:
                    claims.ended = True
                    claims.release()

    def pending_counts(self) -> dict[str, int] | None:
        with self.lock:
            pending = [r for r in self.rows if not r.processed]
            return {"unprocessed": len(pending), "dead_letters": sum(r.dead for r in pending)}

    def failing(self, query: str) -> None:
        """Raise the next error queued for ``query``, if any."""
        errors = self.fail.get(query)
        if errors:
            raise errors.pop(0)

    def done(self) -> bool:
        """Every row processed or a dead letter."""
        with self.lock:
            return all(r.processed or r.dead for r in self.rows)


class MemoryClaims:
    """One worker's connection to the outbox (Claims)."""

    def __init__(self, outbox: MemoryOutbox) -> None:
        self.store = outbox
        self.connected = False
        self.ended = False  # PostgreSQL ended the session (MemoryOutbox.end_sessions)
        self._marks: list[tuple[Row, dict[str, Any]]] | None = None  # in the transaction

    def _query(self, name: str) -> None:
        """A query of the connection: refused once its session has ended, else the test's
        error for it, if any."""
        if self.ended:
            raise psycopg.OperationalError("terminating connection due to administrator command")
        self.store.failing(name)

    def lost(self) -> bool:
        return self.ended

    def open(self) -> None:
        if not self.connected:
            self.store.failing("connect")
            self.connected = True
            self.store.connections += 1

    @contextlib.contextmanager
    def transaction(self) -> Iterator[None]:
        store = self.store
        self.open()
        self._marks = []
        try:
            yield
        except BaseException:
            with store.lock:
                store.rollbacks += 1
            raise
        else:
            self._query("commit")
            with store.lock:
                for row, changes in self._marks:
                    for name, value in changes.items():
                        setattr(row, name, value)
                    row.marks.append("processed" if changes.get("processed") else "failed")
                store.commits += 1
        finally:
            self._marks = None
            self.release()

    def release(self) -> None:
        with self.store.lock:
            for key in [k for k, holder in self.store.advisory.items() if holder is self]:
                del self.store.advisory[key]

    def _held_back(self, row: Row, now: float) -> bool:
        """A row of its aggregate before it waits out a backoff."""
        return any(
            w.waits(now) and w.seq < row.seq and w.aggregate_id == row.aggregate_id
            for w in self.store.rows
            if w.aggregate_type == row.aggregate_type
        )

    def claim_aggregates(self, limit: int, shard: int, shards: int, skip: list[int]) -> list[int]:
        assert self._marks is not None, "outside a transaction"
        self._query("claim_aggregates")
        self.store.before_claim(skip)
        now = self.store.clock()
        keys: set[int] = set()
        got = 0
        with self.store.lock:
            for row in sorted(self.store.rows, key=lambda r: r.seq):
                if got >= limit:
                    break
                if not row.due(now) or row.key in skip:
                    continue
                if (hashtext(row.aggregate_id.encode()) & 0x7FFFFFFF) % shards != shard:
                    continue
                if self._held_back(row, now):
                    continue
                holder = self.store.advisory.get(row.key)
                if row.key in self.store.other_pollers or holder not in (None, self):
                    continue
                self.store.advisory[row.key] = self
                keys.add(row.key)
                got += 1
        return sorted(keys)

    def claim(self, limit: int, keys: list[int]) -> list[OutboxRow]:
        assert self._marks is not None, "outside a transaction"
        self._query("claim")
        now = self.store.clock()
        with self.store.lock:
            rows = [
                r
                for r in sorted(self.store.rows, key=lambda r: r.seq)
                if r.due(now)
                and r.key in keys
                and not self._held_back(r, now)
                and r.id not in self.store.locked_rows
            ][:limit]
            claimed = [
                OutboxRow(
                    id=r.id,
                    aggregate_type=r.aggregate_type,
                    aggregate_id=r.aggregate_id,
                    event_type="created",
                    payload=r.payload,
                    payload_type=r.payload_type,
                    attempts=r.attempts,
                    seq=r.seq,
                    key=r.key,
                )
                for r in rows
            ]
            if claimed:
                self.store.claimed.append([r.id for r in claimed])
        return claimed

    def claim_skipped(self, keys: list[int], last: int, ids: list[str]) -> dict[int, int]:
        assert self._marks is not None, "outside a transaction"
        self._query("claim_skipped")
        now = self.store.clock()
        skipped: dict[int, int] = {}
        with self.store.lock:
            for r in self.store.rows:
                if r.due(now) and r.key in keys and r.seq < last and r.id not in ids:
                    skipped[r.key] = min(skipped.get(r.key, r.seq), r.seq)
        return skipped

    def published_after(self, ids: list[str]) -> dict[str, int]:
        self._query("published_after")
        with self.store.lock:
            after = {}
            for row_id in ids:
                row = self.store.row(row_id)
                later = [
                    r.seq
                    for r in self.store.rows
                    if r.processed and r.aggregate_id == row.aggregate_id and r.seq > row.seq
                ]
                if later:
                    after[row_id] = max(later)
            return after

    def mark_processed(self, ids: list[str]) -> None:
        assert self._marks is not None, "outside a transaction"
        self._query("mark_processed")
        for row_id in ids:
            self._marks.append((self.store.row(row_id), {"processed": True}))

    def mark_failed(
        self,
        ids: list[str],
        errors: list[str],
        delays: list[float],
        own: list[bool],
        max_attempts: int,
    ) -> dict[str, dict[str, Any]]:
        assert self._marks is not None, "outside a transaction"
        self._query("mark_failed")
        outcome = {}
        now = self.store.clock()
        for row_id, error, delay, its_own in zip(ids, errors, delays, own, strict=True):
            row = self.store.row(row_id)
            attempts = row.attempts + 1
            dead = its_own and attempts >= max_attempts
            self._marks.append(
                (
                    row,
                    {
                        "attempts": attempts,
                        "last_error": error,
                        "retry_after": math.inf if dead else now + delay,
                    },
                )
            )
            outcome[row_id] = {"id": row_id, "attempts": attempts, "dead": dead}
        return outcome

    def close(self) -> None:
        self.connected = False
        self.ended = False  # the next transaction connects anew
        self.release()
