"""The CloudEvents headers of --cloudevents: the mapping, its refusals and fallbacks, and the
created_at text of both relays (the plugins' DateStyle ISO, the poller's to_jsonb) as ce_time."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta, timezone

import pytest
from click.testing import CliRunner
from hypothesis import given
from hypothesis import strategies as st
from test_routing import captured_event
from test_wal2json import outbox_events, records

from cdc_relay.commands.cli import cli
from cdc_relay.errors import UsageError
from cdc_relay.events import Column, Relation, RowMapper, SchemaError
from cdc_relay.kafka.cloudevents import (
    CloudEvents,
    check_source,
    configure,
    default_source,
    rfc3339,
)
from cdc_relay.kafka.routing import Router

SOURCE = "/cdc-relay/shop/public.outbox_events"
CE = CloudEvents(SOURCE)


def ce_headers(**changes: object) -> dict[str, bytes]:
    headers = CE.headers(replace(captured_event(), **changes))
    assert len(headers) == len(dict(headers)), "a header twice"
    return dict(headers)


def test_the_headers_of_a_captured_pgoutput_row() -> None:
    plain = Router().route(captured_event())
    message = Router(cloudevents=CE).route(captured_event())
    assert (message.topic, message.key, message.value) == (plain.topic, plain.key, plain.value)
    assert message.headers[: len(plain.headers)] == plain.headers  # the relay's own come first
    assert message.headers[len(plain.headers) :] == [
        ("ce_specversion", b"1.0"),
        ("ce_id", b"6f1c1b7e-2a51-4c43-9d0e-3f5d2b8a9c01"),
        ("ce_source", SOURCE.encode()),
        ("ce_type", b"order.created"),
        ("ce_time", b"2026-11-29T08:34:57.509194Z"),  # created_at 2026-11-29 08:34:57.509194+00
        ("ce_subject", b"o-1"),
        ("content-type", b"application/json"),
    ]


def test_header_columns_stay_before_the_cloudevents_headers() -> None:
    event = replace(captured_event(), headers=(("tenant", b"t-1"),))
    names = [name for name, _ in Router(cloudevents=CE).route(event).headers]
    assert names[:4] == ["id", "event_type", "aggregate_type", "tenant"]
    assert names[4] == "ce_specversion"


def test_wal2json_and_pgoutput_rows_get_the_same_cloudevents_headers() -> None:
    router = Router(cloudevents=CE)
    from_pgoutput = [router.route(e) for e in outbox_events(records("pgoutput"))]
    from_wal2json = [router.route(e) for e in outbox_events(records("wal2json"))]
    assert from_wal2json == from_pgoutput
    assert all(dict(m.headers).get("ce_time", b"").endswith(b"Z") for m in from_pgoutput)


@pytest.mark.parametrize("event_type", ["", "order\ncreated", "tab\there", "nul\x00", "\x85"])
def test_an_event_without_a_usable_type_is_refused_not_sent(event_type: str) -> None:
    with pytest.raises(SchemaError, match=r"event_type .*ce_type; give the event one"):
        ce_headers(event_type=event_type)


def test_a_null_type_or_an_empty_id_is_refused() -> None:
    with pytest.raises(SchemaError, match="its event_type is NULL"):
        ce_headers(event_type=None)
    with pytest.raises(SchemaError, match="its id is empty, and CloudEvents requires it as ce_id"):
        ce_headers(id="")


@pytest.mark.parametrize("event_type", ["größe.geändert", "注文.作成", "😀", "a b/c:d#e"])
def test_types_beyond_ascii_go_as_utf8(event_type: str) -> None:
    assert ce_headers(event_type=event_type)["ce_type"] == event_type.encode()


def test_noncharacters_are_not_cloudevents_strings() -> None:
    for bad in ("\ufffe", "\U0001ffff", "\ufdd0"):
        with pytest.raises(SchemaError, match="which CloudEvents does not allow"):
            ce_headers(event_type=f"x{bad}")


@pytest.mark.parametrize(
    ("aggregate_id", "subject"),
    [("o-1", b"o-1"), ("maß-1", "maß-1".encode()), (None, None), ("", None), ("a\nb", None)],
)
def test_the_subject_is_the_aggregate_id_when_cloudevents_takes_it(
    aggregate_id: str | None, subject: bytes | None
) -> None:
    """ce_subject is optional: left out (not refused) for a NULL, empty or control-character
    aggregate_id, which remains the key."""
    assert ce_headers(aggregate_id=aggregate_id).get("ce_subject") == subject


def test_no_created_at_no_time() -> None:
    assert "ce_time" not in ce_headers(created_at=None)
    assert "ce_time" not in ce_headers(created_at=b"infinity")


@pytest.mark.parametrize(
    ("kind", "content_type"),
    [
        ("json", b"application/json"),
        ("text", b"text/plain; charset=utf-8"),
        ("bytes", b"application/octet-stream"),
    ],
)
def test_content_type_follows_the_payload_column(kind: str, content_type: bytes) -> None:
    assert ce_headers(payload_kind=kind)["content-type"] == content_type
    # a tombstone is still the event's message: same headers, no value
    assert ce_headers(payload_kind=kind, payload=None)["content-type"] == content_type


def relation(payload_type: int, created_at_type: int | None = 1184) -> Relation:
    columns = [
        Column("id", 2950),
        Column("aggregate_type", 25),
        Column("aggregate_id", 25),
        Column("event_type", 25),
        Column("payload", payload_type),
    ]
    if created_at_type is not None:
        columns.append(Column("created_at", created_at_type))
    return Relation(16384, "public", "outbox_events", tuple(columns))


@pytest.mark.parametrize(
    ("payload_type", "kind"),
    [(3802, "json"), (114, "json"), (25, "text"), (1043, "text"), (17, "bytes"), (90001, "bytes")],
)
def test_the_row_mapper_knows_the_payload_kind(payload_type: int, kind: str) -> None:
    bytea_types = frozenset({17, 90001})  # 90001: a domain over bytea
    mapper = RowMapper.for_relation(relation(payload_type), bytea_types=bytea_types)
    assert mapper.payload_kind == kind


@pytest.mark.parametrize(("created_at_type", "position"), [(1184, 5), (1114, 5), (25, None)])
def test_only_a_timestamp_created_at_is_read(created_at_type: int, position: int | None) -> None:
    assert RowMapper.for_relation(relation(3802, created_at_type)).created_at == position
    assert RowMapper.for_relation(relation(3802, None)).created_at is None


# -- created_at as ce_time --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "time"),
    [
        # DateStyle ISO, as the plugins send a timestamptz (in the walsender's TimeZone)
        ("2026-01-05 10:00:00.123456+01", "2026-01-05T09:00:00.123456Z"),
        ("2026-01-05 05:30:00.5+05:30", "2026-01-05T00:00:00.500000Z"),
        ("2026-01-05 00:00:00-03", "2026-01-05T03:00:00.000000Z"),
        ("1900-01-01 00:09:21+00:09:21", "1900-01-01T00:00:00.000000Z"),  # local mean time
        ("2026-01-05 10:00:00.1", "2026-01-05T10:00:00.100000Z"),  # timestamp: taken as UTC
        # to_jsonb's ISO 8601, as the poller reads it
        ("2026-01-05T10:00:00.123456+01:00", "2026-01-05T09:00:00.123456Z"),
        ("1900-01-01T00:09:21+00:09:21", "1900-01-01T00:00:00.000000Z"),
        ("2026-01-05T10:00:00.1", "2026-01-05T10:00:00.100000Z"),
        ("0001-01-01T00:00:00+00:00", "0001-01-01T00:00:00.000000Z"),
        ("9999-12-31 23:59:59.999999+00", "9999-12-31T23:59:59.999999Z"),
    ],
)
def test_created_at_becomes_rfc3339_in_utc(text: str, time: str) -> None:
    assert rfc3339(text.encode()) == time.encode()


@pytest.mark.parametrize(
    "text",
    [
        "infinity",
        "-infinity",
        "0044-03-15 12:09:21+00:09:21 BC",
        "0044-03-15T12:00:00 BC",
        "10000-01-01 01:00:00+01",
        "10000-01-01T01:00:00+01:00",
        "9999-12-31 23:30:00-01",  # the year 10000 in UTC
        "0001-01-01 00:30:00+01",  # the year 0 in UTC
    ],
)
def test_times_rfc3339_cannot_write_leave_ce_time_out(text: str) -> None:
    assert rfc3339(text.encode()) is None


@pytest.mark.parametrize(
    "text",
    [
        "01/05/2026 10:00:00.123456 CET",  # DateStyle SQL
        "Mon Jan 05 10:00:00.123456 2026 CET",  # DateStyle Postgres
        "05.01.2026 10:00:00.123456 CET",  # DateStyle German
        "2026-01-05",
        "",
    ],
)
def test_a_created_at_that_is_not_iso_stops_with_the_remedy(text: str) -> None:
    with pytest.raises(SchemaError, match=r"created_at of event e-1 reads .*DateStyle ISO"):
        rfc3339(text.encode(), "e-1")


def _fraction(moment: datetime) -> str:
    return f".{moment.microsecond:06d}".rstrip("0") if moment.microsecond else ""


def _offset(offset: timedelta, iso8601: bool) -> str:
    """An offset as PostgreSQL prints it: +HH, +HH:MM, +HH:MM:SS (DateStyle ISO), always with
    the minutes in to_jsonb's ISO 8601."""
    seconds = int(offset.total_seconds())
    sign = "-" if seconds < 0 else "+"
    hours, rest = divmod(abs(seconds), 3600)
    minutes, seconds = divmod(rest, 60)
    text = f"{sign}{hours:02d}"
    if minutes or seconds or iso8601:
        text += f":{minutes:02d}"
    if seconds:
        text += f":{seconds:02d}"
    return text


