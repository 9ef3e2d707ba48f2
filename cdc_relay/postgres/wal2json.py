"""Decoder of wal2json's format-version 2 into the records pgoutput yields.

Pure: no I/O. One piece of state: wal2json names a row's columns in every message, where
pgoutput sends a Relation once, so the decoder gives each distinct column layout a relation
id and yields a Relation before the first row of a new layout. The stream then treats both
plugins alike, and the two produce byte-identical Kafka messages.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from cdc_relay.errors import DecodeError, UsageError
from cdc_relay.events import (
    BYTEA_OID,
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
from cdc_relay.lsn import parse


def _raw(text: str) -> str:
    """Numbers keep the digits PostgreSQL printed (pgoutput sends the same text)."""
    return text


def _lsn(value: Any) -> int:
    if not isinstance(value, str):
        raise DecodeError(f"LSN {value!r} is not a string")
    try:
        return parse(value)
    except UsageError:
        raise DecodeError(f"malformed LSN {value!r}") from None


_UNIX_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def _timestamp_us(value: Any) -> int:
    if not isinstance(value, str):
        raise DecodeError(f"timestamp {value!r} is not a string")
    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        raise DecodeError(f"malformed timestamp {value!r}") from None
    if moment.tzinfo is None:
        raise DecodeError(f"timestamp {value!r} has no time zone")
    # Integer arithmetic: int(moment.timestamp()) rounds toward zero, a second off before 1970.
    return (moment - _UNIX_EPOCH) // timedelta(microseconds=1)


def _value(value: Any) -> Value:
    if value is None:
        return None
    if isinstance(value, bool):
        return b"t" if value else b"f"
    if isinstance(value, str):
        return _utf8(value)
    return json.dumps(value).encode()


def _utf8(text: str) -> bytes:
    # JSON can escape a lone surrogate ("\ud800"), which has no UTF-8 form.
    try:
        return text.encode()
    except UnicodeEncodeError:
        raise DecodeError(f"wal2json text {text[:40]!r} has a lone surrogate") from None


def _field(message: dict[str, Any], name: str, kind: type) -> Any:
    value = message.get(name)
    if not isinstance(value, kind):
        raise DecodeError(f"wal2json {message.get('action')!r} message lacks a valid {name!r}")
    return value


# Options for START_REPLICATION; the stream adds add-tables and add-msg-prefixes.
START_OPTIONS = {
    "format-version": "2",
    "include-xids": "1",
    "include-timestamp": "1",
    "include-lsn": "1",
    "include-type-oids": "1",
    "actions": "insert",
}


def table_filter(schema: str, table: str) -> str:
    """wal2json's add-tables value for one table: ``,``, ``.``, ``*`` and ``\\`` escaped."""
    return f"{_escape(schema)}.{_escape(table)}"


def _escape(name: str) -> str:
    return "".join("\\" + c if c in ",.*\\ " else c for c in name)


class Wal2JsonDecoder:
    """Turns wal2json (format-version 2) messages into :mod:`cdc_relay.events` records."""

    def __init__(self, bytea_types: frozenset[int] = frozenset({BYTEA_OID})) -> None:
        self._relations: dict[tuple[Any, ...], Relation] = {}
        self._bytea_types = bytea_types  # bytea and its domains (their type OIDs)

    def decode(self, message: bytes) -> Sequence[Record]:
        """Decode one message; a row of a new column layout comes after its Relation."""
        try:
            document = json.loads(message, parse_int=_raw, parse_float=_raw)
        except (ValueError, RecursionError) as exc:
            raise DecodeError(f"wal2json message is not JSON: {exc}") from None
        if not isinstance(document, dict):
            raise DecodeError("wal2json message is not a JSON object")
        action = document.get("action")
        if action == "I":
            return self._insert(document)
        if action == "B":
            return (
                Begin(
                    final_lsn=_lsn(document.get("lsn")),
                    commit_time_us=_timestamp_us(document.get("timestamp")),
                    xid=_xid(document.get("xid")),
                ),
            )
        if action == "C":
            return (
                Commit(
                    commit_lsn=_lsn(document.get("lsn")),
                    end_lsn=_lsn(document.get("nextlsn")),
                    commit_time_us=_timestamp_us(document.get("timestamp")),
                ),
            )
        if action == "M":
            transactional = document.get("transactional")
            if not isinstance(transactional, bool):
                raise DecodeError("wal2json message lacks a valid 'transactional'")
            return (
                LogicalMessage(
                    transactional=transactional,
                    lsn=_lsn(document.get("lsn")),
                    prefix=_field(document, "prefix", str),
                    content=_utf8(_field(document, "content", str)),
                ),
            )
        if action in ("U", "D", "T"):
            return (Ignored({"U": "update", "D": "delete", "T": "truncate"}[action]),)
        raise DecodeError(f"unknown wal2json action {action!r}")

    def _insert(self, document: dict[str, Any]) -> Sequence[Record]:
        schema = _field(document, "schema", str)
        table = _field(document, "table", str)
        columns = _field(document, "columns", list)
        names: list[str] = []
        oids: list[int] = []
        values: list[Value] = []
        for column in columns:
            if not isinstance(column, dict) or not isinstance(column.get("name"), str):
                raise DecodeError("wal2json column without a name")
            names.append(column["name"])
            oid = _digits(column.get("typeoid")) or 0
            oids.append(oid)
            value = _value(column.get("value"))
            if oid in self._bytea_types and isinstance(value, bytes):
                # Hex output (the relay sets it): wal2json drops the \x of bytea itself but
                # not of a domain over it; pgoutput's form has it.
                if not value.startswith(b"\\x"):
                    value = b"\\x" + value
            values.append(value)
        key = (schema, table, tuple(names), tuple(oids))
        relation = self._relations.get(key)
        records: list[Record] = []
        if relation is None:
            relation = Relation(
                relid=len(self._relations) + 1,
                namespace=schema,
                name=table,
                columns=tuple(Column(n, o) for n, o in zip(names, oids, strict=True)),
            )
            self._relations[key] = relation
            records.append(relation)
        records.append(Insert(relid=relation.relid, values=tuple(values)))
        return records


def _xid(value: Any) -> int:
    xid = _digits(value)
    if xid is None:
        raise DecodeError(f"xid {value!r:.60} is not a number")
    return xid


def _digits(value: Any) -> int | None:
    """A JSON number's ASCII digits (parse_int keeps them as text) as an int, else None.

    str.isdigit() alone would let through "²", which int() refuses, and int() refuses more
    than 4,300 digits; 20 digits hold any 64-bit number.
    """
    if isinstance(value, str) and value.isascii() and value.isdigit() and len(value) <= 20:
        return int(value)
    return None
