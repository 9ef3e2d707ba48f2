"""cdc-relay trace without services: Kafka's murmur2, and the answer drawn from the facts."""

from __future__ import annotations

import datetime as dt

import pytest

from cdc_relay.kafka.lookup import Found, murmur2, partition_of
from cdc_relay.ops.trace import Pending, Trace, answer

# org.apache.kafka.common.utils.UtilsTest#testMurmur2, as Java's signed ints
JAVA = {
    b"21": -973932308,
    b"foobar": -790332482,
    b"a-little-bit-long-string": -985981536,
    b"a-little-bit-longer-string": -1486304829,
    b"lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8": -58897971,
    b"abc": 479470107,
}


@pytest.mark.parametrize(("key", "signed"), JAVA.items())
def test_murmur2_is_kafkas(key: bytes, signed: int) -> None:
    assert murmur2(key) == signed & 0xFFFFFFFF


def test_the_partition_is_the_positive_hash_modulo_the_count() -> None:
    assert partition_of(b"foobar", 1) == 0
    assert partition_of(b"21", 3) == (-973932308 & 0x7FFFFFFF) % 3


NOW = dt.datetime(2026, 1, 5, 9, 0, tzinfo=dt.UTC)


def pending(active: bool) -> Trace:
    return Trace(
        "e",
        committed=True,
        slot={"slot_name": "s", "active": active, "active_pid": 7, "confirmed_flush_lsn": "0/10"},
        pending=Pending("row", "0/20", NOW, "order", "1", "order.created"),
        confirmed_past_commit=False,
    )


def test_an_event_after_the_confirmed_position_names_the_reason() -> None:
    assert answer(pending(active=False)) == (
        "not on Kafka yet: committed at 0/20 (as a row), after slot s's confirmed position "
        "0/10; no relay is streaming the slot (inactive): start cdc-relay stream"
    )
    assert answer(pending(active=True)).endswith(
        "; the relay (pid 7) is behind, or waits for Kafka's acknowledgement"
    )


def test_on_kafka_with_the_time_from_commit_to_append() -> None:
    trace = Trace("e", committed=True, on_kafka=True, commit_time_source="commit")
    trace.kafka.found = Found("t", 2, 41, NOW, "CreateTime")
    trace.latency_seconds = 0.25
    assert answer(trace) == "on Kafka: t partition 2 offset 41, appended 0.25 s after its commit"


def test_dead_letters_of_either_relay() -> None:
    poll = Trace("e", row={"retry_after": "infinity", "attempts": 10, "last_error": "too big"})
    assert answer(poll).startswith("dead letter of poll: the poller gave up after 10 attempts")
    letter = {"dead_at": NOW, "topic": "t", "error_code": "MSG_SIZE_TOO_LARGE", "error": "big"}
    assert answer(Trace("e", dead_letter=letter)).startswith("dead letter of stream since ")


def test_no_row_no_change_no_dead_letter() -> None:
    assert answer(Trace("e")).startswith("not found: no row with this id (never committed")
