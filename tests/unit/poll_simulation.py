"""The poll relay's world for test_simulation: the outbox (memory_outbox), Kafka, poll
processes that crash, lose their session, stop, and run beside another poller, and the
oracle of claim, mark and retry.

As simulation.py does for ``stream``: everything in memory and in one thread, on the virtual
clock, each call of a stage a step at which the schedule acts. A process is a ``PollRelay``
with one worker (``worker.Worker``, its real claim, publish, mark and retry logic, through its
pipeline and batch), run by the worker's own loop; its waits (for new rows, before a
reconnect) pass on the virtual clock. Another poller, beside it on the same outbox, is a
second process run within one of the first one's steps: while the first holds its claim.

The oracle: at each commit of a claim, no row marked processed is missing from Kafka; after
every step, each aggregate's rows reach Kafka in order (a row only after every earlier one of
its aggregate, or after that one became a dead letter, which holds nothing back); only a row
Kafka refused as its own becomes a dead letter; no row reaches Kafka more often than it was
claimed; at rest, every row processed or a dead letter, each processed one on Kafka, the last
copies in order.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from memory_outbox import MemoryClaims, MemoryOutbox
from simulation import (
    CLOCK,
    STEP,
    TIMED_OUT,
    TOO_LARGE,
    Action,
    Crash,
    Killed,
    LoseConnection,
    Refuse,
    SimSink,
    Stall,
    Stop,
    Stuck,
    Violation,
)
from test_stream_loop import DEAD, event_id

from cdc_relay.kafka.routing import Message
from cdc_relay.relay.poller import PollRelay
from cdc_relay.relay.worker import PollSettings, Worker


@dataclass(frozen=True)
class AddRows:
    """The application writes rows while the poller runs: ``count`` of aggregate ``key``."""

    key: str
    count: int = 1


@dataclass(frozen=True)
class AnotherPoller:
    """Another poll process runs beside this one, for ``steps`` steps, while this one is
    where it is (holding its claim, perhaps)."""

    steps: int


PollAction = Action | AddRows | AnotherPoller


class Event:
    """``threading.Event`` on the virtual clock, for one thread."""

    def __init__(self) -> None:
        self._set = False

    def is_set(self) -> bool:
        return self._set

    def set(self) -> None:
        self._set = True

    def wait(self, timeout: float | None = None) -> bool:
        if not self._set and timeout:
            CLOCK.sleep(timeout)
        return self._set


class Wake:
    """worker.Wake on the virtual clock: a worker that found no more rows waits here; the
    process looks whether it is done (``PollProcess.idle``)."""

    def __init__(self, process: PollProcess) -> None:
        self.process = process

    def seen(self) -> int:
        return 0

    def notify(self) -> None:
        pass

    def wait(self, seen: int, timeout: float) -> None:
        self.process.idle()
        CLOCK.sleep(timeout)


class SimClaims(MemoryClaims):
    """A process's session on the outbox: each query a step; each commit checked."""

    def __init__(self, outbox: MemoryOutbox, process: PollProcess) -> None:
        super().__init__(outbox)
        outbox.sessions.append(self)
        self.process = process

    def lost(self) -> bool:
        self.process.step("lost")
        return super().lost()

    @contextlib.contextmanager
    def transaction(self) -> Iterator[None]:
        self.process.step("begin")
        with super().transaction():
            yield
            self.process.step("commit")
        self.process.world.committed()

    def claim_aggregates(self, limit: int, shard: int, shards: int, skip: list[int]) -> list[int]:
        self.process.step("claim_aggregates")
        return super().claim_aggregates(limit, shard, shards, skip)

    def claim(self, limit: int, keys: list[int]) -> list[Any]:
        self.process.step("claim")
        rows = super().claim(limit, keys)
        self.process.world.claims.update(row.id for row in rows)
        return rows

    def claim_skipped(self, keys: list[int], last: int, ids: list[str]) -> dict[int, int]:
        self.process.step("claim_skipped")
        return super().claim_skipped(keys, last, ids)

    def mark_processed(self, ids: list[str]) -> None:
        self.process.step("mark_processed")
        super().mark_processed(ids)

    def mark_failed(
        self,
        ids: list[str],
        errors: list[str],
        delays: list[float],
        own: list[bool],
        max_attempts: int,
    ) -> dict[str, dict[str, Any]]:
        self.process.step("mark_failed")
        return super().mark_failed(ids, errors, delays, own, max_attempts)


