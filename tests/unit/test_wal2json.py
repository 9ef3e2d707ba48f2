from __future__ import annotations

from collections.abc import Iterable

import pytest
from capture import messages

from cdc_relay.errors import DecodeError
from cdc_relay.events import (
    Begin,
    Commit,
    Insert,
    LogicalMessage,
    OutboxEvent,
    Record,
    Relation,
    RowMapper,
)
from cdc_relay.kafka.routing import Router
from cdc_relay.postgres import pgoutput
from cdc_relay.postgres.wal2json import Wal2JsonDecoder, table_filter


def records(plugin: str) -> list[Record]:
    if plugin == "pgoutput":
        return [pgoutput.decode(m) for m in messages("pgoutput")]
    decoder = Wal2JsonDecoder()
    return [r for m in messages("wal2json") for r in decoder.decode(m)]


def outbox_events(stream: Iterable[Record]) -> list[OutboxEvent]:
    """What the relay makes of a stream: events of the outbox table, with their commit."""
    mappers: dict[int, RowMapper] = {}
    begin: Begin | None = None
    events = []
    for record in stream:
        if isinstance(record, Relation):
            mappers[record.relid] = RowMapper.for_relation(record)
        elif isinstance(record, Begin):
            begin = record
        elif isinstance(record, Insert):
            assert begin is not None
            events.append(mappers[record.relid].event(record, begin))
    return events


def test_wal2json_and_pgoutput_yield_the_same_events_and_kafka_messages() -> None:
    from_pgoutput = outbox_events(records("pgoutput"))
    from_wal2json = outbox_events(records("wal2json"))
    assert len(from_pgoutput) == 7
    assert from_wal2json == from_pgoutput
    router = Router()
    assert [router.route(e) for e in from_wal2json] == [router.route(e) for e in from_pgoutput]


def test_wal2json_transactions_have_the_same_boundaries_as_pgoutput() -> None:
    def boundaries(plugin: str) -> list[tuple[int, int]]:
        stream = records(plugin)
        commits = [r for r in stream if isinstance(r, Commit)]
        begins = [r for r in stream if isinstance(r, Begin)]
        return [(b.final_lsn, c.end_lsn) for b, c in zip(begins, commits, strict=True)]

    pg = boundaries("pgoutput")
    wj = boundaries("wal2json")
    # wal2json also reports the transactions that changed nothing it publishes (DDL).
    assert set(pg) <= set(wj)
    assert all(begin < end for begin, end in wj)


def test_wal2json_logical_message_matches_pgoutput() -> None:
    (pg,) = [r for r in records("pgoutput") if isinstance(r, LogicalMessage)]
    (wj,) = [r for r in records("wal2json") if isinstance(r, LogicalMessage)]
    assert wj == pg


def test_a_new_column_layout_gets_a_new_relation() -> None:
    relations = [r for r in records("wal2json") if isinstance(r, Relation)]
    assert [len(r.columns) for r in relations] == [11, 12]
    assert relations[1].columns[-1].name == "tenant"
    assert relations[0].relid != relations[1].relid


@pytest.mark.parametrize(
    "message",
    [
        b"",
        b"not json",
        b"[]",
        b'{"action": "Z"}',
        b'{"action": "B", "xid": 1, "timestamp": "2026-01-01 00:00:00+00", "lsn": "zz"}',
        b'{"action": "B", "xid": 1, "timestamp": "yesterday", "lsn": "0/1"}',
        b'{"action": "C", "lsn": "0/1", "timestamp": "2026-01-01 00:00:00+00"}',
        b'{"action": "I", "schema": "public", "table": "t", "columns": [{"value": 1}]}',
        b'{"action": "M", "transactional": 1, "lsn": "0/1", "prefix": "p", "content": "c"}',
        b"[" * 100_000,
    ],
    ids=lambda message: repr(message[:40]),
)
def test_bad_input_raises_decode_error(message: bytes) -> None:
    with pytest.raises(DecodeError):
        Wal2JsonDecoder().decode(message)


def test_every_truncation_of_every_captured_message_raises_decode_error() -> None:
    for message in messages("wal2json"):
        for end in range(0, len(message), max(1, len(message) // 200)):
            with pytest.raises(DecodeError):
                Wal2JsonDecoder().decode(message[:end])


def test_add_tables_escapes_the_characters_wal2json_splits_on() -> None:
    assert table_filter("public", "outbox_events") == "public.outbox_events"
    assert table_filter("my.schema", "a,b c") == "my\\.schema.a\\,b\\ c"
