"""pgoutput's wire format, written: the inverse of cdc_relay.postgres.pgoutput, for tests that need
messages PostgreSQL would send but no capture holds (test_simulation's WAL shapes,
test_decoder_properties' round trips).

Each function writes one message of protocol version 1 (PostgreSQL docs, "Logical
Replication Message Formats"); ``encode`` writes the records the relay decodes. What the
decoder reads and drops (a Relation's replica identity, key flags and type modifiers, a
Commit's flags) takes PostgreSQL's values for an outbox table: identity ``d``, the key
column ``id``, no type modifier, no flags. test_pgoutput_encoder checks that every message
captured from PostgreSQL (tests/unit/data) is written back byte for byte.
"""

from __future__ import annotations

import struct
from collections.abc import Collection, Sequence

from cdc_relay.events import (
    PG_EPOCH_OFFSET_US,
    UNCHANGED,
    Begin,
    Column,
    Commit,
    Insert,
    LogicalMessage,
    Record,
    Relation,
    Value,
)


def cstring(text: str) -> bytes:
    """A NUL-terminated UTF-8 string."""
    return text.encode() + b"\0"


def tuple_data(values: Sequence[Value], binary: Collection[int] = ()) -> bytes:
    """TupleData: each value as text ('t'; 'b' for the positions in ``binary``), NULL ('n')
    or an unchanged TOASTed value ('u')."""
    out = [struct.pack("!H", len(values))]
    for position, value in enumerate(values):
        if value is None:
            out.append(b"n")
        elif value is UNCHANGED:
            out.append(b"u")
        else:
            assert isinstance(value, bytes)
            kind = b"b" if position in binary else b"t"
            out.append(kind + struct.pack("!I", len(value)) + value)
    return b"".join(out)


def begin(final_lsn: int, commit_time_us: int, xid: int) -> bytes:
    """Begin: the LSN of the commit record, the commit time (Unix microseconds), the xid."""
    return b"B" + struct.pack("!QqI", final_lsn, commit_time_us - PG_EPOCH_OFFSET_US, xid)


def commit(commit_lsn: int, end_lsn: int, commit_time_us: int, flags: int = 0) -> bytes:
    """Commit: where the commit record starts and ends, the commit time (Unix microseconds)."""
    return b"C" + struct.pack(
        "!BQQq", flags, commit_lsn, end_lsn, commit_time_us - PG_EPOCH_OFFSET_US
    )


def relation(
    relid: int,
    namespace: str,
    name: str,
    columns: Sequence[Column],
    key: Collection[str] = ("id",),
    replica_identity: str = "d",
    typmods: Sequence[int] | None = None,
    flags: Sequence[int] | None = None,
) -> bytes:
    """Relation: a table's layout (``pg_catalog`` is sent as the empty string); each
    column's flags are 1 for a ``key`` column unless ``flags`` gives them."""
    out = [
        b"R",
        struct.pack("!I", relid),
        cstring("" if namespace == "pg_catalog" else namespace),
        cstring(name),
        replica_identity.encode(),
        struct.pack("!H", len(columns)),
    ]
    for position, column in enumerate(columns):
        typmod = -1 if typmods is None else typmods[position]
        flag = int(column.name in key) if flags is None else flags[position]
        out.append(bytes([flag]) + cstring(column.name))
        out.append(struct.pack("!Ii", column.type_oid, typmod))
    return b"".join(out)


def insert(relid: int, values: Sequence[Value], binary: Collection[int] = ()) -> bytes:
    return b"I" + struct.pack("!I", relid) + b"N" + tuple_data(values, binary)


def message(
    transactional: bool, lsn: int, prefix: str, content: bytes, flags: int | None = None
) -> bytes:
    """A logical decoding message (``pg_logical_emit_message``): ``lsn`` is where its WAL
    record ends."""
    flag = int(transactional) if flags is None else flags
    return (
        b"M"
        + bytes([flag])
        + struct.pack("!Q", lsn)
        + cstring(prefix)
        + struct.pack("!I", len(content))
        + content
    )


def update(
    relid: int,
    new: Sequence[Value],
    old: Sequence[Value] | None = None,
    old_kind: str = "K",
    binary: Collection[int] = (),
    old_binary: Collection[int] | None = None,
) -> bytes:
    """Update: the old key ('K') or tuple ('O') when the replica identity sends one."""
    head = b"U" + struct.pack("!I", relid)
    if old is not None:
        head += old_kind.encode() + tuple_data(old, binary if old_binary is None else old_binary)
    return head + b"N" + tuple_data(new, binary)


def delete(
    relid: int, old: Sequence[Value], old_kind: str = "K", binary: Collection[int] = ()
) -> bytes:
    return b"D" + struct.pack("!I", relid) + old_kind.encode() + tuple_data(old, binary)


def truncate(relids: Sequence[int], options: int = 0) -> bytes:
    return b"T" + struct.pack(f"!IB{len(relids)}I", len(relids), options, *relids)


def origin(lsn: int, name: str) -> bytes:
    return b"O" + struct.pack("!Q", lsn) + cstring(name)


def type_(oid: int, namespace: str, name: str) -> bytes:
    return b"Y" + struct.pack("!I", oid) + cstring(namespace) + cstring(name)


def encode(record: Record) -> bytes:
    """The message of a record the relay decodes (Begin, Commit, Relation, Insert,
    LogicalMessage)."""
    match record:
        case Begin(final_lsn=lsn, commit_time_us=ts, xid=xid):
            return begin(lsn, ts, xid)
        case Commit(commit_lsn=lsn, end_lsn=end, commit_time_us=ts):
            return commit(lsn, end, ts)
        case Relation(relid=relid, namespace=namespace, name=name, columns=columns):
            return relation(relid, namespace, name, columns)
        case Insert(relid=relid, values=values):
            return insert(relid, values)
        case LogicalMessage(transactional=transactional, lsn=lsn, prefix=prefix, content=content):
            return message(transactional, lsn, prefix, content)
    raise ValueError(f"no pgoutput message for {record!r}")
