"""Properties of the pgoutput and wal2json decoders, checked on generated input.

Whatever bytes arrive, a decoder returns well-formed records or raises DecodeError, nothing
else: arbitrary bytes, the captured messages truncated, bit-flipped, with bytes inserted or
deleted, and messages built from records by the encoders below, which must decode back to
those records. ``CDC_RELAY_HYPOTHESIS_PROFILE=fuzz`` raises the number of examples for a long
run; the coverage-guided fuzzer is tests/fuzz/fuzz_decoders.py.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pgoutput_encoder as encoder
import pytest
from capture import messages
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cdc_relay.errors import DecodeError
from cdc_relay.events import (
    BYTEA_OID,
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
    jsonb_text,
)
from cdc_relay.lsn import format_lsn
from cdc_relay.postgres import pgoutput
from cdc_relay.postgres.wal2json import Wal2JsonDecoder

settings.register_profile(
    "unit",
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "fuzz",
    max_examples=20_000,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
PROFILE = settings.get_profile(os.environ.get("CDC_RELAY_HYPOTHESIS_PROFILE", "unit"))

PGOUTPUT_SEEDS = messages("pgoutput")
WAL2JSON_SEEDS = messages("wal2json")


# -- the property ----------------------------------------------------------------------------


def check_record(record: object) -> None:
    """A record of a type the stream knows, its fields of the declared types."""
    match record:
        case Begin(final_lsn=lsn, commit_time_us=ts, xid=xid):
            assert all(isinstance(v, int) for v in (lsn, ts, xid))
        case Commit(commit_lsn=lsn, end_lsn=end, commit_time_us=ts):
            assert all(isinstance(v, int) for v in (lsn, end, ts))
        case Relation(relid=relid, namespace=namespace, name=name, columns=columns):
            assert isinstance(relid, int)
            assert isinstance(namespace, str) and isinstance(name, str)
            assert all(
                isinstance(c, Column) and isinstance(c.name, str) and isinstance(c.type_oid, int)
                for c in columns
            )
        case Insert(relid=relid, values=values):
            assert isinstance(relid, int)
            assert all(v is None or v is UNCHANGED or isinstance(v, bytes) for v in values)
        case LogicalMessage(transactional=transactional, lsn=lsn, prefix=prefix, content=content):
            assert isinstance(transactional, bool) and isinstance(lsn, int)
            assert isinstance(prefix, str) and isinstance(content, bytes)
        case Ignored(kind=kind):
            assert isinstance(kind, str)
        case _:
            pytest.fail(f"not a record: {record!r}")


def decodes_or_refuses(decode: Callable[[bytes], Sequence[Record]], message: bytes) -> None:
    """The property: records of the right types, or DecodeError; any other exception escapes."""
    try:
        records = decode(message)
    except DecodeError:
        return
    for record in records:
        check_record(record)


def pgoutput_decode(message: bytes) -> Sequence[Record]:
    return (pgoutput.decode(message),)


# -- mutations of captured messages ------------------------------------------------------------

# Values that push length and count fields to their limits.
INTERESTING = [b"\x00", b"\xff", b"\x7f", b"\x80", b"\x00\x00", b"\xff\xff", b"\x7f\xff\xff\xff"]
INTERESTING += [b"\xff\xff\xff\xff", b"\x80\x00\x00\x00", b"\x00\x00\x00\x00", b"\xff" * 8]


@st.composite
def mutated(draw: st.DrawFn, seeds: list[bytes]) -> bytes:
    """A captured message after a few truncations, bit flips, insertions and deletions."""
    data = bytearray(draw(st.sampled_from(seeds)))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["truncate", "flip", "insert", "delete", "overwrite"]))
        pos = draw(st.integers(0, len(data)))
        if op == "truncate":
            del data[pos:]
        elif op == "flip" and data:
            data[pos % len(data)] ^= 1 << draw(st.integers(0, 7))
        elif op == "insert":
            data[pos:pos] = draw(st.binary(min_size=1, max_size=8))
        elif op == "delete":
            del data[pos : pos + draw(st.integers(1, 8))]
        elif op == "overwrite":
            chunk = draw(st.sampled_from(INTERESTING))
            data[pos : pos + len(chunk)] = chunk
    return bytes(data)


# -- pgoutput: an encoder of the protocol, for round trips --------------------------------------

u8 = st.integers(0, 2**8 - 1)
u16 = st.integers(0, 2**16 - 1)
u32 = st.integers(0, 2**32 - 1)
u64 = st.integers(0, 2**64 - 1)
i32 = st.integers(-(2**31), 2**31 - 1)
i64 = st.integers(-(2**63), 2**63 - 1)
# pgoutput's strings are NUL-terminated UTF-8.
c_text = st.text(st.characters(exclude_characters="\0", exclude_categories=["Cs"]), max_size=20)


@st.composite
def pg_tuple(draw: st.DrawFn) -> tuple[tuple[Value, ...], set[int]]:
    """TupleData's values, each text ('t'), binary ('b'), NULL ('n') or unchanged TOAST
    ('u'), and the positions of the binary ones."""
    values: list[Value] = []
    binary = set()
    for position, kind in enumerate(draw(st.lists(st.sampled_from("tbnu"), max_size=12))):
        if kind in "tb":
            values.append(draw(st.binary(max_size=40)))
            if kind == "b":
                binary.add(position)
        else:
            values.append(None if kind == "n" else UNCHANGED)
    return tuple(values), binary


@st.composite
def pg_begin(draw: st.DrawFn) -> tuple[bytes, Record]:
    lsn, ts, xid = draw(u64), draw(i64), draw(u32)
    record = Begin(final_lsn=lsn, commit_time_us=ts + PG_EPOCH_OFFSET_US, xid=xid)
    return encoder.begin(lsn, record.commit_time_us, xid), record


@st.composite
def pg_commit(draw: st.DrawFn) -> tuple[bytes, Record]:
    flags, lsn, end, ts = draw(u8), draw(u64), draw(u64), draw(i64)
    record = Commit(commit_lsn=lsn, end_lsn=end, commit_time_us=ts + PG_EPOCH_OFFSET_US)
    return encoder.commit(lsn, end, record.commit_time_us, flags), record


@st.composite
def pg_relation(draw: st.DrawFn) -> tuple[bytes, Record]:
    relid, namespace, name = draw(u32), draw(c_text), draw(c_text)
    drawn = draw(st.lists(st.tuples(u8, c_text, u32, i32), max_size=12))
    columns = tuple(Column(column, oid) for _, column, oid, _ in drawn)
    encoded = encoder.relation(
        relid,
        namespace,
        name,
        columns,
        replica_identity=draw(st.sampled_from("dnfi")),
        typmods=[typmod for *_, typmod in drawn],
        flags=[flags for flags, *_ in drawn],
    )
    # pgoutput's "" for pg_catalog
    record = Relation(relid=relid, namespace=namespace or "pg_catalog", name=name, columns=columns)
    return encoded, record


@st.composite
def pg_insert(draw: st.DrawFn) -> tuple[bytes, Record]:
    relid = draw(u32)
    values, binary = draw(pg_tuple())
    return encoder.insert(relid, values, binary), Insert(relid=relid, values=values)


@st.composite
def pg_message(draw: st.DrawFn) -> tuple[bytes, Record]:
    flags, lsn, prefix, content = draw(u8), draw(u64), draw(c_text), draw(st.binary(max_size=60))
    transactional = bool(flags & 1)
    encoded = encoder.message(transactional, lsn, prefix, content, flags)
    record = LogicalMessage(transactional=transactional, lsn=lsn, prefix=prefix, content=content)
    return encoded, record


@st.composite
def pg_ignored(draw: st.DrawFn) -> tuple[bytes, Record]:
    """Update, Delete, Truncate, Origin and Type: read through, then ignored."""
    kind = draw(st.sampled_from(["update", "delete", "truncate", "origin", "type"]))
    relid = draw(u32)
    if kind == "update":
        old_kind = draw(st.sampled_from(["", "K", "O"]))
        old, old_binary = draw(pg_tuple())
        new, binary = draw(pg_tuple())
        encoded = encoder.update(
            relid, new, old if old_kind else None, old_kind or "K", binary, old_binary
        )
    elif kind == "delete":
        old, binary = draw(pg_tuple())
        encoded = encoder.delete(relid, old, draw(st.sampled_from("KO")), binary)
    elif kind == "truncate":
        encoded = encoder.truncate(draw(st.lists(u32, max_size=5)), draw(u8))
    elif kind == "origin":
        encoded = encoder.origin(draw(u64), draw(c_text))
    else:
        encoded = encoder.type_(relid, draw(c_text), draw(c_text))
    return encoded, Ignored(kind)


pg_messages = st.one_of(
    pg_begin(), pg_commit(), pg_relation(), pg_insert(), pg_message(), pg_ignored()
)


# -- pgoutput ----------------------------------------------------------------------------------


@PROFILE
@given(st.binary(max_size=200))
def test_pgoutput_arbitrary_bytes(message: bytes) -> None:
    decodes_or_refuses(pgoutput_decode, message)


@PROFILE
@given(st.sampled_from(b"BCRIUDTOYM"), st.binary(max_size=200))
def test_pgoutput_arbitrary_body_after_a_known_type(kind: int, body: bytes) -> None:
    decodes_or_refuses(pgoutput_decode, bytes([kind]) + body)


@PROFILE
@given(mutated(PGOUTPUT_SEEDS))
def test_pgoutput_mutated_captured_messages(message: bytes) -> None:
    decodes_or_refuses(pgoutput_decode, message)


@PROFILE
@given(pg_messages, st.data())
def test_pgoutput_round_trip(built: tuple[bytes, Record], data: st.DataObject) -> None:
    encoded, record = built
    assert pgoutput.decode(encoded) == record
    cut = data.draw(st.integers(0, len(encoded) - 1), label="cut")
    with pytest.raises(DecodeError):
        pgoutput.decode(encoded[:cut])
    with pytest.raises(DecodeError):
        pgoutput.decode(encoded + data.draw(st.binary(min_size=1, max_size=4), label="tail"))


@PROFILE
@given(pg_messages, st.data())
def test_pgoutput_mutated_built_messages(built: tuple[bytes, Record], data: st.DataObject) -> None:
    decodes_or_refuses(pgoutput_decode, data.draw(mutated([built[0]])))


# -- wal2json: documents built from records, for round trips -----------------------------------


def json_values_of(text: st.SearchStrategy[str]) -> st.SearchStrategy[Any]:
    """Any JSON value: scalars, and arrays and objects of them, nested."""
    scalars = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(10**30), 10**30),
        st.floats(allow_nan=False, allow_infinity=False),
        text,
    )
    return st.recursive(
        scalars,
        lambda children: (
            st.lists(children, max_size=5) | st.dictionaries(text, children, max_size=5)
        ),
        max_leaves=20,
    )


# Any text, lone surrogates included: JSON may escape them ("\ud800"), PostgreSQL never does.
any_text = st.text(st.characters(exclude_categories=()), max_size=20)
# Text that str.isdigit() accepts but int() may not: "²", or more digits than int() reads.
digit_text = st.text(st.characters(categories=["N"]), min_size=1, max_size=12) | st.integers(
    4000, 5000
).map(lambda n: "9" * n)
json_values = json_values_of(any_text)
pg_chars = st.characters(exclude_categories=["Cs"])
pg_json_values = json_values_of(st.text(pg_chars, max_size=20))

UNIX_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


@st.composite
def pg_timestamptz(draw: st.DrawFn) -> tuple[str, int]:
    """A timestamptz as PostgreSQL prints it (wal2json's "timestamp"), and its Unix µs."""
    moment = draw(st.datetimes(min_value=datetime(1, 1, 2), max_value=datetime(9999, 12, 30)))
    minutes = draw(st.integers(-15 * 60, 15 * 60))
    offset = timedelta(minutes=minutes)
    moment = moment.replace(tzinfo=timezone(offset))
    text = (
        f"{moment.year:04}-{moment.month:02}-{moment.day:02} "
        f"{moment.hour:02}:{moment.minute:02}:{moment.second:02}"
    )
    if moment.microsecond:
        text += f".{moment.microsecond:06}".rstrip("0")
    sign = "-" if minutes < 0 else "+"
    hours, mins = divmod(abs(minutes), 60)
    text += f"{sign}{hours:02}" + (f":{mins:02}" if mins else "")
    return text, (moment - UNIX_EPOCH) // timedelta(microseconds=1)


def expected_value(value: Any, oid: int = 0) -> Value:
    """What a column value in wal2json's JSON becomes: text-format bytes, as pgoutput sends;
    for a bytea column, with the \\x of hex output that wal2json leaves out."""
    if value is None:
        return None
    if isinstance(value, bool):
        text = b"t" if value else b"f"
    elif isinstance(value, str):
        text = value.encode()
    else:
        text = json.dumps(value).encode()  # a number, the digits as written
    if oid == BYTEA_OID and not text.startswith(b"\\x"):
        return b"\\x" + text
    return text


wal2json_column_values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**30), 10**30),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(pg_chars, max_size=30),
)