@given(
    moment=st.datetimes(
        min_value=datetime(2, 1, 1),  # naive: made aware below
        max_value=datetime(9998, 12, 31),
    ),
    offset_seconds=st.integers(min_value=-15 * 3600, max_value=15 * 3600),
)
def test_both_relays_texts_of_one_moment_give_the_same_time(
    moment: datetime, offset_seconds: int
) -> None:
    offset = timedelta(seconds=offset_seconds)
    local = moment.replace(tzinfo=timezone(offset))
    date = f"{local.year:04d}-{local.month:02d}-{local.day:02d}"
    clock = f"{local.hour:02d}:{local.minute:02d}:{local.second:02d}{_fraction(local)}"
    plugin = f"{date} {clock}{_offset(offset, iso8601=False)}"
    poller = f"{date}T{clock}{_offset(offset, iso8601=True)}"
    expected = local.astimezone(UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")
    assert rfc3339(plugin.encode()) == rfc3339(poller.encode()) == expected.encode()


# -- ce_source --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "source",
    [
        SOURCE,
        "urn:shop:outbox",
        "https://shop.example/outbox?x=1#frag",
        "/cdc-relay/gr%C3%B6%C3%9Fe/x",
        "outbox",
        "a/b:c",
    ],
)
def test_uri_references_are_sources(source: str) -> None:
    assert check_source(source) == source


