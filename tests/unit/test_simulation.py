"""A model-based simulation of the stream relay: the real loop, generated WAL shapes and
faults at any step, an oracle after every step (ARCHITECTURE.md, "The simulation").

Hypothesis's stateful testing drives it: each rule writes to the database, arms a fault at a
step of the next relay process, or runs one; a failing run shrinks to a minimal schedule,
which Hypothesis prints as the rules that make it (and ``note`` what the processes did).
What runs is the real code: ``StreamRelay.stream`` with the pipeline, the stream's units,
skips and checkpoints, the LSN tracker, ``Rewinds`` and ``DeadLetterRefusals``, exactly
once's ``Committer``; the stages are in memory (simulation.py), on a virtual clock, in one
thread, so a schedule always gives the same run.

``make test`` runs a bounded number of examples of each mode, derandomized;
``make simulate`` runs many more (SIMULATION_EXAMPLES, SIMULATION_SEED).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field

import memory_outbox
import pytest
from hypothesis import HealthCheck, Phase, currently_in_test_context, event, note, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from poll_simulation import AddRows, AnotherPoller, PollAction, PollProcess, PollWorld
from simulation import (
    CLOCK,
    DATABASE,
    KNOWN_OPEN,
    PSYCOPG,
    Abort,
    Action,
    Crash,
    Fence,
    InlineThread,
    KeepaliveSent,
    LoseConnection,
    Process,
    Refuse,
    Reshard,
    Settings,
    SimConnection,
    Slot,
    Stall,
    Stop,
    Takeover,
    World,
    Write,
)

from cdc_relay.kafka import exactly_once
from cdc_relay.lsn import format_lsn
from cdc_relay.metrics import LATENCY
from cdc_relay.postgres import messages
from cdc_relay.relay import (
    cut,
    kafka_transactions,
    losses,
    preflight,
    records,
    slot_connection,
    standby,
    status,
    stream,
    worker,
)

EXAMPLES = int(os.environ.get("CDC_RELAY_SIMULATION_EXAMPLES", "0"))
LONG = EXAMPLES > 0
SIMULATION = settings(
    max_examples=EXAMPLES or 200,
    stateful_step_count=25,
    deadline=None,
    derandomize=not LONG,  # the bounded run: the same examples on every machine
    database=None,
    print_blob=True,
    report_multiple_bugs=False,  # the first failure, shrunk: one schedule to read
    # No explain phase: it traces every line the relay runs, for minutes.
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink],
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)

KEYS = st.sampled_from("abc")
EVENTS = st.lists(
    st.tuples(st.sampled_from(["row", "txmsg", "msg"]), KEYS), min_size=1, max_size=7
).map(tuple)
DURING = st.none() | st.integers(1, 100)  # before the next process starts, or at its step


def faults(exactly: bool) -> st.SearchStrategy[Action]:
    common: list[st.SearchStrategy[Action]] = [
        st.builds(Crash, st.integers(0, 3)),
        st.just(LoseConnection()),
        st.just(Stop()),
        st.builds(Stall, st.integers(1, 60)),
        st.builds(Refuse, st.integers(0, 60), st.sampled_from(["culprit", "client", "transient"])),
    ]
    if exactly:
        # Fenced, a relay that was paused while a standby took over cannot add to Kafka when
        # it resumes; at least once, it may deliver what its producer held before it notices
        # (docs/exactly-once.md), so there the paused relay is killed instead of resumed.
        common += [st.just(Abort()), st.just(Fence()), st.builds(Takeover, st.integers(0, 2))]
    else:
        common.append(st.builds(Takeover, st.integers(0, 2), st.booleans()))
    return st.one_of(common)


@dataclass
class Search:
    """How the search went: examples run, and the first failure's (before shrinking)."""

    started: float = field(default_factory=time.monotonic)
    examples: int = 0
    first_failure: tuple[int, float] | None = None  # (example, seconds)

    def failed(self) -> None:
        if self.first_failure is None:
            self.first_failure = (self.examples, time.monotonic() - self.started)

    def __str__(self) -> str:
        took = f"{self.examples} examples in {time.monotonic() - self.started:.1f} s"
        if self.first_failure is None:
            return f"simulation: {took}, no failure"
        example, seconds = self.first_failure
        return f"simulation: {took}; the first failure at example {example}, after {seconds:.1f} s"