@st.composite
def w2j_transaction(draw: st.DrawFn) -> tuple[list[dict[str, Any]], list[Record]]:
    """Begin, inserts and logical messages, Commit: the documents and the records they are."""
    xid, final_lsn, end_lsn = draw(u32), draw(u64), draw(u64)
    stamp, time_us = draw(pg_timestamptz())
    head = {"xid": xid, "timestamp": stamp}
    documents: list[dict[str, Any]] = [
        {"action": "B", **head, "lsn": format_lsn(final_lsn), "nextlsn": format_lsn(end_lsn)}
    ]
    records: list[Record] = [Begin(final_lsn=final_lsn, commit_time_us=time_us, xid=xid)]
    names = st.text(pg_chars, max_size=12)
    # Few distinct layouts, so that some rows share one and get no second Relation.
    layouts = draw(
        st.lists(
            # bytea (17) often: the decoder gives its values the \\x that wal2json leaves out
            st.tuples(
                names, names, st.lists(st.tuples(names, st.one_of(st.just(17), u32)), max_size=6)
            ),
            min_size=1,
            max_size=3,
        )
    )
    relations: dict[tuple[Any, ...], Relation] = {}
    for _ in range(draw(st.integers(0, 5))):
        if draw(st.booleans()):
            lsn, prefix = draw(u64), draw(names)
            content = draw(st.text(pg_chars, max_size=40))
            transactional = draw(st.booleans())
            documents.append(
                {
                    "action": "M",
                    **head,
                    "lsn": format_lsn(lsn),
                    "transactional": transactional,
                    "prefix": prefix,
                    "content": content,
                }
            )
            records.append(LogicalMessage(transactional, lsn, prefix, content.encode()))
            continue
        schema, table, columns = draw(st.sampled_from(layouts))
        values = [draw(wal2json_column_values) for _ in columns]
        documents.append(
            {
                "action": "I",
                **head,
                "lsn": format_lsn(draw(u64)),
                "schema": schema,
                "table": table,
                "columns": [
                    {"name": name, "type": "text", "typeoid": oid, "value": value}
                    for (name, oid), value in zip(columns, values, strict=True)
                ],
            }
        )
        key = (schema, table, tuple(columns))
        if key not in relations:
            relations[key] = Relation(
                relid=len(relations) + 1,
                namespace=schema,
                name=table,
                columns=tuple(Column(name, oid) for name, oid in columns),
            )
            records.append(relations[key])
        records.append(
            Insert(
                relations[key].relid,
                tuple(expected_value(v, oid) for (_, oid), v in zip(columns, values, strict=True)),
            )
        )
    documents.append(
        {"action": "C", **head, "lsn": format_lsn(final_lsn), "nextlsn": format_lsn(end_lsn)}
    )
    records.append(Commit(commit_lsn=final_lsn, end_lsn=end_lsn, commit_time_us=time_us))
    return documents, records


