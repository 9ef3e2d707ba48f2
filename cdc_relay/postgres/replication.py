"""The replication connection: the only code that speaks PostgreSQL's streaming protocol.

Built on ``psycopg.pq``: a ``replication=database`` connection, ``START_REPLICATION ...
LOGICAL``, then the COPY BOTH stream of XLogData and keepalive messages one way and standby
status updates the other (PostgreSQL docs, "Streaming Replication Protocol").
"""

from __future__ import annotations

import contextlib
import select
import struct
import time
from collections.abc import Mapping
from dataclasses import dataclass

import psycopg
from mypy_extensions import mypyc_attr
from psycopg import pq
from psycopg.conninfo import make_conninfo

from cdc_relay.errors import PreflightError, RelayError, SlotInUseError
from cdc_relay.events import PG_EPOCH_OFFSET_US
from cdc_relay.lsn import Lsn, format_lsn, parse
from cdc_relay.metrics import observe_slot
from cdc_relay.postgres import failover
from cdc_relay.queries import QUERIES

_XLOG_HEADER = struct.Struct("!QQq")  # WAL start, WAL end, server clock
_KEEPALIVE = struct.Struct("!Qq?")  # WAL end, server clock, reply requested
_STATUS = struct.Struct("!cQQQq?")  # 'r', written, flushed, applied, client clock, reply


# Compiled (compiled.py), and extended by the poller's own lost connection (worker.py).
@mypyc_attr(allow_interpreted_subclasses=True)
class ConnectionLost(RelayError):
    """The replication connection broke; the relay reconnects. ``server_error``: the server
    ended the stream with an ERROR of its own (which may come again on every attempt), not
    a connection that failed."""

    def __init__(self, message: str, server_error: bool = False) -> None:
        # libpq's text may run over lines (ERROR, then CONTEXT, DETAIL): one line, as every
        # message of the relay's is.
        super().__init__(" ".join(line.strip() for line in message.splitlines() if line.strip()))
        self.server_error = server_error


# Per message: plain slotted dataclasses, never changed once made (a frozen one costs four
# times as much to make). XLogData writes its own ``__init__``, as events.Insert does (why:
# there).
@dataclass(init=False, slots=True)
class XLogData:
    wal_start: Lsn
    wal_end: Lsn
    data: bytes

    def __init__(self, wal_start: Lsn, wal_end: Lsn, data: bytes) -> None:
        self.wal_start = wal_start
        self.wal_end = wal_end
        self.data = data

    def __reduce__(self) -> tuple[type[XLogData], tuple[Lsn, Lsn, bytes]]:
        return (XLogData, (self.wal_start, self.wal_end, self.data))


@dataclass(slots=True)
class Keepalive:
    wal_end: Lsn
    reply_requested: bool


def _now_pg_us() -> int:
    return time.time_ns() // 1000 - PG_EPOCH_OFFSET_US