SEARCH = Search()


class Simulation(RuleBasedStateMachine):
    """The relay's world (simulation.World): what the database writes, the faults armed for
    the next process of a slot, the processes run one after the other on the slot and
    Kafka."""

    mode = Settings()

    def __init__(self) -> None:
        super().__init__()
        CLOCK.__init__()
        SEARCH.examples += 1
        self.world = World(self.mode)

    def schedule(self, slot: Slot | None = None) -> list[tuple[int, Action]]:
        """What is armed for the next process of ``slot`` (the first slot by default)."""
        return self.world.schedules.setdefault((slot or self.world.slot).name, [])

    @rule(events=EVENTS, during=DURING)
    def write(self, events: tuple[tuple[str, str], ...], during: int | None) -> None:
        """A transaction (rows, transactional and non-transactional messages, by key)."""
        if during is None:
            self.world.writer.transaction(events)
        else:
            self.schedule().append((during, Write(events)))

    @rule(during=DURING, reply=st.booleans())
    def keepalive(self, during: int | None, reply: bool) -> None:
        if during is None:
            self.world.writer.keepalive(reply)
        else:
            self.schedule().append((during, KeepaliveSent(reply)))

    @rule(on=st.booleans())
    def linger(self, on: bool) -> None:
        """From now on the producer holds its batches for linger.ms (a poll reports nothing
        until then, a flush sends at once), or sends each at once."""
        self.world.linger = on

    @rule(data=st.data())
    def fault(self, data: st.DataObject) -> None:
        """A fault at a step of the next process, within what it will have to do."""
        self.arm_fault(data, self.world.slot)

    def arm_fault(self, data: st.DataObject, slot: Slot) -> None:
        at = data.draw(st.integers(1, self.horizon(slot)), label="at")
        self.schedule(slot).append((at, data.draw(faults(self.mode.exactly_once), label="fault")))

    def horizon(self, slot: Slot) -> int:
        """About the steps the next process takes: some for each event it will stream."""
        world = self.world
        events = sum(1 for w in world.writer.written if w.end > slot.wal.confirmed)
        events += sum(len(a.events) for _, a in self.schedule(slot) if isinstance(a, Write))
        return 12 + 10 * events

    @rule()
    def run(self) -> None:
        """A relay process on the slot, from its confirmed position (and exactly once, the
        committed checkpoint), until it ends."""
        self.run_on(self.world.slot)

    def run_on(self, slot: Slot) -> str:
        process = self.world.process(self.world.schedules.pop(slot.name, []), slot)
        outcome = self.conclude(process)
        if outcome == "drained" and not process.faulted and not self.mode.shards:
            self.world.check_quiet()
        return outcome

    def conclude(self, process: Process) -> str:
        """Run ``process``; note what happened, for the report of a failing schedule."""
        world = self.world
        outcome = "failed"
        try:
            outcome = process.run()
        except BaseException:
            SEARCH.failed()
            raise
        finally:
            world.trace.append(f"{process.name}: {outcome}")
            if currently_in_test_context():  # not in the schedules replayed below
                event(f"process {outcome}")
                note("\n".join(world.trace))
            world.trace.clear()
        return outcome

    @invariant()
    def kafka_in_order(self) -> None:
        self.world.check_kafka()

    def teardown(self) -> None:
        """The operator fixes what Kafka refused; a last process drains the stream."""
        world = self.world
        if not world.writer.written or world.failure:
            return
        if not self.mode.dead_letters:
            world.fix([*world.poison, *world.client_refuses])
        world.schedules.clear()
        outcome = self.conclude(world.process())
        assert outcome == "drained", f"the last process ended {outcome}, not drained"
        world.check_kafka()
        world.check_quiet()


