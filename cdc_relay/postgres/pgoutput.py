"""Decoder of pgoutput, PostgreSQL's built-in logical decoding plugin (protocol version 1).

Pure functions of bytes: no I/O, no state. ``decode`` turns the payload of one XLogData
message into a record of :mod:`cdc_relay.events`; anything it cannot read raises
:class:`~cdc_relay.errors.DecodeError`. Message layouts: PostgreSQL docs, "Logical
Replication Message Formats".
"""

from __future__ import annotations

import struct
from collections.abc import Callable

from cdc_relay.errors import DecodeError
from cdc_relay.events import (
    PG_EPOCH_OFFSET_US,
    UNCHANGED,
    Begin,
    Column,
    Commit,
    Ignored,
    Insert,
    LogicalMessage,
    Record,
    Relation,
    Value,
)

_BEGIN = struct.Struct("!QqI")  # final LSN, commit timestamp, xid
_COMMIT = struct.Struct("!BQQq")  # flags, commit LSN, end LSN, commit timestamp
_RELATION_HEAD = struct.Struct("!I")  # relation OID
_COLUMN_TAIL = struct.Struct("!Ii")  # type OID, type modifier
_INT8 = struct.Struct("!B")
_INT16 = struct.Struct("!H")
_INT32 = struct.Struct("!I")
_INT64 = struct.Struct("!Q")


class _Reader:
    """A cursor over one message; every read checks the bounds."""

    __slots__ = ("buf", "pos")

    def __init__(self, buf: bytes) -> None:
        self.buf = buf
        self.pos = 1  # past the message type byte

    def unpack(self, fmt: struct.Struct) -> tuple[int, ...]:
        end = self.pos + fmt.size
        if end > len(self.buf):
            raise DecodeError(f"message ends at byte {len(self.buf)}, wanted {end}")
        values = fmt.unpack_from(self.buf, self.pos)
        self.pos = end
        return values

    def byte(self) -> int:
        if self.pos >= len(self.buf):
            raise DecodeError("message ends before an expected byte")
        value = self.buf[self.pos]
        self.pos += 1
        return value

    def string(self) -> str:
        end = self.buf.find(b"\0", self.pos)
        if end < 0:
            raise DecodeError("string without its terminating zero byte")
        try:
            value = self.buf[self.pos : end].decode()
        except UnicodeDecodeError as exc:
            raise DecodeError(f"string is not UTF-8: {exc}") from None
        self.pos = end + 1
        return value

    def take(self, size: int) -> bytes:
        end = self.pos + size
        if size < 0 or end > len(self.buf):
            raise DecodeError(f"value of {size} bytes overruns the message")
        value = self.buf[self.pos : end]
        self.pos = end
        return value

    def done(self) -> None:
        if self.pos != len(self.buf):
            raise DecodeError(f"{len(self.buf) - self.pos} unexpected bytes at the end")


def _timestamp(pg_us: int) -> int:
    return pg_us + PG_EPOCH_OFFSET_US


def _tuple(r: _Reader) -> tuple[Value, ...]:
    values, r.pos = _values(r.buf, r.pos)
    return values


def _values(buf: bytes, pos: int) -> tuple[tuple[Value, ...], int]:
    """The column values of a tuple starting at ``pos``, and the position after it.

    The hot path of every row, one tight loop (bench/per_stage.py): bounds are left to Python
    (an index past the end raises IndexError, a slice stops at the end), then checked once,
    so a malformed tuple still raises DecodeError. Lengths are read byte by byte, not with
    struct: compiled (cdc_relay/compiled.py), indexing bytes and shifting are native
    operations and the loop runs 3.5 times as fast, where a call to struct stays a Python call
    (pure Python pays a fifth more for this loop; bench/README.md, "Compiled").
    """
    try:
        count = (buf[pos] << 8) | buf[pos + 1]
        pos += 2
        values: list[Value] = [None] * count  # a NULL stays None
        for i in range(count):
            kind = buf[pos]
            if kind == 0x74 or kind == 0x62:  # 't' text, 'b' binary
                start = pos + 5
                pos = start + (
                    (buf[pos + 1] << 24) | (buf[pos + 2] << 16) | (buf[pos + 3] << 8) | buf[pos + 4]
                )
                values[i] = buf[start:pos]
            elif kind == 0x6E:  # 'n' null
                pos += 1
            elif kind == 0x75:  # 'u' unchanged TOASTed value
                values[i] = UNCHANGED
                pos += 1
            else:
                raise DecodeError(f"unknown tuple column kind {kind:#x}")
    except IndexError:
        raise DecodeError(f"a tuple overruns its message of {len(buf)} bytes") from None
    if pos > len(buf):
        raise DecodeError(f"a value overruns its message of {len(buf)} bytes")
    return tuple(values), pos


