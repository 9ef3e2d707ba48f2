"""The exactly-once checkpoint: what it says, what a replay skips by it, and how much of it a
relay trusts on another timeline of the server (after a promotion)."""

from __future__ import annotations

from cdc_relay.exactly_once import Checkpoint, Skipper


def skipped(checkpoint: Checkpoint, units: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """For units (position, events) of a replay: how many of each the skipper skips."""
    skipper = Skipper(checkpoint)
    result = []
    for position, events in units:
        skipper.unit(position)
        result.append((position, sum(skipper.skip() for _ in range(events))))
    return result


def test_a_checkpoint_survives_its_encoding_and_reads_the_older_one_without_timeline() -> None:
    checkpoint = Checkpoint(0x3000, 0x3100, 7, timeline=2)
    assert Checkpoint.decode(checkpoint.encode()) == checkpoint
    older = b'{"v": 1, "position": 12288, "partial_position": 0, "partial_events": 0}'
    assert Checkpoint.decode(older) == Checkpoint(12288)


def test_a_replay_skips_the_whole_units_and_the_part_of_the_split_one_kafka_has() -> None:
    units = [(0x1000, 3), (0x2000, 2), (0x3000, 5), (0x4000, 1)]
    assert skipped(Checkpoint(0x2000, 0x3000, 3), units) == [
        (0x1000, 3),
        (0x2000, 2),
        (0x3000, 3),
        (0x4000, 0),
    ]


def test_on_its_own_timeline_or_an_unknown_one_the_checkpoint_is_trusted_whole() -> None:
    checkpoint = Checkpoint(0x5000, 0x6000, 4, timeline=1)
    assert checkpoint.trusted_on(1, confirmed=0x1000) is checkpoint
    assert checkpoint.trusted_on(0, confirmed=0x1000) is checkpoint  # a standby: unknown
    assert Checkpoint(0x5000).trusted_on(2, confirmed=0x1000) == Checkpoint(0x5000)  # older one


def test_on_another_timeline_nothing_past_the_slot_is_skipped() -> None:
    """A checkpoint of the old primary at 0x5000; the new primary's slot at 0x3000 and its
    own transactions after it: none of them may be taken for one Kafka has."""
    checkpoint = Checkpoint(0x5000, 0x6000, 4, timeline=1)
    trusted = checkpoint.trusted_on(2, confirmed=0x3000)
    assert trusted == Checkpoint(0x3000, timeline=2)
    units = [(0x2800, 2), (0x3000, 1), (0x4000, 3), (0x5000, 2), (0x6000, 4)]
    assert skipped(trusted, units) == [
        (0x2800, 2),
        (0x3000, 1),
        (0x4000, 0),
        (0x5000, 0),
        (0x6000, 0),
    ]
    # Before the slot's position the history is shared: what Kafka has there is still skipped.
    behind = Checkpoint(0x2000, 0x2800, 1, timeline=1).trusted_on(2, confirmed=0x3000)
    assert behind == Checkpoint(0x2000, 0x2800, 1, timeline=2)