class ReshardSimulation(Simulation):
    """A resharding from one slot (``old``) to two shards: the new slots exist and their
    publications say they start after the cut; the rules emit and commit the cut (with
    transactions committed in between, before it), and run relays of either side, a new
    shard running the old shard's relay when it waits for it at the cut."""

    @rule(data=st.data(), shard=st.integers(0, 1))
    def fault_on_new(self, data: st.DataObject, shard: int) -> None:
        """A fault at a step of the next process of a new shard."""
        self.arm_fault(data, self.world.slots[1 + shard])

    @rule(shard=st.integers(0, 1))
    def run_new(self, shard: int) -> None:
        """A relay of a new shard."""
        self.run_on(self.world.slots[1 + shard])

    @precondition(lambda self: self.reshard.message is None)
    @rule()
    def emit_cut(self) -> None:
        """reshard's transaction emits the cut message."""
        self.world.writer.emit_cut()

    @precondition(lambda self: self.reshard.message is not None and self.reshard.commit is None)
    @rule()
    def commit_cut(self) -> None:
        """reshard's transaction commits: the transactions committed since its message are
        before the cut."""
        self.world.writer.commit_cut()

    @property
    def reshard(self) -> Reshard:
        reshard = self.world.writer.reshard
        assert reshard is not None
        return reshard

    def teardown(self) -> None:
        """The operator fixes what Kafka refused and finishes the resharding: the old shard's
        relay stops at the cut, each new shard relays the rest."""
        world = self.world
        if world.failure:
            return
        if not self.mode.dead_letters:
            world.fix([*world.poison, *world.client_refuses])
        world.schedules.clear()
        if self.reshard.message is None:
            self.emit_cut()
        if self.reshard.commit is None:
            self.commit_cut()
        old = self.run_on(world.slot)
        assert old in ("stopped", "drained"), f"the old shard's last relay ended {old}"
        for slot in world.slots[1:]:
            outcome = self.run_on(slot)
            assert outcome == "drained", f"the last relay of {slot.name} ended {outcome}"
        world.check_kafka()
        world.check_quiet(world.slots[1:])
        commit = self.reshard.commit
        assert commit is not None and world.slot.wal.confirmed >= commit, (
            f"the old slot stopped at {format_lsn(world.slot.wal.confirmed)}, before the cut"
        )


class PollSimulation(RuleBasedStateMachine):
    """The poll relay's world (poll_simulation.PollWorld): the application adds rows, faults
    are armed for the next poll process, processes run one after the other on the outbox
    (and another poller beside one of them, as a fault)."""

    def __init__(self) -> None:
        super().__init__()
        CLOCK.__init__()
        SEARCH.examples += 1
        self.world = PollWorld()
        self.schedule: list[tuple[int, PollAction]] = []

    @rule(on=st.booleans())
    def linger(self, on: bool) -> None:
        """From now on the producer holds its batches for linger.ms, or sends each at once."""
        self.world.linger = on

    @rule(key=KEYS, count=st.integers(1, 5), during=DURING)
    def add(self, key: str, count: int, during: int | None) -> None:
        """``count`` rows of aggregate ``key``."""
        if during is None:
            self.world.add(key, count)
        else:
            self.schedule.append((during, AddRows(key, count)))

    @rule(data=st.data())
    def fault(self, data: st.DataObject) -> None:
        """A fault at a step of the next process, within what it will have to do."""
        world = self.world
        pending = sum(1 for row in world.outbox.rows if not (row.processed or row.dead))
        at = data.draw(st.integers(1, 12 + 8 * pending), label="at")
        fault = data.draw(
            st.one_of(
                st.builds(Crash, st.integers(0, 3)),
                st.just(LoseConnection()),
                st.just(Stop()),
                st.builds(Stall, st.integers(1, 60)),
                st.builds(
                    Refuse, st.integers(0, 60), st.sampled_from(["culprit", "client", "transient"])
                ),
                st.builds(AnotherPoller, st.integers(1, 60)),
            ),
            label="fault",
        )
        self.schedule.append((at, fault))

    @rule()
    def run(self) -> None:
        """A poll process on the outbox, until it ends."""
        process = self.world.process(self.schedule)
        self.schedule = []
        if self.conclude(process) == "drained" and not process.faulted:
            self.world.check_quiet()

    def conclude(self, process: PollProcess) -> str:
        world = self.world
        outcome = "failed"
        try:
            outcome = process.run()
        except BaseException:
            SEARCH.failed()
            raise
        finally:
            world.trace.append(f"{process.name}: {outcome}")
            if currently_in_test_context():
                event(f"process {outcome}")
                note("\n".join(world.trace))
            world.trace.clear()
        return outcome

    @invariant()
    def kafka_in_order(self) -> None:
        self.world.check_kafka()

    def teardown(self) -> None:
        """A last process works the outbox off: a row Kafka refuses as its own becomes a dead
        letter after --max-attempts."""
        world = self.world
        if not world.outbox.rows or world.failure:
            return
        outcome = self.conclude(world.process())
        assert outcome == "drained", f"the last process ended {outcome}, not drained"
        world.check_kafka()
        world.check_quiet()