def _quote_ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _quote_literal(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


class ReplicationConnection:
    """One logical replication session on one slot."""

    def __init__(self, dsn: str, application_name: str = "cdc-relay") -> None:
        conninfo = make_conninfo(dsn, replication="database", application_name=application_name)
        self.caught_up = False  # the last read found nothing waiting (stages.Source)
        self._conn = pq.PGconn.connect(conninfo.encode())
        if self._conn.status != pq.ConnStatus.OK:
            message = _error_text(self._conn)
            self._conn.finish()
            raise ConnectionLost(f"cannot connect to PostgreSQL: {message}; check --dsn")

    def query(self, sql: str) -> list[tuple[str | None, ...]]:
        """Run a simple query on the replication connection (before streaming starts)."""
        result = self._conn.exec_(sql.encode())
        if result.status != pq.ExecStatus.TUPLES_OK:
            raise ConnectionLost(f"query failed: {_error_text(self._conn)}")
        return [
            tuple(
                None if (v := result.get_value(row, col)) is None else v.decode()
                for col in range(result.nfields)
            )
            for row in range(result.ntuples)
        ]

    def create_slot_exporting_snapshot(self, slot: str, plugin: str) -> tuple[Lsn, str]:
        """Create a logical slot and export the snapshot it starts from.

        Returns the slot's consistent point and the snapshot's name. A transaction that runs
        ``SET TRANSACTION SNAPSHOT`` with it sees exactly the transactions committed before the
        consistent point, and the slot decodes exactly those after. The snapshot can be
        imported until this connection runs another command or closes.
        """
        option = "(SNAPSHOT 'export')" if self._conn.server_version >= 150000 else "EXPORT_SNAPSHOT"
        command = f"CREATE_REPLICATION_SLOT {_quote_ident(slot)} LOGICAL {_quote_ident(plugin)}"
        result = self._conn.exec_(f"{command} {option}".encode())
        if result.status != pq.ExecStatus.TUPLES_OK:
            message = _error_text(self._conn)
            if result.error_field(pq.DiagnosticField.SQLSTATE) == b"42710":  # duplicate_object
                raise PreflightError(
                    f"replication slot {slot!r} exists already; drop it (cdc-relay drop-slot) "
                    "or choose another --slot"
                )
            raise RelayError(f"cannot create replication slot {slot!r}: {message}")
        columns = {result.fname(i): i for i in range(result.nfields)}
        consistent_point = result.get_value(0, columns[b"consistent_point"]) or b""
        snapshot = result.get_value(0, columns[b"snapshot_name"]) or b""
        return parse(consistent_point.decode()), snapshot.decode()

    def _command(self, sql: str) -> None:
        result = self._conn.exec_(sql.encode())
        if result.status != pq.ExecStatus.COMMAND_OK:
            raise ConnectionLost(f"{sql} failed: {_error_text(self._conn)}")

    def start(self, slot: str, start_lsn: Lsn, options: Mapping[str, str]) -> None:
        """Send START_REPLICATION; the server streams from max(start_lsn, confirmed LSN)."""
        # The plugins print bytea in the walsender's bytea_output: hex is the one form that
        # reads back unambiguously (wal2json prints it without the \x, escape would look alike).
        self._command("SET bytea_output = 'hex'")
        opts = ", ".join(f"{_quote_ident(k)} {_quote_literal(v)}" for k, v in options.items())
        command = f"START_REPLICATION SLOT {_quote_ident(slot)} LOGICAL {format_lsn(start_lsn)}" + (
            f" ({opts})" if opts else ""
        )
        self._conn.send_query(command.encode())
        result = self._conn.get_result()
        if result is None or result.status != pq.ExecStatus.COPY_BOTH:
            sqlstate = result.error_field(pq.DiagnosticField.SQLSTATE) if result else None
            message = _error_text(self._conn)
            if sqlstate == b"55006":  # object_in_use
                raise SlotInUseError(
                    f"replication slot {slot!r} is in use by another process ({message}); "
                    "stop the other relay, or give this one its own --slot"
                )
            if sqlstate == b"42704":  # undefined_object
                raise PreflightError(
                    failover.slot_gone(slot, self._timeline())
                    or f"replication slot {slot!r} does not exist; run cdc-relay setup-slot first"
                )
            if sqlstate == b"55000":  # object_not_in_prerequisite_state: invalidated
                raise PreflightError(self._unusable(slot, message))
            raise ConnectionLost(
                f"START_REPLICATION failed: {message}", server_error=result is not None
            )

    def _unusable(self, slot: str, message: str) -> str:
        """Why the server refused to stream ``slot`` (SQLSTATE 55000), in one line: read from
        the slot's row when PostgreSQL invalidated it."""
        self._discard_results()
        row: dict[str, str | None] = {}
        # The walsender runs plain SQL, by the simple protocol only: the slot's name is
        # quoted into the query as psycopg would bind it on the client.
        with contextlib.suppress(psycopg.Error):  # then the server's message will do
            result = self._conn.exec_((QUERIES["slot"] % {"slot": _quote_literal(slot)}).encode())
            if result.status == pq.ExecStatus.TUPLES_OK and result.ntuples == 1:
                row = {
                    (result.fname(col) or b"").decode(): None
                    if (v := result.get_value(0, col)) is None
                    else v.decode()
                    for col in range(result.nfields)
                }
        if row:
            observe_slot(row)
        return failover.slot_invalidated(slot, row) or (
            f"replication slot {slot!r} cannot be streamed: "
            f"{' '.join(message.split())}; see cdc-relay status"
        )

    def _discard_results(self) -> None:
        """Read what remains of a failed command, so that the connection takes another."""
        while self._conn.get_result() is not None:
            pass

    def _timeline(self) -> int | None:
        """The server's timeline (IDENTIFY_SYSTEM), after a failed command; None if unknown."""
        self._discard_results()
        try:
            ((_, timeline, *_),) = self.query("IDENTIFY_SYSTEM")
            return int(timeline or 0)
        except (ConnectionLost, ValueError):
            return None

    def read(self, timeout: float) -> XLogData | Keepalive | None:
        """The next message from the server, or None if none came within ``timeout`` seconds."""
        message = self.read_now()
        if message is not None or not self.caught_up:
            return message
        if not self._readable(timeout):
            return None
        return self._received_now()

    def read_now(self) -> XLogData | Keepalive | None:
        """The next message if libpq holds it whole or the socket has more already, without
        waiting; None otherwise, and ``caught_up`` when nothing at all was waiting."""
        nbytes, data = self._copy_data()
        self.caught_up = False
        if nbytes == 0:  # nothing whole in libpq's buffer: is more on the socket already?
            if not self._readable(0):
                self.caught_up = True  # the relay read all the server sent so far
                return None
            return self._received_now()
        return self._message(nbytes, data)

    def _readable(self, timeout: float) -> bool:
        """Whether the socket has something within ``timeout`` seconds."""
        try:  # libpq without a socket any more: psycopg's OperationalError
            readable, _, _ = select.select([self._conn.socket], [], [], timeout)
        except (OSError, ValueError, psycopg.OperationalError) as exc:
            raise ConnectionLost(f"replication connection failed: {exc}") from None
        return bool(readable)

    def _received_now(self) -> XLogData | Keepalive | None:
        """What the socket has: the next message if it completes one, else None."""
        conn = self._conn
        try:
            conn.consume_input()
        except Exception as exc:  # noqa: BLE001 - psycopg raises its own OperationalError
            raise ConnectionLost(f"replication connection lost: {exc}") from None
        nbytes, data = self._copy_data()
        if nbytes == 0:
            return None
        return self._message(nbytes, data)

    def _copy_data(self) -> tuple[int, memoryview]:
        """libpq's next whole message, its length 0 for none, -1 at the end of the stream."""
        try:
            return self._conn.get_copy_data(1)
        except psycopg.OperationalError as exc:  # libpq's -2: the connection failed
            raise ConnectionLost(f"replication connection lost: {exc}") from None

    def _message(self, nbytes: int, data: memoryview) -> XLogData | Keepalive:
        if nbytes < 0:
            self._raise_end()
        kind = data[0]
        if kind == 0x77:  # 'w' XLogData
            wal_start, wal_end, _clock = _XLOG_HEADER.unpack_from(data, 1)
            return XLogData(wal_start, wal_end, bytes(data[25:]))
        if kind == 0x6B:  # 'k' primary keepalive
            wal_end, _clock, reply = _KEEPALIVE.unpack_from(data, 1)
            return Keepalive(wal_end, reply)
        raise ConnectionLost(f"unexpected replication message type {bytes(data[:1])!r}")

    def send_status(self, written: Lsn, flushed: Lsn) -> None:
        """Standby status update: ``flushed`` becomes the slot's confirmed_flush_lsn."""
        message = _STATUS.pack(b"r", written, flushed, flushed, _now_pg_us(), False)
        try:
            sent = self._conn.put_copy_data(message) == 1 and self._conn.flush() == 0
        except Exception as exc:  # noqa: BLE001 - psycopg raises its own OperationalError
            raise ConnectionLost(f"cannot send status: {exc}") from None
        if not sent:
            raise ConnectionLost(f"cannot send status: {_error_text(self._conn)}")

    def close(self) -> None:
        """End the COPY and the connection; the slot becomes free at once."""
        try:
            self._conn.put_copy_end()
            self._conn.flush()
        except Exception:  # noqa: BLE001, S110 - closing a broken connection is best effort
            pass
        self._conn.finish()

    def _raise_end(self) -> None:
        result = self._conn.get_result()
        message = _error_text(self._conn)
        server_error = result is not None and result.status == pq.ExecStatus.FATAL_ERROR
        if result is not None and server_error:
            message = (result.error_message or b"").decode(errors="replace").strip() or message
        raise ConnectionLost(
            f"replication stream ended: {message or 'server closed it'}", server_error
        )


def _error_text(conn: pq.abc.PGconn) -> str:
    return conn.error_message.decode(errors="replace").strip() or "no message"
