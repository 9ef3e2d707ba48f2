"""Which event a sink warns about when Kafka does not answer for it (cdc_relay.kafka.overdue)."""

from __future__ import annotations

import pytest

from cdc_relay.kafka.overdue import Overdue


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def test_the_longest_watched_message_is_told_once_it_waited_longer_than_the_bound() -> None:
    clock = Clock()
    overdue: Overdue[str] = Overdue(after=5.0, every=30.0, clock=clock)
    overdue.watch("t.a", "a1")
    clock.advance(1.0)
    overdue.watch("t.b", "b1")
    clock.advance(3.9)
    assert overdue.due() is None
    clock.advance(0.2)
    assert overdue.due() == (pytest.approx(5.1), "t.a", "a1")
    assert overdue.due() is None  # told: not again at once
    overdue.answered("t.a")
    clock.advance(29.0)
    assert overdue.due() is None  # at most one line every 30 s
    clock.advance(1.0)
    assert overdue.due() == (pytest.approx(34.1), "t.b", "b1")


def test_an_answered_topic_watches_its_next_message() -> None:
    clock = Clock()
    overdue: Overdue[str] = Overdue(after=5.0, every=30.0, clock=clock)
    overdue.watch("t.a", "a1")
    clock.advance(4.0)
    overdue.answered("t.a")
    overdue.answered("t.a")  # a second report changes nothing
    assert "t.a" not in overdue.watched
    overdue.watch("t.a", "a2")
    clock.advance(4.0)
    assert overdue.due() is None  # a2 has waited 4 s, not 8
    clock.advance(1.0)
    assert overdue.due() == (pytest.approx(5.0), "t.a", "a2")


def test_clear_forgets_what_is_watched() -> None:
    """The producer holds nothing any more (purged, closed): no report will come for it."""
    clock = Clock()
    overdue: Overdue[str] = Overdue(after=5.0, every=30.0, clock=clock)
    overdue.watch("t.a", "a1")
    overdue.clear()
    clock.advance(10.0)
    assert overdue.due() is None
    overdue.watch("t.a", "a2")
    clock.advance(5.0)
    assert overdue.due() == (pytest.approx(5.0), "t.a", "a2")