@pytest.fixture
def simulated(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The relay on the virtual clock, its start-up inline, its log quiet (a failure prints
    what the processes did instead: ``note``)."""
    caplog.set_level(logging.CRITICAL, logger="cdc_relay")
    # The stream relay's parts that read the clock.
    for module in (stream, records, standby, slot_connection, status, losses):
        monkeypatch.setattr(module, "time", CLOCK)
    monkeypatch.setattr(exactly_once, "time", CLOCK)
    monkeypatch.setattr(kafka_transactions, "threading", InlineThread)
    monkeypatch.setattr(worker, "time", CLOCK)
    monkeypatch.setattr(memory_outbox, "time", CLOCK)
    # The database the relay asks besides the stream (a new shard: the cut, the old slot).
    for module in (cut, preflight):
        monkeypatch.setattr(module, "connect", DATABASE.connect)
    monkeypatch.setattr(standby, "reconnecting", DATABASE.connect)
    monkeypatch.setattr(messages, "psycopg", PSYCOPG)


MODES = {
    "poll": Settings(),  # PollSimulation's
    "at-least-once": Settings(),
    "resharding": Settings(shards=True),
    "dead-letters": Settings(dead_letters=True),
    "exactly-once": Settings(exactly_once=True, max_events=2),
    "exactly-once-dead-letters": Settings(exactly_once=True, dead_letters=True, max_events=1),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.usefixtures("simulated")
def test_simulation(mode: str) -> None:
    global SEARCH  # one search per test
    SEARCH = Search()
    base: type[RuleBasedStateMachine] = Simulation
    if mode == "poll":
        base = PollSimulation
    elif MODES[mode].shards:
        base = ReshardSimulation
    machine = type(f"Simulation_{mode.replace('-', '_')}", (base,), {"mode": MODES[mode]})
    observed, total = _latencies()
    flowed = SimConnection.flowed
    try:
        run_state_machine_as_test(machine, settings=SIMULATION)
    finally:
        print(SEARCH)  # shown with a failure, and by make simulate
    if mode != "poll":
        # Every clock the relay reads is the virtual one, the commit-to-ack latency's too.
        count, seconds = _latencies()
        assert count > observed
        assert (seconds - total) / (count - observed) < 3600
        # The stream's messages were handled several in one go too (reading.py), between
        # its ticks: faults fell amid such runs, not only between one message and the next.
        assert SimConnection.flowed > flowed


def _latencies() -> tuple[float, float]:
    """How many commit-to-ack latencies the stream relay observed, and their sum."""
    samples = {s.name: s.value for metric in LATENCY.collect() for s in metric.samples}
    return samples[f"{LATENCY._name}_count"], samples[f"{LATENCY._name}_sum"]


# -- schedules the search found, replayed ------------------------------------------------------
#
# Each is the shrunk schedule of a defect the simulation found, made robust to how many steps
# the code takes: the fault is tried at every step of the process.


def machine(mode: str) -> Simulation:
    base = ReshardSimulation if MODES[mode].shards else Simulation
    return type(f"Replay_{mode.replace('-', '_')}", (base,), {"mode": MODES[mode]})()


@pytest.mark.usefixtures("simulated")
@pytest.mark.parametrize("mode", ["exactly-once", "exactly-once-dead-letters"])
def test_a_transaction_sharing_its_position_with_a_message_is_not_skipped(mode: str) -> None:
    """Issue 24, defect 1, as the search shrank it (exactly-once at example 126): a
    transaction whose last event is a non-transactional message, which therefore has the LSN
    where the commit record starts and is streamed first; the connection lost at any step.
    Before exactly once named units by kind, a checkpoint "P, and k events of the transaction
    at P" made the replay skip the rest of the transaction: the slot confirmed past e3."""
    for at in range(1, 40):
        state = machine(mode)
        state.write(events=(("row", "a"), ("row", "a"), ("row", "a"), ("msg", "a")), during=None)
        state.schedule().append((at, LoseConnection()))
        state.run()
        state.kafka_in_order()
        state.teardown()


@pytest.mark.usefixtures("simulated")
def test_a_new_shard_waits_for_what_commits_between_the_cut_message_and_its_commit() -> None:
    """Issue 24, defect 3, as the search shrank it (resharding at example 253, with the cut
    placed at its message again): two events of one aggregate commit between the cut
    message and the cut's commit, the second refused by Kafka on the old shard. The old
    relay delivers the first (its slot passes the cut message) and stops at the refusal; the
    new shard must not pass the cut until the old relay, restarted, delivered the second.
    With the cut at its message it passed: its slot was confirmed past e2, which Kafka
    never had."""
    state = machine("resharding")
    state.emit_cut()
    state.write(events=(("row", "a"),), during=None)
    state.write(events=(("row", "a"),), during=None)
    state.commit_cut()
    state.schedule(state.world.slots[2]).append((1, Refuse(1, "culprit")))
    state.run_new(shard=1)
    state.kafka_in_order()
    state.teardown()


@pytest.mark.usefixtures("simulated")
def test_a_relay_that_lost_its_connection_delivers_no_stale_queue_after_a_takeover() -> None:
    """Issue 24, item 7 (at least once): Kafka away, the replication connection lost, and a
    standby taking the slot over while the relay reconnects; Kafka back, the relay must not
    deliver what its producer held after the standby's newer events (e1, e2, e3, e4, then
    e1, e2 again: a compacted topic ends on e2). Fails on the code that drained the queue on
    a lost connection; the takeover is tried at every step after the loss."""
    for at in range(12, 40):
        state = machine("at-least-once")
        state.write(events=(("row", "a"), ("row", "a")), during=None)
        state.write(events=(("row", "a"), ("row", "a")), during=None)
        state.schedule().extend(
            [(2, Stall(300)), (12, LoseConnection()), (at, Takeover(0, resume=True))]
        )
        state.run()
        state.kafka_in_order()
        state.teardown()


@pytest.mark.usefixtures("simulated")
def test_a_refusal_during_the_graceful_stop_ends_it_with_its_stop_line() -> None:
    """Found by make simulate (exactly-once-dead-letters, 333rd example): a keepalive, two
    non-transactional messages, the first refused for good by Kafka, SIGTERM while its
    refusal is on its way. The stop's drain serves the report in _maybe_commit, and
    Rewinds.served raises pipeline.Rewind out of shutdown: the relay exits with a traceback,
    without its final status or stop line. (Nothing is lost: nothing was confirmed.) Now the
    stop goes on: no commit while a refusal is reported, the stop line, exit as asked."""
    assert "rewind out of the stop" not in KNOWN_OPEN  # the process must end as the relay does
    for at in range(2, 20):
        state = machine("exactly-once-dead-letters")
        state.keepalive(during=None, reply=False)
        state.write(events=(("msg", "a"), ("msg", "a")), during=None)
        state.schedule().extend([(1, Refuse(0, "culprit")), (at, Stop())])
        state.run()
        state.teardown()