def field_values(valid: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """A field's value: valid, or a string of anything, or any JSON value."""
    return st.one_of(valid, any_text, digit_text, json_values)


w2j_columns = st.lists(
    st.fixed_dictionaries(
        {},
        optional={
            "name": field_values(st.text(max_size=10)),
            "type": field_values(st.just("text")),
            "typeoid": field_values(u32),
            "value": field_values(wal2json_column_values),
        },
    ),
    max_size=5,
)
w2j_documents = st.fixed_dictionaries(
    {"action": field_values(st.sampled_from("BCIMUDTX"))},
    optional={
        "xid": field_values(u32),
        "timestamp": field_values(pg_timestamptz().map(lambda pair: pair[0])),
        "lsn": field_values(u64.map(format_lsn)),
        "nextlsn": field_values(u64.map(format_lsn)),
        "schema": field_values(st.text(max_size=10)),
        "table": field_values(st.text(max_size=10)),
        "columns": field_values(w2j_columns),
        "transactional": field_values(st.booleans()),
        "prefix": field_values(st.text(max_size=10)),
        "content": field_values(st.text(max_size=20)),
    },
)


def to_json(document: Any, ascii_only: bool) -> bytes:
    return json.dumps(document, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")


@st.composite
def json_mutated(draw: st.DrawFn, seeds: list[bytes]) -> bytes:
    """A captured message with one value anywhere replaced by any JSON value, or removed."""
    document = json.loads(draw(st.sampled_from(seeds)))
    containers: list[Any] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict | list) and node:
            containers.append(node)
            for child in node.values() if isinstance(node, dict) else node:
                walk(child)

    walk(document)
    for _ in range(draw(st.integers(1, 3))):
        node = draw(st.sampled_from(containers))
        if not node:
            continue
        key = draw(st.sampled_from(sorted(node) if isinstance(node, dict) else range(len(node))))
        if draw(st.integers(0, 4)) == 0:
            del node[key]
        else:
            node[key] = draw(field_values(st.sampled_from(["", "0", "4294967296", "0/0"])))
    return to_json(document, draw(st.booleans()))


# -- wal2json ----------------------------------------------------------------------------------


@PROFILE
@given(st.binary(max_size=200))
def test_wal2json_arbitrary_bytes(message: bytes) -> None:
    decodes_or_refuses(Wal2JsonDecoder().decode, message)


@PROFILE
@given(json_values, st.booleans())
def test_wal2json_arbitrary_json(document: Any, ascii_only: bool) -> None:
    decodes_or_refuses(Wal2JsonDecoder().decode, to_json(document, ascii_only))


@PROFILE
@given(st.lists(w2j_documents, min_size=1, max_size=4), st.booleans())
def test_wal2json_documents_with_any_field_values(
    documents: list[dict[str, Any]], ascii_only: bool
) -> None:
    decoder = Wal2JsonDecoder()  # one decoder: its relation ids carry over between messages
    for document in documents:
        decodes_or_refuses(decoder.decode, to_json(document, ascii_only))


@PROFILE
@given(mutated(WAL2JSON_SEEDS))
def test_wal2json_mutated_captured_messages(message: bytes) -> None:
    decodes_or_refuses(Wal2JsonDecoder().decode, message)


@PROFILE
@given(json_mutated(WAL2JSON_SEEDS))
def test_wal2json_captured_messages_with_a_value_replaced(message: bytes) -> None:
    decodes_or_refuses(Wal2JsonDecoder().decode, message)


@PROFILE
@given(w2j_transaction(), st.booleans())
def test_wal2json_round_trip(
    built: tuple[list[dict[str, Any]], list[Record]], ascii_only: bool
) -> None:
    documents, records = built
    decoder = Wal2JsonDecoder()
    decoded = [r for d in documents for r in decoder.decode(to_json(d, ascii_only))]
    assert decoded == records


# -- jsonb_text --------------------------------------------------------------------------------


def keys_in_jsonb_order(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [key.encode("utf-8", "surrogatepass") for key, _ in pairs]
    assert keys == sorted(keys, key=lambda k: (len(k), k))
    return dict(pairs)


@PROFILE
@given(pg_json_values)
def test_jsonb_text_parses_back_to_the_value_with_keys_by_length_then_bytes(value: Any) -> None:
    text = jsonb_text(value)
    assert json.loads(text, object_pairs_hook=keys_in_jsonb_order) == value


# -- inputs that escaped as other exceptions, or decoded wrong, before their fix ---------------

BEGIN_HEAD = '{"action": "B", "lsn": "0/1", "timestamp": "2026-01-01 00:00:00+00", '


@pytest.mark.parametrize(
    "message",
    [
        # Lone surrogates have no UTF-8 form: str.encode() raised UnicodeEncodeError (fuzz run).
        b'{"action": "I", "schema": "s", "table": "t", '
        b'"columns": [{"name": "a", "value": "\\ud800"}]}',
        b'{"action": "M", "transactional": true, "lsn": "0/1", "prefix": "p", '
        b'"content": "\\udc00"}',
        # str.isdigit() takes these, int() does not: ValueError.
        (BEGIN_HEAD + '"xid": "\u00b2"}').encode(),
        (BEGIN_HEAD + '"xid": ' + "9" * 4400 + "}").encode(),
    ],
    ids=["surrogate value", "surrogate content", "superscript xid", "4400-digit xid"],
)
def test_wal2json_inputs_that_raised_other_errors_raise_decode_error(message: bytes) -> None:
    with pytest.raises(DecodeError):
        Wal2JsonDecoder().decode(message)


@pytest.mark.parametrize("typeoid", ['"\u00b2"', "9" * 4400], ids=["superscript", "4400 digits"])
def test_wal2json_typeoid_that_int_cannot_read_is_unknown(typeoid: str) -> None:
    # Found by the property tests: a 4,400-digit typeoid raised ValueError.
    message = '{"action": "I", "schema": "s", "table": "t", "columns": [{"name": "a", '
    message += f'"typeoid": {typeoid}, "value": "v"}}]}}'
    relation, insert = Wal2JsonDecoder().decode(message.encode())
    assert relation == Relation(1, "s", "t", (Column("a", 0),))
    assert insert == Insert(1, (b"v",))


@pytest.mark.parametrize(
    ("timestamp", "unix_us"),
    [
        # Found by the round trip: int(timestamp()) made these a second late.
        ("1969-01-01 00:00:00.000001+00", -31_535_999_999_999),
        ("1969-12-31 23:59:59.5+00", -500_000),
        ("9999-12-31 23:59:59.999999+00", 253_402_300_799_999_999),
        ("2026-11-29 08:34:57.5099+05:30", 1_795_921_497_509_900),
    ],
)
def test_wal2json_commit_timestamps_are_exact(timestamp: str, unix_us: int) -> None:
    message = f'{{"action": "B", "xid": 1, "lsn": "0/1", "timestamp": "{timestamp}"}}'
    (begin,) = Wal2JsonDecoder().decode(message.encode())
    assert begin == Begin(final_lsn=1, commit_time_us=unix_us, xid=1)
