"""ReplicationConnection.read and read_now (postgres/replication.py) over a stand-in for libpq's
COPY BOTH reading: a socket pair whose far end is the server, and a buffer that
``consume_input`` fills from it, as libpq's does. Whole messages, a message cut in two, a
keepalive, the end of the stream, a closed socket, a wait; and Reading.flow over it. Both builds
run these (the compiled one checks its annotations at run time).

The integration suite reads a real server's stream (tests/integration/test_stream.py).
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Iterator

import psycopg
import pytest
from test_stream_loop import Wal, backlog
from test_stream_reading import opened, transactions

from cdc_relay.postgres import replication
from cdc_relay.postgres.replication import (
    ConnectionLost,
    Keepalive,
    ReplicationConnection,
    XLogData,
)

END_OF_COPY = struct.pack("!I", 0xFFFFFFFF)  # the stand-in's CopyDone


class Libpq:
    """What read and read_now ask of psycopg's ``pq.PGconn`` while streaming. Like
    psycopg_binary, ``get_copy_data`` gives ``b""`` (bytes, not a memoryview) when it has no
    message to give."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self.buffer = bytearray()
        self.status = replication.pq.ConnStatus.OK
        self.error_message = b""
        self.copy_failed = False  # PQgetCopyData's -2, as psycopg raises it
        self.dropped = False  # libpq dropped its socket (PQsocket -1), as psycopg raises it

    @property
    def socket(self) -> int:
        if self.dropped:
            raise psycopg.OperationalError("the connection is lost")
        return self._sock.fileno()

    def consume_input(self) -> None:
        self._sock.setblocking(False)
        try:
            while chunk := self._sock.recv(65536):
                self.buffer += chunk
            raise OSError("server closed the connection unexpectedly")
        except BlockingIOError:
            pass

    def get_copy_data(self, async_: int) -> tuple[int, memoryview | bytes]:
        if self.copy_failed:
            raise psycopg.OperationalError(
                "receiving copy data failed: server closed the connection"
            )
        if len(self.buffer) >= 4:
            (size,) = struct.unpack_from("!I", self.buffer)
            if size == 0xFFFFFFFF:
                return -1, b""
            if len(self.buffer) >= 4 + size:
                data = bytes(self.buffer[4 : 4 + size])
                del self.buffer[: 4 + size]
                return size, memoryview(data)
        return 0, b""

    def get_result(self) -> None:
        return None

    def finish(self) -> None:
        pass


def xlog(start: int, end: int, payload: bytes) -> bytes:
    body = b"w" + struct.pack("!QQq", start, end, 0) + payload
    return struct.pack("!I", len(body)) + body


def keepalive(end: int, reply: bool) -> bytes:
    body = b"k" + struct.pack("!Qq?", end, 0, reply)
    return struct.pack("!I", len(body)) + body


@pytest.fixture
def stream(
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[tuple[ReplicationConnection, socket.socket]]:
    """A connection whose libpq is the stand-in, and the server's end of its socket."""
    ours, server = socket.socketpair()
    libpq = Libpq(ours)

    class PGconn:
        @staticmethod
        def connect(conninfo: bytes) -> Libpq:
            return libpq

    class Pq:
        ConnStatus = replication.pq.ConnStatus

    Pq.PGconn = PGconn  # type: ignore[attr-defined]
    monkeypatch.setattr(replication, "pq", Pq)
    conn = ReplicationConnection("dbname=test")
    monkeypatch.undo()
    yield conn, server
    ours.close()
    server.close()


def test_read_now_hands_each_whole_message_then_none_caught_up(
    stream: tuple[ReplicationConnection, socket.socket],
) -> None:
    conn, server = stream
    server.sendall(xlog(1, 2, b"A") + xlog(2, 3, b"B") + keepalive(9, True))
    assert conn.read_now() == XLogData(1, 2, b"A")
    assert not conn.caught_up
    assert conn.read_now() == XLogData(2, 3, b"B")
    assert conn.read_now() == Keepalive(9, True)
    assert conn.read_now() is None
    assert conn.caught_up  # the relay read all the server sent


def test_a_message_cut_in_two_is_not_caught_up_and_read_waits_for_the_rest(
    stream: tuple[ReplicationConnection, socket.socket],
) -> None:
    conn, server = stream
    whole = xlog(5, 6, b"x" * 100)
    server.sendall(whole[:30])
    assert conn.read_now() is None
    assert not conn.caught_up  # something came: not all the server sent is read
    threading.Timer(0.05, lambda: server.sendall(whole[30:])).start()
    assert conn.read(5.0) == XLogData(5, 6, b"x" * 100)


def test_read_waits_its_timeout_when_nothing_comes(
    stream: tuple[ReplicationConnection, socket.socket],
) -> None:
    conn, _ = stream
    started = time.monotonic()
    assert conn.read(0.1) is None
    assert time.monotonic() - started >= 0.1
    assert conn.caught_up


@pytest.mark.parametrize("how", ["read", "read_now"])
def test_the_end_of_the_stream_is_a_lost_connection(
    stream: tuple[ReplicationConnection, socket.socket], how: str
) -> None:
    conn, server = stream
    server.sendall(xlog(1, 2, b"A") + END_OF_COPY)
    assert conn.read_now() == XLogData(1, 2, b"A")
    with pytest.raises(ConnectionLost, match=r"^replication stream ended: "):
        conn.read(1.0) if how == "read" else conn.read_now()


def test_a_closed_socket_is_a_lost_connection(
    stream: tuple[ReplicationConnection, socket.socket],
) -> None:
    conn, server = stream
    server.close()
    with pytest.raises(ConnectionLost, match="replication connection lost"):
        conn.read(1.0)


@pytest.mark.parametrize("how", ["read", "read_now"])
@pytest.mark.parametrize("failure", ["copy_failed", "dropped"])
def test_libpq_failing_the_connection_is_a_lost_connection(
    stream: tuple[ReplicationConnection, socket.socket], how: str, failure: str
) -> None:
    """psycopg's OperationalError: libpq's -2 from PQgetCopyData, or no socket any more (what a
    keep-alive's failed flush leaves: stream._keep_alive leaves it to the next read)."""
    conn, _ = stream
    libpq = conn._conn
    assert isinstance(libpq, Libpq)
    setattr(libpq, failure, True)
    with pytest.raises(ConnectionLost, match=r"^replication connection (lost|failed): "):
        conn.read(1.0) if how == "read" else conn.read_now()


def test_a_flow_over_the_connection_handles_the_backlog_up_to_a_keepalive(
    stream: tuple[ReplicationConnection, socket.socket],
) -> None:
    conn, server = stream
    raw = backlog()[: transactions(3)]
    wal = Wal(raw)
    relay, sink, _ = opened(wal)
    two = transactions(2)
    server.sendall(
        b"".join(xlog(i + 1, i + 1, data) for i, data in enumerate(raw[:two]))
        + keepalive(10**6, True)
        + b"".join(xlog(i + 1, i + 1, data) for i, data in enumerate(raw[two:], two))
    )
    first = conn.read(1.0)
    assert isinstance(first, XLogData)
    assert relay._reading.flow(conn, first, float("inf")) == Keepalive(10**6, True)
    assert [event_id for event_id, _ in sink.offered] == wal.event_ids[:20]
    assert relay._reading.received == two

    first = conn.read(1.0)
    assert isinstance(first, XLogData)
    assert relay._reading.flow(conn, first, float("inf")) is None
    assert conn.caught_up
    assert [event_id for event_id, _ in sink.offered] == wal.event_ids
