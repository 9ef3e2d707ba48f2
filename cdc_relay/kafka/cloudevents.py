"""CloudEvents (``--cloudevents``): the Kafka protocol binding's binary content mode.

The message stays as it is (key, value, the relay's own headers); the event's context
attributes are added as ``ce_*`` headers and its data's media type as ``content-type``. Both
relays build them here from the same ``OutboxEvent`` fields, so both send the same bytes.

With ``--trace-column``, the Distributed Tracing extension's attributes too (``ce_traceparent``,
``ce_tracestate``): the trace the event started in, the same as the W3C ``traceparent`` and
``tracestate`` headers the message carries (one hop, the relay's own span not among them), and
only for a valid traceparent, which the extension requires.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta, timezone
from urllib.parse import quote

import psycopg

from cdc_relay.errors import PreflightError, UsageError
from cdc_relay.events import OutboxEvent, PayloadKind, SchemaError
from cdc_relay.postgres.connection import connect
from cdc_relay.postgres.tables import find_table

SPEC_VERSION = b"1.0"

CONTENT_TYPES: dict[PayloadKind, bytes] = {
    "json": b"application/json",
    "text": b"text/plain; charset=utf-8",  # the database is UTF8 (checked at start-up)
    "bytes": b"application/octet-stream",
}

# CloudEvents' String type excludes control characters, surrogates and noncharacters.
_NOT_CE_STRING = re.compile(
    "[\x00-\x1f\x7f-\x9f\ud800-\udfff\ufdd0-\ufdef\ufffe\uffff"
    + "".join(f"{chr(plane << 16 | 0xFFFE)}{chr(plane << 16 | 0xFFFF)}" for plane in range(1, 17))
    + "]"
)

# RFC 3986 URI-reference characters; % only as the start of an escape.
_URI_REFERENCE = re.compile(r"(?:[A-Za-z0-9\-._~:/?#\[\]@!$&'()*+,;=]|%[0-9A-Fa-f]{2})+")
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*:")

# A timestamp as PostgreSQL prints it: DateStyle ISO in the stream (the plugins send the
# output function's text) and to_jsonb's ISO 8601 in the poller; an offset only for timestamptz.
_TIMESTAMP = re.compile(
    r"(\d{4,})-(\d\d)-(\d\d)[ T](\d\d):(\d\d):(\d\d)(?:\.(\d{1,6}))?"
    r"(?:([+-])(\d\d)(?::?(\d\d))?(?::?(\d\d))?)?( BC)?"
)


def _problem(text: str) -> str | None:
    """Why ``text`` is not a CloudEvents String (empty included); None if it is one."""
    if not text:
        return "is empty"
    bad = _NOT_CE_STRING.search(text)
    if bad:
        return f"holds the character U+{ord(bad[0]):04X}, which CloudEvents does not allow"
    return None


def check_source(source: str) -> str:
    """``source`` if it is a URI-reference CloudEvents accepts; a UsageError saying why not."""
    if not _URI_REFERENCE.fullmatch(source) or (
        ":" in source.split("/", 1)[0] and not _SCHEME.match(source)
    ):
        raise UsageError(
            f"--cloudevents-source {source!r} is not a URI-reference (RFC 3986): use ASCII "
            "letters, digits, -._~:/?#[]@!$&'()*+,;= and %XX escapes, e.g. "
            "/cdc-relay/shop/public.outbox_events or urn:shop:outbox"
        )
    return source


def default_source(database: str, schema: str, table: str) -> str:
    """``/cdc-relay/<database>/<schema>.<table>``, each name percent-encoded (UTF-8)."""
    return f"/cdc-relay/{quote(database, safe='')}/{quote(schema, safe='')}.{quote(table, safe='')}"


def source_of(dsn: str, table: str) -> str:
    """The default source of the outbox table ``table`` names, in the database ``dsn`` names
    (resolved as the relays resolve it, so both relays agree however --table is spelled)."""
    with connect(dsn) as conn:
        try:
            found = find_table(conn, table)
        except psycopg.OperationalError:
            raise
        except psycopg.DatabaseError as exc:  # e.g. a name with too many dots
            first_line = (str(exc).strip().splitlines() or ["no message"])[0]
            raise PreflightError(
                f"--table {table!r} is not a table name PostgreSQL reads: {first_line}"
            ) from None
        if found is None:
            raise PreflightError(f"table {table} does not exist; check --table")
        return default_source(conn.info.dbname, found.schema, found.name)


def rfc3339(text: bytes, event_id: str = "") -> bytes | None:
    """A created_at timestamp as PostgreSQL printed it, as RFC 3339 in UTC with microseconds
    (``2026-01-05T09:00:00.123456Z``); a timestamp without time zone is taken as UTC.

    None when RFC 3339 cannot write it (infinity, BC, beyond the year 9999 in UTC). A
    SchemaError for text that is no ISO timestamp (a session whose DateStyle is not ISO).
    """
    match = _TIMESTAMP.fullmatch(text.decode(errors="replace"))
    if match is None:
        if text in (b"infinity", b"-infinity"):
            return None
        raise SchemaError(
            f"created_at of event {event_id} reads {text.decode(errors='replace')!r}, not "
            "PostgreSQL's ISO output, so it cannot become ce_time: let the relay's sessions "
            "use DateStyle ISO (the default), e.g. options='-c DateStyle=ISO' in the DSN or "
            "ALTER ROLE ... SET DateStyle = ISO"
        )
    year, month, day, hour, minute, second, fraction, sign, oh, om, os_, bc = match.groups()
    if bc or len(year) > 4:
        return None
    offset = timedelta(hours=int(oh or 0), minutes=int(om or 0), seconds=int(os_ or 0))
    try:
        moment = datetime(
            int(year),
            int(month),
            int(day),
            int(hour),
            int(minute),
            int(second),
            int((fraction or "0").ljust(6, "0")),
            tzinfo=timezone(-offset if sign == "-" else offset),
        ).astimezone(UTC)
    except (ValueError, OverflowError):  # the year 0 or 10000 in UTC
        return None
    # not strftime, whose %Y leaves years before 1000 without their leading zeros
    return (
        f"{moment.year:04d}-{moment.month:02d}-{moment.day:02d}T{moment.hour:02d}:"
        f"{moment.minute:02d}:{moment.second:02d}.{moment.microsecond:06d}Z"
    ).encode()


@dataclass(frozen=True)
class CloudEvents:
    """The CloudEvents headers of every event; ``source`` is checked and fixed at start-up."""

    source: str

    def headers(self, event: OutboxEvent) -> list[tuple[str, bytes]]:
        """``ce_specversion``, ``ce_id``, ``ce_source``, ``ce_type``, then ``ce_time``,
        ``ce_subject``, ``ce_traceparent`` and ``ce_tracestate`` when the event has them, and
        ``content-type``; a SchemaError when a required attribute cannot be made."""
        for attribute, field, value in (
            ("ce_id", "id", event.id),
            ("ce_type", "event_type", event.event_type),
        ):
            problem = _problem(value) if isinstance(value, str) else "is NULL"
            if problem:
                raise SchemaError(
                    f"event {event.id} ({event.event_type!r}, aggregate {event.aggregate_id}): "
                    f"its {field} {problem}, and CloudEvents requires it as {attribute}; give "
                    "the event one (poll tries a row again after it is updated), or relay it "
                    "without --cloudevents"
                )
        headers = [
            ("ce_specversion", SPEC_VERSION),
            ("ce_id", event.id.encode()),
            ("ce_source", self.source.encode()),
            ("ce_type", event.event_type.encode()),
        ]
        if event.created_at is not None:
            time = rfc3339(event.created_at, event.id)
            if time is not None:
                headers.append(("ce_time", time))
        subject = event.aggregate_id
        if subject is not None and _problem(subject) is None:
            headers.append(("ce_subject", subject.encode()))
        trace = event.trace
        if trace is not None and trace.valid and trace.traceparent is not None:
            headers.append(("ce_traceparent", trace.traceparent))
            state = trace.tracestate
            if state is not None and _problem(state.decode(errors="replace")) is None:
                headers.append(("ce_tracestate", state))
        headers.append(("content-type", CONTENT_TYPES[event.payload_kind]))
        return headers


def configure(
    enabled: bool,
    source: str | None,
    dsn: str,
    table: str,
    header_columns: Iterable[str] = (),
) -> CloudEvents | None:
    """The CloudEvents settings of ``--cloudevents`` and ``--cloudevents-source``; without a
    source, the default one of the outbox table (which needs the database)."""
    if not enabled:
        if source is not None:
            raise UsageError("--cloudevents-source is given without --cloudevents; add it")
        return None
    clashes = [
        column
        for column in header_columns
        if column.lower() == "content-type" or column.lower().startswith("ce_")
    ]
    if clashes:
        raise UsageError(
            f"--header-column {clashes[0]} would send a header named like the CloudEvents "
            "headers of --cloudevents (ce_*, content-type); rename the column or leave it out"
        )
    return CloudEvents(check_source(source) if source is not None else source_of(dsn, table))
