from __future__ import annotations

from datetime import timedelta

import click
import pytest

from cdc_relay.commands import options
from cdc_relay.relay.backoff import backoff


def test_backoff_doubles_with_each_attempt_up_to_the_cap() -> None:
    def top(attempts: int) -> float:  # the jitter's highest draw
        return backoff(attempts, base=1.0, cap=300.0, jitter=lambda: 1.0)

    assert [top(n) for n in range(1, 11)] == [1, 2, 4, 8, 16, 32, 64, 128, 256, 300]
    assert top(1_000_000) == 300  # no overflow however many attempts


def test_backoff_jitter_keeps_at_least_half_of_the_step() -> None:
    assert backoff(4, base=0.5, cap=60, jitter=lambda: 0.0) == 2.0
    assert backoff(4, base=0.5, cap=60, jitter=lambda: 0.5) == 3.0
    assert backoff(20, base=0.5, cap=60, jitter=lambda: 0.0) == 30.0


def test_backoff_spreads_rows_that_failed_together() -> None:
    delays = [backoff(3, base=1.0, cap=300.0) for _ in range(200)]
    assert all(2.0 <= d < 4.0 for d in delays)
    assert len(set(delays)) > 150  # not one instant for all of them


def test_backoff_of_a_first_failure_is_the_base() -> None:
    assert backoff(1, base=1.5, cap=300, jitter=lambda: 1.0) == 1.5
    assert backoff(0, base=1.5, cap=300, jitter=lambda: 1.0) == 1.5  # never below the base


@pytest.mark.parametrize(
    ("text", "age"),
    [
        ("90s", timedelta(seconds=90)),
        ("30m", timedelta(minutes=30)),
        ("12h", timedelta(hours=12)),
        ("7d", timedelta(days=7)),
        ("2w", timedelta(weeks=2)),
        ("1.5d", timedelta(hours=36)),
    ],
)
def test_prune_ages(text: str, age: timedelta) -> None:
    assert (
        options.age(click.Context(click.Command("prune")), click.Option(["--older-than"]), text)
        == age
    )


@pytest.mark.parametrize("text", ["7", "d", "7x", "-1d", "seven days", ""])
def test_prune_ages_that_are_not(text: str) -> None:
    with pytest.raises(click.BadParameter, match="is not an age"):
        options.age(click.Context(click.Command("prune")), click.Option(["--older-than"]), text)
