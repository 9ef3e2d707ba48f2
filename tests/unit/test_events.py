from __future__ import annotations

import copy
import dataclasses
import json
import pickle

import pytest
from capture import pgoutput_messages

from cdc_relay.errors import UsageError
from cdc_relay.events import (
    Begin,
    Column,
    Insert,
    LogicalMessage,
    OutboxLayout,
    Relation,
    RowMapper,
    SchemaError,
    envelope_event,
    jsonb_text,
)
from cdc_relay.kafka.routing import Message
from cdc_relay.postgres import pgoutput

DEBEZIUM_COLUMNS = ("id", "aggregatetype", "aggregateid", "type", "payload", "tenant")
BEGIN = Begin(final_lsn=100, commit_time_us=1, xid=7)


def relation(*names: str) -> Relation:
    return Relation(1, "public", "outbox", tuple(Column(n, 25) for n in names))


def test_debezium_layout_maps_by_column_name_and_sends_extra_columns_as_headers() -> None:
    layout = OutboxLayout.from_options(
        ["aggregate_type=aggregatetype", "aggregate_id=aggregateid", "event_type=type"],
        ["tenant", "absent"],
    )
    mapper = RowMapper.for_relation(relation(*DEBEZIUM_COLUMNS), layout)
    row = Insert(1, (b"e-1", b"order", b"o-1", b"created", b"{}", b"t-9"))
    event = mapper.event(row, BEGIN)
    assert (event.id, event.aggregate_type, event.aggregate_id) == ("e-1", "order", "o-1")
    assert event.event_type == "created"
    assert event.headers == (("tenant", b"t-9"),)


def test_layout_options_are_checked() -> None:
    with pytest.raises(UsageError, match="FIELD=COLUMN"):
        OutboxLayout.from_options(["kind=type"], [])
    with pytest.raises(UsageError):
        OutboxLayout.from_options(["event_type"], [])
    with pytest.raises(UsageError, match="--column event_type is given twice"):
        OutboxLayout.from_options(["event_type=type", "event_type=kind"], [])


@pytest.mark.parametrize("column", ["id", "event_type", "aggregate_type"])
def test_a_header_column_named_like_a_header_every_message_has_is_refused(column: str) -> None:
    # A consumer reading the last header of the name (Java's lastHeader) would take the
    # column's value for the event's id, its dedup key, or for its type.
    with pytest.raises(UsageError, match=f"--header-column {column}: every message carries"):
        OutboxLayout.from_options([], ["tenant", column])


def test_a_header_column_given_twice_is_refused() -> None:
    with pytest.raises(UsageError, match="--header-column tenant is given twice"):
        OutboxLayout.from_options([], ["tenant", "tenant"])
    # Another case is another header name: Kafka's header keys are case-sensitive.
    assert OutboxLayout.from_options([], ["ID", "tenant"]).header_columns == ("ID", "tenant")


def test_missing_required_column_is_a_schema_error_naming_it() -> None:
    with pytest.raises(SchemaError, match="no column event_type"):
        RowMapper.for_relation(relation("id", "aggregate_type", "aggregate_id", "payload"))


def test_null_aggregate_id_is_kept_as_none_and_null_id_stops() -> None:
    mapper = RowMapper.for_relation(
        relation("id", "aggregate_type", "aggregate_id", "event_type", "payload")
    )
    event = mapper.event(Insert(1, (b"e", b"order", None, b"x", b"{}")), BEGIN)
    assert event.aggregate_id is None
    with pytest.raises(SchemaError, match="column id is NULL"):
        mapper.event(Insert(1, (None, b"order", b"a", b"x", b"{}")), BEGIN)


def test_captured_message_with_a_bare_envelope_is_refused_clearly() -> None:
    message = next(
        r
        for r in (pgoutput.decode(m) for m in pgoutput_messages("logical message"))
        if isinstance(r, LogicalMessage)
    )
    with pytest.raises(SchemaError, match="lacks a string 'aggregate_type'"):
        envelope_event(message, BEGIN)