def _begin(r: _Reader) -> Record:
    final_lsn, ts, xid = r.unpack(_BEGIN)
    return Begin(final_lsn=final_lsn, commit_time_us=_timestamp(ts), xid=xid)


def _commit(r: _Reader) -> Record:
    _flags, commit_lsn, end_lsn, ts = r.unpack(_COMMIT)
    return Commit(commit_lsn=commit_lsn, end_lsn=end_lsn, commit_time_us=_timestamp(ts))


def _relation(r: _Reader) -> Record:
    (relid,) = r.unpack(_RELATION_HEAD)
    namespace = r.string() or "pg_catalog"  # pgoutput sends "" for pg_catalog
    name = r.string()
    r.byte()  # replica identity setting
    (count,) = r.unpack(_INT16)
    columns = []
    for _ in range(count):
        r.byte()  # flags: part of the key or not
        column_name = r.string()
        type_oid, _typmod = r.unpack(_COLUMN_TAIL)
        columns.append(Column(column_name, type_oid))
    return Relation(relid=relid, namespace=namespace, name=name, columns=tuple(columns))


def _update(r: _Reader) -> Record:
    r.unpack(_INT32)
    marker = r.byte()
    if marker in (0x4B, 0x4F):  # 'K' key or 'O' old tuple, then the new one
        _tuple(r)
        marker = r.byte()
    if marker != 0x4E:
        raise DecodeError("update without its new tuple")
    _tuple(r)
    return Ignored("update")


def _delete(r: _Reader) -> Record:
    r.unpack(_INT32)
    if r.byte() not in (0x4B, 0x4F):
        raise DecodeError("delete without its old key or tuple")
    _tuple(r)
    return Ignored("delete")


def _truncate(r: _Reader) -> Record:
    (count,) = r.unpack(_INT32)
    r.byte()  # options
    r.take(4 * count)
    return Ignored("truncate")


def _origin(r: _Reader) -> Record:
    r.unpack(_INT64)
    r.string()
    return Ignored("origin")


def _type(r: _Reader) -> Record:
    r.unpack(_INT32)
    r.string()
    r.string()
    return Ignored("type")


def _message(r: _Reader) -> Record:
    flags = r.byte()
    (lsn,) = r.unpack(_INT64)
    prefix = r.string()
    (size,) = r.unpack(_INT32)
    return LogicalMessage(
        transactional=bool(flags & 1), lsn=lsn, prefix=prefix, content=r.take(size)
    )


_DECODERS: dict[int, Callable[[_Reader], Record]] = {
    ord("B"): _begin,
    ord("C"): _commit,
    ord("R"): _relation,
    ord("U"): _update,
    ord("D"): _delete,
    ord("T"): _truncate,
    ord("O"): _origin,
    ord("Y"): _type,
    ord("M"): _message,
}


def _insert_message(buf: bytes) -> Record:
    """An Insert without a reader object: most messages are inserts."""
    try:
        relid = (buf[1] << 24) | (buf[2] << 16) | (buf[3] << 8) | buf[4]
        new = buf[5]
    except IndexError:
        raise DecodeError(f"insert message of {len(buf)} bytes is too short") from None
    if new != 0x4E:  # 'N'
        raise DecodeError("insert without its new tuple")
    values, end = _values(buf, 6)
    if end != len(buf):
        raise DecodeError(f"{len(buf) - end} unexpected bytes at the end")
    return Insert(relid, values)


def decode(message: bytes) -> Record:
    """Decode one pgoutput message (the payload of an XLogData message)."""
    if not message:
        raise DecodeError("empty pgoutput message")
    if message[0] == 0x49:  # 'I'
        return _insert_message(message)
    decoder = _DECODERS.get(message[0])
    if decoder is None:
        raise DecodeError(f"unknown pgoutput message type {message[:1]!r}")
    reader = _Reader(message)
    record = decoder(reader)
    reader.done()
    return record


def publication_names(*names: str) -> str:
    """The ``publication_names`` option for ``names``: pgoutput reads it as a list of SQL
    identifiers, folding an unquoted one to lower case and splitting at commas, so each
    name goes quoted (``OutboxPub`` unquoted asks for ``outboxpub``, which PostgreSQL 15
    refuses at the first change and 18 skips with a warning, losing the change)."""
    return ",".join('"' + name.replace('"', '""') + '"' for name in names)