class PollProcess:
    """One poll process: a PollRelay's worker on stages of its own, run by ``run``."""

    BUDGET = 20_000

    def __init__(
        self, world: PollWorld, name: str, schedule: Sequence[tuple[int, PollAction]] = ()
    ) -> None:
        self.world = world
        self.name = name
        self.schedule = sorted(schedule, key=lambda entry: entry[0])
        self.steps = 0
        self.dead = False
        self.stall_until = -1
        self.faulted = False
        self.drained = False
        self.sinks: list[SimSink] = []
        self.relay = PollRelay(
            PollSettings(
                dsn="dbname=sim",
                kafka_config={},
                topic_template="outbox.{aggregate_type}",
                table="outbox_events",
                batch_size=world.batch_size,
                poll_interval=0.01,
                progress_interval=3600.0,
                max_attempts=3,
                backoff_base=0.01,
                backoff_max=0.05,
                shutdown_timeout=0.05,
            ),
            open_sink=self._sink,
        )
        self.relay.stopping = Event()  # type: ignore[assignment]
        self.relay.wake = Wake(self)  # type: ignore[assignment]
        self.claims = SimClaims(world.outbox, self)
        self.worker = Worker(self.relay, 0, self.claims, world.outbox.outbox, self.relay._open_sink)

    def _sink(self, on_ack: Any, on_refused: Any) -> SimSink:
        sink = SimSink(self, on_ack, on_refused)  # type: ignore[arg-type]
        self.sinks.append(sink)
        return sink

    def run(self) -> str:
        """Run until the process ends: ``drained``, ``stopped`` or ``killed``; a promise
        broken fails here."""
        world = self.world
        try:
            self.worker.batch.pipeline.run(self.worker)
            outcome = "drained" if self.drained else "stopped"
        except Killed:
            outcome = "killed"
        except Violation:
            outcome = "broke a promise"
        except Stuck as exc:
            world.failure = world.failure or str(exc)
            outcome = "stuck"
        if world.failure:
            raise AssertionError(world.failure)
        return outcome

    def step(self, what: str) -> None:
        if self.dead:
            raise Killed
        self.steps += 1
        CLOCK.sleep(STEP)
        if self.steps > self.BUDGET:
            raise Stuck(f"{self.name} still going after {self.BUDGET} steps (at {what})")
        while self.schedule and self.schedule[0][0] <= self.steps:
            _, action = self.schedule.pop(0)
            self.world.trace.append(f"{self.name} step {self.steps} ({what}): {action}")
            self.faulted = self.faulted or not isinstance(action, AddRows)
            self.act(action)

    def act(self, action: PollAction) -> None:
        world = self.world
        if isinstance(action, Crash):
            self.kill(action.reached)
        elif isinstance(action, LoseConnection):
            with world.outbox.lock:  # PostgreSQL ends the session: its claim is released
                if self.claims.connected:
                    self.claims.ended = True
                    self.claims.release()
        elif isinstance(action, Stop):
            self.relay.request_stop()
        elif isinstance(action, Stall):
            self.stall_until = self.steps + action.steps
        elif isinstance(action, Refuse):
            world.refuse(action)
        elif isinstance(action, AddRows):
            world.add(action.key, action.count)
        elif isinstance(action, AnotherPoller):
            other = world.process([(action.steps, Stop())])
            outcome = other.run()
            world.trace.append(f"{other.name} (beside {self.name}): {outcome}")

    def stalled(self) -> bool:
        return self.steps < self.stall_until

    def idle(self) -> None:
        """No more rows were due: what the schedule adds comes now; with every row processed
        or a dead letter and nothing in flight, the process is stopped (drained)."""
        adds = [entry for entry in self.schedule if isinstance(entry[1], AddRows)]
        if adds:
            self.schedule.remove(adds[0])
            self.act(adds[0][1])
            return
        if self.world.outbox.done() and not any(s.in_flight() for s in self.sinks):
            self.drained = True
            self.relay.request_stop()

    def kill(self, reached: int = 0) -> None:
        """SIGKILL: the claim's transaction rolls back, the producer's queue is gone (its first
        ``reached`` messages had reached Kafka)."""
        for sink in self.sinks:
            self.world.log.extend(message for message, _ in sink.queue[:reached])
            sink.queue = []
        self.dead = True
        raise Killed