def test_envelope_event_matches_a_table_row_byte_for_byte() -> None:
    payload = '{"a": null, "b": [1, 2.50, "é"], "aa": {"y": false, "z": true}}'
    content = json.dumps(
        {
            "id": "e-1",
            "aggregate_type": "order",
            "aggregate_id": "o-1",
            "event_type": "created",
            "payload": json.loads(payload),
        }
    ).replace("2.5", "2.50")
    message = LogicalMessage(True, 90, "outbox", content.encode())
    event = envelope_event(message, BEGIN)
    assert event.payload == payload.encode()
    assert event.commit_lsn == BEGIN.final_lsn


@pytest.mark.parametrize(
    ("value", "text"),
    [
        ({"b": 1, "a": 2, "aa": 3}, '{"a": 2, "b": 1, "aa": 3}'),
        (["x\ty", "é", None, True], '["x\\ty", "é", null, true]'),
        ({"": {}}, '{"": {}}'),
    ],
)
def test_jsonb_text_writes_like_postgresql(value: object, text: str) -> None:
    assert jsonb_text(value) == text


def test_envelope_with_a_lone_surrogate_is_a_schema_error_not_a_crash() -> None:
    content = (
        b'{"id": "1", "aggregate_type": "a", "aggregate_id": "b", "event_type": "e", '
        b'"payload": {"\\ud800": 1}}'
    )
    with pytest.raises(SchemaError, match="not valid Unicode"):
        envelope_event(LogicalMessage(True, 1, "outbox", content), BEGIN)


@pytest.mark.parametrize("field", ["id", "aggregate_type", "aggregate_id", "event_type"])
def test_an_envelope_field_with_a_lone_surrogate_is_a_schema_error_not_a_crash(
    field: str,
) -> None:
    envelope = {"id": "1", "aggregate_type": "a", "aggregate_id": "b", "event_type": "e"}
    content = json.dumps({**envelope, field: "\ud800", "payload": {}}).encode()
    with pytest.raises(SchemaError, match=f"has a '{field}' that is not valid Unicode"):
        envelope_event(LogicalMessage(True, 1, "outbox", content), BEGIN)


def test_a_payload_nested_as_deep_as_json_reads_is_written_whole() -> None:
    # json.loads reads about 990 levels; jsonb_text wrote about 330 before it ran out of
    # Python's recursion (pure build) and any depth compiled: both now write what was read.
    depth = 900
    payload = '{"a": ' * depth + "[1, []]" + "}" * depth
    content = (
        json.dumps({"id": "1", "aggregate_type": "a", "aggregate_id": "b", "event_type": "e"})[:-1]
        + f', "payload": {payload}}}'
    )
    event = envelope_event(LogicalMessage(True, 1, "outbox", content.encode()), BEGIN)
    assert event.payload == payload.encode()


def test_records_made_per_event_copy_and_pickle_in_either_build() -> None:
    """Insert and Message write their __init__ for the compiled build (cdc_relay.events); the
    compiled default copy would call it without arguments. Real captured rows, both builds
    (make compiled-check runs this on the compiled one)."""
    records = [pgoutput.decode(m) for m in pgoutput_messages()]
    inserts = [r for r in records if isinstance(r, Insert)]
    assert inserts
    message = Message("outbox.event.order", b"o-1", b"{}", [("id", b"1")], 42)
    for record in [*inserts, message, Message("t", None, None, [])]:
        for copied in (
            copy.copy(record),
            copy.deepcopy(record),
            pickle.loads(pickle.dumps(record)),  # noqa: S301 - bytes it just made
        ):
            assert copied == record
            assert type(copied) is type(record)
    assert Message("t", None, None, []).lsn == 0
    assert dataclasses.fields(Message)[-1].default == 0