@pytest.mark.parametrize("source", ["", " ", "a b", "größe", "/x%zz", "/x%", ":x", "1a:b", "a\nb"])
def test_what_is_no_uri_reference_is_refused(source: str) -> None:
    with pytest.raises(UsageError, match="is not a URI-reference"):
        check_source(source)


def test_the_default_source_names_the_database_and_the_table() -> None:
    assert default_source("shop", "public", "outbox_events") == SOURCE
    odd = default_source("my shop", "Sales", "größe/v2#x")
    assert odd == "/cdc-relay/my%20shop/Sales.gr%C3%B6%C3%9Fe%2Fv2%23x"
    assert check_source(odd) == odd


def test_configure_checks_options_before_any_connection() -> None:
    dsn = "host=db.invalid"  # never connected to: a source is given, or nothing is asked
    assert configure(False, None, dsn, "outbox_events") is None
    assert configure(True, "urn:x", dsn, "outbox_events") == CloudEvents("urn:x")
    with pytest.raises(UsageError, match="without --cloudevents"):
        configure(False, "urn:x", dsn, "outbox_events")
    for column in ("ce_id", "CE_Source", "Content-Type"):
        with pytest.raises(UsageError, match=f"--header-column {column} would send"):
            configure(True, "urn:x", dsn, "outbox_events", ("tenant", column))


@pytest.mark.parametrize("command", ["stream", "poll", "setup-slot"])
def test_a_bad_source_is_refused_while_parsing(command: str) -> None:
    args = [command, "--cloudevents", "--cloudevents-source", "a b"]
    result = CliRunner().invoke(cli, [*args, "--dsn", "host=db.invalid"])
    assert isinstance(result.exception, UsageError)
    assert "is not a URI-reference" in str(result.exception)