@dataclass
class PollWorld:
    """The outbox, Kafka and what the poll processes did, with the oracle."""

    batch_size: int = 4
    capacity: int = 1_000
    linger: bool = False  # the producer holds its batches for linger.ms (simulation.SimSink)
    outbox: MemoryOutbox = field(default_factory=MemoryOutbox)
    log: list[Message] = field(default_factory=list)  # what reached Kafka
    claims: Counter[str] = field(default_factory=Counter)  # times a row was claimed
    poison: dict[str, int] = field(default_factory=dict)
    client_refuses: dict[str, int] = field(default_factory=dict)
    refuse_once: dict[str, int] = field(default_factory=dict)
    dead_at: dict[str, int] = field(default_factory=dict)  # a dead letter since: len(log)
    trace: list[str] = field(default_factory=list)
    failure: str | None = None
    processes: int = 0

    def process(self, schedule: Sequence[tuple[int, PollAction]] = ()) -> PollProcess:
        self.processes += 1
        return PollProcess(self, f"poller {self.processes}", schedule)

    def add(self, key: str, count: int = 1) -> None:
        self.outbox.add(key, count, payload=b'{"n": 1}')

    def refuse(self, refusal: Refuse) -> None:
        rows = self.outbox.rows
        if not rows:
            return
        row = rows[refusal.event % len(rows)].id
        if refusal.kind == "culprit":
            self.poison[row] = TOO_LARGE
        elif refusal.kind == "client":
            self.client_refuses[row] = TOO_LARGE
        else:
            self.refuse_once[row] = TIMED_OUT

    # -- the oracle -------------------------------------------------------------------------

    def committed(self) -> None:
        """A claim's transaction committed: no row it marked processed is missing from
        Kafka, and only a row Kafka refused as its own is a dead letter."""
        if self.failure:
            return
        have = {event_id(message) for message in self.log}
        for row in self.outbox.rows:
            if row.processed and row.id not in have:
                self.failure = f"row {row.id} was marked processed, and Kafka lacks it"
            elif row.dead and row.id not in self.dead_at:
                if row.id not in self.poison and row.id not in self.client_refuses:
                    self.failure = (
                        f"row {row.id} became a dead letter, and Kafka never refused it as its "
                        f"own (last error: {row.last_error})"
                    )
                self.dead_at[row.id] = len(self.log)
        if self.failure:
            raise Violation

    def check_kafka(self) -> None:
        """Each aggregate's rows in order; no row more often than it was claimed."""
        rows = {row.id: row for row in self.outbox.rows}
        seen: set[str] = set()
        counts: Counter[str] = Counter()
        for position, message in enumerate(self.log):
            row_id = event_id(message)
            assert message.topic != DEAD and row_id in rows, f"Kafka holds {row_id}"
            counts[row_id] += 1
            row = rows[row_id]
            overtaken = [
                earlier.id
                for earlier in self.outbox.rows
                if earlier.aggregate_id == row.aggregate_id
                and earlier.seq < row.seq
                and earlier.id not in seen
                and self.dead_at.get(earlier.id, len(self.log) + 1) > position
            ]
            assert not overtaken, (
                f"row {row_id} (aggregate {row.aggregate_id}) reached Kafka at {position} "
                f"before {overtaken}, earlier rows of its aggregate"
            )
            seen.add(row_id)
        more = [row_id for row_id, n in counts.items() if n > self.claims[row_id]]
        assert not more, f"{more} reached Kafka more often than they were claimed"

    def check_quiet(self) -> None:
        """At rest: every row processed (on Kafka) or a dead letter Kafka refused, the last
        copies of each aggregate's rows in order."""
        have = {event_id(message) for message in self.log}
        for row in self.outbox.rows:
            assert row.processed or row.dead, f"at rest, row {row.id} is neither done nor dead"
            assert not row.processed or row.id in have, f"at rest, Kafka lacks row {row.id}"
        last = {event_id(message): position for position, message in enumerate(self.log)}
        for key in {row.aggregate_id for row in self.outbox.rows}:
            done = [r.id for r in self.outbox.rows if r.aggregate_id == key and r.processed]
            positions = [last[row_id] for row_id in done]
            assert positions == sorted(positions), (
                f"at rest, the last copies of aggregate {key}'s rows are out of order: "
                f"{sorted(done, key=last.__getitem__)}"
            )
