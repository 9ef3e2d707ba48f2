"""The exactly-once checkpoint: what it says, what a replay skips by it, and how much of it a
relay trusts on another timeline of the server (after a promotion); and the transaction
interval that Kafka's transaction timeout allows."""

from __future__ import annotations

import time
from typing import cast

import pytest
from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

from cdc_relay.errors import UsageError
from cdc_relay.kafka import exactly_once
from cdc_relay.kafka.checkpoints import (
    MESSAGE,
    Checkpoint,
    Unit,
    UnreadableCheckpoint,
    _watermarks,
)
from cdc_relay.kafka.exactly_once import (
    BACKLOG_INTERVAL,
    Committer,
    ExactlyOnce,
    Skipper,
    Transactions,
    check_interval,
    fitted,
)
from cdc_relay.lsn import Lsn


def skipped(checkpoint: Checkpoint, units: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """For units (position, events) of a replay: how many of each the skipper skips."""
    skipper = Skipper(checkpoint)
    result = []
    for position, events in units:
        skipper.unit(Unit(position))
        result.append((position, sum(skipper.skip() for _ in range(events))))
    return result


def test_a_checkpoint_survives_its_encoding_and_reads_the_older_one_without_timeline() -> None:
    checkpoint = Checkpoint(Unit(0x3000), Unit(0x3100), 7, timeline=2)
    assert Checkpoint.decode(checkpoint.encode()) == checkpoint
    at_message = Checkpoint(Unit(0x3000, MESSAGE), Unit(0x3000), 2, timeline=2)
    assert Checkpoint.decode(at_message.encode()) == at_message
    # Version 1 named a unit by its LSN alone: read as the message that may end there, so a
    # transaction committing at that LSN is replayed, never skipped unseen.
    older = b'{"v": 1, "position": 12288, "partial_position": 0, "partial_events": 0}'
    assert Checkpoint.decode(older) == Checkpoint(Unit(12288, MESSAGE), Unit(0, MESSAGE))


@pytest.mark.parametrize(
    "record",
    [
        b'{"v": 3, "position": 1, "position_kind": "epoch", "partial_position": 0, '
        b'"partial_events": 0}',
        b'{"v": 2, "position": "far"}',
        b"not json",
        b"[]",
    ],
)
def test_a_checkpoint_record_it_cannot_read_is_one_line_with_the_remedy(record: bytes) -> None:
    with pytest.raises(UnreadableCheckpoint) as failure:
        Checkpoint.decode(record)
    assert "\n" not in str(failure.value)
    assert "transactional id" in str(failure.value)


def test_a_message_and_the_transaction_committing_at_its_lsn_are_two_units() -> None:
    """A non-transactional message ends where the next commit record starts: the message at
    0x2000 comes first, then the transaction committing at 0x2000 (invariant 11). A
    checkpoint after the message and 3 events of that transaction skips exactly those."""
    units = [Unit(0x1000), Unit(0x2000, MESSAGE), Unit(0x2000), Unit(0x3000)]
    assert units == sorted(units)
    checkpoint = Checkpoint(Unit(0x2000, MESSAGE), Unit(0x2000), 3)
    skipper = Skipper(checkpoint)
    result = []
    for unit, events in zip(units, [2, 1, 5, 1], strict=True):
        skipper.unit(unit)
        result.append(sum(skipper.skip() for _ in range(events)))
    assert result == [2, 1, 3, 0]


def test_a_replay_skips_the_whole_units_and_the_part_of_the_split_one_kafka_has() -> None:
    units = [(0x1000, 3), (0x2000, 2), (0x3000, 5), (0x4000, 1)]
    assert skipped(Checkpoint(Unit(0x2000), Unit(0x3000), 3), units) == [
        (0x1000, 3),
        (0x2000, 2),
        (0x3000, 3),
        (0x4000, 0),
    ]


def test_on_its_own_timeline_or_an_unknown_one_the_checkpoint_is_trusted_whole() -> None:
    checkpoint = Checkpoint(Unit(0x5000), Unit(0x6000), 4, timeline=1)
    assert checkpoint.trusted_on(1, confirmed=0x1000) is checkpoint
    assert checkpoint.trusted_on(0, confirmed=0x1000) is checkpoint  # a standby: unknown
    assert Checkpoint(Unit(0x5000)).trusted_on(2, confirmed=0x1000) == Checkpoint(
        Unit(0x5000)
    )  # older one


def test_on_another_timeline_nothing_past_the_slot_is_skipped() -> None:
    """A checkpoint of the old primary at 0x5000; the new primary's slot at 0x3000 and its
    own transactions after it: none of them may be taken for one Kafka has."""
    checkpoint = Checkpoint(Unit(0x5000), Unit(0x6000), 4, timeline=1)
    trusted = checkpoint.trusted_on(2, confirmed=0x3000)
    assert trusted == Checkpoint(Unit(0x3000, MESSAGE), timeline=2)
    units = [(0x2800, 2), (0x3000, 1), (0x4000, 3), (0x5000, 2), (0x6000, 4)]
    # A transaction committing at 0x3000 ends past the slot's position: replayed, not skipped.
    assert skipped(trusted, units) == [
        (0x2800, 2),
        (0x3000, 0),
        (0x4000, 0),
        (0x5000, 0),
        (0x6000, 0),
    ]
    # Before the slot's position the history is shared: what Kafka has there is still skipped.
    behind = Checkpoint(Unit(0x2000), Unit(0x2800), 1, timeline=1).trusted_on(2, confirmed=0x3000)
    assert behind == Checkpoint(Unit(0x2000), Unit(0x2800), 1, timeline=2)


class _Transactions:
    """What the committer asks of the transactional sink: the open transaction's size and
    age, and its commit with a checkpoint (recorded here)."""

    def __init__(self) -> None:
        self.events = 0
        self.opened = 0.0
        self.commits: list[Checkpoint] = []

    def commit(self, checkpoint: Checkpoint) -> None:
        self.commits.append(checkpoint)
        self.events = 0


def committer(checkpoint: Checkpoint, timeline: int = 1) -> tuple[Committer, _Transactions]:
    sink = _Transactions()
    eos = Committer(ExactlyOnce("cdc-relay-slot", "checkpoints"), cast(Transactions, sink))
    eos.timeline = timeline
    eos.trust(checkpoint, confirmed=0)
    return eos, sink


def first_skipped(eos: Committer, position: Lsn) -> bool:
    """Whether the first event of the unit at ``position`` is skipped as in Kafka already."""
    eos.unit_begins(Unit(position))
    return eos.skip()


def test_the_committer_replays_past_its_checkpoint_and_commits_where_the_stream_is() -> None:
    """A relay restarted at the slot (0x1000) whose checkpoint reaches 0x2000 and 3 events of
    the unit at 0x3000: it skips those, produces the rest, and each commit's checkpoint says
    exactly how far the produced events reach, a split unit by its count."""
    eos, sink = committer(Checkpoint(Unit(0x2000), Unit(0x3000), 3, timeline=1))
    produced = []
    for position, events in [(0x1000, 2), (0x2000, 1), (0x3000, 5), (0x4000, 2)]:
        eos.unit_begins(Unit(position))
        for n in range(events):
            if not eos.skip():
                eos.produced()
                produced.append((position, n))
        if position == 0x3000:
            sink.events = 2
            eos.commit()  # in the middle of a unit: 3 skipped + 2 produced of it are in
        eos.unit_ends()
    assert produced == [(0x3000, 3), (0x3000, 4), (0x4000, 0), (0x4000, 1)]
    assert not eos.replaying
    sink.events = 2
    eos.commit()
    assert sink.commits == [
        Checkpoint(Unit(0x2000), Unit(0x3000), 5, 1),
        Checkpoint(Unit(0x4000), timeline=1),
    ]
    assert eos.committed == Checkpoint(Unit(0x4000), timeline=1)


def test_after_a_reconnect_the_committer_skips_what_it_committed_itself() -> None:
    eos, sink = committer(Checkpoint())
    for position in (0x1000, 0x2000):
        eos.unit_begins(Unit(position))
        assert not eos.skip()
        eos.produced()
        eos.unit_ends()
    sink.events = 2
    eos.commit()
    eos.restart()  # the connection was lost: the stream comes again from the slot
    assert eos.replaying
    assert first_skipped(eos, 0x1000)
    assert not first_skipped(eos, 0x3000)
    assert not eos.replaying


def test_a_committer_on_a_new_timeline_trusts_its_checkpoint_only_up_to_the_slot() -> None:
    """Reconnected to a promoted server: the checkpoint held (timeline 1) reaches 0x5000, the
    slot there 0x2000; WAL past it may be the new primary's own, and must not be skipped."""
    eos, _ = committer(Checkpoint(Unit(0x5000), timeline=1))
    assert eos.committed == Checkpoint(Unit(0x5000), timeline=1)
    eos.timeline = 2
    assert not eos.trust(eos.committed, confirmed=0x2000)
    assert eos.committed == Checkpoint(Unit(0x2000, MESSAGE), timeline=2)
    assert first_skipped(eos, 0x1800)
    # A transaction committing at the slot's position ends past it: the new primary's.
    assert not first_skipped(eos, 0x2000)
    assert not eos.replaying


def test_a_commit_is_due_when_the_transaction_is_old_or_large_enough() -> None:
    eos, sink = committer(Checkpoint())
    assert not eos.due(force=True)  # nothing open
    sink.events, sink.opened = 1, time.monotonic()
    assert not eos.due()
    assert eos.due(force=True)
    sink.events = eos.eos.max_events
    assert eos.due()
    sink.events, sink.opened = 1, time.monotonic() - eos.eos.interval
    assert not eos.due()  # busy since it began: a backlog, which larger transactions drain
    sink.opened = time.monotonic() - eos.eos.backlog_after
    assert eos.due()


@pytest.mark.parametrize(
    ("interval", "config"),
    [
        (30.001, {}),  # more than half of the default 60 s
        (60.0, {}),  # the longest --transaction-interval takes
        (5.0, {"transaction.timeout.ms": "9000"}),
    ],
)
def test_an_interval_the_transaction_timeout_cuts_short_is_refused(
    interval: float, config: dict[str, str]
) -> None:
    with pytest.raises(UsageError) as refused:
        check_interval(config, interval)
    message = str(refused.value)
    assert "\n" not in message
    assert "transaction.timeout.ms" in message
    assert f"use at most {int(config.get('transaction.timeout.ms', 60000)) / 2000:g} s" in message


@pytest.mark.parametrize(
    ("interval", "config"),
    [
        (0.1, {}),  # the default
        (30.0, {}),
        (60.0, {"transaction.timeout.ms": "900000"}),
        (1.0, {"transaction.timeout.ms": "not a number"}),  # librdkafka says why at start
    ],
)
def test_an_interval_within_half_the_transaction_timeout_passes(
    interval: float, config: dict[str, str]
) -> None:
    check_interval(config, interval)


class LeaderlessPartition:
    """The consumer's answer to the watermarks of a partition whose leader is being elected:
    confluent-kafka raises KafkaException(KafkaError(code)) for ``answers`` codes in turn (as
    its get_watermark_offsets does, never marked retriable), then the watermarks."""

    def __init__(self, *answers: int) -> None:
        self.answers = list(answers)
        self.asked = 0

    def get_watermark_offsets(self, partition: object, timeout: float) -> tuple[int, int]:
        self.asked += 1
        if self.answers:
            raise KafkaException(KafkaError(self.answers.pop(0)))
        return 0, 7


def test_the_watermarks_of_a_partition_without_a_leader_yet_are_asked_again() -> None:
    consumer = LeaderlessPartition(
        KafkaError.NOT_LEADER_FOR_PARTITION, KafkaError.LEADER_NOT_AVAILABLE
    )
    watermarks = _watermarks(cast(Consumer, consumer), TopicPartition("t", 0), time.monotonic() + 5)
    assert watermarks == (0, 7)
    assert consumer.asked == 3


def test_a_refusal_of_the_watermarks_is_not_asked_again() -> None:
    consumer = LeaderlessPartition(KafkaError.TOPIC_AUTHORIZATION_FAILED)
    with pytest.raises(KafkaException) as raised:
        _watermarks(cast(Consumer, consumer), TopicPartition("t", 0), time.monotonic() + 5)
    assert raised.value.args[0].code() == KafkaError.TOPIC_AUTHORIZATION_FAILED
    assert consumer.asked == 1


def test_a_partition_still_without_a_leader_at_the_deadline_is_an_error() -> None:
    consumer = LeaderlessPartition(*[KafkaError.NOT_LEADER_FOR_PARTITION] * 100)
    started = time.monotonic()
    with pytest.raises(KafkaException):
        _watermarks(cast(Consumer, consumer), TopicPartition("t", 0), started + 0.5)
    assert time.monotonic() - started < 1.0


class OpenTransaction:
    """The exactly-once sink as Committer.due reads it: events open since ``opened``."""

    def __init__(self, events: int, age: float, now: float | None = None) -> None:
        self.events = events
        self.opened = (time.monotonic() if now is None else now) - age


@pytest.mark.parametrize(
    ("events", "age", "idle", "due"),
    [
        (0, 100.0, True, False),  # nothing open: nothing to commit
        (5, 1.0, False, False),  # young, and more is coming
        (5, 1.0, True, False),  # young: a commit every few events would load the broker
        (5, 4.0, False, False),  # the stream is busy: more events may join it
        (5, 4.0, True, True),  # idle past a quarter of the interval: waiting adds latency
        (5, 11.0, False, True),  # past the interval
        (10, 0.0, False, True),  # max_events
    ],
)
def test_a_transaction_commits_past_its_interval_or_a_quarter_of_it_once_the_stream_idles(
    events: int, age: float, idle: bool, due: bool
) -> None:
    eos = ExactlyOnce("test", interval=10.0, max_events=10)
    committer = Committer(eos, cast(Transactions, OpenTransaction(events, age)))
    assert committer.due(idle=idle) is due
    assert committer.due(force=True) is (events > 0)


class Clock:
    """time, as exactly_once reads it: ``monotonic`` moved by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


@pytest.mark.parametrize(
    ("looks", "age", "due"),
    [
        ([], 2.0, False),  # busy since it began: a backlog, whose transactions grow
        ([], 5.0, True),  # up to backlog_interval
        ([True], 2.0, True),  # idle once (young then): it keeps up, the interval holds
        ([True, False, False], 2.0, True),
        ([False, False], 2.0, False),
    ],
)
def test_a_transaction_stays_open_longer_while_the_relay_drains_a_backlog(
    looks: list[bool], age: float, due: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = Clock()
    monkeypatch.setattr(exactly_once, "time", clock)
    eos = ExactlyOnce("test", interval=1.0, max_events=1000, backlog_interval=5.0)
    assert eos.backlog_after == 5.0
    committer = Committer(eos, cast(Transactions, OpenTransaction(5, 0.0, clock.now)))
    clock.now += 0.1
    for idle in looks:
        assert not committer.due(idle=idle)  # 0.1 s old: young, idle or not
    clock.now += age - 0.1
    assert committer.due(idle=False) is due


def test_an_idle_look_counts_for_its_own_transaction_only(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = Clock()
    monkeypatch.setattr(exactly_once, "time", clock)
    eos = ExactlyOnce("test", interval=1.0, max_events=1000, backlog_interval=5.0)
    transaction = OpenTransaction(5, 0.0, clock.now)
    committer = Committer(eos, cast(Transactions, transaction))
    assert not committer.due(idle=True)  # the relay idles in the first transaction
    clock.now += 0.01
    transaction.opened = clock.now  # it commits; the next one is busy all along
    clock.now += 2.0
    assert not committer.due(idle=False)
    clock.now += 3.0
    assert committer.due(idle=False)


@pytest.mark.parametrize(
    ("config", "backlog_after"),
    [
        ({}, BACKLOG_INTERVAL),  # the default 60 s
        ({"transaction.timeout.ms": "5000"}, 0.5),
        ({"transaction.timeout.ms": "1000"}, 0.1),  # librdkafka's least: a tenth of it
        ({"transaction.timeout.ms": "not a number"}, BACKLOG_INTERVAL),  # librdkafka says
    ],
)
def test_a_transaction_of_a_backlog_leaves_most_of_the_transaction_timeout_to_its_commit(
    config: dict[str, str], backlog_after: float
) -> None:
    assert fitted(ExactlyOnce("test"), config).backlog_after == pytest.approx(backlog_after)
    assert fitted(ExactlyOnce("test", interval=0.3), config).backlog_after >= 0.3


def test_the_backlog_interval_is_never_shorter_than_the_interval() -> None:
    assert ExactlyOnce("test", interval=2.0).backlog_after == 2.0
    assert ExactlyOnce("test").backlog_after == BACKLOG_INTERVAL > ExactlyOnce("test").interval
