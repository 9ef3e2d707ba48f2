"""Several rounds of one trial as one row: the median of each figure, and each round's.

On a machine whose cores are shared (this bench's services and contestants run on the same
two), one run of a trial can be a quarter off the next one of the same build. ``--rounds N``
runs every trial N times, in turns (round 1 of every contestant and workload, then round 2),
so a slow spell of the machine falls on all of them alike; each figure of a trial is then the
median of its rounds, and each round's main figures stay beside it (``rounds``).
"""

from __future__ import annotations

import statistics
from typing import Any

SUMMED = ("lost", "duplicates")
"""Counted over every round: one round's loss is the trial's."""


def merge(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One row for the rounds ``rows`` of a trial (one round: that row, as it is). A round that
    failed fails the trial, with which round said."""
    if len(rows) == 1:
        return rows[0]
    brief = [_brief(row) for row in rows]
    for number, row in enumerate(rows, 1):
        if row["status"] != "ok":
            return (
                row
                | {"reason": f"round {number} of {len(rows)}: {row['reason']}"}
                | {"rounds": brief}
            )
    merged = dict(rows[0])
    for key, value in rows[0].items():
        if key in SUMMED:
            merged[key] = sum(row.get(key) or 0 for row in rows)
        elif isinstance(value, bool):
            merged[key] = all(row.get(key) for row in rows)
        elif isinstance(value, int | float):
            merged[key] = _median([row.get(key) for row in rows], value)
        elif isinstance(value, dict):
            merged[key] = {
                name: _median([(row.get(key) or {}).get(name) for row in rows], figure)
                for name, figure in value.items()
            }
    return merged | {"rounds": brief}


def _median(values: list[Any], first: Any) -> Any:
    numbers = [v for v in values if isinstance(v, int | float) and not isinstance(v, bool)]
    if not numbers or not isinstance(first, int | float):
        return first
    middle = statistics.median(numbers)
    return round(middle) if isinstance(first, int) else round(middle, 2)


def _brief(row: dict[str, Any]) -> dict[str, Any]:
    """A round's main figures, as the rounds table shows them."""
    latency = row.get("latency_ms") or {}
    return {
        "status": row["status"],
        "events_per_s": row.get("events_per_s"),
        "cpu_s": row.get("cpu_s"),
        "p99_ms": latency.get("p99"),
        "peak_rss_mib": row.get("peak_rss_mib"),
    }
