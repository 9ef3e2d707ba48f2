"""How long a relay waits before trying again: a failed row (the poll relay's ``--backoff-*``)
and PostgreSQL lost (both relays), doubling from a base up to a cap, with jitter so that what
failed together does not come back together."""

from __future__ import annotations

import random
from collections.abc import Callable

RECONNECT_BASE = 0.5  # seconds before reconnecting to PostgreSQL, doubling up to the max
RECONNECT_MAX = 10.0  # seconds: the longest pause before another attempt


def backoff(
    attempts: int, base: float, cap: float, jitter: Callable[[], float] = random.random
) -> float:
    """Seconds before a row that has failed ``attempts`` times is tried again.

    ``base * 2 ** (attempts - 1)``, at most ``cap``, times a random factor in [0.5, 1): rows that
    failed together come back apart, and no wait is shorter than half its step.
    """
    step = min(cap, base * 2.0 ** min(max(attempts - 1, 0), 64))
    return step * (0.5 + jitter() / 2)


def reconnect_delay(failures: int) -> float:
    """Seconds before connecting to PostgreSQL again after ``failures`` failures in a row."""
    return backoff(failures, RECONNECT_BASE, RECONNECT_MAX)
