"""Stop requests that come before a relay listens for them.

Importing the relay (librdkafka, psycopg) takes a while; a SIGTERM or Ctrl-C meanwhile would
kill the process with the signal's default action. Until a relay installs its own handlers,
one is only remembered here, and the relay then stops before it starts, having confirmed
nothing.
"""

from __future__ import annotations

import signal
from types import FrameType

_requested = False


def _remember(signum: int, frame: FrameType | None) -> None:
    global _requested
    _requested = True


def defer_stops() -> None:
    """Remember SIGTERM and SIGINT from now until a relay installs its handlers."""
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, _remember)


def restore_stops() -> None:
    """Back to the default actions; a stop asked for meanwhile is acted on now."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if _requested:
        signal.raise_signal(signal.SIGTERM)


def stop_requested() -> bool:
    """Whether a stop was asked for before the relay listened."""
    return _requested
