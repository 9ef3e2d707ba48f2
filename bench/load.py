"""The machine's load average: whether a run measures the relays or the other work sharing the
cores. A full run on a busy machine is refused unless asked for; every run records the load at
its start and end, and one that started busy is reported noisy."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

QUIET = 1.0
"""The highest 1-minute load average at which a run counts as quiet."""

Load = tuple[float, float, float]
"""The 1-, 5- and 15-minute load averages."""


def read() -> Load | None:
    """The load averages now, or None where the system does not tell."""
    try:
        return os.getloadavg()
    except OSError:
        return None


def text(load: Load | None) -> str:
    return "unknown" if load is None else " ".join(f"{value:.2f}" for value in load)


@dataclass(frozen=True)
class Verdict:
    go: bool
    """Whether the run may start."""
    noisy: bool | None
    """Whether the machine was busy at the start (None: its load is unknown)."""
    message: str | None
    """One line for the person who started the run: why it is refused, or a warning."""


def check(load: Load | None, full: Sequence[str], allow_noisy: bool, command: str) -> Verdict:
    """Whether a run may start at this load.

    ``full`` says what makes the run a full one (empty for a small run); ``command`` is the
    run's command line, for the message that tells how to run it anyway.
    """
    if load is None:
        return Verdict(True, None, "warning: the load average cannot be read here")
    minute = load[0]
    if minute <= QUIET:
        return Verdict(True, False, None)
    busy = f"the load average is {minute:.2f} (1 min), above {QUIET:.1f}"
    if not full:
        return Verdict(True, True, f"warning: {busy}; a small run goes on, reported noisy")
    if allow_noisy:
        return Verdict(True, True, f"warning: {busy}; --allow-noisy: the run is reported noisy")
    return Verdict(
        False,
        True,
        f"refused: {busy}, and this is a full run ({'; '.join(full)}): its figures would "
        f"measure the other work on this machine; wait until it is quiet, or run "
        f"`{command} --allow-noisy` to measure anyway (reported noisy)",
    )
