"""The workloads: a backlog written before the contestant starts, and a steady rate of events
written while it runs (at two rates), with the moment each COMMIT returned recorded per event.

Both insert through the SQL function ``bench_insert`` (bench/queries.sql), so every event has
the same shape whichever writer made it, and the writer's own CPU stays small: on two cores a
writer that builds its events in Python falls behind the rate while a relay is busy.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import psycopg

from bench.sql import QUERIES

WORKLOADS = ("backlog", "steady", "steady-high")
"""Every workload, in the order they run and appear in the results."""
RATE_SETTING = {"steady": "rate", "steady-high": "high_rate"}
"""The steady workloads, and the setting (an option of ``bench.run``) that holds each one's
rate: both write the same events in the same transactions, only the rate differs."""
REACHED = 0.98
"""A writer that wrote this fraction of its target rate reached it. On schedule it writes the
target exactly; one that fell behind writes every event all the same, later, at a lower rate."""

AGGREGATE_TYPES = ("order", "customer", "payment")
"""The aggregate types (and so topics) of the events; ``bench_insert`` cycles through them."""
WARMUP_TYPE = "warmup"
"""The aggregate type (and topic) of the event that shows a contestant is up."""


def reached(written: float, target: float) -> bool:
    """Whether a steady writer that wrote ``written`` events/s kept to its ``target``."""
    return written >= REACHED * target


def install(dsn: str) -> None:
    """Add the writers' function and procedure to a trial's database."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(QUERIES["insert_function"])
        conn.execute(QUERIES["backlog_procedure"])


def write_backlog(dsn: str, events: int, per_transaction: int) -> float:
    """Write ``events`` events in transactions of ``per_transaction``; return the seconds taken.

    Server-side (a procedure that commits every ``per_transaction`` rows), so that a million
    events take half a minute rather than minutes; the WAL is that of any client's inserts.
    """
    started = time.monotonic()
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(QUERIES["backlog"], {"events": events, "per_transaction": per_transaction})
    return time.monotonic() - started


def event_ids(dsn: str) -> set[str]:
    """The ids of every event in the outbox but the warm-up event."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        return {row[0] for row in conn.execute(QUERIES["event_ids"])}


def write_warmup(dsn: str) -> None:
    """One event on the warm-up topic: its arrival shows the contestant delivers."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(QUERIES["insert_warmup"])


@dataclass
class SteadyWriter:
    """Writes ``rate`` events/s for ``duration`` s in transactions of ``per_transaction``.

    Transactions are due on a fixed schedule, spread over ``connections`` connections (each in
    its own thread) so that one slow round trip does not hold the next transaction back; a
    writer that falls behind catches up without sleeping, and the rate it reached is reported.
    Each transaction is one statement in autocommit, one round trip: PostgreSQL commits it
    before it answers, so ``committed`` maps each event id to the wall-clock time
    (``time.time()``, the clock of the broker's LogAppendTime) at which the writer saw its
    COMMIT return. Four connections and one round trip each: with two connections and an
    explicit COMMIT (two round trips) the writer alone reached 16,700 of 20,000 events/s on
    this project's 2-core machine.
    """

    dsn: str
    rate: float
    duration: float
    per_transaction: int
    connections: int = 4
    first: int = 0
    """The number of the first event (the payloads' ``n``)."""
    committed: dict[str, float] = field(default_factory=dict)
    elapsed: float = 0.0
    errors: list[BaseException] = field(default_factory=list)
    _threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> SteadyWriter:
        transactions = max(1, round(self.rate * self.duration / self.per_transaction))
        started = time.monotonic() + 0.05
        self._threads = [
            threading.Thread(
                target=self._run,
                args=(started, range(k, transactions, self.connections)),
                name=f"steady-writer-{k}",
                daemon=True,
            )
            for k in range(self.connections)
        ]
        for thread in self._threads:
            thread.start()
        self._started = started
        return self

    def join(self) -> None:
        for thread in self._threads:
            thread.join()
        self.elapsed = time.monotonic() - self._started
        if self.errors:
            raise self.errors[0]

    @property
    def achieved_rate(self) -> float:
        """Events per second written: below ``rate`` only when the writer fell behind."""
        return len(self.committed) / max(self.elapsed, self.duration)

    def _run(self, started: float, numbers: range) -> None:
        size = self.per_transaction
        interval = size / self.rate
        query = QUERIES["insert_events"]
        committed = self.committed
        try:
            with psycopg.connect(self.dsn, autocommit=True) as conn:
                for number in numbers:
                    delay = started + number * interval - time.monotonic()
                    if delay > 0:
                        time.sleep(delay)
                    first = self.first + number * size
                    rows = conn.execute(query, {"count": size, "first": first}).fetchall()
                    now = time.time()
                    for (event_id,) in rows:
                        committed[event_id] = now
        except BaseException as exc:  # noqa: BLE001 - raised again by join()
            self.errors.append(exc)
