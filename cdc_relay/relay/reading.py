"""The stream's messages while they flow: each XLogData message decoded and its records
handled, then the next one the connection holds already, and so on, without going back to
the relay's loop (StreamRelay.pump) until its tick is due (a few milliseconds: delivery
reports, status updates), a keepalive comes, the connection holds nothing more, or the relay
is asked to stop.

Compiled with the rest of the hot path (compiled.py): in Python, the loop's own work around
each message cost as much as decoding it (bench/README.md, "The loop compiled").
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import final

from cdc_relay.errors import DecodeError, RelayError
from cdc_relay.lsn import Lsn, format_lsn
from cdc_relay.postgres.replication import Keepalive, XLogData
from cdc_relay.relay.records import Records
from cdc_relay.relay.stages import Source


@final
class Reading:
    """What the stream relay read, and whether it is to stop reading.

    ``received``: the highest WAL end of the messages read (a status update's write position).
    ``stopping``: set by the relay's stop (a signal); no message is handled after it.
    ``clock``: the loop's, ``time.monotonic`` (the tests' virtual one: a compiled module's own
    ``time`` cannot be patched).
    """

    def __init__(self, records: Records, clock: Callable[[], float] = time.monotonic) -> None:
        self._records = records
        self._clock = clock
        self.received: Lsn = 0
        self.stopping = False

    def flow(self, source: Source, message: XLogData, until: float) -> Keepalive | None:
        """Handle ``message``, then each XLogData message ``source`` holds already, until
        the clock reaches ``until`` or a stop; the keepalive that came next, if one
        did (the caller handles it)."""
        records = self._records
        decode = records.decode
        handle = records.handle
        clock = self._clock
        while True:
            if message.wal_end > self.received:
                self.received = message.wal_end
            try:
                decoded = decode(message.data)
            except DecodeError as exc:
                raise RelayError(
                    f"cannot decode {records.plugin} message at {format_lsn(message.wal_start)}: "
                    f"{exc}; this is a bug, please report it with the PostgreSQL and plugin "
                    "versions"
                ) from None
            for record in decoded:
                handle(record)
            if self.stopping or clock() >= until:
                return None
            following = source.read_now()
            if not isinstance(following, XLogData):
                return following
            message = following
