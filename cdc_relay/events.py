"""The neutral records every decoder yields, and the outbox event they become.

Records are never changed once made. The ones made per event (Begin, Commit, Insert,
OutboxEvent) are plain slotted dataclasses all the same, not frozen ones: a frozen
dataclass's ``__init__`` costs four times as much (bench/per_stage.py), paid for every event.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from mypy_extensions import mypyc_attr

from cdc_relay.errors import RelayError, UsageError
from cdc_relay.lsn import Lsn
from cdc_relay.tracecontext import NAMES as TRACE_HEADERS
from cdc_relay.tracecontext import TraceContext
from cdc_relay.tracecontext import parse as parse_trace

# Microseconds between the Unix epoch and PostgreSQL's (2000-01-01 UTC).
PG_EPOCH_OFFSET_US = 946_684_800_000_000

BYTEA_OID = 17
"""pg_type OID of bytea: both plugins send its text form, which the relay turns back into
the stored bytes."""

JSON_OIDS = frozenset({114, 3802})  # json, jsonb
TIMESTAMP_OIDS = frozenset({1114, 1184})  # timestamp, timestamptz

PayloadKind = Literal["json", "text", "bytes"]
"""What the payload column holds, by its declared type: json or jsonb, bytea (or a domain over
it), or anything else, sent as its text."""


def payload_kind(type_oid: int | None, bytea: bool) -> PayloadKind:
    """The kind of a payload column of type ``type_oid``; ``bytea`` if bytea or a domain over it."""
    if bytea:
        return "bytes"
    return "json" if type_oid in JSON_OIDS else "text"


@dataclass(slots=True)
class Begin:
    """A transaction starts; ``final_lsn`` is the LSN of its commit record."""

    final_lsn: Lsn
    commit_time_us: int  # Unix microseconds
    xid: int


@dataclass(slots=True)
class Commit:
    """A transaction ends; ``end_lsn`` is the position to confirm once its events are acked."""

    commit_lsn: Lsn
    end_lsn: Lsn
    commit_time_us: int


@dataclass(frozen=True, slots=True)
class Column:
    name: str
    type_oid: int


@dataclass(frozen=True, slots=True)
class Relation:
    """A table's layout, sent before its first row and again after a schema change."""

    relid: int
    namespace: str
    name: str
    columns: tuple[Column, ...]

    @property
    def qualified_name(self) -> str:
        return f"{self.namespace}.{self.name}"


