"""The stream relay's lost connections, counted toward its stop: the server ending the stream
with one error again and again, with no progress between, is the user's to fix (a publication
it cannot find, a role without REPLICATION), and stops the relay with one line; a connection
that merely fails is waited out (a restart, a failover). How often to retry meanwhile is the
relay's (stream.StreamRelay.recover backs off by ``in_a_row``)."""

from __future__ import annotations

import time

from cdc_relay.errors import RelayError
from cdc_relay.lsn import Lsn, format_lsn
from cdc_relay.postgres.replication import ConnectionLost
from cdc_relay.relay.lsn_tracker import LsnTracker

# The server ending the stream with one error this many times in a row, with no progress in
# between (about 25 s of backing off), stops the relay: the error is the user's to fix.
_SAME_ERROR_LIMIT = 8
_SAME_ERROR_WITHIN = 60.0  # seconds: a loss longer after the last one starts the count anew


class Losses:
    """The connections lost in a row with one error at one position of the stream."""

    def __init__(self, tracker: LsnTracker) -> None:
        self._tracker = tracker
        # The last lost connection's error, where the stream was, and when.
        self._last_loss: tuple[str, Lsn, float] = ("", -1, 0.0)
        self.in_a_row = 0  # connections lost in a row with that error at that position

    def count(self, exc: ConnectionLost) -> None:
        """Count ``exc`` toward the stop: the same error again within _SAME_ERROR_WITHIN
        seconds, with no progress between; the relay stops after _SAME_ERROR_LIMIT of them
        when the server itself answered with the error (a connection that fails is waited
        out: a restart, a failover)."""
        now = time.monotonic()
        again = (str(exc), self._tracker.safe_lsn) == self._last_loss[:2] and (
            now - self._last_loss[2] < _SAME_ERROR_WITHIN
        )
        self.in_a_row = self.in_a_row + 1 if again else 1
        self._last_loss = (str(exc), self._tracker.safe_lsn, now)
        if exc.server_error and self.in_a_row >= _SAME_ERROR_LIMIT:
            raise RelayError(
                f"the server ended the stream {self.in_a_row} times in a row at "
                f"{format_lsn(self._tracker.safe_lsn)} with the same error, so retrying does "
                f"not help: {exc}; fix its cause and restart the relay: it resumes after the "
                "last event Kafka acknowledged"
            )
