from __future__ import annotations

import json

import pytest
from capture import pgoutput_messages

from cdc_relay.errors import DecodeError
from cdc_relay.events import (
    UNCHANGED,
    Begin,
    Commit,
    Ignored,
    Insert,
    LogicalMessage,
    Relation,
    RowMapper,
)
from cdc_relay.postgres import pgoutput


def decode_step(step: str) -> list[object]:
    return [pgoutput.decode(m) for m in pgoutput_messages(step)]


def test_single_insert_decodes_to_begin_relation_insert_commit() -> None:
    begin, relation, insert, commit = decode_step("single insert")
    assert isinstance(begin, Begin)
    assert isinstance(relation, Relation)
    assert isinstance(insert, Insert)
    assert isinstance(commit, Commit)
    assert relation.qualified_name == "public.outbox_events"
    assert [c.name for c in relation.columns][:6] == [
        "id",
        "seq",
        "aggregate_type",
        "aggregate_id",
        "event_type",
        "payload",
    ]
    assert insert.relid == relation.relid
    assert commit.commit_lsn == begin.final_lsn
    assert commit.end_lsn > commit.commit_lsn
    assert commit.commit_time_us == begin.commit_time_us
    # 2026 or later, in Unix microseconds: the PostgreSQL epoch offset was applied
    assert commit.commit_time_us > 1_700_000_000_000_000


def test_insert_maps_to_outbox_event_with_payload_bytes_as_stored() -> None:
    begin, relation, insert, _ = decode_step("single insert")
    assert isinstance(begin, Begin) and isinstance(relation, Relation)
    assert isinstance(insert, Insert)
    event = RowMapper.for_relation(relation).event(insert, begin)
    assert event.id == "6f1c1b7e-2a51-4c43-9d0e-3f5d2b8a9c01"
    assert (event.aggregate_type, event.aggregate_id) == ("order", "o-1")
    assert event.event_type == "order.created"
    assert event.payload == b'{"items": [1, 2], "total": 42}'  # jsonb's canonical text
    assert event.commit_lsn == begin.final_lsn
    assert event.xid == begin.xid


def test_non_ascii_and_toasted_values_arrive_whole() -> None:
    insert = decode_step("non-ascii payload")[1]
    assert isinstance(insert, Insert)
    assert insert.values[3] == "ö-3".encode()
    payload = insert.values[5]
    assert isinstance(payload, bytes)
    assert json.loads(payload) == {"name": "Zoë 😀", "city": "Łódź"}

    big = decode_step("toasted payload")[1]
    assert isinstance(big, Insert)
    blob = big.values[5]
    assert isinstance(blob, bytes)
    assert len(json.loads(blob)["blob"]) == 200 * 32


def test_two_inserts_keep_their_order_in_one_transaction() -> None:
    records = decode_step("two inserts in one transaction")
    inserts = [r for r in records if isinstance(r, Insert)]
    assert [i.values[3] for i in inserts] == [b"o-2", b"c-1"]


def test_insert_then_delete_still_carries_the_insert() -> None:
    records = decode_step("insert then delete")
    assert [type(r).__name__ for r in records] == ["Begin", "Insert", "Commit"]


def test_update_delete_truncate_are_ignored_without_harm() -> None:
    kinds = {
        r.kind
        for step in ("update", "delete", "truncate")
        for r in decode_step(step)
        if isinstance(r, Ignored)
    }
    assert kinds == {"update", "delete", "truncate"}


def test_transactional_logical_message_decodes_with_prefix_and_content() -> None:
    begin, message, commit = decode_step("logical message")
    assert isinstance(begin, Begin) and isinstance(commit, Commit)
    assert isinstance(message, LogicalMessage)
    assert message.transactional
    assert message.prefix == "outbox"
    assert message.content == b'{"id": "m-1"}'
    assert begin.final_lsn >= message.lsn


def test_schema_change_sends_a_new_relation_with_the_added_column() -> None:
    relation = decode_step("insert after schema change")[1]
    assert isinstance(relation, Relation)
    assert relation.columns[-1].name == "tenant"
    assert relation.columns[-1].type_oid == 25  # text


def test_unchanged_toast_value_is_distinct_from_null() -> None:
    message = bytes.fromhex("49000040024e0002") + b"n" + b"u"
    record = pgoutput.decode(message)
    assert isinstance(record, Insert)
    assert record.values == (None, UNCHANGED)


@pytest.mark.parametrize(
    "message",
    [b"", b"Z", b"B\x00", b"I\x00\x00\x40\x02X", b"R\x00\x00\x00\x01no-terminator"],
)
def test_bad_input_raises_decode_error(message: bytes) -> None:
    with pytest.raises(DecodeError):
        pgoutput.decode(message)


def test_every_truncation_of_every_captured_message_raises_decode_error() -> None:
    for message in pgoutput_messages():
        for end in range(len(message)):
            with pytest.raises(DecodeError):
                pgoutput.decode(message[:end])
        with pytest.raises(DecodeError):
            pgoutput.decode(message + b"\x00")


def test_publication_names_go_quoted_so_pgoutput_neither_folds_nor_splits_them() -> None:
    assert pgoutput.publication_names("cdc_relay_outbox") == '"cdc_relay_outbox"'
    assert pgoutput.publication_names("OutboxPub") == '"OutboxPub"'
    assert pgoutput.publication_names('a "b", c', "d") == '"a ""b"", c","d"'
