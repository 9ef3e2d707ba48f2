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

import pytest
from hypothesis import HealthCheck, Phase, event, note, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    rule,
    run_state_machine_as_test,
)
from simulation import (
    CLOCK,
    Abort,
    Action,
    Crash,
    Fence,
    InlineThread,
    KeepaliveSent,
    LoseConnection,
    Process,
    Refuse,
    Settings,
    Stall,
    Stop,
    Takeover,
    World,
    Write,
)

from cdc_relay import exactly_once, stream

EXAMPLES = int(os.environ.get("CDC_RELAY_SIMULATION_EXAMPLES", "0"))
LONG = EXAMPLES > 0
SIMULATION = settings(
    max_examples=EXAMPLES or 500,
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
        # (README), so there the paused relay is killed instead of resumed.
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
    the next process, the processes run one after the other on the same slot and Kafka."""

    mode = Settings()

    def __init__(self) -> None:
        super().__init__()
        CLOCK.__init__()
        SEARCH.examples += 1
        self.world = World(self.mode)
        self.schedule: list[tuple[int, Action]] = []

    @rule(events=EVENTS, during=DURING)
    def write(self, events: tuple[tuple[str, str], ...], during: int | None) -> None:
        """A transaction (rows, transactional and non-transactional messages, by key)."""
        if during is None:
            self.world.writer.transaction(events)
        else:
            self.schedule.append((during, Write(events)))

    @rule(during=DURING, reply=st.booleans())
    def keepalive(self, during: int | None, reply: bool) -> None:
        if during is None:
            self.world.writer.keepalive(reply)
        else:
            self.schedule.append((during, KeepaliveSent(reply)))

    @rule(data=st.data())
    def fault(self, data: st.DataObject) -> None:
        """A fault at a step of the next process, within what it will have to do."""
        at = data.draw(st.integers(1, self.horizon()), label="at")
        self.arm(at, data.draw(faults(self.mode.exactly_once), label="fault"))

    def arm(self, at: int, action: Action) -> None:
        self.schedule.append((at, action))

    def horizon(self) -> int:
        """About the steps the next process takes: some for each event it will stream."""
        world = self.world
        events = sum(1 for w in world.writer.written if w.end > world.wal.confirmed)
        events += sum(len(a.events) for _, a in self.schedule if isinstance(a, Write))
        return 12 + 10 * events

    @rule()
    def run(self) -> None:
        """A relay process on the slot, from its confirmed position (and exactly once, the
        committed checkpoint), until it ends."""
        process = self.world.process(self.schedule)
        self.schedule = []
        outcome = self.conclude(process)
        if outcome == "drained" and not process.faulted:
            self.world.check_quiet()

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
            event(f"process {outcome}")
            world.trace.append(f"{process.name}: {outcome}")
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
        outcome = self.conclude(world.process())
        assert outcome == "drained", f"the last process ended {outcome}, not drained"
        world.check_kafka()
        world.check_quiet()


@pytest.fixture
def simulated(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The relay on the virtual clock, its start-up inline, its log quiet (a failure prints
    what the processes did instead: ``note``)."""
    caplog.set_level(logging.CRITICAL, logger="cdc_relay")
    monkeypatch.setattr(stream, "time", CLOCK)
    monkeypatch.setattr(exactly_once, "time", CLOCK)
    monkeypatch.setattr(stream, "threading", InlineThread)


MODES = {
    "at-least-once": Settings(),
    "dead-letters": Settings(dead_letters=True),
    "exactly-once": Settings(exactly_once=True, max_events=2),
    "exactly-once-dead-letters": Settings(exactly_once=True, dead_letters=True, max_events=1),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.usefixtures("simulated")
def test_simulation(mode: str) -> None:
    global SEARCH  # one search per test
    SEARCH = Search()
    machine = type(f"Simulation_{mode.replace('-', '_')}", (Simulation,), {"mode": MODES[mode]})
    try:
        run_state_machine_as_test(machine, settings=SIMULATION)
    finally:
        print(SEARCH)  # shown with a failure, and by make simulate