class _Unchanged:
    """A TOASTed value the plugin did not send because it did not change."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "UNCHANGED"


UNCHANGED = _Unchanged()

Value = bytes | None | _Unchanged
"""A column value as the plugin sent it: text-format bytes, NULL, or unchanged TOAST."""


# A record made per event says ``init=False`` and writes its ``__init__``: compiled
# (cdc_relay/compiled.py), a written one is native code, while the one the dataclass decorator
# makes stays a Python function, six times as slow to call (bench/README.md, "Compiled").
# Equality, repr and fields() are still the decorator's; ``__reduce__`` keeps copy and pickle
# working compiled, where the default one would call ``__init__`` without its arguments.
@dataclass(init=False, slots=True)
class Insert:
    relid: int
    values: tuple[Value, ...]

    def __init__(self, relid: int, values: tuple[Value, ...]) -> None:
        self.relid = relid
        self.values = values

    def __reduce__(self) -> tuple[type[Insert], tuple[int, tuple[Value, ...]]]:
        return (Insert, (self.relid, self.values))


@dataclass(frozen=True, slots=True)
class LogicalMessage:
    """A message written with ``pg_logical_emit_message(transactional, prefix, content)``."""

    transactional: bool
    lsn: Lsn
    prefix: str
    content: bytes


@dataclass(frozen=True, slots=True)
class Ignored:
    """A message the relay does not act on (update, delete, truncate, origin, type, ...)."""

    kind: str


Record = Begin | Commit | Relation | Insert | LogicalMessage | Ignored


# A Python class in a compiled build too: the poller builds events from rows whose columns may
# hold what the annotations do not say (a NULL event_type, where the table allows one), and a
# native class would refuse them where the pure build does not: both builds meet them alike.
@mypyc_attr(native_class=False)
@dataclass(slots=True)
class OutboxEvent:
    """One committed outbox event (a row or a logical decoding message), ready for routing."""

    id: str
    aggregate_type: str
    aggregate_id: str | None  # NULL: a message without a key
    event_type: str
    payload: bytes | None
    commit_lsn: Lsn
    xid: int
    commit_time_us: int
    headers: tuple[tuple[str, bytes], ...] = ()  # extra columns chosen as headers
    # The created_at column's text as PostgreSQL printed it (timestamp types only), if any.
    created_at: bytes | None = None
    payload_kind: PayloadKind = "json"
    # The outbox table of a row, (schema, name), as the relay named it at start (renames
    # do not move its events to other topics); None for a logical decoding message.
    source: tuple[str, str] | None = None
    # What --trace-column holds (None: no such column, NULL, or nothing in it).
    trace: TraceContext | None = None


class SchemaError(RelayError):
    """The outbox table or an event lacks something the relay needs."""


FIELDS = ("id", "aggregate_type", "aggregate_id", "event_type", "payload")
HEADERS = ("id", "event_type", "aggregate_type")
"""The headers every message carries first, in this order (routing.Router.route): a
``--header-column`` of one of these names would send it twice, and a consumer reading the
last one (Java's ``Headers.lastHeader``) would take the column for the event's id or type."""


@dataclass(frozen=True)
class OutboxLayout:
    """Which column holds which field of an event, which extra columns become headers, and
    which holds the event's trace context (sent as the W3C headers traceparent, tracestate)."""

    id: str = "id"
    aggregate_type: str = "aggregate_type"
    aggregate_id: str = "aggregate_id"
    event_type: str = "event_type"
    payload: str = "payload"
    header_columns: tuple[str, ...] = ()
    trace_column: str | None = None

    @classmethod
    def from_options(
        cls,
        mappings: Iterable[str],
        header_columns: Iterable[str],
        trace_column: str | None = None,
    ) -> OutboxLayout:
        """From ``--column FIELD=COLUMN`` pairs, ``--header-column`` names and
        ``--trace-column``."""
        names: dict[str, str] = {}
        for mapping in mappings:
            field, sep, column = mapping.partition("=")
            if not sep or field.strip() not in FIELDS or not column.strip():
                raise UsageError(
                    f"--column {mapping!r}: write FIELD=COLUMN with FIELD one of "
                    f"{', '.join(FIELDS)}, e.g. --column aggregate_type=aggregatetype"
                )
            if field.strip() in names:
                raise UsageError(
                    f"--column {field.strip()} is given twice ({field.strip()}="
                    f"{names[field.strip()]} and {mapping.strip()}); map each field once"
                )
            names[field.strip()] = column.strip()
        headers = tuple(header_columns)
        for column in headers:
            if column in HEADERS:
                raise UsageError(
                    f"--header-column {column}: every message carries a header {column} "
                    "already (the event's), and a second one would be taken for it; rename the "
                    "column or leave it out"
                )
            if headers.count(column) > 1:
                raise UsageError(f"--header-column {column} is given twice; name it once")
        check_trace_column(trace_column, headers)
        return cls(**names, header_columns=headers, trace_column=trace_column)

    def column(self, field: str) -> str:
        return str(getattr(self, field))


def check_trace_column(trace_column: str | None, header_columns: Iterable[str]) -> None:
    """Refuse a ``--trace-column`` that ``--header-column`` would send too, and a header
    column named like the trace headers: either would send a header twice."""
    if trace_column is None:
        return
    if not trace_column.strip():
        raise UsageError("--trace-column is empty; name the column that holds the traceparent")
    for column in header_columns:
        if column == trace_column:
            raise UsageError(
                f"--header-column {column} is the --trace-column too, which sends it as "
                "traceparent (and tracestate); leave it out of --header-column"
            )
        if column.lower() in TRACE_HEADERS:
            raise UsageError(
                f"--header-column {column} would send a header named like the trace context "
                f"of --trace-column {trace_column} ({', '.join(TRACE_HEADERS)}); rename the "
                "column or leave it out"
            )


@dataclass(frozen=True, slots=True)
class RowMapper:
    """Turns an Insert into an OutboxEvent, by the column positions of one Relation."""

    relid: int
    id: int
    aggregate_type: int
    aggregate_id: int
    event_type: int
    payload: int
    headers: tuple[tuple[str, int], ...]
    payload_is_bytea: bool = False
    created_at: int | None = None  # position of a timestamp column named created_at
    payload_kind: PayloadKind = "json"
    source: tuple[str, str] | None = None  # the outbox table, for OutboxEvent.source
    trace: int | None = None  # position of --trace-column

    @classmethod
    def for_relation(
        cls,
        relation: Relation,
        layout: OutboxLayout | None = None,
        bytea_types: frozenset[int] = frozenset({BYTEA_OID}),
        source: tuple[str, str] | None = None,
    ) -> RowMapper:
        """The mapper of ``relation``'s rows; ``bytea_types`` are bytea and its domains,
        ``source`` the outbox table its events name (the topic template's fields)."""
        layout = layout or OutboxLayout()
        positions = {column.name: i for i, column in enumerate(relation.columns)}
        missing = [layout.column(f) for f in FIELDS if layout.column(f) not in positions]
        if missing:
            raise SchemaError(
                f"table {relation.qualified_name} has no column {', '.join(missing)}; "
                "restore it (see cdc-relay schema show outbox) or map yours with --column, "
                "then restart the relay: it resumes after the last event Kafka acknowledged"
            )
        trace = layout.trace_column
        if trace is not None and trace not in positions:
            # Unlike a header column's, its absence is no choice: most likely a typo, or a
            # migration that dropped it, and every event would go out without its trace.
            raise SchemaError(
                f"table {relation.qualified_name} has no column {trace} (--trace-column); "
                "add it back, or restart the relay naming the right column or without "
                "--trace-column: it resumes after the last event Kafka acknowledged"
            )
        # A header column that is gone is optional: the header is left out.
        headers = tuple(
            (name, positions[name]) for name in layout.header_columns if name in positions
        )
        payload_type = relation.columns[positions[layout.payload]].type_oid
        created_at = positions.get("created_at")
        if created_at is not None and relation.columns[created_at].type_oid not in TIMESTAMP_OIDS:
            created_at = None
        return cls(
            relid=relation.relid,
            id=positions[layout.id],
            aggregate_type=positions[layout.aggregate_type],
            aggregate_id=positions[layout.aggregate_id],
            event_type=positions[layout.event_type],
            payload=positions[layout.payload],
            headers=headers,
            payload_is_bytea=payload_type in bytea_types,
            created_at=created_at,
            payload_kind=payload_kind(payload_type, payload_type in bytea_types),
            source=source,
            trace=None if trace is None else positions[trace],
        )

    def event(self, row: Insert, begin: Begin) -> OutboxEvent:
        values = row.values
        try:
            raw_id = values[self.id]
            aggregate_type = values[self.aggregate_type]
            aggregate_id = values[self.aggregate_id]
            event_type = values[self.event_type]
            payload = values[self.payload]
        except IndexError:
            raise SchemaError("a row arrived with fewer columns than its table announced") from None
        # Every event passes here: the common case (text values, a payload as stored) is
        # tested inline, the rest goes through the checks that explain what is wrong.
        if type(raw_id) is bytes and type(aggregate_type) is bytes and type(event_type) is bytes:
            event_id = raw_id.decode()
            type_text = aggregate_type.decode()
            event_type_text = event_type.decode()
        else:
            event_id = _text(raw_id, "id")
            type_text = _text(aggregate_type, "aggregate_type", event_id)
            event_type_text = _text(event_type, "event_type", event_id)
        if type(payload) is not bytes or self.payload_is_bytea:
            payload = _payload(payload, self.payload_is_bytea)
        created_at = None if self.created_at is None else values[self.created_at]
        trace = None
        if self.trace is not None and type(stored := values[self.trace]) is bytes:
            trace = parse_trace(stored)
        return OutboxEvent(
            event_id,
            type_text,
            None if aggregate_id is None else _text(aggregate_id, "aggregate_id"),
            event_type_text,
            payload,
            begin.final_lsn,
            begin.xid,
            begin.commit_time_us,
            tuple(
                (name, value)
                for name, position in self.headers
                if isinstance(value := values[position], bytes)
            )
            if self.headers
            else (),
            created_at if type(created_at) is bytes else None,  # not NULL
            self.payload_kind,
            self.source,
            trace,
        )


def _text(value: Value, column: str, event_id: str | None = None) -> str:
    if not isinstance(value, bytes):
        which = f"event {event_id}" if event_id else "a new row"
        raise SchemaError(f"outbox column {column} is NULL in {which}; make the column NOT NULL")
    return value.decode()


def _payload(value: Value, bytea: bool = False) -> bytes | None:
    if isinstance(value, _Unchanged):
        # An INSERT always carries every value; UNCHANGED here means a plugin bug.
        raise SchemaError("the payload of a new outbox row arrived without its value")
    if bytea and value is not None:
        return bytea_from_text(value)
    return value


_BYTEA_ESCAPE = re.compile(rb"\\\\|\\[0-3][0-7]{2}")


def bytea_from_text(text: bytes) -> bytes:
    """The bytes of a bytea value from its text form, as the plugins send it: hex
    (``\\x0a0b``, the default) or escape (``bytea_output = escape``)."""
    if text.startswith(b"\\x"):
        try:
            return bytes.fromhex(text[2:].decode("ascii"))
        except ValueError:
            raise SchemaError("a bytea payload arrived in a malformed hex form") from None
    return _BYTEA_ESCAPE.sub(
        lambda m: b"\\" if m[0] == b"\\\\" else bytes([int(m[0][1:], 8)]), text
    )


def envelope_event(message: LogicalMessage, begin: Begin | None) -> OutboxEvent:
    """An event from a logical decoding message whose content is the JSON envelope
    ``{"v": 2, "id", "aggregate_type", "aggregate_id", "event_type", "payload"}``, the payload
    left out when it is NULL (an envelope without "v", of an older outbox_emit(), has null).

    The payload is written as PostgreSQL prints jsonb, so an event sent this way and the
    same event sent as a table row are byte-identical on Kafka.
    """
    try:
        envelope = json.loads(message.content, parse_int=_Number, parse_float=_Number)
    except (ValueError, RecursionError):
        raise SchemaError(
            f"logical message at {message.lsn:X} with prefix {message.prefix!r} is not JSON; "
            "write it with outbox_emit() (cdc-relay schema outbox)"
        ) from None
    if not isinstance(envelope, dict):
        raise SchemaError(f"logical message at {message.lsn:X} is not a JSON object")

    def text(field: str, required: bool = True) -> str | None:
        value = envelope.get(field)
        if value is None and not required:
            return None
        if not isinstance(value, str | _Number):
            raise SchemaError(f"logical outbox message at {message.lsn:X} lacks a string {field!r}")
        try:
            value.encode()
        except UnicodeEncodeError:  # a lone surrogate escape: no text Kafka's headers can hold
            raise SchemaError(
                f"logical outbox message at {message.lsn:X} has a {field!r} that is not valid "
                "Unicode; write it with outbox_emit() (cdc-relay schema outbox)"
            ) from None
        return str(value)

    # Version 2 (outbox_emit() of cdc-relay schema outbox) leaves the payload out when it is
    # NULL, so that JSON null is the value null; before it, null stood for both.
    if str(envelope.get("v")) == "2":
        missing = "payload" not in envelope
    else:
        missing = envelope.get("payload") is None
    payload = envelope.get("payload")
    try:
        payload_bytes = None if missing else jsonb_text(payload).encode()
    except UnicodeEncodeError:  # a lone surrogate escape: not text PostgreSQL would store
        raise SchemaError(
            f"logical outbox message at {message.lsn:X} has a payload that is not valid "
            "Unicode; write it with outbox_emit() (cdc-relay schema outbox)"
        ) from None
    return OutboxEvent(
        id=str(text("id")),
        aggregate_type=str(text("aggregate_type")),
        aggregate_id=text("aggregate_id", required=False),
        event_type=str(text("event_type")),
        payload=payload_bytes,
        commit_lsn=begin.final_lsn if begin else message.lsn,
        xid=begin.xid if begin else 0,
        commit_time_us=begin.commit_time_us if begin else 0,
    )


def _key_order(key: str) -> tuple[int, bytes]:
    raw = key.encode(errors="surrogatepass")
    return len(raw), raw


@mypyc_attr(native_class=False)  # a native class cannot extend str
class _Number(str):
    """A JSON number kept as the digits written, as jsonb keeps them."""

    __slots__ = ()


def jsonb_text(value: object) -> str:
    """``value`` as PostgreSQL's jsonb output writes it: keys by length then bytes, ", " and
    ": " separators, non-ASCII kept, numbers as written. Without recursion, so a payload
    nested as deep as json.loads reads one is written too (and alike by the compiled build,
    whose calls count no recursion depth)."""
    out: list[str] = []
    # What is left to write, last first: JSON values, and text to write as it is (a 1-tuple,
    # which no JSON value is).
    pending: list[object] = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, tuple):
            out.append(item[0])
        elif isinstance(item, _Number):
            out.append(str(item))
        elif isinstance(item, str):
            out.append(_json_string(item))
        elif item is None:
            out.append("null")
        elif item is True:
            out.append("true")
        elif item is False:
            out.append("false")
        elif isinstance(item, int | float):
            out.append(repr(item))
        elif isinstance(item, list):
            pending.append(("]",))
            for index in range(len(item) - 1, -1, -1):
                pending.append(item[index])
                if index:
                    pending.append((", ",))
            pending.append(("[",))
        elif isinstance(item, dict):
            pending.append(("}",))
            keys = sorted(item, key=_key_order)
            for index in range(len(keys) - 1, -1, -1):
                pending.append(item[keys[index]])
                pending.append((f"{', ' if index else ''}{_json_string(keys[index])}: ",))
            pending.append(("{",))
        else:
            raise SchemaError(f"unexpected JSON value {item!r}")
    return "".join(out)


_ESCAPES = {
    '"': '\\"',
    "\\": "\\\\",
    "\b": "\\b",
    "\f": "\\f",
    "\n": "\\n",
    "\r": "\\r",
    "\t": "\\t",
}


def _json_string(text: str) -> str:
    out = []
    for char in text:
        escaped = _ESCAPES.get(char)
        if escaped is not None:
            out.append(escaped)
        elif char < " ":
            out.append(f"\\u{ord(char):04x}")
        else:
            out.append(char)
    return '"' + "".join(out) + '"'
